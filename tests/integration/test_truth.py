"""The archive tells the truth: tampering is found by show/diff/reproduce (non-zero exit), a seal is
never rewritten, cancel and the wait timeout stop the processes before recording `cancelled`, a
corrupt index is rebuilt, and text that looks like rich markup is printed as it is."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, clone_worktree, launch, run_cmd, runs_json
from launcher.backends.local import pid_alive
from launcher.run.rundir import RunDir
from launcher.run.status import Status

pytestmark = [pytest.mark.timeout(600)]

QUICK = ["train.steps=6", "optim.warmup_steps=0", "train.log_interval=0",
         "cluster.gpus_per_node=1"]
LONG = ["train.steps=100000", "optim.warmup_steps=0", "train.log_interval=0",
        "cluster.gpus_per_node=2"]


def launcher(args, runs_root, **kw) -> subprocess.CompletedProcess:
    return run_cmd([str(BIN / "launcher"), *args, "--root", str(runs_root)], runs_root, timeout=300, **kw)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two sealed local runs of one sweep (seeds 1 and 2)."""
    root = tmp_path_factory.mktemp("truth") / "runs"
    res = launch(["-m", *QUICK, "seed=1,2"], root, timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    runs = runs_json(root)
    assert [r["status"] for r in runs] == ["completed", "completed"]
    for r in runs:
        assert RunDir(r["dir"]).verify() == []
    return root, runs


def _copy_run(run, dest_root: Path, name: str) -> Path:
    """A copy of a sealed run dir to tamper with (the original stays intact)."""
    dest = dest_root / name / "0"
    shutil.copytree(run["dir"], dest)
    return dest


def _writable(path: Path) -> Path:
    os.chmod(path, path.stat().st_mode | stat.S_IWUSR)
    return path


@pytest.mark.parametrize("tamper,expect", [
    ("edit_config", "config.yaml changed"),
    ("delete_manifest", "manifest.json missing"),
    ("add_file", "notes.txt added after the seal"),
    ("delete_status", "status.json missing"),
])
def test_show_and_diff_find_tampering(two_runs, tmp_path, tamper, expect):
    root, runs = two_runs
    rdir = _copy_run(runs[0], tmp_path, tamper)
    if tamper == "edit_config":
        cfg = _writable(rdir / "config.yaml")
        cfg.write_text(cfg.read_text().replace("lr: 0.001", "lr: 0.1"))
    elif tamper == "delete_manifest":
        (rdir / "manifest.json").unlink()
    elif tamper == "add_file":
        (rdir / "notes.txt").write_text("added later")
    elif tamper == "delete_status":
        (rdir / "status.json").unlink()
    show = launcher(["show", str(rdir)], root)
    assert show.returncode == 1, show.stdout + show.stderr
    assert "DOES NOT MATCH ITS SEAL" in show.stderr and expect in show.stderr, show.stderr
    diff = launcher(["diff", str(rdir), runs[1]["dir"]], root)
    assert diff.returncode == 1 and expect in diff.stderr, diff.stdout + diff.stderr
    intact = launcher(["show", runs[1]["dir"]], root)
    assert intact.returncode == 0, intact.stderr


def test_special_and_oversized_records_are_refused_by_name_never_read(two_runs, tmp_path):
    """Bounded reads: a FIFO as metrics.jsonl (a read would block for ever), a rank's log linked to
    /dev/zero (endless) and a 1 GB sparse status.json: every command that meets them names the file and
    goes on or stops at once, in bounded time and memory."""
    root, runs = two_runs
    rdir = _copy_run(runs[0], tmp_path / "runs", "special")
    os.chmod(rdir, 0o755)
    (rdir / "metrics.jsonl").unlink()
    os.mkfifo(rdir / "metrics.jsonl")
    # the copy's own job folder (never the original run's: its log stays a file), its rank 0 log -> /dev/zero
    job_file = _writable(rdir / "job.json")
    job = json.loads(job_file.read_text())
    folder = tmp_path / "runs" / "special" / ".submitit"
    folder.mkdir()
    for key in ("submitit_folder", "stdout", "stderr"):
        job[key] = job[key].replace(str(Path(job["submitit_folder"])), str(folder))
    job_file.write_text(json.dumps(job))
    from launcher import backends

    log = backends.get(job["backend"]).log_path(RunDir(rdir).job(), 0)
    assert log.parent == folder
    log.symlink_to("/dev/zero")
    for args in (["status", str(rdir)], ["report", str(rdir), "-o", str(tmp_path / "page.html")],
                 ["doctor", str(rdir)], ["diff", str(rdir), runs[1]["dir"]]):
        # (the timeout: a read of the FIFO would block for ever)
        res = run_cmd([str(BIN / "launcher"), *args, "--root", str(tmp_path / "runs")], tmp_path / "runs", timeout=60)
        assert "Traceback" not in res.stderr, (args, res.stderr)
        if args[0] != "doctor":  # (a completed run: the doctor reads no metrics)
            assert "metrics.jsonl is a FIFO, not a file: not read" in res.stderr, (args, res.stdout, res.stderr)
    res = run_cmd([str(BIN / "launcher"), "logs", str(rdir), "--root", str(tmp_path / "runs")], tmp_path / "runs",
                  timeout=60)
    assert res.returncode != 0 and "is a device, not a file: not read" in res.stderr, res.stdout[-500:] + res.stderr
    status = _writable(rdir / "status.json")
    with open(status, "r+b") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte that takes no disk
    res = run_cmd([str(BIN / "launcher"), "show", str(rdir), "--root", str(tmp_path / "runs")], tmp_path / "runs",
                  timeout=60)
    assert res.returncode != 0 and "status.json holds 1,073,741,824 bytes" in res.stdout + res.stderr, res.stderr


def test_removing_every_seal_and_trace_of_a_run_never_gets_it_sealed_again(tmp_path):
    """A tampered config.yaml hidden by removing the manifest, status.json, the sweep's seal mark, the
    metrics and the checkpoints: what the job left elsewhere (each rank's record) says it ran, so the run
    is tamper evidence, never pending; a refresh records the lost outcome without sealing over the change,
    and show and reproduce refuse it."""
    root = tmp_path / "runs"
    res = launch([*QUICK, "train.checkpoint.every=3"], root, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    rdir = Path(run["dir"])
    subprocess.run(["chmod", "-R", "u+w", str(rdir), str(rdir.parent / ".seals")], check=True)
    cfg = rdir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("lr: 0.001", "lr: 0.5"))
    for p in (rdir / "manifest.json", rdir / "status.json", rdir.parent / ".seals" / "0.json", rdir / "metrics.jsonl"):
        p.unlink()
    shutil.rmtree(rdir / "checkpoints")
    show = launcher(["show", str(rdir)], root)
    assert show.returncode == 1 and "status.json missing although the run started" in show.stderr, show.stderr
    # the index still holds it completed (a witness the run dir lost); rebuilt from the dirs, it reads the run
    # as they say, and the next status settles the lost outcome
    assert launcher(["runs", "--reindex"], root).returncode == 0
    launcher(["status", run["sweep_id"]], root)
    assert not (rdir / "manifest.json").exists()  # never sealed over the tampered config.yaml
    assert RunDir(rdir).status().state in ("failed", "cancelled", "timeout")
    show = launcher(["show", str(rdir)], root)
    assert show.returncode == 1 and "manifest.json missing for a finished run" in show.stderr, show.stderr
    res = launcher(["reproduce", str(rdir), "submit.dry_run=true"], root)
    assert res.returncode != 0, res.stdout + res.stderr


def test_reproduce_refuses_a_tampered_run_and_launches_nothing(two_runs, tmp_path):
    root, runs = two_runs
    rdir = _copy_run(runs[0], root, "copied-sweep")
    cfg = _writable(rdir / "config.yaml")
    cfg.write_text(cfg.read_text().replace("seed: 1", "seed: 7"))
    before = sorted(p.name for p in root.iterdir())
    res = launcher(["reproduce", str(rdir)], root)
    assert res.returncode == 2 and "config.yaml changed" in res.stderr, res.stdout + res.stderr
    assert sorted(p.name for p in root.iterdir()) == before
    shutil.rmtree(root / "copied-sweep")


def test_reproduce_refuses_a_hand_made_run_and_a_planted_snapshot_link(two_runs, tmp_path):
    """Issue 27, through the real commands: a run dir made by hand outside the root (a copy, its
    snapshot a modified copy, a manifest written with RunDir.seal()), and a symlinked `sitecustomize`
    package planted in a sealed run's code snapshot: show says so, reproduce launches nothing."""
    root, runs = two_runs
    before = len(runs_json(root))
    fake = tmp_path / "elsewhere" / "s" / "0"
    shutil.copytree(runs[0]["dir"], fake)
    snap = Path(RunDir(runs[0]["dir"]).snapshot()["path"])
    evil = tmp_path / "elsewhere" / "code"
    shutil.copytree(snap, evil)
    train = _writable(evil / "recipes" / "gpt" / "train.py")
    train.write_text(train.read_text() + "\n# modified\n")
    _writable(fake / "manifest.json").unlink()
    record = json.loads((fake / "code" / "snapshot.json").read_text())
    _writable(fake / "code" / "snapshot.json").write_text(json.dumps({**record, "path": str(evil)}))
    assert RunDir(fake).seal() and RunDir(fake).verify() == []
    res = launcher(["reproduce", str(fake)], root)
    assert res.returncode == 2 and "lies outside the known runs roots" in res.stderr, res.stdout + res.stderr
    mode = snap.stat().st_mode
    planted = tmp_path / "sitecustomize"
    planted.mkdir()
    (planted / "__init__.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w')\n")
    os.chmod(snap, mode | stat.S_IWUSR)
    os.symlink(planted, snap / "sitecustomize")
    try:
        show = launcher(["show", runs[0]["dir"]], root)
        assert show.returncode == 1 and "holds a symlink sitecustomize" in show.stderr, show.stderr
        res = launcher(["reproduce", runs[0]["run_id"]], root)
        assert res.returncode == 2 and "code snapshot" in res.stderr, res.stdout + res.stderr
    finally:
        (snap / "sitecustomize").unlink()
        os.chmod(snap, mode)
    assert len(runs_json(root)) == before and not (tmp_path / "PWNED").exists()


def test_a_seal_is_never_rewritten(tmp_path):
    """Deleting status.json and letting the registry record an outcome must not re-seal over the
    evidence: the old manifest stays and still shows the change."""
    rd = RunDir(tmp_path / "run")
    rd.set_status(Status.running)
    rd.write_seeds({"seed": 1})
    assert rd.finish(Status.completed, exit_code=0)
    sealed = (rd.path / "manifest.json").read_text()
    os.chmod(rd.path / "status.json", 0o644)
    (rd.path / "status.json").unlink()
    assert rd.finish(Status.failed, error="lost")  # a new status may be recorded ...
    assert (rd.path / "manifest.json").read_text() == sealed  # ... but the seal is not rewritten
    assert "status.json changed" in rd.verify()


def test_an_edited_code_snapshot_is_found(two_runs, tmp_path):
    root, runs = two_runs
    snap = Path(RunDir(runs[1]["dir"]).snapshot()["path"])
    train = _writable(snap / "recipes" / "gpt" / "train.py")
    train.write_text(train.read_text() + "\n# edited after the run\n")
    show = launcher(["show", runs[1]["dir"]], root)
    assert show.returncode == 1 and "code snapshot" in show.stderr and "changed" in show.stderr, show.stderr
    diff = launcher(["diff", runs[0]["dir"], runs[1]["dir"]], root)
    assert diff.returncode == 1, diff.stdout + diff.stderr


def _wait_for_ranks(run_dir: Path, n: int, timeout: float = 120) -> list:
    deadline = time.time() + timeout
    while time.time() < deadline:
        ranks = RunDir(run_dir).ranks()
        if len(ranks) == n and RunDir(run_dir).metrics():
            return ranks
        time.sleep(0.5)
    raise AssertionError(f"ranks of {run_dir} never started")


def _running_local_run(tmp_path: Path, root: Path):
    """A LONG local run launched without waiting, once both its ranks recorded themselves: (its row, ranks)."""
    # the local job keeps launch's stdout: capture into a file, not a pipe that stays open
    with open(tmp_path / "launch.log", "w") as log:
        res = subprocess.run([str(BIN / "launch"), *LONG, "submit.wait=false"], stdout=log, stderr=log, timeout=120,
                             env=dict(os.environ, LAUNCHER_RUNS=str(root)), cwd=str(tmp_path))
    assert res.returncode == 0, (tmp_path / "launch.log").read_text()
    (run,) = runs_json(root)
    return run, _wait_for_ranks(Path(run["dir"]), 2)


def test_cancel_stops_a_local_run_and_records_cancelled(tmp_path):
    root = tmp_path / "runs"
    run, ranks = _running_local_run(tmp_path, root)
    res = launcher(["cancel", run["run_id"]], root)
    assert res.returncode == 0 and "cancelled 1 run(s)" in res.stdout, res.stdout + res.stderr
    deadline = time.time() + 30
    while time.time() < deadline and any(pid_alive(r["pid"]) for r in ranks):
        time.sleep(0.2)
    assert not any(pid_alive(r["pid"]) for r in ranks), "rank processes still running after cancel"
    assert not pid_alive(int(run["job_id"]))
    time.sleep(2)  # nothing of the job writes after this
    st = RunDir(run["dir"]).status()
    assert st.state == "cancelled" and st.exit_code is None, st
    assert RunDir(run["dir"]).verify() == []
    (again,) = runs_json(root)
    assert again["status"] == "cancelled"


def test_a_cancel_whose_record_cannot_be_written_still_stops_the_job(tmp_path):
    """A record that cannot be written (a full disk; here the run dir made immutable) never stops the
    cancel: the job's processes end all the same, and the command says what it could not record."""
    root = tmp_path / "runs"
    run, ranks = _running_local_run(tmp_path, root)
    if subprocess.run(["chattr", "+i", run["dir"]]).returncode != 0:  # no file can be created or replaced in it
        launcher(["cancel", run["run_id"]], root)
        pytest.skip("this file system has no immutable flag (chattr +i)")
    try:
        res = launcher(["cancel", run["run_id"]], root)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "its outcome could not be recorded" in res.stderr and "was cancelled" in res.stderr, res.stderr
        deadline = time.time() + 30
        while time.time() < deadline and any(pid_alive(r["pid"]) for r in ranks):
            time.sleep(0.2)
        assert not any(pid_alive(r["pid"]) for r in ranks), "rank processes still running after cancel"
        assert not pid_alive(int(run["job_id"]))
    finally:
        subprocess.run(["chattr", "-i", run["dir"]], check=True)
    # the next command settles it from the scheduler's word (the job is gone) and seals it
    st = json.loads(launcher(["status", run["sweep_id"], "--json"], root).stdout)
    assert sum(st["counts"].values()) == 1 and "running" not in st["counts"] and "pending" not in st["counts"], st


def test_wait_timeout_cancels_then_records(tmp_path):
    root = tmp_path / "runs"
    # rank 1 asleep in its second step and rank 0 waiting on it: running, as a long run is, without
    # burning two cores for the 15 s
    res = launch([*LONG, "submit.wait_timeout_s=15", "train.fail_mode=sleep", "train.fail_at_step=2",
                  "train.fail_rank=1"], root, timeout=200)
    assert res.returncode == 1, res.stdout + res.stderr
    (run,) = runs_json(root)
    rd = RunDir(run["dir"])
    st = rd.status()
    assert st.state == "cancelled" and "wait_timeout_s=15" in st.error, st
    deadline = time.time() + 30  # killed ranks linger briefly as zombies until reaped
    while time.time() < deadline and any(pid_alive(r["pid"]) for r in rd.ranks()):
        time.sleep(0.2)
    assert not any(pid_alive(r["pid"]) for r in rd.ranks())
    time.sleep(2)
    assert rd.verify() == []  # no rank wrote into the run after it was sealed


def test_two_resumes_of_one_run_at_once_submit_one_attempt(tmp_path, monkeypatch):
    """One writer at a time: two `launcher resume RUN` that both checked the run before either began it;
    the second to claim the next attempt is refused naming the first (its pid and host), nothing submitted."""
    from helpers import wait_final
    from launcher.config.errors import ConfigErrors
    from launcher.submit import resume

    root = tmp_path / "runs"
    res = launch([*QUICK, "train.checkpoint.every=3"], root, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    monkeypatch.setenv("LAUNCHER_RUNS", str(root))
    first, second = (resume.prepare(Path(run["dir"]), steps=9) for _ in range(2))  # both checked, neither began
    resume.resubmit([Path(run["dir"])], reason="resume", steps=9, prepared=[first])
    with pytest.raises(ConfigErrors) as refused:
        resume.resubmit([Path(run["dir"])], reason="resume", steps=9, prepared=[second])
    assert f"was claimed by `launcher resume` (pid {os.getpid()}" in str(refused.value), refused.value
    (done,) = wait_final(root, 1, timeout=300)
    assert done["status"] == "completed", done
    rows = RunDir(run["dir"]).restarts()
    assert [r["attempt"] for r in rows] == [2], rows  # one attempt 2, one job


def test_logs_of_a_run_dir_outside_the_root_given(two_runs, tmp_path):
    """`launcher logs RUN_DIR` (as --help offers) finds the run by its dir wherever --root points."""
    root, runs = two_runs
    res = launcher(["logs", runs[0]["dir"]], tmp_path / "elsewhere")
    assert res.returncode == 0 and res.stdout.strip(), res.stdout[-500:] + res.stderr


def test_a_corrupt_index_is_rebuilt(two_runs, tmp_path):
    root, runs = two_runs
    work = tmp_path / "runs"
    shutil.copytree(root, work, ignore=shutil.ignore_patterns("copied-sweep"))
    (work / "registry.sqlite").write_bytes(b"this is not a database" * 100)
    res = launcher(["runs", "--json"], work)
    assert res.returncode == 0, res.stderr
    assert {r["run_id"] for r in json.loads(res.stdout)} == {r["run_id"] for r in runs}
    (work / "registry.sqlite").write_bytes(b"garbage")
    res = launcher(["runs", "--reindex", "--json"], work)
    assert res.returncode == 0 and "reindexed 2 run(s)" in res.stderr, res.stderr
    with sqlite3.connect(str(work / "registry.sqlite")) as conn:
        assert conn.execute("SELECT count(*) FROM runs").fetchone()[0] == 2
    # launch into a root whose index is corrupt: submitted, archived, indexed
    (work / "registry.sqlite").write_bytes(b"garbage")
    res = launch(QUICK, work, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(runs_json(work)) == 3


def test_markup_looking_text_is_printed_verbatim(tmp_path):
    """A path or an error holding rich markup ([/x], [bold]) is text, not markup."""
    root = tmp_path / "[bold]runs[/x]"
    work = tmp_path / "work"
    clone_worktree(work)
    (work / "markup_recipe.py").write_text(
        "def main(cfg, ctx):\n    raise RuntimeError('gloo: [/__w/pytorch/pytorch/x.cpp:42] [bold]peer closed[/x]')\n")
    res = launch([*QUICK, "recipe._target_=markup_recipe.main"], root, timeout=300, cwd=work,
                 extra_env={"LAUNCHER_CONF_DIR": str(work / "conf")})
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    squeeze = lambda text: "".join(text.replace("│", " ").split())  # noqa: E731  (rich wraps long lines)
    assert squeeze("[/__w/pytorch/pytorch/x.cpp:42] [bold]peer closed[/x]") in squeeze(res.stdout)
    (run,) = runs_json(root)
    assert run["status"] == "failed"
    show = launcher(["show", run["run_id"]], root)
    assert show.returncode == 0, show.stderr
    assert squeeze("[bold]peer closed[/x]") in squeeze(show.stdout) and "[bold]runs[/x]" in squeeze(show.stdout)
    table = launcher(["runs"], root, extra_env={"COLUMNS": "80"})
    assert table.returncode == 0, table.stderr
    assert run["run_id"] in table.stdout  # never cut at 80 columns


def test_a_failed_rank_points_at_its_own_log(tmp_path):
    root = tmp_path / "runs"
    res = launch([*QUICK, "cluster.gpus_per_node=2", "train.fail_at_step=2", "train.fail_rank=1",
                  "train.max_restarts=0"], root, timeout=300)  # no restart: the failure is the outcome
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    log = f"{run['job_id']}_1_log.err"
    assert log in "".join(res.stdout.split()), res.stdout
    assert "injected failure at step 2 on rank 1" in (Path(run["dir"]).parent / ".submitit" / log).read_text()


def test_own_recipe_outside_a_git_repo_runs_from_its_snapshot(tmp_path):
    """`launch recipe._target_=mypkg.train.main` from a plain directory snapshots that directory
    (not the launcher's repo) and the job imports the user's package from the snapshot."""
    work = tmp_path / "proj"
    (work / "mypkg").mkdir(parents=True)
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "mypkg" / "train.py").write_text(
        "def main(cfg, ctx):\n"
        "    ctx.log_metrics(1, loss=1.5)\n"
        "    return {'steps': 1, 'final_loss': 1.5, 'world': ctx.layout.world_size}\n")
    root = tmp_path / "runs"
    res = launch([*QUICK, "recipe._target_=mypkg.train.main"], root, timeout=300, cwd=work)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (run,) = runs_json(root)
    assert run["status"] == "completed" and run["final_loss"] == 1.5
    snap = Path(RunDir(run["dir"]).snapshot()["path"])
    assert (snap / "mypkg" / "train.py").is_file() and not (snap / "launcher").exists()


def test_no_runs_says_which_root(tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    res = launcher(["runs"], root)
    assert res.returncode == 0 and f"no runs under {root}" in res.stderr, res.stderr
