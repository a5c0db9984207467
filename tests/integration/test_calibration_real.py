"""Calibration on real runs: three tiny local runs (ddp, megatron pipeline, megatron tensor parallel;
one sweep), each rank's measured activation_bytes against the planner's estimate, then
`launcher plan --calibrate` on them into a copy of conf/, and a later `launcher plan` that reads it."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import BIN, EQUIV_BASE, REPO, launch, runs_json
from launcher.config.schema import typed
from recipes.gpt.plan import calibrate
from recipes.gpt.plan.spec import Calibration

pytestmark = [pytest.mark.timeout(600), pytest.mark.dist]

BASE = [o for o in EQUIV_BASE if not o.startswith("train.steps=")] + ["train.steps=5", "cluster.gpus_per_node=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibration") / "runs"
    res = launch(["-m", *BASE, "parallelism=dp,pp,tp"], root, timeout=500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    found = runs_json(root)
    assert len(found) == 3 and all(r["status"] == "completed" for r in found), found
    return root, [Path(r["dir"]) for r in found]


def test_every_rank_records_its_activation_bytes_near_the_planners_estimate(runs):
    _, dirs = runs
    for rdir in dirs:
        cfg = typed(yaml.safe_load((rdir / "config.yaml").read_text()))
        layout = json.loads((rdir / "run.json").read_text())["layout"]
        _, _, planned = calibrate.planned(cfg, layout)
        states = [json.loads(p.read_text()) for p in sorted((rdir / "ranks").glob("state_*.json"))]
        assert len(states) == 2
        acts = [s["activation_bytes"] for s in states]
        assert all(isinstance(a, int) and a > 0 for a in acts), (rdir, states)
        assert 0.5 < max(acts) / planned < 2.0, (layout, acts, planned)
        first = json.loads((rdir / "metrics.jsonl").read_text().splitlines()[0])
        assert first["step"] == 1 and first["activation_bytes"] == states[0]["activation_bytes"]


def test_calibrate_on_real_runs_lowers_the_error_and_later_estimates_use_it(runs, tmp_path):
    root, dirs = runs
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    target = conf / "cluster" / "local.yaml"
    before = target.read_text()
    ids = [json.loads((d / "run.json").read_text())["run_id"] for d in dirs]
    env = dict(os.environ, LAUNCHER_RUNS=str(root))
    res = subprocess.run([str(BIN / "launcher"), "plan", "--calibrate", *ids, "--cluster-file", str(target), "--json"],
                         capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    assert rep["written"] and rep["cluster"] == "local"
    for row in rep["runs"]:
        st = row["step_time_s"]
        assert abs(st["error_after"]) < abs(st["error_before"]), row
        act = row["activation_bytes"]
        assert act["measured"] and abs(act["error_after"]) <= abs(act["error_before"]) + 0.05, row
    text = target.read_text()
    assert text.startswith(before)  # the block is appended; the file's other bytes are kept
    block = yaml.safe_load(text)["calibration"]
    assert block["runs"] == ids and block["compute_scale"] > 1
    cal = Calibration.from_cfg(block)

    # a later estimate for the cluster (same conf/, as `launch` would compose it) applies the constants
    res = subprocess.run([sys.executable, "-m", "launcher.cli.main", "plan", "--json", *BASE, "parallelism=dp"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env=dict(os.environ, LAUNCHER_CONF_DIR=str(conf)))
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    assert got["cluster"]["calibration"] == cal.as_dict()
    dp_run = next(d for d in dirs if json.loads((d / "run.json").read_text())["layout"]["dp"] == 2)
    sample = calibrate.read_sample(dp_run)  # one pipeline stage: the planned activations are its own
    assert got["layouts"][0]["step_time_s"] == pytest.approx(sample.parts.step_time(cal), rel=1e-9)
    assert got["layouts"][0]["memory_bytes"]["activations"] == pytest.approx(
        sample.planned_activation_bytes * cal.activation_scale, abs=2)
