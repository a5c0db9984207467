"""cluster.elastic: resize (the rule), decide (the job queued after the run's), regrow (the node side)."""
