"""Slurm launcher and experiment manager for large-model distributed training."""
__version__ = "0.1.0"
