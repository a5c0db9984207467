"""What a command prints is what happened: `launcher resume --wait` names a checkpoint the node rejected,
why, and the step it loaded instead (the defaults: the GPT on local processes); `launcher runs` and
`launcher status` keep one line per run piped and in 80 columns."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import BIN, launch, run_cmd, runs_json


def assert_one_line_per_run(root: Path, run: dict) -> None:
    """`launcher runs` and `launcher status`, piped: every column on one line per run; at COLUMNS=80 one line
    per run within 80 columns, the dir left out (and said)."""
    for cmd in ("runs", "status"):
        piped = run_cmd([str(BIN / "launcher"), cmd], root, timeout=120, extra_env={"COLUMNS": ""})
        assert piped.returncode == 0, piped.stderr
        (row,) = [line for line in piped.stdout.splitlines() if run["run_id"] in line]
        assert "completed" in row and (cmd == "status" or run["dir"] in row), piped.stdout
        narrow = run_cmd([str(BIN / "launcher"), cmd], root, timeout=120, extra_env={"COLUMNS": "80"})
        assert narrow.returncode == 0, narrow.stderr
        lines = narrow.stdout.splitlines()
        (row,) = [line for line in lines if run["run_id"] in line]
        assert "completed" in row and max(len(line) for line in lines) <= 80, narrow.stdout
        # the box is its header, one line per run and the bottom rule: nothing folded onto a second line
        assert len([line for line in lines if line.startswith(("│", "┃"))]) == 2, narrow.stdout
        if cmd == "runs":
            assert run["dir"] not in narrow.stdout and "without dir" in narrow.stdout, narrow.stdout


@pytest.mark.timeout(400)
def test_resume_names_the_checkpoint_the_node_rejected_and_the_step_it_loaded(tmp_path):
    """The latest checkpoint's model.pt swapped for another step's (a valid file, the same size: only its
    sha256 tells): the login node announces step 12, the node rejects it and loads step 8; `launcher
    resume --wait` says both, and the run completes."""
    root = tmp_path / "runs"
    res = launch(["train.steps=12", "train.checkpoint.every=4", "train.checkpoint.keep=3"], root, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    assert_one_line_per_run(root, run)
    ckpts = Path(run["dir"]) / "checkpoints"
    latest, other = ckpts / "step_00000012" / "model.pt", ckpts / "step_00000008" / "model.pt"
    assert latest.stat().st_size == other.stat().st_size  # the login node's check (sizes) cannot tell
    latest.chmod(0o644)  # the sealed run's files are read-only
    shutil.copyfile(other, latest)

    res = run_cmd([str(BIN / "launcher"), "resume", run["run_id"], "--steps", "16", "--wait"], root, timeout=300)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert f"resuming {run['run_id']} from step 12 (attempt 2)" in out, out  # what the login node saw
    assert ("checkpoint step_00000012 rejected (model.pt changed (sha256 differs from checkpoint.json)): "
            "attempt 2 resumed from step 8 (step_00000008)") in out, out
    assert f"{run['run_id']}: completed" in out and "resumed from step 12" not in out, out

    # resumed again, every checkpoint intact: the step loaded is the one announced, and said so once it ran;
    # the fallback of attempt 2 is not reported again
    res = run_cmd([str(BIN / "launcher"), "resume", run["run_id"], "--steps", "20", "--wait"], root, timeout=300)
    out = res.stdout
    assert res.returncode == 0, out[-3000:] + res.stderr[-3000:]
    assert f"{run['run_id']}: attempt 3 resumed from step 16 (step_00000016, verified before it was loaded)" in out, out
    assert "rejected" not in out, out
