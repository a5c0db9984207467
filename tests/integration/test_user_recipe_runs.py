"""A user's own recipe package (written here, outside the project) through the whole life of a run:
failures no restart fixes end at once, a repeated failure ends after the second attempt."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest

from helpers import BIN, launch, run_cmd, runs_json

QUICK = ["cluster=local", "wandb.enabled=false", "train.steps=5", "train.max_restarts=3"]


def user_package(root: Path, files: Dict[str, str], name: str = "upkg") -> Path:
    """``root/<name>/`` with an __init__.py and ``files`` (module name -> source); returns ``root``."""
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "__init__.py").write_text("")
    for module, source in files.items():
        (root / name / f"{module}.py").write_text(source)
    return root


def restart_rows(run_dir: Path) -> List[dict]:
    p = run_dir / "restarts.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def doctor(run_dir: Path, root: Path) -> dict:
    res = run_cmd([str(BIN / "launcher"), "doctor", str(run_dir), "--json"], root, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


@pytest.mark.timeout(300)
def test_a_missing_file_fails_at_once_with_the_diagnosis(tmp_path):
    proj = user_package(tmp_path / "proj", {"train": (
        "def main(cfg, ctx):\n"
        "    with open('/nonexistent/tokens.bin', 'rb') as f:\n"
        "        return {'n': len(f.read())}\n")})
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=upkg.train.main"], root, timeout=240, cwd=proj)
    assert res.returncode != 0, res.stdout[-2000:]
    (run,) = runs_json(root)
    run_dir = Path(run["dir"])
    st = json.loads((run_dir / "status.json").read_text())
    assert st["status"] == "failed" and st["attempt"] == 1, st
    assert restart_rows(run_dir) == []  # not one restart, although train.max_restarts=3
    assert "FileNotFoundError" in st["error"] and "not restarted: a file the code opens is missing" in st["error"]
    assert st["no_restart"]["kind"] == "missing_file"
    d = doctor(run_dir, root)
    assert d["kind"] == "exception" and "FileNotFoundError" in d["summary"] and "upkg/train.py" in d["summary"]
    assert any(line.startswith("not restarted: a file the code opens is missing") for line in d["detail"]), d
    assert "absolute" in d["fix"], d


@pytest.mark.timeout(400)
def test_the_same_failure_twice_before_any_step_ends_after_the_second_attempt(tmp_path):
    proj = user_package(tmp_path / "proj", {"train": (
        "def main(cfg, ctx):\n"
        "    raise RuntimeError('the service is not configured')\n")})
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=upkg.train.main"], root, timeout=360, cwd=proj)
    assert res.returncode != 0, res.stdout[-2000:]
    (run,) = runs_json(root)
    run_dir = Path(run["dir"])
    st = json.loads((run_dir / "status.json").read_text())
    assert st["status"] == "failed" and st["attempt"] == 2, st
    (row,) = restart_rows(run_dir)  # one restart (the first failure might not repeat), not three
    assert row["reason"] == "failure" and row["failure"]["type"] == "RuntimeError"
    assert row["failure"]["place"].endswith("upkg/train.py:2 in main")
    assert st["no_restart"]["kind"] == "repeated" and "attempt 1 failed the same way" in st["error"], st
