"""The run config: its schema and defaults, the one rule table, the Layout the rules are checked on,
composition (Hydra groups, sweeps), the recipe contract, seeds. Imports no torch."""
