"""Submission: turn validated run configs into submitit jobs (local processes or one Slurm array)."""
