"""`launcher`: the management CLI. Each subcommand is a thin call into the library."""
