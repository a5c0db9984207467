"""`launcher report` on real runs: a tiny local training run and a 4-point sweep, each reported as one
self-contained page (plots embedded, run ids present), the sealed run dir left as it was sealed; both
pages opened in a real headless browser (Debian's chromium, scripts/browser.sh): they load with no
console error and every plot decodes. LAUNCHER_DOCS_SCREENSHOTS=1 writes their screenshots to docs/.

(Named test_report_real.py: tests/unit/test_report.py holds the unit tests, and two test modules of one
basename cannot be collected together without package __init__ files.)"""
import os
import re
from pathlib import Path

import pytest

import browser
from helpers import BIN, REPO, launch, run_cmd, wait_final
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.timeout(600), pytest.mark.dist]

SMALL = ["train.steps=6"]
IMG = re.compile(r'<img src="data:image/png;base64,[A-Za-z0-9+/]+=*" alt="([^"]*)">')


def _in_browser(path: Path, n_images: int, shot: Path) -> None:
    """Open the page in headless chromium: no console error, every image decoded, a screenshot."""
    binary = browser.find()
    if binary is None:
        if os.environ.get("LAUNCHER_REQUIRE_BROWSER"):
            pytest.fail("no chromium: scripts/browser.sh installs it (scripts/test.sh runs it)")
        pytest.skip("no chromium on this machine (scripts/browser.sh installs Debian's)")
    b = browser.Browser(binary)
    try:
        b.open(path)
        images = b.evaluate("Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        b.screenshot(shot)
        assert b.console_errors() == []
    finally:
        b.close()
    assert len(images) == n_images and all(ok and w > 100 and h > 100 for ok, w, h in images), images
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("LAUNCHER_DOCS_SCREENSHOTS"):
        (REPO / "docs" / shot.name).write_bytes(shot.read_bytes())


def _report(target: str, root: Path) -> str:
    res = run_cmd([str(BIN / "launcher"), "report", target, "--root", str(root)], root, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    path = Path(res.stdout.strip().splitlines()[-1])
    text = path.read_text()
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text)  # nothing outside the page
    return path, text


def test_report_of_a_real_run_and_a_sweep(runs_root, tmp_path):
    res = launch(SMALL, runs_root)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = wait_final(runs_root, 1)
    assert run["status"] == "completed", run
    res = launch(["-m", "seed=1,2", "optim.lr=1e-3,3e-3", *SMALL], runs_root, timeout=500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(runs_root, 5)
    points = [r for r in runs if r["sweep_id"] != run["sweep_id"]]
    assert len(points) == 4 and all(r["status"] == "completed" for r in points), points

    path, text = _report(run["run_id"], runs_root)
    rdir = Path(run["dir"])
    assert path == rdir.parent / f"report-{rdir.name}.html"
    alts = IMG.findall(text)
    expected = {"loss", "learning rate", "gradient norm", "tokens/s", "step time (s)", "step time by phase"}
    assert expected <= set(alts), alts
    # the recipe's step-time breakdown (recipes/common/phases.py), every step
    rows = RunDir(rdir).metrics()
    for m in rows:
        parts = [m[f"time_{p}_s"] for p in ("data", "forward", "backward", "optimizer", "loss_sync", "other")]
        assert all(v >= 0 for v in parts) and parts[1] > 0 and parts[2] > 0, m
        assert sum(parts) == pytest.approx(m["step_time_s"], rel=1e-6), m
    assert run["run_id"] in text and "<h2>Planned and measured</h2>" in text and "step time (s)</td>" in text
    assert "<h2>Layout</h2>" in text and "<h2>Topology</h2>" in text and "resolved config" in text
    assert RunDir(rdir).verify() == []  # the report lies beside the sealed run, not in it
    _in_browser(path, len(alts), tmp_path / "report-run.png")

    sweep_id = points[0]["sweep_id"]
    path, text = _report(sweep_id, runs_root)
    assert path == Path(points[0]["dir"]).parent / "report.html"
    alts = IMG.findall(text)
    assert alts == ["loss per step, every point", "final_loss vs seed", "final_loss vs optim.lr"], alts
    for r in points:
        assert f'href="#run-{r["run_id"]}"' in text and f'id="run-{r["run_id"]}"' in text
    assert run["run_id"] not in text  # only the sweep's own points
    _in_browser(path, len(alts), tmp_path / "report-sweep.png")
