"""Pieces shared by recipes: seeding the RNGs, the synthetic dataset, the DeepSpeed config, metrics."""
