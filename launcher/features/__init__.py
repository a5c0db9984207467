"""Each sweep and fault-tolerance feature in a folder of its own: its pure rule, and beside it the
login side's and the node's halves that carry it out (docs/architecture.md, "Features")."""
