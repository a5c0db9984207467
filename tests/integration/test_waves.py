"""Waves on the real local Slurm cluster, which enforces association limits as most sites do
(AccountingStorageEnforce=associations,limits,qos: scripts/slurm-local.sh). The user's association in
an account of this test's own is limited (sacctmgr ... MaxSubmitJobs=N), and removed after:

- a launch killed (SIGKILL) once its first array is queued, its jobs held: the next `launcher runs`
  publishes what it queued, puts the rest to `waiting` and queues a wave job; `launcher cancel SWEEP`
  then cancels the queued runs, the waiting ones and the wave job: nothing of the account left in squeue;
- a sweep of more points than the limit, its launch sent SIGTERM the moment its first array is queued:
  what it queued stays, the rest wait (`waiting`), and every point ends completed exactly once (one job,
  one attempt), in waves no larger than the room, `squeue` empty after. Slurm itself refuses a job past
  the limit, so a run that completed was never one too many;
- a launch past the limit left to its end: exit 0, the waiting points and the wave job named.
"""
import getpass
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import BIN, run_cmd, runs_json, wait_final

pytestmark = [pytest.mark.slurm]

ACCOUNT = "wavesdrill"
# a user's script that ends at once (recipe=script: no torch in its rank), one task on one node, in the account
POINT = ["recipe=script", "recipe.script=point.py", "cluster=local_slurm", "cluster.nodes=1", "cluster.gpus_per_node=1",
         "train.steps=2", f"cluster.account={ACCOUNT}"]


def sacctmgr(env, *args):
    res = subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0 or "Nothing" in res.stdout + res.stderr, res.stdout + res.stderr
    return res.stdout


def in_queue(env):
    res = subprocess.run(["squeue", "-h", "-r", "-A", ACCOUNT, "-o", "%i|%j|%T"], capture_output=True, text=True,
                         timeout=60, env=env)
    return [line for line in res.stdout.splitlines() if line.strip()]


def wait_queue_empty(env, timeout=90):
    deadline = time.time() + timeout
    while in_queue(env) and time.time() < deadline:
        time.sleep(0.5)
    assert not in_queue(env), f"still queued in account {ACCOUNT} after {timeout}s: {in_queue(env)}"


@pytest.fixture
def limited(slurm, tmp_path):
    """The account, the user's association in it limited to ``MaxSubmitJobs`` (set by the test), and an
    environment whose launches read the limits afresh (the sacctmgr cache of its own)."""
    env = dict(os.environ, **slurm, XDG_CACHE_HOME=str(tmp_path / "cache"))
    user = getpass.getuser()
    sacctmgr(env, "add", "account", ACCOUNT, "description=waves drill", "organization=tests")
    sacctmgr(env, "add", "user", user, f"account={ACCOUNT}")
    yield env, lambda n: sacctmgr(env, "modify", "user", "where", f"name={user}", f"account={ACCOUNT}",
                                  "set", f"maxsubmitjobs={n}")
    subprocess.run(["scancel", "-A", ACCOUNT], capture_output=True, timeout=60, env=env)
    wait_queue_empty(env)
    sacctmgr(env, "delete", "user", "where", f"name={user}", f"account={ACCOUNT}")
    sacctmgr(env, "delete", "account", ACCOUNT)


def start_launch(overrides, root, env):
    (root.parent / "point.py").write_text("print('point done')\n")
    return subprocess.Popen([str(BIN / "launch"), "-m", *POINT, *overrides], cwd=str(root.parent),
                            env=dict(env, LAUNCHER_RUNS=str(root)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def first_array_queued(root, proc, timeout=120):
    """Until the launch's journal names its first array (sbatch returned), or the launch has ended."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        journals = list(root.glob("*/.launch.json"))
        try:
            if journals and json.loads(journals[0].read_text()).get("arrays"):
                return
        except (OSError, ValueError):  # being replaced
            pass
        time.sleep(0.01)
    assert proc.poll() is not None, f"no array queued after {timeout}s"


def launcher(args, runs_root, env, timeout=120):
    return run_cmd([str(BIN / "launcher"), *args, "--root", str(runs_root)], runs_root, timeout=timeout, extra_env=env)


@pytest.mark.timeout(600)
def test_a_sweep_past_the_users_limit_runs_in_waves_after_sigkill_sigterm_and_to_its_end(limited, tmp_path):
    env, limit = limited

    # ---- 8 held points, room 4: the launch killed (SIGKILL) once its first array is queued; the next
    # `launcher runs` repairs it (the runs it never queued wait, a wave job queued); cancel ends all of it
    limit(4)
    held = tmp_path / "a" / "runs"  # each launch from a dir of its own, holding the script
    held.mkdir(parents=True)
    proc = start_launch(["seed=range(0,8)", "cluster.max_array_size=1", "+cluster.sbatch_extra.begin=now+10hours"],
                        held, env)
    first_array_queued(held, proc)
    proc.kill()
    out, err = proc.communicate(timeout=60)
    res = launcher(["runs", "--json"], held, env)  # the repair of what the killed launch left
    assert res.returncode == 0, res.stdout + res.stderr
    runs = runs_json(held)
    sweep = runs[0]["sweep_id"]
    states = sorted(r["status"] for r in runs)
    # (killed between an sbatch and its runs' records, that array is cancelled and its runs wait too)
    assert len(runs) == 8 and set(states) <= {"pending", "waiting"} and "waiting" in states, (states, out, err,
                                                                                            res.stderr)
    queued = in_queue(env)
    assert any("|waves-" in line for line in queued) and len(queued) <= 4, queued  # the limit, never one more
    res = launcher(["cancel", sweep], held, env)
    assert res.returncode == 0 and "cancelled 8 run(s)" in res.stdout and "wave job" in res.stdout, res.stdout
    wait_queue_empty(env, timeout=60)
    assert [r["status"] for r in runs_json(held)] == ["cancelled"] * 8
    plan = json.loads((Path(runs[0]["dir"]).parent / "waves.json").read_text())
    assert plan["stopped"] == "cancelled by user" and plan["waiting"] == [], plan

    # ---- 8 points, room 4: SIGTERM once the first array is queued; the sweep completes in waves
    root = tmp_path / "b" / "runs"
    root.mkdir(parents=True)
    proc = start_launch(["seed=range(0,8)", "cluster.max_array_size=1"], root, env)
    first_array_queued(root, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 128 + signal.SIGTERM), out + err
    runs = runs_json(root)
    assert len(runs) == 8, runs
    states = [r["status"] for r in runs]
    assert states.count("waiting") >= 5 and "cancelled" not in states, states  # room 4: at most 3 went now

    done = wait_final(root, 8, timeout=420)
    assert [r["status"] for r in done] == ["completed"] * 8, [(r["run_id"], r["status"], r["error"]) for r in done]
    for r in done:  # each point one job, one attempt: never queued twice
        job = json.loads((Path(r["dir"]) / "job.json").read_text())
        status = json.loads((Path(r["dir"]) / "status.json").read_text())
        assert not job.get("earlier_job_ids") and status.get("attempt") in (None, 1), (job, status)
    assert len({r["job_id"] for r in done}) == 8
    plan = json.loads((Path(done[0]["dir"]).parent / "waves.json").read_text())
    queued = [i for w in plan["waves"] for i in w["runs"]]
    assert sorted(queued) == list(range(8)) and plan["waiting"] == [], plan  # every point in one wave, once
    assert len(plan["waves"]) >= 3 and all(len(w["runs"]) <= 3 for w in plan["waves"]), plan  # room 4 less the slot
    wait_queue_empty(env, timeout=60)

    # ---- 6 held points, room 4, the launch left to its end: it exits 0 naming the waiting points and the
    # wave job, and every run, queued or waiting, is listed; cancel ends all of it
    whole = tmp_path / "c" / "runs"
    whole.mkdir(parents=True)
    proc = start_launch(["seed=range(0,6)", "cluster.max_array_size=1", "+cluster.sbatch_extra.begin=now+10hours"],
                        whole, env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "waiting for wave job" in out and "Traceback" not in err, out + err
    runs = runs_json(whole)
    assert len(runs) == 6 and "waiting" in {r["status"] for r in runs}, runs
    res = launcher(["cancel", runs[0]["sweep_id"]], whole, env)
    assert res.returncode == 0 and "cancelled 6 run(s)" in res.stdout, res.stdout + res.stderr
    wait_queue_empty(env, timeout=60)
