"""Megatron-style model parallelism for the GPT recipe: the rank mesh (``mesh``), tensor parallel
layers and regions (``tensor_parallel``) and pipeline stages (``pipeline``).

``mesh`` is pure Python (no torch at import); the others need torch.distributed.
"""
