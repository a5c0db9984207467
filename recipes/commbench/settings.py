"""The benchmark's settings: message sizes, iterations and dtype, read from the run config's
``recipe.params`` (conf/recipe/commbench.yaml sets the defaults; override on the command line,
``recipe.params.max_bytes=1048576``). They are read from the archived config, so a run measures what
its config.yaml says. No torch here: the values are checked before any process group work starts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from launcher.config.schema import enum_value

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Settings:
    min_bytes: int = 1024
    max_bytes: int = 64 << 20
    factor: int = 2
    warmup_iters: int = 5
    iters: int = 20
    dtype: str = "fp32"


def _get(node: Any, key: str) -> Any:
    if node is None:
        return None
    try:
        return node.get(key)
    except (AttributeError, KeyError):
        return None


def _raw(cfg: RunConfig, name: str) -> Optional[Any]:
    """recipe.params.<name>, or None when unset."""
    return _get(_get(_get(cfg, "recipe"), "params"), name)


def _int(cfg: RunConfig, name: str, default: int, lowest: int) -> int:
    raw = _raw(cfg, name)
    if raw is None or raw == "":
        return default
    where = f"recipe.params.{name}"
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError(f"{where}={raw!r} is not an integer") from None
    if value < lowest:
        raise ValueError(f"{where}={value} must be >= {lowest}")
    return value


def from_cfg(cfg: RunConfig) -> Settings:
    """The settings of a run; the dtype defaults to the run's precision.dtype."""
    d = Settings()
    run_dtype = _get(_get(cfg, "precision"), "dtype")
    dtype = str(_raw(cfg, "dtype") or (enum_value(run_dtype) if run_dtype is not None else d.dtype))
    if dtype not in DTYPES:
        raise ValueError(f"recipe.params.dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    s = Settings(
        min_bytes=_int(cfg, "min_bytes", d.min_bytes, 1),
        max_bytes=_int(cfg, "max_bytes", d.max_bytes, 1),
        factor=_int(cfg, "factor", d.factor, 2),
        warmup_iters=_int(cfg, "warmup_iters", d.warmup_iters, 0),
        iters=_int(cfg, "iters", d.iters, 1),
        dtype=dtype,
    )
    if s.max_bytes < s.min_bytes:
        raise ValueError(f"recipe.params.max_bytes={s.max_bytes} is below recipe.params.min_bytes={s.min_bytes}")
    return s
