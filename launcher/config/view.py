"""Attribute access over a resolved config (plain dicts, as ``OmegaConf.to_container`` returns it).

The rules and the planner read a config by attribute (``cfg.train.steps``, ``cfg.get("optim")``).
Reading a DictConfig goes through OmegaConf's node machinery (~10 us a read); a sweep checks every
point once it is resolved anyway, so the checks read the resolution through this view instead."""
from __future__ import annotations

from typing import Any, Dict, Iterator, Mapping


class ConfigView(Mapping):
    __slots__ = ("_data",)

    def __init__(self, data: Dict[str, Any]) -> None:
        object.__setattr__(self, "_data", data)

    @staticmethod
    def _wrap(value: Any) -> Any:
        return ConfigView(value) if isinstance(value, dict) else value

    def __getattr__(self, name: str) -> Any:
        try:
            return self._wrap(self._data[name])
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("a ConfigView is read-only")

    def __getitem__(self, key: str) -> Any:
        return self._wrap(self._data[key])

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"ConfigView({self._data!r})"

    def to_dict(self) -> Dict[str, Any]:
        return self._data

