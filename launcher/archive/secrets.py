"""Secrets never reach the archive or the logs: values of variables whose names look secret are
replaced before anything is written."""
from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Mapping

REDACTED = "<redacted>"
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# environment that shapes training and is worth archiving
TRAINING_ENV = re.compile(r"^(NCCL_|SLURM_|CUDA_|OMP_|TORCH_|MKL_|GLOO_|MASTER_|WORLD_SIZE$|RANK$|LOCAL_RANK$|"
                          r"PYTHONHASHSEED$|CUBLAS_|NVIDIA_|DS_|WANDB_|HYDRA_|SUBMITIT_)")


def is_secret(name: str) -> bool:
    return bool(SECRET_NAME.search(str(name)))


def redact_env(env: Mapping[str, Any]) -> Dict[str, str]:
    """name -> value, with secret-named values replaced."""
    return {str(k): (REDACTED if is_secret(k) else str(v)) for k, v in env.items()}


def training_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The variables that shape training (NCCL_*, SLURM_*, CUDA_*, OMP_*, TORCH_*, ...), redacted."""
    return redact_env({k: v for k, v in sorted(env.items()) if TRAINING_ENV.match(k)})


def secret_values(env: Mapping[str, str], min_len: int = 4) -> Iterable[str]:
    """Values of secret-named variables (to scrub from free text such as a patch or a script)."""
    return sorted({v for k, v in env.items() if is_secret(k) and v and len(v) >= min_len}, key=len, reverse=True)


def scrub(text: str, env: Mapping[str, str]) -> str:
    """Replace every secret value of `env` that occurs in `text`."""
    for value in secret_values(env):
        text = text.replace(value, REDACTED)
    return text


def redact_config(resolved: Dict[str, Any]) -> Dict[str, Any]:
    """A resolved config with secret-named keys of cluster.env (and anywhere else) redacted."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (REDACTED if is_secret(k) and not isinstance(v, (dict, list)) and v not in (None, "")
                        else walk(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(resolved)
