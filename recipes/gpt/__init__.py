"""Megatron-style GPT recipe: ``recipes.gpt.train.main`` is the entry point."""
