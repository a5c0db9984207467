"""The run archive end to end: code snapshot, exact reproduction, secrets, atomicity, registry."""
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, clone_worktree, launch, read_metrics, run_cmd, runs_json, wait_final
from launcher.run.rundir import RunDir

pytestmark = [pytest.mark.timeout(600)]

FAST = ["train.steps=12", "optim.lr=3e-3", "train.log_interval=0"]


@pytest.fixture
def worktree(tmp_path):
    """A scratch clone of this repo with the working tree's current files: the tests change its
    conf/ and code after launching, as a user would."""
    dest = tmp_path / "work"
    clone_worktree(dest)
    return dest


def _env(worktree):
    return {"LAUNCHER_CONF_DIR": str(worktree / "conf")}


def _sabotage(worktree):
    """Change both conf/ and the training code: any run that used them would train differently."""
    adamw = worktree / "conf" / "optim" / "adamw.yaml"
    adamw.write_text(adamw.read_text().replace("beta2: 0.95", "beta2: 0.5"))
    train = worktree / "recipes" / "common" / "schedule.py"  # the schedule the GPT's loop trains with
    text = train.read_text()
    assert "def lr_at(" in text
    train.write_text(text.replace('    min_lr = lr * min_lr_ratio\n',
                                  '    lr = lr * 0.25\n    min_lr = lr * min_lr_ratio\n', 1))


def _reproduce(run, runs_root, worktree, extra_env=None):
    env = {**_env(worktree), **(extra_env or {})}
    res = run_cmd([str(BIN / "launcher"), "reproduce", run["run_id"], "--root", str(runs_root)], runs_root,
                  extra_env=env, cwd=worktree, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def _diff(a, b, runs_root):
    res = run_cmd([str(BIN / "launcher"), "diff", a["run_id"], b["run_id"], "--json", "--root", str(runs_root)],
                  runs_root, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def _check_reproduction(original, runs_root, worktree, extra_env=None, n_before=1):
    _sabotage(worktree)
    _reproduce(original, runs_root, worktree, extra_env)
    runs = wait_final(runs_root, n_before + 1)
    repro = runs[-1]
    assert repro["status"] == "completed", repro
    assert repro["reproduces"] == original["run_id"]
    d = _diff(original, repro, runs_root)
    assert d["metrics"]["bitwise_identical"], d["metrics"]
    assert d["config"] == {} and d["seeds"] == {}
    assert read_metrics(original["dir"]) and [r["loss"] for r in read_metrics(original["dir"])] == \
        [r["loss"] for r in read_metrics(repro["dir"])]
    return repro


def _check_registry(runs, runs_root):
    """The registry's filters (a config key, a tag, a status) over the two points of a sweep, and the
    index rebuilt from the run dirs alone, in the same order."""
    base = [str(BIN / "launcher"), "runs", "--json", "--root", str(runs_root)]
    one = json.loads(run_cmd(base + ["seed=2"], runs_root).stdout)
    assert [r["config"]["seed"] for r in one] == [2]
    assert len(json.loads(run_cmd(base + ["--tag", "a"], runs_root).stdout)) == 2
    assert json.loads(run_cmd(base + ["--tag", "b"], runs_root).stdout) == []
    assert len(json.loads(run_cmd(base + ["--status", "completed"], runs_root).stdout)) == 2
    db = runs_root / "registry.sqlite"
    db.unlink()
    res = run_cmd([str(BIN / "launcher"), "runs", "--reindex", "--json", "--root", str(runs_root)], runs_root)
    assert [r["run_id"] for r in json.loads(res.stdout)] == [r["run_id"] for r in runs]


def test_reproduce_local_run_bitwise_after_conf_and_code_change(runs_root, worktree):
    """A point of a local sweep (the second of two seeds: the reproduction takes that point's own config
    and seed) reproduced bit for bit after conf/ and the training code changed; the changed tree, launched
    fresh, trains differently; a reproduction on another world size warns that it cannot be bitwise.
    The registry's filters and its reindex are checked on the same sweep's two points before anything
    else runs (the reproduction then reads the rebuilt index). (One test: each made its own runs.)
    One process a run: the reproduction must take the archived world size (1), not the default (2); a
    2-rank run reproduced bitwise is test_reproduce_two_node_slurm_run's."""
    one_rank = "cluster.gpus_per_node=1"
    res = launch(["-m", *FAST, one_rank, "seed=1,2", "tags=[a]"], runs_root, extra_env=_env(worktree),
                 cwd=worktree)
    assert res.returncode == 0, res.stdout + res.stderr
    runs = wait_final(runs_root, 2)
    assert runs[0]["sweep_id"] == runs[1]["sweep_id"]
    snaps = [json.loads((Path(r["dir"]) / "code" / "snapshot.json").read_text()) for r in runs]
    assert len({s["path"] for s in snaps}) == 1  # one snapshot per launch, shared by the sweep's points
    assert Path(snaps[0]["path"]).is_dir() and snaps[0]["files"] > 10
    _check_registry(runs, runs_root)
    original = runs[1]
    assert RunDir(original["dir"]).config()["seed"] == 2
    _check_reproduction(original, runs_root, worktree, n_before=2)
    # and the changed tree, launched fresh, does train differently (the change was real)
    res = launch([*FAST, one_rank, "seed=2"], runs_root, extra_env=_env(worktree), cwd=worktree)
    assert res.returncode == 0, res.stderr
    fresh = runs_json(runs_root)[-1]
    assert fresh["run_id"] not in {r["run_id"] for r in runs}
    assert _diff(original, fresh, runs_root)["metrics"]["bitwise_identical"] is False
    # another topology: warned before anything is queued (a dry run: the warning is the reproduction's
    # own check of the archived topology, made before it launches)
    n = len(runs_json(runs_root))
    res = run_cmd([str(BIN / "launcher"), "reproduce", original["run_id"], "cluster.gpus_per_node=2",
                   "submit.dry_run=true", "--root", str(runs_root)], runs_root, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "world size 2 differs from the original 1" in res.stderr
    assert len(runs_json(runs_root)) == n  # the dry run queued nothing


@pytest.mark.slurm
def test_reproduce_two_node_slurm_run(slurm, runs_root, worktree):
    args = ["cluster=local_slurm", "cluster.nodes=2", *FAST]
    res = launch(args, runs_root, extra_env={**_env(worktree), **slurm}, cwd=worktree)
    assert res.returncode == 0, res.stdout + res.stderr
    (original,) = wait_final(runs_root, 1)
    assert original["status"] == "completed", original
    repro = _check_reproduction(original, runs_root, worktree, extra_env=slurm)
    hosts = {json.loads(p.read_text())["slurmd_nodename"] for p in (Path(repro["dir"]) / "ranks").glob("rank_*.json")}
    assert len(hosts) == 2


def _secret():  # made at test time: a literal would also sit in the code snapshot of this file
    import secrets

    return "v-" + secrets.token_hex(12)


SECRETS = {"WANDB_API_KEY": _secret(), "HF_TOKEN": _secret(), "MY_SERVICE_SECRET": _secret(),
           "DB_PASSWORD": _secret(), "AWS_SECRET_ACCESS_KEY": _secret(), "GIT_CREDENTIALS": _secret()}
CFG_TOKEN = _secret()


def _all_files(*dirs):
    for d in dirs:
        for p in Path(d).rglob("*"):
            if p.is_file():
                yield p


def test_bundle_is_sealed_verifiable_and_holds_no_secret(runs_root):
    """One run checked both ways (each was its own launch): no secret value handed to the launch
    reaches any file under runs_root or the output, and its bundle is sealed and verifies."""
    extra = dict(SECRETS, NCCL_DEBUG="INFO", OMP_NUM_THREADS="1")
    # and the same values under keys that are not secret-named (tags, cluster.setup): found by value
    res = launch(["train.steps=6", f"+cluster.env.API_TOKEN={CFG_TOKEN}", f"tags=[{SECRETS['HF_TOKEN']},plain]",
                  f"cluster.setup=['export X={CFG_TOKEN}']"], runs_root, extra_env=extra)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = runs_json(runs_root)
    rdir = Path(run["dir"])
    assert json.loads((rdir / "run.json").read_text())["tags"] == ["<redacted>", "plain"]
    env = json.loads((rdir / "env" / "training-env.json").read_text())
    assert env.get("NCCL_DEBUG") == "INFO"  # training environment is archived...
    # the bundle: every record in its manifest, read-only, verified by `launcher show`
    manifest = json.loads((rdir / "manifest.json").read_text())
    for name in ("config.yaml", "overrides.yaml", "seeds.json", "run.json", "status.json", "metrics.jsonl",
                 "code/git.json", "code/patch.diff", "code/snapshot.json", "env/pip-freeze.txt",
                 "env/software.json", "env/runtime.json", "env/training-env.json", "job.json", "plan.json",
                 "checks.json"):
        assert name in manifest["files"], name
    assert any(k.startswith("topology/node_") for k in manifest["files"])
    assert any(k.startswith("ranks/rank_1") for k in manifest["files"])
    assert all((rdir / f).stat().st_mode & 0o222 == 0 for f in manifest["files"])
    show = run_cmd([str(BIN / "launcher"), "show", run["run_id"], "--json", "--root", str(runs_root)], runs_root)
    info = json.loads(show.stdout)
    assert info["manifest_problems"] == []
    seeds = info["seeds"]
    assert seeds["seed"] == 1234 and set(seeds["dropout"]["per_dp_rank"]) == {"0", "1"}
    assert info["topology"]["world_size"] == 2
    values = list(SECRETS.values()) + [CFG_TOKEN]
    leaks = []
    for p in _all_files(runs_root):  # the run dir, its sweep's logs and code snapshot, the index
        data = p.read_bytes()
        leaks += [(str(p), v) for v in values if v.encode() in data]
    assert not leaks, leaks  # ...but no secret value, anywhere
    assert all(v not in res.stdout + res.stderr + show.stdout for v in values)


@pytest.mark.slurm
def test_killed_launch_leaves_no_half_written_run(slurm, runs_root):
    """SIGKILL the launcher while it writes a 300-point sweep: every listed run is complete."""
    env = dict(os.environ, LAUNCHER_RUNS=str(runs_root), **slurm)
    # jobs that could be submitted are held far in the future, so nothing runs
    proc = subprocess.Popen([str(BIN / "launch"), "-m", "cluster=local_slurm", "cluster.nodes=1",
                             "+cluster.sbatch_extra.begin=now+10hours", "seed=range(0,300)"],
                            env=env, cwd=str(runs_root.parent), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline:
        staged = list(runs_root.glob("*/.*.partial")) + list(runs_root.glob("*/[0-9]*"))
        if len(staged) >= 40:
            break
        time.sleep(0.02)
    assert len(staged) >= 40, f"the launch never staged 40 runs in 120 s ({len(staged)})"
    proc.send_signal(signal.SIGKILL)
    # the kill landed while the launch was still writing: it had not exited, and not every run is listed
    assert proc.wait(timeout=60) == -signal.SIGKILL, proc.stderr.read()[-2000:]
    try:
        listed = runs_json(runs_root)
        assert len(listed) < 300, "the launch had finished writing before the kill: nothing was tested"
        for r in listed:
            rdir = Path(r["dir"])
            for name in ("run.json", "config.yaml", "plan.json", "job.json"):
                assert (rdir / name).is_file(), (rdir, name)
            # the sweep's shared records and its per-point seeds and overrides (written into the run
            # when its job starts) are already readable
            rd = RunDir(rdir)
            assert rd.git() and rd.software() and rd.snapshot()["path"], rdir
            assert rd.seeds()["seed"] == rd.config()["seed"] and rd.overrides()["overrides"], rdir
            assert r["status"] == "pending" and r["job_id"], r
        res = run_cmd([str(BIN / "launcher"), "runs", "--reindex", "--json", "--root", str(runs_root)], runs_root)
        assert res.returncode == 0, res.stderr
        assert [r["run_id"] for r in json.loads(res.stdout)] == [r["run_id"] for r in listed]
    finally:
        for job in {r.get("job_id", "").split("_")[0] for r in runs_json(runs_root) if r.get("job_id")}:
            subprocess.run(["scancel", job], timeout=60)


# Twenty tasks that each do next to nothing (the cluster's 16 CPUs run them in two waves: 16 writers at
# once, then the rest while the first wave seals): what is measured is the archive under many
# concurrent writers (one array, every run sealed, the registry complete and never locked out), not
# training; a script recipe that imports no torch keeps the array's cost to its tasks' start-up. (It
# was 40 tasks in three waves: the third wave added ~17 s and 20 task starts, not more writers at once.)
TINY_SCRIPT = """import json, os
with open(os.environ["LAUNCHER_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"step": 1, "loss": float(os.environ["RANK"])}) + "\\n")
"""


@pytest.mark.slurm
@pytest.mark.slurm_whole
@pytest.mark.timeout(1200)
def test_twenty_task_array(slurm, runs_root, tmp_path):
    code = tmp_path / "code"
    code.mkdir()
    (code / "tiny.py").write_text(TINY_SCRIPT)
    res = launch(["-m", "recipe=script", "recipe.script=tiny.py", "cluster=local_slurm", "cluster.nodes=1",
                  "cluster.gpus_per_node=1", "seed=range(0,20)"], runs_root,
                 extra_env=slurm, timeout=600, cwd=code)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    runs = wait_final(runs_root, 20, timeout=1100)
    assert len(runs) == 20 and all(r["status"] == "completed" for r in runs), \
        [r for r in runs if r["status"] != "completed"][:3]
    assert len({r["job_id"].split("_")[0] for r in runs}) == 1
    for r in runs:
        rdir = Path(r["dir"])
        assert (rdir / "manifest.json").is_file()
    import sqlite3

    with sqlite3.connect(runs_root / "registry.sqlite") as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs WHERE status='completed'").fetchone()[0] == 20
    logs = " ".join(p.read_text(errors="replace") for p in runs_root.glob("*/.submitit/*.err"))
    assert "database is locked" not in logs and "OperationalError" not in logs
