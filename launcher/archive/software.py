"""The software a run used: interpreter, key package versions, the launcher (version, commit), the
full `pip freeze`."""
from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from typing import TYPE_CHECKING, Any, Dict, Optional

from launcher.archive import code

if TYPE_CHECKING:
    from concurrent.futures import Future

KEY_PACKAGES = ("torch", "deepspeed", "hydra-core", "omegaconf", "submitit", "wandb", "numpy")


def versions() -> Dict[str, Any]:
    out: Dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    for name in KEY_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["launcher"] = code.launcher_state()  # its version and commit, apart from the user's code (code/git.json)
    return out


_prefetched: Optional[Future[str]] = None


def prefetch_pip_freeze() -> None:
    """Start `pip freeze` in the background (once): a launch composes and checks its points meanwhile."""
    global _prefetched
    if _prefetched is None:
        # threads only when submitting or archiving for real, not on a dry run
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pip-freeze")
        _prefetched = pool.submit(_pip_freeze)
        pool.shutdown(wait=False)


def pip_freeze() -> str:
    """The full `pip freeze --all` (the prefetched one when started)."""
    if _prefetched is not None:
        return _prefetched.result()
    return _pip_freeze()


def _pip_freeze() -> str:
    try:
        res = subprocess.run(
            [sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, timeout=120
        )
        return res.stdout
    except (OSError, subprocess.SubprocessError) as e:  # archive what we can, never fail a launch
        return f"# pip freeze failed: {e}\n"
