"""The time limit's margin from the saves measured, for real (cluster=local: submitit's controller
sends USR2 exactly cluster.signal_delay_s before cluster.time_min): with a warning too short for a save
like the last one, rank 0 stops the run itself earlier, saves, and the requeued attempt completes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_user_recipe_runs import CHECKPOINTED

from helpers import launch, runs_json

# the user's checkpointed loop, each step 0.2 s of real work
SLOW = CHECKPOINTED.replace("import torch\n", "import time\n\nimport torch\n", 1).replace(
    "    for step in loop:\n", "    for step in loop:\n        time.sleep(0.2)\n", 1)


@pytest.mark.timeout(420)
def test_a_warning_too_short_for_the_last_save_stops_the_run_earlier_and_it_resumes(tmp_path):
    proj = tmp_path / "proj"
    (proj / "upkg").mkdir(parents=True)
    (proj / "upkg" / "__init__.py").write_text("")
    (proj / "upkg" / "slow.py").write_text(SLOW)
    root = tmp_path / "runs"
    # a 60 s limit whose warning comes 5 s before it: a save needs 1.5 x its time + 15 s, so rank 0 stops
    # ~15 s before the limit (step ~220 of 250 at 0.2 s a step), never at the warning
    res = launch(["cluster=local", "recipe._target_=upkg.slow.main", "cluster.time_min=1", "cluster.signal_delay_s=5",
                  "train.steps=250", "train.checkpoint.every=20", "train.max_restarts=3"], root, timeout=400, cwd=proj)
    assert "time.sleep(0.2)" in SLOW
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(root)
    run_dir = Path(run["dir"])
    st = json.loads((run_dir / "status.json").read_text())
    assert st["status"] == "completed" and st["attempt"] == 2, st
    rows = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rows] == ["time_limit"], rows
    logs = "".join(p.read_text(errors="replace") for p in run_dir.parent.rglob("*_log.out"))
    assert "launcher: the last checkpoint took" in logs and "set cluster.signal_delay_s=" in logs, logs[-3000:]
    assert 20 <= st["summary"]["resumed_from"] < 250, st["summary"]  # stopped early, saved, resumed from there
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 250
