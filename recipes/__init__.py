"""Training programs the launcher runs: each exposes ``main(cfg, ctx) -> dict``.

Kept free of heavy imports: the login-node path may import this package to resolve a
recipe target without touching torch.
"""
