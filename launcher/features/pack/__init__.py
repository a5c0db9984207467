"""cluster.pack: runner (the pack job's queue of points; plan_starts, pure)."""
