"""Every command of the README's usage block runs as written (placeholders such as RUN replaced by
real ids), against the local default and the real local Slurm cluster; every --help answers."""
from __future__ import annotations

import re
import shlex
import subprocess
from typing import Dict, List

import pytest

from helpers import BIN, REPO, run_cmd, runs_json

PLACEHOLDERS = ("RUN_A", "RUN_B", "SWEEP_OR_RUN", "RUN", "S")


def readme_commands() -> List[str]:
    """`launch ...` and `launcher ...` lines of the README's ```bash blocks (comments dropped)."""
    text = (REPO / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            cmd = line.split("  #")[0].split(" # ")[0].strip()
            if re.match(r"^launch(er)?( |$)", cmd) and "<" not in cmd:
                out.append(cmd)
    return out


def _fill(cmd: str, ids: Dict[str, str]) -> List[str]:
    words = shlex.split(cmd)
    return [ids.get(w, w) for w in words]


SLURM_IDS = ("S", "SWEEP_OR_RUN")


def on_slurm(cmd: str) -> bool:
    """A command of the Slurm part: it submits to the cluster or names a Slurm sweep."""
    return "cluster=local_slurm" in cmd or any(w in SLURM_IDS for w in shlex.split(cmd))


def run_commands(commands: List[str], root, env: Dict[str, str]) -> Dict[str, str]:
    """Each command as written, in order, its placeholders filled from the runs made before it."""
    ids: Dict[str, str] = {}
    for cmd in commands:
        words = _fill(cmd, ids)
        res = run_cmd([str(BIN / words[0]), *words[1:]], root, timeout=600, extra_env=env, cwd=REPO)
        assert res.returncode == 0, f"{cmd}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        if (words[0] == "launch" and "--help" not in words and "--cfg" not in words
                and "submit.dry_run=true" not in words):
            runs = runs_json(root)
            local = [r for r in runs if r["backend"] == "local"]
            slurm_runs = [r for r in runs if r["backend"] == "slurm"]
            if local:
                ids["RUN"] = ids["RUN_A"] = local[0]["run_id"]
                ids["RUN_B"] = local[-1]["run_id"]
            if slurm_runs:
                ids["S"] = ids["SWEEP_OR_RUN"] = slurm_runs[-1]["sweep_id"]
    return ids


def test_the_readme_has_both_parts():
    commands = readme_commands()
    assert any(c.startswith("launch ") for c in commands) and any(c.startswith("launcher ") for c in commands)
    assert any(on_slurm(c) for c in commands) and not all(on_slurm(c) for c in commands)


# The local part runs outside the Slurm group (tests/conftest.py: the Slurm tests run one after another
# on one worker), so the README's local trainings do not wait behind the Slurm drills.
@pytest.mark.timeout(1500)
def test_every_local_readme_command_runs_as_written(tmp_path):
    ids = run_commands([c for c in readme_commands() if not on_slurm(c)], tmp_path / "runs", {})
    assert set(PLACEHOLDERS) - set(SLURM_IDS) <= set(ids), ids


@pytest.mark.timeout(900)
def test_every_slurm_readme_command_runs_as_written(tmp_path, slurm):
    root = tmp_path / "runs"
    ids = run_commands([c for c in readme_commands() if on_slurm(c)], root, dict(slurm))
    assert set(SLURM_IDS) <= set(ids), ids
    for sweep in {r["sweep_id"] for r in runs_json(root) if r["backend"] == "slurm"}:  # leave the cluster idle
        run_cmd([str(BIN / "launcher"), "cancel", sweep], root, timeout=300, extra_env=dict(slurm))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", [["launch", "--help"], ["launcher", "--help"]] + [
    ["launcher", sub, "--help"] for sub in ("runs", "logs", "cancel", "show", "diff", "reproduce", "plan",
                                                 "resume", "doctor", "status", "retry", "results", "report", "data")])
def test_help_answers(argv, tmp_path):
    res = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert argv[0] in res.stdout and len(res.stdout.splitlines()) > 3, res.stdout
