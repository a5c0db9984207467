"""The software a run used: interpreter, key package versions, the full `pip freeze`."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from typing import Dict, Optional

KEY_PACKAGES = ("torch", "deepspeed", "hydra-core", "omegaconf", "submitit", "wandb", "numpy")


def versions() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {"python": platform.python_version(), "executable": sys.executable}
    for name in KEY_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def pip_freeze() -> str:
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=120
        )
        return res.stdout
    except (OSError, subprocess.SubprocessError) as e:  # archive what we can, never fail a launch
        return f"# pip freeze failed: {e}\n"
