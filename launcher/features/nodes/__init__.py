"""Node health: the ledger of what jobs saw of each node, its pure rule, and the exclusion it asks of
the scheduler (docs/fault-tolerance.md, "Bad and slow nodes")."""
