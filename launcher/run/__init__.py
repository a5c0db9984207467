"""The run dir, by part: launcher.run.rundir.RunDir puts them together (its names and FILES table there)."""
