"""The code record of a launch from the user's own git repo (launcher.archive.code): the patch and the
dirty flag hold the user's code and nothing the launcher or Hydra wrote into the repo (the default runs
root ./runs lies inside it), large or binary files are listed by name, size and sha256, and the patch
takes the same few git calls however many files changed. The pure rules: tests/unit/test_code_record.py."""
from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest
from test_user_recipe_runs import CHECKPOINTED

from helpers import BIN
from launcher.archive import code, index, snapshot, tree

GIT_ID = ["-c", "user.email=u@example.com", "-c", "user.name=u"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *GIT_ID, *args], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def user_repo(root: Path, files: Dict[str, str]) -> Path:
    """A `git init`ed repo holding ``files`` (path -> text), all committed."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root.parent, "init", "-q", str(root))
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "first")
    return root


def leftovers(repo: Path) -> None:
    """What earlier launches and Hydra apps leave in a repo (none of it ignored): the configured runs
    root (exp/), an earlier runs root under another name (its registry), Hydra's output dirs, wandb's."""
    rng = random.Random(0)
    for rel in ["exp/20261205-101959-eee4/0/checkpoints/step_00000002/state.pt",
                f"old_runs/{index.DB_NAME}", "old_runs/20261204-090000-aaaa/0/checkpoints/step_00000002/state.pt",
                "outputs/2026-12-05/10-00-00/.hydra/config.yaml", ".hydra/overrides.yaml", "multirun.yaml",
                "wandb/offline-run-1/run-1.wandb"]:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(bytes(rng.randrange(256) for _ in range(400_000)) if rel.endswith((".pt", ".wandb"))
                                 else b"x: 1\n")
    (repo / "old_runs" / "20261204-090000-aaaa" / "0" / "run.json").write_text("{}")


def git_calls(log: Path) -> List[str]:
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture
def counted_git(tmp_path, monkeypatch):
    """Every git process this test's code starts is logged (the real git runs it)."""
    real = subprocess.run(["sh", "-c", "command -v git"], capture_output=True, text=True, check=True).stdout.strip()
    shim = tmp_path / "bin"
    shim.mkdir()
    log = tmp_path / "git-calls.log"
    (shim / "git").write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{real}" "$@"\n')
    (shim / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    return log


@pytest.mark.timeout(120)
def test_a_clean_repo_with_runs_and_outputs_in_it_is_clean(tmp_path, counted_git):
    repo = user_repo(tmp_path / "proj", {"upkg/__init__.py": "", "upkg/train.py": "def main(cfg, ctx):\n    pass\n"})
    leftovers(repo)
    state = code.git_state(repo, known={}, exclude=[repo / "exp"])
    assert state["dirty"] is False and state["patch"] == "" and state["patch_listed"] == [], state
    assert state["patch_excluded"] == []
    info = snapshot.take(repo, tmp_path / "sweep" / "code", known={}, exclude=[repo / "exp"])
    assert info["git"]["dirty"] is False and info["files"] == 2, info
    assert (tmp_path / "sweep" / "code" / snapshot.PATCH_FILE).read_text() == ""


@pytest.mark.timeout(120)
def test_a_changed_tree_shows_its_code_and_lists_its_data(tmp_path, counted_git):
    """A modified tracked file and a new small source file are in the patch; a large binary, a small binary
    and a large text file are listed by name, size and sha256; a file over the snapshot's limit, the runs
    roots, Hydra's and wandb's output are in neither; a .env is refused; nothing is written into .git.
    And the git calls are as many for 40 new files as for 2."""
    repo = user_repo(tmp_path / "proj", {"upkg/__init__.py": "", "upkg/train.py": "def main(cfg, ctx):\n    pass\n",
                                         "assets/logo.bin": "\0logo"})
    leftovers(repo)
    (repo / "upkg" / "train.py").write_text("def main(cfg, ctx):\n    return {'tuned': 1}\n")
    (repo / "upkg" / "extra.py").write_text("HIDDEN = 3\n")
    weights = random.Random(1).randbytes(300_000)
    (repo / "weights.pt").write_bytes(weights)
    (repo / "assets" / "logo.bin").write_bytes(b"\0logo, changed")
    (repo / "table.csv").write_text("a,b\n" * 70_000)  # text, untracked, over PATCH_MAX_BYTES
    (repo / "data.bin").write_bytes(b"\0" * (tree.MAX_FILE_BYTES + 1))
    (repo / ".env").write_text("SOME_KEY=1\n")
    before = {p: p.read_bytes() for p in [repo / ".git" / "index"]}
    objects = sorted(str(p) for p in (repo / ".git" / "objects").rglob("*"))

    counted_git.unlink()
    state = code.git_state(repo, known={}, exclude=[repo / "exp"])
    calls = git_calls(counted_git)
    patch = state["patch"]
    heads = sorted(line.split(" b/")[-1] for line in patch.splitlines() if line.startswith("diff --git "))
    assert heads == ["upkg/extra.py", "upkg/train.py"], heads
    assert "+HIDDEN = 3" in patch and "+    return {'tuned': 1}" in patch and "new file mode" in patch
    assert state["patch_listed"] == [
        {"path": "assets/logo.bin", "bytes": 14, "sha256": hashlib.sha256(b"\0logo, changed").hexdigest()},
        {"path": "table.csv", "bytes": 280_000, "sha256": hashlib.sha256(b"a,b\n" * 70_000).hexdigest()},
        {"path": "weights.pt", "bytes": 300_000, "sha256": hashlib.sha256(weights).hexdigest()}]
    assert state["patch_excluded"] == [".env"] and state["dirty"] is True
    assert len(patch) < 2_000, len(patch)
    assert {p: p.read_bytes() for p in before} == before  # the user's index untouched
    assert sorted(str(p) for p in (repo / ".git" / "objects").rglob("*")) == objects  # no object written
    assert "M upkg/train.py" in git(repo, "status", "--porcelain")  # (and its own view unchanged)

    # the same git processes for 40 new files as for 2 (none per file)
    for i in range(38):
        (repo / "upkg" / f"m{i}.py").write_text(f"X = {i}\n")
    counted_git.unlink()
    more = code.git_state(repo, known={}, exclude=[repo / "exp"])
    assert more["patch"].count("diff --git ") == 40
    commands = lambda lines: [line.split()[2] for line in lines]  # noqa: E731 (git -C <repo> <command> ...)
    assert commands(git_calls(counted_git)) == commands(calls), (calls, git_calls(counted_git))
    print(f"git calls for 2 and for 40 new files: {commands(calls)}")
    assert len(calls) <= 8, calls


def launch_here(repo: Path, overrides: List[str], timeout: float) -> subprocess.CompletedProcess:
    """`launch` run from the repo's top as a user runs it: the default runs root (./runs), no
    LAUNCHER_RUNS pointing elsewhere."""
    env = {k: v for k, v in os.environ.items() if k != "LAUNCHER_RUNS"}
    return subprocess.run([str(BIN / "launch"), *overrides], capture_output=True, text=True, timeout=timeout,
                          env={**env, "PYTHONUNBUFFERED": "1"}, cwd=str(repo))


TRAIN = CHECKPOINTED  # the user's function recipe on the public training API


@pytest.mark.timeout(400)
def test_four_launches_from_a_clean_repo_are_clean_and_their_patches_empty(tmp_path):
    """A user package on the training API, committed in its own repo, launched 4 times from the repo's
    top with the defaults (runs under ./runs, wandb on): each run's code record says `dirty: false`, and
    its patch is empty, though every earlier run's checkpoints, logs and wandb files lie untracked in the
    repo. A 5th launch after a change shows that change, and lists the large file by its hash."""
    repo = user_repo(tmp_path / "proj", {"upkg/__init__.py": "", "upkg/train.py": TRAIN})
    # one process, 3 steps, a checkpoint at step 2: quick, and each run leaves binary .pt files in ./runs
    quick = ["recipe._target_=upkg.train.main", "cluster=local", "cluster.gpus_per_node=1", "train.steps=3",
             "train.checkpoint.every=2"]
    for _ in range(4):
        res = launch_here(repo, quick, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sweeps = sorted(p for p in (repo / "runs").iterdir() if p.is_dir())
    assert len(sweeps) == 4 and list(sweeps[0].glob("0/checkpoints/step_*/state.pt")), sweeps
    records = [json.loads((s / "0" / "code" / "git.json").read_text()) for s in sweeps]
    sizes = [(s / "0" / "code" / "patch.diff").stat().st_size for s in sweeps]
    snap_sizes = [(s / "code" / snapshot.PATCH_FILE).stat().st_size for s in sweeps]
    print(f"dirty={[r['dirty'] for r in records]} patch.diff bytes={sizes} .patch.diff bytes={snap_sizes}")
    assert [r["dirty"] for r in records] == [False] * 4, records
    assert [r["patch_listed"] for r in records] == [[]] * 4, records
    assert len(set(sizes)) == 1 and sizes[0] < 10_000 and snap_sizes == sizes, (sizes, snap_sizes)
    assert all(r["commit"] == git(repo, "rev-parse", "HEAD").strip() for r in records)

    (repo / "upkg" / "train.py").write_text(TRAIN + "# tuned\n")
    (repo / "upkg" / "helper.py").write_text("SCALE = 2\n")
    blob = random.Random(2).randbytes(400_000)
    (repo / "upkg" / "table.bin").write_bytes(blob)
    res = launch_here(repo, quick, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    last = max(p for p in (repo / "runs").iterdir() if p.is_dir())
    record = json.loads((last / "0" / "code" / "git.json").read_text())
    patch = (last / "0" / "code" / "patch.diff").read_text()
    heads = sorted(line.split(" b/")[-1] for line in patch.splitlines() if line.startswith("diff --git "))
    assert record["dirty"] is True and heads == ["upkg/helper.py", "upkg/train.py"], (record, heads)
    assert record["patch_listed"] == [{"path": "upkg/table.bin", "bytes": 400_000,
                                       "sha256": hashlib.sha256(blob).hexdigest()}]
    print(f"5th launch (changed tree): patch.diff bytes={len(patch)}")
