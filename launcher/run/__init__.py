"""The run dir, by part: launcher.rundir.RunDir puts them together (its names and FILES table there)."""
