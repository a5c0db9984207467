"""A user's recipe is a first-class recipe (the recipe contract, launcher.config.recipe_contract): run for real
on 3 local processes with a batch the GPT's rule refuses, it completes, is named after itself, counts no
steps, and neither `launcher show` nor `launcher report` prints a GPT plan."""
import json
from pathlib import Path

import pytest

from helpers import BIN, launch, run_cmd, runs_json

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]

# 3 processes x micro batch 4 = 12 does not divide the global batch 16: the GPT recipe is refused
THREE = ["cluster=local", "cluster.gpus_per_node=3"]


def test_a_user_recipe_on_three_processes_is_not_held_to_gpt_rules(tmp_path):
    pkg = tmp_path / "userproj" / "mlp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(  # never reads train.global_batch_size, logs no steps
        "def main(cfg, ctx):\n    return {'final_loss': 0.5, 'world': ctx.world_size}\n")
    runs_root = tmp_path / "runs"

    refused = launch([*THREE, "submit.dry_run=true"], runs_root, timeout=120, cwd=pkg.parent)
    assert refused.returncode != 0 and "train.global_batch_size: 16 is not a multiple" in refused.stderr

    res = launch(["recipe._target_=mlp.train.main", *THREE], runs_root, timeout=240, cwd=pkg.parent)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "/60" not in res.stdout  # progress counts no train.steps for a recipe that declares none
    (run,) = runs_json(runs_root)
    rdir = Path(run["dir"])
    assert run["status"] == "completed" and run["name"] == "mlp", run
    assert json.loads((rdir / "status.json").read_text())["summary"]["world"] == 3
    assert not (rdir / "plan.json").exists()

    show = run_cmd([str(BIN / "launcher"), "show", run["run_id"], "--root", str(runs_root)], runs_root, timeout=120)
    assert show.returncode == 0, show.stderr
    assert "loss 0.5" in show.stdout and "loss None" not in show.stdout and "tokens/s" not in show.stdout
    assert "gpt_tiny" not in show.stdout

    status = run_cmd([str(BIN / "launcher"), "status", run["sweep_id"], "--json", "--root", str(runs_root)],
                     runs_root, timeout=120)
    assert status.returncode == 0, status.stderr
    assert [p.get("steps") for p in json.loads(status.stdout)["runs"]] == [None]  # not "0/60"

    out = tmp_path / "r.html"
    rep = run_cmd([str(BIN / "launcher"), "report", str(rdir), "-o", str(out)], runs_root, timeout=120)
    assert rep.returncode == 0, rep.stderr
    page = out.read_text()
    assert "Planned and measured" not in page and "planned" not in page.split("resolved config")[0]
