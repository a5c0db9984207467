"""Pieces shared by recipes: seeding and the synthetic dataset."""
