"""A user's own recipe package (written here, outside the project) through the whole life of a run:
failures no restart fixes end at once, a repeated failure ends after the second attempt, a corrupt
checkpoint is caught before `launcher resume` loads it; resume and reproduce run the snapshot from any
directory; the user's commit and the launcher's are kept apart."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Dict, List

import pytest

import launcher
from helpers import BIN, REPO, launch, run_cmd, runs_json

QUICK = ["cluster=local", "train.steps=5", "train.max_restarts=3"]


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


CHECKPOINTED = (
    "import torch\n\n"
    "from launcher.training import Checkpoint, StepLoop\n\n\n"
    "def main(cfg, ctx):\n"
    "    torch.manual_seed(0)\n"
    "    model = torch.nn.Linear(4, 1)\n"
    "    opt = torch.optim.AdamW(model.parameters(), lr=0.1)\n"
    "    loop = StepLoop(cfg, ctx, Checkpoint(cfg, ctx, {'model': model, 'optimizer': opt}))\n"
    "    for step in loop:\n"
    "        loss = model(torch.randn(8, 4)).pow(2).mean()\n"
    "        opt.zero_grad()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "        loop.log(loss=loss.item())\n"
    "    return {'steps': loop.steps, 'resumed_from': loop.start}\n")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("share", [0, 1])
def test_a_checkpoint_with_one_byte_flipped_is_caught_before_resume_loads_it(tmp_path, share):
    """The only checkpoint (keep 1) of a completed run gets one byte flipped (torch.load would load it
    silently) in a file rank ``share`` hashes at resume (each of the 2 ranks hashes its share of the
    files): `launcher resume` fails the run at once, naming the file, with no restart spent although
    train.max_restarts=3. (Truncation, a re-pointed `latest`, a file deleted or planted, and the fallback
    to an earlier checkpoint: tests/unit/test_training_api.py.)"""
    from launcher.run import checkpoint_manifest

    proj = user_package(tmp_path / "proj", {"ck": CHECKPOINTED})
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=upkg.ck.main", "train.checkpoint.every=2", "train.checkpoint.keep=1"],
                 root, timeout=240, cwd=proj)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    run_dir = Path(run["dir"])
    ckpt = run_dir / "checkpoints" / "step_00000005"
    rel = checkpoint_manifest.shares(checkpoint_manifest.listed_files(ckpt), 2)[share][0]
    state = ckpt / rel
    state.chmod(0o644)  # the sealed run's files are read-only
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))

    res = run_cmd([str(BIN / "launcher"), "resume", str(run_dir), "--steps", "7"], root, timeout=240)
    assert res.returncode != 0, res.stdout[-2000:]
    st = summary_of(run_dir)
    assert st["status"] == "failed" and st["attempt"] == 2, st
    assert "CheckpointCorrupt" in st["error"] and f"checkpoints/step_00000005/{rel} changed" in st["error"], st
    assert st["no_restart"]["kind"] == "corrupt_checkpoint", st
    assert [r["reason"] for r in restart_rows(run_dir)] == ["resume"]  # the user's; not one automatic restart
    d = doctor(run_dir, root)
    assert f"checkpoints/step_00000005/{rel} changed" in d["summary"], d
    assert any(line.startswith("not restarted: no checkpoint to resume from is intact") for line in d["detail"]), d


DDP_LOOP = (
    "import torch\n"
    "from torch.nn.parallel import DistributedDataParallel\n\n"
    "from launcher.training import Checkpoint, StepLoop\n\n\n"
    "def main(cfg, ctx):\n"
    "    torch.manual_seed(0)\n"
    "    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),\n"
    "                                                        torch.nn.Linear(8, 1)))\n"
    "    opt = torch.optim.AdamW(model.parameters(), lr=0.01)\n"
    "    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)\n"
    "    loop = StepLoop(cfg, ctx, Checkpoint(cfg, ctx, {'model': model, 'optimizer': opt, 'sched': sched}))\n"
    "    for step in loop:\n"
    "        g = torch.Generator().manual_seed(step * 100 + ctx.rank)\n"
    "        loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()\n"
    "        opt.zero_grad()\n"
    "        loss.backward()\n"
    "        opt.step()\n"
    "        sched.step()\n"
    "        loop.log(loss=loss.item(), lr=sched.get_last_lr()[0])\n"
    "    return {'steps': loop.steps, 'resumed_from': loop.start}\n")


@pytest.mark.timeout(400)
def test_a_users_ddp_loop_resumes_on_another_layout_bitwise(tmp_path):
    """A user's DDP loop (its model, optimizer and scheduler in a Checkpoint) run on 2 processes goes on
    from its last checkpoint on 1 (`launcher resume ... cluster.gpus_per_node=1`): the model and Adam
    moments load by parameter name from the layout-independent state, each tensor gathered after the
    load bitwise equal to what was saved; the scheduler goes on from where it was (the learning rate
    keeps halving every 2 steps)."""
    proj = user_package(tmp_path / "proj", {"ddp": DDP_LOOP})
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=upkg.ddp.main", "train.steps=4", "train.checkpoint.every=2"], root,
                 timeout=240, cwd=proj)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    run_dir = Path(run["dir"])
    ckpt = run_dir / "checkpoints" / "step_00000004"
    # the model and its moments are in rank 0's state.pt whole: the universal form is named, not written twice
    assert (ckpt / "universal.links.00000.json").is_file() and not (ckpt / "universal").exists()
    res = run_cmd([str(BIN / "launcher"), "resume", str(run_dir), "--steps", "6", "cluster.gpus_per_node=1"], root,
                  timeout=240, cwd=proj)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    logs = "".join(p.read_text() for p in run_dir.parent.glob(".submitit/*_0_log.out"))  # (the sweep's folder)
    assert "wrote the layout-independent state of step_00000004 from its own files" in logs, logs[-2000:]
    # (its scratch copy deleted once loaded and checked: the checkpoint stays as its manifest lists it)
    assert not list((run_dir / "checkpoints").glob(".universal_*")) and not (ckpt / "universal").exists()
    st = summary_of(run_dir)
    assert st["status"] == "completed" and st["summary"]["resumed_from"] == 4, st
    (row,) = [json.loads(x) for x in (run_dir / "reshard.jsonl").read_text().splitlines()]
    assert row["bitwise_equal"] and row["from"]["dp"] == 2 and row["to"]["dp"] == 1, row
    assert row["verify"]["tensors"] >= 12 and not row["verify"]["mismatched"], row  # 4 weights, 8 moments (+ steps)
    lrs = [r["lr"] for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert lrs == [0.01, 0.005, 0.005, 0.0025, 0.0025, 0.00125], lrs


# ---- resume and reproduce from any directory; the launcher's recipes in the snapshot; provenance ------
COUNTING = (
    "import recipes.common.phases as phases\n\n\n"
    "def main(cfg, ctx):\n"
    "    for step in range(1, int(cfg.train.steps) + 1):\n"
    "        ctx.log_metrics(step, loss=1.0 / step)\n"
    "        ctx.heartbeat(step)\n"
    "    return {'steps': int(cfg.train.steps), 'final_loss': 1.0 / int(cfg.train.steps),\n"
    "            'recipes_from': phases.__file__}\n")


WIDE = {"COLUMNS": "400"}  # rich wraps a table at 80 columns when the output is no terminal


def show(run_dir: Path, root: Path, cwd: Path) -> dict:
    res = run_cmd([str(BIN / "launcher"), "show", str(run_dir), "--json"], root, timeout=120, cwd=cwd)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def summary_of(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "status.json").read_text())


@pytest.mark.timeout(600)
def test_resume_and_reproduce_from_another_dir_run_the_snapshot(tmp_path):
    proj = user_package(tmp_path / "proj", {"t": COUNTING})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=upkg.t.main"], root, timeout=240, cwd=proj)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    run_dir = Path(run["dir"])
    snap = Path(json.loads((run_dir / "code" / "snapshot.json").read_text())["path"])
    # the user's tree, and the launcher's recipes its code imports, both from the snapshot
    assert (snap / "upkg" / "t.py").is_file() and (snap / "recipes" / "common" / "phases.py").is_file()
    assert summary_of(run_dir)["summary"]["recipes_from"] == str(snap / "recipes" / "common" / "phases.py")
    assert json.loads((run_dir / "code" / "snapshot.json").read_text())["bundled"]["recipes"]["files"] > 5

    # from a directory that holds neither the package nor the project
    res = run_cmd([str(BIN / "launcher"), "resume", str(run_dir), "--steps", "7"], root, timeout=240, cwd=elsewhere)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    st = summary_of(run_dir)
    assert st["status"] == "completed" and st["attempt"] == 2 and st["summary"]["steps"] == 7, st
    res = run_cmd([str(BIN / "launcher"), "reproduce", str(run_dir)], root, timeout=240, cwd=elsewhere)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (repro,) = [r for r in runs_json(root) if Path(r["dir"]) != run_dir]
    assert repro["status"] == "completed", repro
    assert summary_of(repro["dir"])["summary"]["recipes_from"].startswith(str(snap))

    # provenance outside git: the user's code has no commit; the launcher's own is named apart
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    code = show(run_dir, root, elsewhere)["code"]
    assert code["commit"] is None and code["note"] == "not a git repo" and code["source"] == str(proj), code
    assert code["launcher_version"] == launcher.__version__ and code["launcher_commit"] == head, code
    text = run_cmd([str(BIN / "launcher"), "show", str(run_dir)], root, timeout=120, cwd=elsewhere,
                   extra_env=WIDE).stdout
    assert "not a git repo" in " ".join(text.split()) and f"commit {head}" in " ".join(text.split()), text


@pytest.mark.timeout(300)
def test_show_names_the_users_commit_and_the_launchers(tmp_path):
    proj = user_package(tmp_path / "gproj", {"t": COUNTING.replace("recipes.common.phases", "json")
                                             .replace("phases.__file__", "'-'")})

    def git(*args):
        return subprocess.run(["git", "-C", str(proj), "-c", "user.email=t@t", "-c", "user.name=t", *args],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "my model")
    commit = git("rev-parse", "HEAD")
    (proj / "upkg" / "t.py").write_text((proj / "upkg" / "t.py").read_text() + "# tuned\n")  # dirty
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=upkg.t.main"], root, timeout=240, cwd=proj)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    code = show(Path(run["dir"]), root, tmp_path)["code"]
    assert code["commit"] == commit and code["dirty"] is True and code["repo"] == str(proj), code
    assert code["launcher_version"] == launcher.__version__ and code["launcher_commit"] not in (None, commit), code
    assert "# tuned" in (Path(run["dir"]) / "code" / "patch.diff").read_text()
    text = " ".join(run_cmd([str(BIN / "launcher"), "show", run["dir"]], root, timeout=120,
                            extra_env=WIDE).stdout.split())
    assert f"commit {commit} dirty True" in text and f"commit {code['launcher_commit']}" in text, text
