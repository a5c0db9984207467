"""`launcher report` on real runs: a tiny local training run and a 2-point sweep, each reported as one
self-contained page (plots embedded, run ids present), the sealed run dir left as it was sealed.

(Named test_report_real.py: tests/unit/test_report.py holds the unit tests, and two test modules of one
basename cannot be collected together without package __init__ files.)"""
import re
from pathlib import Path

import pytest

from helpers import BIN, launch, run_cmd, wait_final
from launcher.rundir import RunDir

pytestmark = [pytest.mark.timeout(600), pytest.mark.dist]

SMALL = ["train.steps=6", "wandb.enabled=false"]
IMG = re.compile(r'<img src="data:image/png;base64,[A-Za-z0-9+/]+=*" alt="([^"]*)">')


def _report(target: str, root: Path) -> str:
    res = run_cmd([str(BIN / "launcher"), "report", target, "--root", str(root)], root, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    path = Path(res.stdout.strip().splitlines()[-1])
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text)  # nothing outside the page
    return path, text


def test_report_of_a_real_run_and_a_sweep(runs_root):
    res = launch(SMALL, runs_root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = wait_final(runs_root, 1)
    assert run["status"] == "completed", run
    res = launch(["-m", "seed=1,2", *SMALL], runs_root, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(runs_root, 3)
    points = [r for r in runs if r["sweep_id"] != run["sweep_id"]]
    assert len(points) == 2 and all(r["status"] == "completed" for r in points), points

    path, text = _report(run["run_id"], runs_root)
    rdir = Path(run["dir"])
    assert path == rdir.parent / f"report-{rdir.name}.html"
    alts = IMG.findall(text)
    assert {"loss", "learning rate", "gradient norm", "tokens/s", "step time (s)"} <= set(alts), alts
    assert run["run_id"] in text and "<h2>Planned and measured</h2>" in text and "step time (s)</td>" in text
    assert "<h2>Layout</h2>" in text and "<h2>Topology</h2>" in text and "resolved config" in text
    assert RunDir(rdir).verify() == []  # the report lies beside the sealed run, not in it

    sweep_id = points[0]["sweep_id"]
    path, text = _report(sweep_id, runs_root)
    assert path == Path(points[0]["dir"]).parent / "report.html"
    alts = IMG.findall(text)
    assert alts == ["loss per step, every point", "final_loss vs seed"], alts
    for r in points:
        assert f'href="#run-{r["run_id"]}"' in text and f'id="run-{r["run_id"]}"' in text
    assert run["run_id"] not in text  # only the sweep's own points
