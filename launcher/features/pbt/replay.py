"""`launcher reproduce MEMBER` of a sweep=pbt member: its lineage replayed whole.

A member's state at the end is its own training and every checkpoint it copied, and those donors' own
lineages: so the whole population is launched again, each member from its archived config (its
launched values: the explored ones are laid over them again as the replay goes) and the sweep's code
snapshot, with ``sweep.replay=<the original sweep dir>``: at every generation the recorded decision
(who copies whom, which values) is carried out instead of a new one computed. Once the population has
ended (where the backend waits), the reproduced member's losses are compared with the original's
(launcher.archive.compare: bitwise). No torch here.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from launcher.archive import compare
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.run.rundir import RunDir, SweepDir


def is_member(rd: RunDir) -> bool:
    try:
        sweep = rd.config().get("sweep") or {}
    except (OSError, ValueError):
        return False
    return str(sweep.get("scheduler") or "") == "pbt"


def population(rd: RunDir, unverified: Sequence[str] = ()) -> List[RunDir]:
    """The members to launch again, in index order; refused (naming why) where the original population
    is not complete, not numbered 0..n-1, or a member's archive does not verify."""
    sd = SweepDir(rd.path.parent)
    members = sd.runs()
    indices = [int(m.path.name) for m in members]
    if indices != list(range(len(members))):
        raise ConfigErrors([ConfigError("RUN", f"the population of {rd.run_id} is numbered {indices}, not 0..n-1",
                                        "reproduce a member of a sweep=pbt launch")])
    running = [m.run_id for m in members if not m.status().is_final]
    if running:
        raise ConfigErrors([ConfigError("RUN", f"members {', '.join(running)} have not ended: their lineages are "
                                        "not complete", "reproduce once every member has ended")])
    if not unverified:
        bad = {m.run_id: m.verify() for m in members}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            raise ConfigErrors([ConfigError("RUN", f"member {k}'s archive does not verify: {'; '.join(v[:3])}",
                                            "reproduce an intact population (or --trust-unverified)")
                                for k, v in bad.items()])
    return members


def reproduce_population(rd: RunDir, overrides: List[str], runs_root: Optional[Path], out, snapshot: Path,
                         extra: Dict[str, Any], archived_point: Callable[..., Any],
                         topology_warnings: Callable[..., List[str]]) -> Any:
    """Launch the population again following the recorded decisions; the reproduced member is run
    ``<new sweep>-<index>``. ``archived_point``, ``topology_warnings``: launcher.submit.reproduce's (a
    member's point from its archive, as for any run). Returns the launch's result (the comparison
    printed where it waited)."""
    from launcher.app import finish
    from launcher.submit import pipeline

    members = population(rd, extra.get("trusted_unverified") or ())
    replay = [f"sweep.replay={rd.path.parent.resolve()}"]
    points = [archived_point(m.path, [*overrides, *replay], runs_root) for m in members]
    for w in topology_warnings(rd.path, points[0].cfg):
        print(f"warning: {w}", file=sys.stderr)
    me = int(rd.path.name)
    print(f"reproducing {rd.run_id}, a member of a sweep=pbt population: its lineage is replayed by launching "
          f"the {len(members)} members again with their archived configs, seeds and code snapshot {snapshot}, "
          f"every generation's recorded decision followed (sweep.replay)", file=out)
    meta = {**{k: v for k, v in extra.items() if k not in ("reproduces", "reproduces_dir")},
            "replays_population": {"sweep": rd.path.parent.name, "sweep_dir": str(rd.path.parent.resolve()),
                                   "member": me, "reproduces": rd.run_id}}
    result = pipeline.launch(points, argv=list(sys.argv), out=out, code_snapshot=snapshot, extra_meta=meta)
    try:
        finish(result, points)
    finally:
        if result.sweep_dir is not None:
            again = SweepDir(result.sweep_dir).run(me)
            if again.status().is_final:
                cmp = compare.loss_comparison(compare.losses(rd.path), compare.losses(again.path))
                word = "bitwise identical" if cmp["bitwise_identical"] else \
                    f"different from step {cmp['first_different_step']} (max |diff| {cmp['max_abs_diff']})"
                print(f"member {rd.run_id} reproduced as {again.run_id}: its losses over {cmp['steps'][1]} steps are "
                      f"{word} (launcher diff {rd.run_id} {again.run_id})", file=out)
    return result
