"""Submission: the launch pipeline (check, stage, submit, publish), waiting, and reproduce."""
