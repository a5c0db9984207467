"""Hugging Face causal LMs built from a config, never downloaded (conf/model/hf_llama_tiny.yaml).

``transformers`` is an optional extra (setup.cfg); only the job imports it, when it builds
the model: the login side never does.
"""
from __future__ import annotations

from typing import Any, Dict


def causal_lm(config: Dict[str, Any]) -> Any:
    """A randomly initialised ``AutoModelForCausalLM`` of ``config["model_type"]`` (llama, mistral,
    qwen2, ...; default llama) from the other keyword arguments of its config class
    (``LlamaConfig(**config)``, ``attn_implementation`` included). The engine seeds and initialises
    it, the same on every layout (launcher.training.engines)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as e:  # the job's environment lacks the extra
        raise ImportError(f"model._target_=recipes.lm.hf.causal_lm needs transformers (setup.cfg's extras): {e}") from e
    kwargs = dict(config)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(kwargs.pop("model_type", "llama"), **kwargs))
