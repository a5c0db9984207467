"""A small Hydra app of its own (not a `launch` recipe): sweep it with this project's Hydra launcher.

    python -m recipes.hydra_example.app -m x=1,2 y=0,1 hydra/launcher=launcher_local
    python -m recipes.hydra_example.app -m x=1,2 hydra/launcher=launcher_slurm hydra.launcher.partition=debug
"""
