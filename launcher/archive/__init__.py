"""What goes into a run's archive (code snapshot, software, topology, secrets scrubbing), run
comparison, and the SQLite index over all run dirs. The run dir's files are named by launcher.run.rundir."""
