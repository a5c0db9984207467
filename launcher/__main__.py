from launcher.app import main

main()
