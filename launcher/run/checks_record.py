"""ChecksRecord: what checks.json holds, typed: what was checked before the run was queued, and what the
launch let through (a memory or bubble warning `submit.force=true` forced past stays with the run).
Staging writes it in every run dir (RunDir.write_checks); `launcher show` prints it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

LAUNCH = "launch"  # the rule table (the shared rows and the recipe's) and the recipe's planner
HYDRA_APP = "hydra_app"  # a Hydra app's run: its config is the app's own; the plugin checked its sweep keys


@dataclass(frozen=True)
class ChecksRecord:
    by: str  # LAUNCH or HYDRA_APP
    forced: Tuple[str, ...] = ()  # the warnings submit.force=true let through, as the launch printed them
    advice: Tuple[str, ...] = ()  # the rules' advice the launch printed (never a reason to refuse)

    def describe(self) -> str:
        """One line for `launcher show`."""
        if self.by == HYDRA_APP:
            return "a Hydra app: its config is its own (the launcher plugin checked the sweep's keys)"
        if self.forced:
            return f"passed; {len(self.forced)} warning(s) let through by submit.force=true: " + "; ".join(self.forced)
        return "passed the rule table and the recipe's planner, no warning"

    def to_json(self) -> Dict[str, Any]:
        return {"by": self.by, "forced": list(self.forced), "advice": list(self.advice)}

    @classmethod
    def from_json(cls, data: Optional[Dict[str, Any]]) -> Optional[ChecksRecord]:
        if not isinstance(data, dict) or not isinstance(data.get("by"), str):
            return None  # a run staged before checks.json existed, or a damaged file
        return cls(by=data["by"], forced=tuple(str(w) for w in data.get("forced") or ()),
                   advice=tuple(str(a) for a in data.get("advice") or ()))
