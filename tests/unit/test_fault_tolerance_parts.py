"""The parts of fault tolerance that need no job: the run dir's checkpoint and restart records, the
checkpointer's commit protocol, the requeue decision, the stop signals, the hang finding."""
import json
import os
import signal
import time
from pathlib import Path

import pytest

from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import restarts, stacks


def make_run(tmp_path: Path, status: dict = None) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.write_run({"run_id": "x-0", "layout": {}})
    fields = dict(status or {"status": "pending"})
    rd.set_status(Status(fields.pop("status")), **fields)
    return rd


# ---- checkpoint records ------------------------------------------------------------------------

def test_latest_names_only_a_complete_checkpoint(tmp_path):
    rd = make_run(tmp_path)
    assert rd.latest_checkpoint() is None
    rd.checkpoint_partial(5).mkdir(parents=True)
    assert rd.latest_checkpoint() is None and rd.checkpoints() == []
    assert rd.stale_partials() == [rd.checkpoint_partial(5)]
    os.replace(rd.checkpoint_partial(5), rd.checkpoint_dir(5))
    rd.set_latest(rd.checkpoint_dir(5))
    assert rd.latest_checkpoint() == rd.checkpoint_dir(5) and RunDir.checkpoint_step(rd.checkpoint_dir(5)) == 5
    import shutil

    shutil.rmtree(rd.checkpoint_dir(5))  # a pointer to something gone points nowhere
    assert rd.latest_checkpoint() is None


def test_seal_names_checkpoints_without_hashing_them(tmp_path):
    rd = make_run(tmp_path)
    rd.checkpoint_dir(10).mkdir(parents=True)
    (rd.checkpoint_dir(10) / "model.pt").write_bytes(b"x" * 100)
    rd.set_latest(rd.checkpoint_dir(10))
    rd.finish(Status.completed)
    manifest = json.loads((rd.path / "manifest.json").read_text())
    assert manifest["checkpoints"] == ["step_00000010"]
    assert not any(k.startswith("checkpoints/") for k in manifest["files"])
    assert rd.verify() == []


def test_restarts_since_launch_counts_from_the_last_resume(tmp_path):
    rd = make_run(tmp_path)
    for reason in ("failure", "hang", "resume", "time_limit"):
        rd.record_restart({"reason": reason})
    assert [r["reason"] for r in rd.restarts()] == ["failure", "hang", "resume", "time_limit"]
    assert all(r["time"] for r in rd.restarts())
    assert rd.restarts_since_launch() == 1


def test_reopen_keeps_the_old_seal_and_makes_the_run_writable(tmp_path):
    rd = make_run(tmp_path)
    rd.set_status(Status.running, attempt=1, hosts=["n1"])
    rd.finish(Status.failed, error="boom", exit_code=1)
    # the mode bits, not os.access: as root (CI) every file is writable whatever its mode
    sealed = [p for p in rd.path.rglob("*") if p.is_file()]
    assert rd.path / "run.json" in sealed
    assert all(p.stat().st_mode & 0o222 == 0 for p in sealed), [oct(p.stat().st_mode) for p in sealed]
    rd.reopen(1)
    st = rd.status()
    assert st.state == "pending" and st.error is None and st.earlier[0]["error"] == "boom"
    assert st.attempt == 1 and st.hosts == ["n1"]
    assert (rd.attempt_dir(1) / "manifest.json").exists() and not (rd.path / "manifest.json").exists()
    assert os.stat(rd.path / "run.json").st_mode & 0o200


# ---- attempts and the requeue decision -----------------------------------------------------------

class Recorder:
    requeue_exit_code = 144

    def __init__(self):
        self.calls = []

    def request_requeue(self, job_id):
        self.calls.append(job_id)


def test_an_attempt_on_fewer_ranks_and_other_nodes_moves_the_records_it_lacks_aside(tmp_path):
    """Attempt 1 ran 4 ranks on nodes a and b; attempt 2 (a smaller layout, node b lost for c) starts:
    the records of ranks 2-3, of nodes a/b and every mesh/state record go to attempts/1/; the records
    of ranks 0-1 (written by attempt 2's ranks as it starts, or soon replaced) stay."""
    rd = make_run(tmp_path)
    assert restarts.begin_attempt(rd, max_restarts=3, job_id="7", world=4, hosts=["a", "b"]) == 1
    for r in range(4):
        rd.write_rank(r, {"rank": r, "attempt": 1})
        rd.write_mesh(r, {"dp": r})
        rd.write_state(r, {"params": 1})
    rd.write_topology("a", 0, {"node": "a"})
    rd.write_topology("b", 1, {"node": "b"})
    rd.set_status(Status.requeued)
    rd.write_rank(0, {"rank": 0, "attempt": 2})  # a rank of attempt 2 recorded itself before rank 0 began it
    assert restarts.begin_attempt(rd, max_restarts=3, job_id="7", world=2, hosts=["a", "c"]) == 2
    ranks = sorted(p.name for p in (rd.path / "ranks").iterdir())
    assert ranks == ["rank_0.json", "rank_1.json"] and rd.rank(0)["attempt"] == 2
    aside = rd.attempt_dir(1)
    assert sorted(p.name for p in (aside / "ranks").iterdir()) == sorted(
        [f"{k}_{r}.json" for k in ("mesh", "state") for r in range(4)] + ["rank_2.json", "rank_3.json"])
    assert sorted(p.name for p in (rd.path / "topology").iterdir()) == ["node_a_0.json"]
    assert sorted(p.name for p in (aside / "topology").iterdir()) == ["node_b_1.json"]
    # without the new attempt's place (an older caller) only what it always moved goes
    rd.write_rank(3, {"rank": 3})
    rd.set_status(Status.requeued)
    assert restarts.begin_attempt(rd, max_restarts=3, job_id="7") == 3
    assert (rd.path / "ranks" / "rank_3.json").exists()


def test_attempts_record_why_they_restarted_and_stop_at_the_budget(tmp_path):
    rd = make_run(tmp_path)
    backend = Recorder()
    assert restarts.begin_attempt(rd, max_restarts=1, job_id="7") == 1
    rd.write_rank_error(1, "Traceback: boom")
    assert restarts.request_requeue(rd, backend, attempt=1, max_restarts=1, reason="failure", detail="rank 1: boom",
                                    rank=1, step=None, job_id="7")
    # a second rank of the same attempt learns it was done, without asking again
    assert restarts.request_requeue(rd, backend, attempt=1, max_restarts=1, reason="failure", detail="rank 0: reset",
                                    rank=0, step=None, job_id="7")
    assert backend.calls == ["7"] and rd.status().state == "requeued"

    assert restarts.begin_attempt(rd, max_restarts=1, job_id="7") == 2
    (row,) = rd.restarts()
    assert row["attempt"] == 2 and row["reason"] == "failure" and row["detail"] == "rank 1: boom"
    assert rd.failed_ranks() == [] and (rd.attempt_dir(1) / "errors" / "rank_1.error").exists()
    assert rd.status().state == "running" and rd.status().stop is None

    # the budget (1 restart) is spent: no second requeue; a restart the scheduler makes anyway is refused
    assert not restarts.request_requeue(rd, backend, attempt=2, max_restarts=1, reason="failure", detail="again",
                                        rank=0, step=None, job_id="7")
    with pytest.raises(RuntimeError, match="restart budget spent"):
        restarts.begin_attempt(rd, max_restarts=1, job_id="7")
    assert rd.status().state == "failed" and rd.restarts()[-1]["reason"] == "scheduler"


def test_stop_signals_are_remembered_and_chained(tmp_path):
    seen = []
    old_usr2 = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    old_term = signal.getsignal(signal.SIGTERM)
    try:
        flag = restarts.StopFlag().install()
        assert flag.reason is None
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.05)
        assert flag.reason == "time_limit" and seen == [signal.SIGUSR2]  # the earlier handler still ran
        signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert flag.reason == "time_limit"  # the time limit outranks a later TERM (both save; it requeues)
    finally:
        signal.signal(signal.SIGUSR2, old_usr2)
        signal.signal(signal.SIGTERM, old_term)


# ---- the checkpointer's commit protocol (one process, no process group) ---------------------------

class TinyEngine:
    """One parameter and an optimizer whose step changes it in place (as every engine's does)."""

    def __init__(self):
        import torch

        self.p = torch.nn.Parameter(torch.arange(4.0))
        self.optimizer = torch.optim.SGD([self.p], lr=1.0)

    def train_step(self):
        import torch

        self.p.grad = -torch.ones(4)
        self.optimizer.step()  # p += 1, in place

    @property
    def w(self):
        return self.p.detach()

    def optimizers(self):
        return [self.optimizer]

    def save_native(self, path):
        pass

    def checkpoint_files(self):
        return {"model.pt": {"w": self.p, "opt": self.optimizer.state_dict()}}

    def load_checkpoint(self, path):
        import torch

        with torch.no_grad():
            self.p.copy_(torch.load(path / "model.pt", weights_only=True)["w"])


class Ctx:
    rank, world_size, attempt = 0, 1, 1

    def __init__(self, rd):
        self.rundir = rd

    def heartbeat(self, step=None):
        pass


def checkpointer(rd, every=2, keep=2, async_save=True, steps=9, ctx=None, store=None):
    from omegaconf import OmegaConf

    from launcher.training.checkpoint import Checkpointer

    cfg = OmegaConf.create({"train": {"steps": steps, "fail_at_step": None, "fail_rank": 0, "fail_mode": "exception",
                                      "fail_attempt": None,
                                      "checkpoint": {"every": every, "keep": keep, "async_save": async_save}}})
    engine = TinyEngine()
    return Checkpointer(cfg, ctx or Ctx(rd), engine, store=store), engine


@pytest.mark.parametrize("async_save", [True, False])
def test_checkpointer_commits_whole_keeps_k_and_resumes(tmp_path, async_save, monkeypatch):
    rd = make_run(tmp_path)
    ck, engine = checkpointer(rd, async_save=async_save)
    assert ck.resume() == (0, [])
    history = []
    for step in range(1, 10):
        engine.train_step()  # changes the state in place while the last save may still be copied/written
        history.append({"step": step, "loss": float(step)})
        if ck.due(step):
            ck.save(step, history)
    ck.finish()
    assert [p.name for p in rd.checkpoints()] == ["step_00000008", "step_00000009"]  # every 2, the end, keep 2
    assert rd.latest_checkpoint() == rd.checkpoint_dir(9) and rd.stale_partials() == []

    rd.checkpoint_partial(11).mkdir()  # a save that died half-way
    ck2, engine2 = checkpointer(rd)
    step, rows = ck2.resume()
    assert step == 9 and [r["step"] for r in rows] == list(range(1, 10))
    assert engine2.w.tolist() == [9.0, 10.0, 11.0, 12.0]  # the state after step 9, not a later one
    assert rd.stale_partials() == []

    # every checkpoint of a run that keeps them all holds the state after its own step (the copy is
    # slowed, so a step that did not wait for it would change the weights before they are copied)
    rd3 = RunDir(tmp_path / "keep_all")
    rd3.path.mkdir()
    ck3, engine3 = checkpointer(rd3, every=1, keep=100, async_save=async_save, steps=12)
    _slow_host_copy(monkeypatch, 0.01)
    history = []
    for step in range(1, 13):
        engine3.train_step()
        history.append({"step": step, "loss": float(step)})
        ck3.save(step, history)
    ck3.finish()
    assert [RunDir.checkpoint_step(p) for p in rd3.checkpoints()] == list(range(1, 13))
    for p in rd3.checkpoints():
        _assert_holds_step(p, RunDir.checkpoint_step(p))


def _slow_host_copy(monkeypatch, delay_s=0.0, gate=None):
    """Make the checkpointer's host copy take ``delay_s`` per tensor, or wait for ``gate`` first."""
    import torch

    from launcher.training import async_save

    real = async_save.host_copy

    def slow(obj, reuse=None, *more):
        if gate is not None:
            assert gate.wait(20), "the test never released the copy"
        if torch.is_tensor(obj):
            time.sleep(delay_s)
        return real(obj, reuse, *more)

    monkeypatch.setattr(async_save, "host_copy", slow)


def _assert_holds_step(path, step):
    """A TinyEngine checkpoint taken after ``step`` (p starts at 0..3, each step adds 1)."""
    import torch

    model = torch.load(path / "model.pt", weights_only=True)
    assert model["w"].tolist() == [float(step + i) for i in range(4)], (path.name, model["w"].tolist())
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == step and [r["step"] for r in meta["metrics"]] == list(range(1, step + 1))


class Rank(Ctx):
    def __init__(self, rd, rank, world):
        super().__init__(rd)
        self.rank, self.world_size = rank, world


def test_a_checkpoint_is_committed_only_when_every_rank_marked_it_done(tmp_path):
    """World 2: rank 0's part alone leaves the partial dir and `latest` as they were; rank 1's mark
    completes the set and that rank renames it into place (the ranks count their parts in one store,
    as in the default process group's)."""
    import torch.distributed as dist

    from launcher.training.checkpoint import DONE_FILE

    rd = make_run(tmp_path)
    store = dist.HashStore()
    ranks = [checkpointer(rd, async_save=False, ctx=Rank(rd, r, 2), store=store) for r in (0, 1)]
    for _ck, engine in ranks:
        engine.train_step()
        engine.train_step()
    ranks[0][0].save(2, [{"step": 1}, {"step": 2}])
    partial = rd.checkpoint_partial(2)
    assert (partial / DONE_FILE.format(rank=0)).exists() and not (partial / DONE_FILE.format(rank=1)).exists()
    assert partial.is_dir() and rd.latest_checkpoint() is None and rd.checkpoints() == []
    assert rd.stale_partials() == [partial]
    ranks[1][0].save(2, [{"step": 1}, {"step": 2}])
    assert not partial.exists() and rd.latest_checkpoint() == rd.checkpoint_dir(2)
    assert sorted(p.name for p in rd.checkpoint_dir(2).glob("done_rank_*")) == ["done_rank_00000", "done_rank_00001"]
    _assert_holds_step(rd.checkpoint_dir(2), 2)

    # the next checkpoint: again only one rank's mark, so `latest` still names step 2
    for _ck, engine in ranks:
        engine.train_step()
    ranks[1][0].save(3, [])
    assert rd.checkpoint_partial(3).is_dir() and rd.latest_checkpoint() == rd.checkpoint_dir(2)


@pytest.mark.timeout(60)
def test_an_async_save_returns_while_the_write_is_pending(tmp_path, monkeypatch):
    """async_save: save() returns before the checkpoint is written, a training step runs meanwhile,
    and finish() waits for the write (and commits it)."""
    import threading

    from launcher.training import checkpoint

    rd = make_run(tmp_path)
    ck, engine = checkpointer(rd, async_save=True)
    release, writing = threading.Event(), threading.Event()
    real = checkpoint._write_file

    def blocked_write(path, obj):
        writing.set()
        release.wait(5)  # (a synchronous save would wait here, then find the test's assertions failed)
        real(path, obj)

    monkeypatch.setattr(checkpoint, "_write_file", blocked_write)
    engine.train_step()
    engine.train_step()
    ck.save(2, [{"step": 1}, {"step": 2}])
    assert not release.is_set()
    assert writing.wait(5)  # the background writer has started ...
    assert rd.latest_checkpoint() is None and rd.checkpoints() == []  # ... and is not done
    engine.train_step()  # the copy is in host memory: the step runs while the write is pending
    assert engine.w.tolist() == [3.0, 4.0, 5.0, 6.0] and rd.latest_checkpoint() is None
    finisher = threading.Thread(target=ck.finish)
    finisher.start()
    finisher.join(0.3)
    assert finisher.is_alive()  # finish() waits for the write in flight
    release.set()
    finisher.join(10)
    assert not finisher.is_alive()
    assert rd.latest_checkpoint() == rd.checkpoint_dir(2)
    _assert_holds_step(rd.checkpoint_dir(2), 2)


@pytest.mark.timeout(60)
def test_the_optimizer_step_waits_for_the_host_copy(tmp_path, monkeypatch):
    """async_save: while the state is being copied to host memory, the next optimizer step (which
    changes it in place) waits; once the copy is done it runs, and the checkpoint holds the old state."""
    import threading

    rd = make_run(tmp_path)
    ck, engine = checkpointer(rd, async_save=True)
    gate = threading.Event()
    engine.train_step()
    engine.train_step()
    _slow_host_copy(monkeypatch, gate=gate)
    ck.save(2, [{"step": 1}, {"step": 2}])  # returns: the copy waits on the gate in the writer thread
    stepper = threading.Thread(target=engine.train_step)
    stepper.start()
    stepper.join(0.5)
    assert stepper.is_alive() and engine.w.tolist() == [2.0, 3.0, 4.0, 5.0]  # the step waits for the copy
    gate.set()
    stepper.join(10)
    assert not stepper.is_alive() and engine.w.tolist() == [3.0, 4.0, 5.0, 6.0]
    ck.finish()
    _assert_holds_step(rd.checkpoint_dir(2), 2)


@pytest.mark.parametrize("async_save", [True, False])
def test_exactly_one_rank_commits_and_no_rank_lists_the_partial_dir(tmp_path, monkeypatch, async_save):
    """World 3 in one store: each rank's save adds 1 to the save's counter; only the rank that brings
    it to 3 commits (whichever order they finish in). No rank lists the partial dir to find the
    others' marks; only the committing rank reads the set (its manifest) and lists the checkpoints
    (pruning, in a thread of its own, joined by wait())."""
    import threading

    import torch.distributed as dist

    rd = make_run(tmp_path)
    store = dist.HashStore()
    ranks = [checkpointer(rd, keep=1, async_save=async_save, ctx=Rank(rd, r, 3), store=store) for r in (0, 1, 2)]
    listed = []  # (thread, dir) of every directory listing under the run's checkpoints
    real_scandir, real_listdir = os.scandir, os.listdir

    def scandir(path="."):
        listed.append((threading.current_thread().name, str(path)))
        return real_scandir(path)

    def listdir(path="."):
        listed.append((threading.current_thread().name, str(path)))
        return real_listdir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    monkeypatch.setattr(os, "listdir", listdir)
    for step in (2, 4):
        for _ck, engine in ranks:
            engine.train_step()
            engine.train_step()
        for r in (2, 0, 1):  # rank 1 finishes last: it commits
            listed.clear()
            ranks[r][0].save(step, [{"step": i} for i in range(1, step + 1)])
            ranks[r][0].wait()
            partial = str(rd.checkpoint_partial(step))
            if r != 1:
                assert not any(partial in d for _t, d in listed), listed
                assert rd.checkpoint_partial(step).is_dir() and rd.latest_checkpoint() != rd.checkpoint_dir(step)
            else:
                assert rd.latest_checkpoint() == rd.checkpoint_dir(step) and not rd.checkpoint_partial(step).exists()
        _assert_holds_step(rd.checkpoint_dir(step), step)
    assert [p.name for p in rd.checkpoints()] == ["step_00000004"]  # keep 1: step 2 pruned
    assert any(t == "checkpoint-pruner" for t, _d in listed)  # the committing rank listed `checkpoints/`
    assert store.add("launcher.checkpoint/4/2", 0) == 3  # one add per rank for the second save

    alone, _ = checkpointer(rd, ctx=Rank(rd, 0, 2))  # two ranks, no process group, no shared store
    with pytest.raises(RuntimeError, match="needs their process group"):
        alone.save(6, [], block=True)


def test_only_rank_0_reads_meta_json_on_resume(tmp_path, monkeypatch):
    """The step and the metrics rows (meta.json grows with every step) come with rank 0's verdict:
    the other ranks load the checkpoint without reading meta.json."""
    import shutil

    import torch.distributed as dist

    rd = make_run(tmp_path)
    ck, engine = checkpointer(rd, async_save=False)
    engine.train_step()
    engine.train_step()
    ck.save(2, [{"step": 1}, {"step": 2}])
    ck.finish()
    ckpt = rd.checkpoint_dir(2)
    shutil.copy(ckpt / "rng_rank_00000.pt", tmp_path / "rng_rank_00001.pt")  # (rank 1's, as a world of 2 has)
    sent = []

    def broadcast(box, src):  # rank 0's call sends its verdict, rank 1's receives it
        if sent:
            box[0] = sent[0]
        else:
            sent.append(box[0])

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "broadcast_object_list", broadcast)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, found: out.__setitem__(slice(None), [found, []]))
    rank0, _ = checkpointer(rd, ctx=Rank(rd, 0, 2))
    assert rank0.resume() == (2, [{"step": 1}, {"step": 2}])
    assert sent[0]["meta"]["step"] == 2

    reads = []
    real = Path.read_text

    def read_text(self, *a, **k):
        reads.append(self.name)
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", read_text)
    rank1, engine1 = checkpointer(rd, ctx=Rank(rd, 1, 2))
    shutil.copy(tmp_path / "rng_rank_00001.pt", ckpt / "rng_rank_00001.pt")
    assert rank1.resume() == (2, [{"step": 1}, {"step": 2}])
    assert "meta.json" not in reads and engine1.w.tolist() == [2.0, 3.0, 4.0, 5.0]


def test_pruning_runs_beside_the_steps_and_is_joined_by_the_next_wait(tmp_path, monkeypatch):
    """A synchronous save commits on the main thread, but the rmtree of old checkpoints runs in a
    thread: save() returns while it is blocked, and wait() (finish, the next save) joins it."""
    import shutil
    import threading

    rd = make_run(tmp_path)
    ck, engine = checkpointer(rd, keep=1, async_save=False)
    engine.train_step()
    ck.save(1, [])
    release, pruning = threading.Event(), threading.Event()
    real = shutil.rmtree

    def slow_rmtree(path, *a, **k):
        pruning.set()
        assert release.wait(10)
        real(path, *a, **k)

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    engine.train_step()
    ck.save(2, [])  # returns with step 1 still being deleted
    assert pruning.wait(5) and rd.latest_checkpoint() == rd.checkpoint_dir(2)
    assert rd.checkpoint_dir(1).exists()
    finisher = threading.Thread(target=ck.finish)
    finisher.start()
    finisher.join(0.3)
    assert finisher.is_alive()  # finish() waits for the pruning
    release.set()
    finisher.join(10)
    assert not finisher.is_alive() and [p.name for p in rd.checkpoints()] == ["step_00000002"]


# ---- the hang finding ----------------------------------------------------------------------------

WAITING = '''# rank 0, no step finished for 6 s (last finished step: 4)
Current thread 0x00007f0000000001 (most recent call first):
  File "/runs/s/code/launcher/runtime/watchdog.py", line 67 in _hang
  File "/usr/lib/python3.11/threading.py", line 982 in run

Thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/runs/s/code/recipes/gpt/engines/megatron.py", line 214 in train_step
  File "/runs/s/code/recipes/gpt/train.py", line 102 in main
  File "/runs/s/code/launcher/runtime/task.py", line 188 in _run_recipe
'''
STUCK = '''# rank 1
Current thread 0x00007f0000000003 (most recent call first):
  File "/runs/s/code/launcher/runtime/watchdog.py", line 67 in _hang

Thread 0x00007f0000000004 (most recent call first):
  File "/runs/s/code/recipes/gpt/train.py", line 55 in inject_fault
  File "/runs/s/code/recipes/gpt/train.py", line 100 in main
  File "/runs/s/code/launcher/runtime/task.py", line 188 in _run_recipe
'''
DDP_BACKWARD = '''Thread 0x00007f0000000005 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/autograd/graph.py", line 979 in _engine_run_backward
  File "/venv/lib/python3.11/site-packages/torch/_tensor.py", line 630 in backward
  File "/runs/s/code/recipes/gpt/engines/ddp.py", line 61 in train_step
  File "/runs/s/code/launcher/runtime/task.py", line 188 in _run_recipe
'''


def test_hang_finding_names_the_stuck_rank_and_the_collective_the_others_wait_in():
    assert stacks.where(WAITING) == {"collective": "all_reduce",
                                     "frame": "recipes/gpt/engines/megatron.py:214 in train_step"}
    assert stacks.where(STUCK) == {"collective": None, "frame": "recipes/gpt/train.py:55 in inject_fault"}
    assert stacks.where(DDP_BACKWARD)["collective"].startswith("backward")
    f = stacks.finding({0: WAITING, 1: STUCK, 2: DDP_BACKWARD}, world=4, step=4, timeout_s=6)
    assert f["stuck_ranks"] == [1, 3] and f["no_stack"] == [3] and set(f["waiting"]) == {0, 2}
    text = stacks.describe(f)
    assert "rank 1 stuck in recipes/gpt/train.py:55 in inject_fault" in text
    assert "rank 3 stuck (no stack" in text and "wait in" in text


def test_hang_finding_names_the_collective_the_stuck_ranks_never_joined_by_its_sequence_number():
    """Each dump records how many collectives its rank issued per process group: the waiting ranks
    issued #12 of the world group (and #3 of the saves' gloo group, where nobody is behind); rank 1
    stopped after #11, rank 3 left no dump: both never joined #12."""
    dumps = {0: stacks.counts_line({"world": 12, "1": 3}) + WAITING,
             1: stacks.counts_line({"world": 11, "1": 3}) + STUCK,
             2: stacks.counts_line({"world": 12, "1": 3}) + DDP_BACKWARD}
    f = stacks.finding(dumps, world=4, step=4, timeout_s=6)
    c = f["collective"]
    assert (c["group"], c["seq"], c["missing"], c["waiting"]) == ("world", 12, [1, 3], [0, 2])
    assert "all_reduce" in c["kind"]
    assert "rank(s) 1, 3 never joined collective #12" in stacks.describe(f)
    assert "collective" not in stacks.finding({0: WAITING, 1: STUCK}, world=2, step=4, timeout_s=6)  # no counts


def test_a_rank_counts_the_collectives_it_issued_on_each_group(tmp_path):
    """torch.distributed's own count, read as the watchdog reads it (one process, gloo)."""
    import torch
    import torch.distributed as dist

    from launcher.runtime.watchdog import collectives_issued

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        side = dist.new_group(backend="gloo")
        before = collectives_issued()
        (other,) = set(before) - {"world"}
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2), group=side)
        assert collectives_issued() == {"world": before["world"] + 3, other: before[other] + 1}
    finally:
        dist.destroy_process_group()


def test_a_real_dump_parses(tmp_path):
    """faulthandler's own output for a thread blocked in a function of this file."""
    import faulthandler
    import threading

    ready, release = threading.Event(), threading.Event()

    def blocked_here():
        ready.set()
        release.wait(10)

    t = threading.Thread(target=blocked_here)
    t.start()
    ready.wait(5)
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    release.set()
    t.join()
    threads = stacks.threads(path.read_text())
    assert any(any(fn == "blocked_here" for _, _, fn in frames) for frames in threads)


def test_a_refused_requeue_fails_the_run_instead(tmp_path):
    class Refusing(Recorder):
        def request_requeue(self, job_id):
            raise RuntimeError("Requested operation is presently disabled")

    rd = make_run(tmp_path)
    restarts.begin_attempt(rd, max_restarts=3, job_id="9")
    assert not restarts.request_requeue(rd, Refusing(), attempt=1, max_restarts=3, reason="failure", detail="x",
                                        rank=0, step=3, job_id="9")
    assert "presently disabled" in rd.status().stop["requeue_error"]


def test_a_requeue_killed_with_the_step_is_asked_again_by_the_teardown(tmp_path, monkeypatch):
    """srun ends a step's processes when one rank dies, the survivor's scontrol child too: the rank's
    note makes the batch script's teardown ask again, once, for that attempt only."""
    import subprocess

    from launcher.runtime import after_step

    class KilledWithTheStep(Recorder):
        def request_requeue(self, job_id):
            raise subprocess.CalledProcessError(-15, ["scontrol", "requeue", job_id])

    class Slurm(Recorder):
        def __init__(self, already=False):
            super().__init__()
            self.already = already

        def requeued_since_start(self, job_id):
            return self.already

    note = tmp_path / "requeue.9.json"
    monkeypatch.setenv(after_step.ENV, str(note))
    rd = make_run(tmp_path)
    restarts.begin_attempt(rd, max_restarts=3, job_id="9")
    after_step.leave(rd, 1, None, "9", backend="slurm", max_restarts=3)  # rank 0, at the attempt's start
    assert restarts.request_requeue(rd, KilledWithTheStep(), attempt=1, max_restarts=3, reason="failure",
                                    detail="rank 1 died", rank=0, step=7, job_id="9")
    assert rd.status().state is Status.requeued and rd.status().stop["deferred"]
    left = json.loads(note.read_text())
    assert left["stop"] == {"reason": "failure", "detail": "rank 1 died", "rank": 0, "step": 7}
    assert (left["run"], left["attempt"], left["job_id"], left["max_restarts"]) == (str(rd.path), 1, "9", 3)
    end = after_step.StepEnd(rc=137, scheduler_state="RUNNING")
    outcome = after_step.judge(rd, left, end)
    assert outcome.action == "requeue" and outcome.stop["step"] == 7
    # the rank's own request went through before the step's teardown killed it: not asked twice
    went_through = Slurm(already=True)
    assert after_step.settle(rd, outcome, went_through, "9") == "requeued" and went_through.calls == []
    slurm = Slurm()
    assert after_step.settle(rd, outcome, slurm, "9") == "requeued" and slurm.calls == ["9"]
    assert rd.status().state is Status.requeued and rd.status().stop["step"] == 7
    restarts.begin_attempt(rd, max_restarts=3, job_id="9")  # the next attempt: an old note does nothing
    assert after_step.judge(rd, left, end).action == "nothing"
    assert rd.restarts()[-1]["reason"] == "failure" and rd.restarts()[-1]["failed_step"] == 7


def test_a_teardown_whose_requeue_is_refused_fails_the_run(tmp_path):
    from launcher.runtime import after_step

    class Refusing(Recorder):
        def requeued_since_start(self, job_id):
            return False

        def request_requeue(self, job_id):
            raise RuntimeError("Requested operation is presently disabled")

    rd = make_run(tmp_path)
    restarts.begin_attempt(rd, max_restarts=3, job_id="9")
    note = {"run": str(rd.path), "attempt": 1, "job_id": "9", "max_restarts": 3, "started": 0}
    outcome = after_step.judge(rd, note, after_step.StepEnd(rc=134, scheduler_state="RUNNING"))
    assert outcome.action == "requeue" and "died without a word" in outcome.why
    assert after_step.settle(rd, outcome, Refusing(), "9") == "failed"
    st = rd.status()
    assert st.state is Status.failed and "presently disabled" in st.error and st.is_final


def test_a_silent_death_is_requeued_by_the_teardown_and_recorded_by_the_next_attempt(tmp_path):
    """No rank recorded anything (NCCL's C++ teardown): the teardown requeues, the next attempt's row
    names why; the same death again before any new step fails the run (restart_policy)."""
    from launcher.runtime import after_step

    class Slurm(Recorder):
        def requeued_since_start(self, job_id):
            return False

    rd = make_run(tmp_path)
    restarts.begin_attempt(rd, max_restarts=3, job_id="9")
    note = {"run": str(rd.path), "attempt": 1, "job_id": "9", "max_restarts": 3, "started": 0}
    slurm = Slurm()
    # as the Slurm backend's teardown says it (its step_word)
    outcome = after_step.judge(rd, note, after_step.StepEnd(rc=137, scheduler_state="RUNNING", source="srun"))
    assert after_step.settle(rd, outcome, slurm, "9") == "requeued" and slurm.calls == ["9"]
    restarts.begin_attempt(rd, max_restarts=3, job_id="9")
    (row,) = rd.restarts()
    assert row["reason"] == "failure" and row["attempt"] == 2
    assert row["detail"] == "a rank died without a word: srun exit 137 (SIGKILL)"
    assert row["failure"]["kind"] == "rank_lost"
    # attempt 2 dies the same way before finishing a step past its checkpoint: a restart would repeat it
    note2 = {**note, "attempt": 2}
    again = after_step.judge(rd, note2, after_step.StepEnd(rc=137, scheduler_state="RUNNING", source="srun"))
    assert again.action == "fail" and "not restarted" in again.why
    assert after_step.settle(rd, again, slurm, "9") == "failed" and slurm.calls == ["9"]
    st = rd.status()
    assert st.state is Status.failed and st.exit_code == 137 and st.no_restart["kind"] == "repeated"


def test_a_rank_failing_before_its_watches_start_is_recorded(tmp_path, monkeypatch):
    """A failure before the rank knows its place (reading the run, its shared records) is written as a
    rank error, so the other ranks' peer watches end them instead of their waiting in the rendezvous."""
    from launcher.runtime import task, watchdog

    rd = RunDir(tmp_path / "run")
    rd.write_run({"run_id": "r"})
    rd.write_config({"cluster": {}, "train": {}})
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(RunDir, "config", lambda self: (_ for _ in ()).throw(OSError("disk gone")))
    watch = watchdog.Watch(rd, rank=0, world=2)  # rank 0's peer watch, started a moment before
    watch._born -= 5
    with pytest.raises(OSError, match="disk gone"):
        task.run(rd)
    assert "OSError: disk gone" in rd.rank_errors()[1]
    st = rd.status()
    assert st.state == "failed" and st.failed_rank == 1 and "disk gone" in st.error
    # what rank 0's peer watch asks (and ends its process on)
    assert rd.failed_ranks(except_rank=0, since=watch._born)


# ---- resume / retry refuse a run that may still have a job ---------------------------------------

@pytest.mark.parametrize("status", ["pending", "running", "requeued"])
def test_resume_and_retry_refuse_a_run_that_may_still_be_running(tmp_path, status):
    """`launcher resume` (and retry, through resubmit) on a run not yet final: refused before anything
    is written (two jobs would write one run dir)."""
    from launcher.submit import resume

    rd = make_run(tmp_path, {"status": status, "attempt": 1})
    before = {p: p.read_bytes() for p in rd.path.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=f"x-0 is {status}: its job may still be running or queued"):
        resume.prepare(rd.path)
    with pytest.raises(ValueError, match="may still be running"):
        resume.resubmit([rd.path], reason="retry")
    assert {p: p.read_bytes() for p in rd.path.rglob("*") if p.is_file()} == before


def test_the_local_controller_starts_a_silent_death_again_and_records_why(tmp_path, monkeypatch):
    """cluster=local: the processes ended with no requeue request and no rank's word; the controller
    (not a rank) decides from the job's note as the Slurm teardown does."""
    from launcher.runtime import local_controller

    note = tmp_path / "requeue.77.json"
    monkeypatch.setenv(restarts.NOTE_ENV, str(note))
    rd = make_run(tmp_path)
    rd.write_config({"train": {"max_restarts": 1}, "cluster": {"backend": "local"}})
    restarts.begin_attempt(rd, max_restarts=1, job_id="77")
    restarts.leave_note(rd, 1, None, "77", backend="local", max_restarts=1)
    assert local_controller.decide_after(note, [-6, -9]) == "requeued"
    st = rd.status()
    assert st.state is Status.requeued and st.stop["detail"].endswith("the processes' exit 137 (SIGKILL)")
    restarts.begin_attempt(rd, max_restarts=1, job_id="77")
    restarts.leave_note(rd, 2, None, "77", backend="local", max_restarts=1)
    # another death (not a repeat of attempt 1's), but the budget (1) is spent: an honest failure
    assert local_controller.decide_after(note, [-11, 0]) == "failed"
    st = rd.status()
    assert st.state is Status.failed and st.exit_code == 139, st
    # the budget's message names the key
    assert "(SIGSEGV); restart budget spent" in st.error and "train.max_restarts=1" in st.error, st.error
    assert local_controller.decide_after(note, [-9, 0]) is None  # the run has its outcome
