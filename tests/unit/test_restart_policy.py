"""Which failures are worth a restart (launcher.runtime.restart_policy): the pure decision, the kinds
of exceptions, and the record an attempt leaves for the next one."""
import json
import time
from pathlib import Path

import pytest

import launcher
from launcher.config.errors import ConfigError
from launcher.run.rundir import RunDir
from launcher.run.status import Status
from launcher.runtime import restart_policy as policy, restarts
from launcher.runtime.env import DeviceError

LAUNCHER_FILE = str(Path(launcher.__file__).resolve().parent / "runtime" / "task.py")
USER_FILE = "/home/me/mp/train.py"


def failure(type_="RuntimeError", message="RuntimeError: boom", place=f"{USER_FILE}:3 in main", kind="other",
            attempt=1, step=None, from_step=0):
    return policy.Failure(type=type_, message=message, place=place, kind=kind, attempt=attempt, step=step,
                          from_step=from_step)


def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as e:
        return e


# ---- the decision ------------------------------------------------------------------------------------
def test_a_first_plain_exception_restarts():
    d = policy.decide(failure(), previous=None)
    assert d.restart and "first failure" in d.why


def test_the_same_exception_at_the_same_place_without_a_new_step_ends_the_run():
    first, second = failure(attempt=1), failure(attempt=2)
    d = policy.decide(second, previous=first)
    assert not d.restart and d.kind == "repeated"
    assert "attempt 1 failed the same way" in d.why and "train.py:3 in main" in d.why and d.fix


def test_a_repeat_in_the_same_step_ends_the_run_even_after_new_steps():
    # the same error in step 2 of every attempt (no checkpoint: each attempt trains step 1 again): the
    # run resumes exactly, so the step that failed fails again (a deterministic error restarted 3 times
    # before: 4 attempts, each waiting for its allocation)
    first = failure(attempt=1, step=1)
    again = failure(attempt=2, step=1, from_step=0)
    d = policy.decide(again, previous=first)
    assert not d.restart and d.kind == "repeated"
    assert "in the same step (2)" in d.why and "attempt 1 failed the same way" in d.why and d.fix
    # resumed from step 6, failed before finishing step 7: no new step
    assert not policy.decide(failure(attempt=3, step=6, from_step=6), previous=again).restart


def test_a_repeat_in_a_later_step_restarts():
    # the same message further on: the attempt got past where the last one failed
    first = failure(attempt=1, step=1)
    assert policy.decide(failure(attempt=2, step=4, from_step=0), previous=first).restart


def test_a_different_message_or_place_is_not_a_repeat():
    first = failure()
    assert policy.decide(failure(message="RuntimeError: other", attempt=2), previous=first).restart
    assert policy.decide(failure(place=f"{USER_FILE}:9 in main", attempt=2), previous=first).restart
    # object addresses differ from one process to the next: still the same message
    a = failure(message="RuntimeError: <object at 0x7f12ab>")
    b = failure(message="RuntimeError: <object at 0x7f99cd>", attempt=2)
    assert not policy.decide(b, previous=a).restart


def test_failures_no_restart_fixes_end_at_the_first_attempt():
    for kind in ("signature", "import", "config", "device", "missing_file"):
        d = policy.decide(failure(kind=kind), previous=None)
        assert not d.restart and d.kind == kind and d.why and d.fix, kind


def test_a_missing_file_after_progress_restarts():
    assert policy.decide(failure(kind="missing_file", step=5, from_step=3), previous=None).restart


def test_a_lost_peer_always_restarts():
    lost = failure(message="RuntimeError: Connection closed by peer [10.0.0.2]:1234", kind="peer_lost")
    assert policy.decide(lost, previous=lost).restart
    assert policy.decide(lost, previous=None).restart


def test_a_node_fault_restarts_without_its_node_and_repeated_on_another_node_is_the_programs():
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
    assert policy.kind_of(RuntimeError(ecc), ecc, USER_FILE) == "node_fault"
    nccl = "DistBackendError: NCCL error in: pg.cpp:1, unhandled system error (run with NCCL_DEBUG=INFO)"
    assert policy.kind_of(RuntimeError(nccl), nccl, USER_FILE) == "node_fault"
    assert policy.kind_of(RuntimeError("CUDA error: device-side assert triggered"),
                          "RuntimeError: CUDA error: device-side assert triggered", USER_FILE) == "other"
    on = lambda node, attempt: policy.Failure(type="RuntimeError", message=ecc, place=f"{USER_FILE}:3 in main",  # noqa: E731
                                              kind="node_fault", attempt=attempt, node=node)
    first = policy.decide(on("node1", 1), previous=None)
    assert first.restart and "node node1" in first.why and "without that node" in first.why
    # the next attempt ran elsewhere and failed the same way: the program's, not a node's
    again = policy.decide(on("node2", 2), previous=on("node1", 1))
    assert not again.restart and again.kind == "repeated" and "two nodes (node1, then node2)" in again.why
    same = policy.decide(on("node1", 2), previous=on("node1", 1))  # (the node was not left out): the repeat rule
    assert not same.restart and same.kind == "repeated"
    other = policy.Failure(type="RuntimeError", message="RuntimeError: boom", place="x:1 in f", kind="other")
    assert policy.decide(on("node2", 2), previous=other).restart


# ---- the kinds -----------------------------------------------------------------------------------------
def test_kinds_of_exceptions():
    k = policy.kind_of
    sig = "TypeError: main() takes 0 positional arguments but 2 were given"
    assert k(TypeError(sig), sig, LAUNCHER_FILE) == "signature"
    assert k(TypeError(sig), sig, USER_FILE) == "other"  # a wrong call inside the user's code
    assert k(ModuleNotFoundError("No module named 'mp'"), "ModuleNotFoundError: No module named 'mp'",
             LAUNCHER_FILE) == "import"
    assert k(SyntaxError("invalid syntax"), "SyntaxError: invalid syntax", USER_FILE) == "import"
    assert k(ConfigError("train.steps", "bad", "fix"), "ConfigError", USER_FILE) == "config"
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = OmegaConf.create({"a": 1})
    OmegaConf.set_struct(cfg, True)
    with pytest.raises(OmegaConfBaseException) as e:
        _ = cfg.b
    assert k(e.value, str(e.value), USER_FILE) == "config"
    assert k(DeviceError("no CUDA device"), "DeviceError: no CUDA device", LAUNCHER_FILE) == "device"
    assert k(FileNotFoundError(2, "No such file"), "FileNotFoundError: x", USER_FILE) == "missing_file"
    from launcher.run.checkpoint_manifest import CheckpointCorrupt

    corrupt = CheckpointCorrupt({"step_00000008": ["checkpoints/step_00000008/model.pt missing"]})
    assert k(corrupt, str(corrupt), LAUNCHER_FILE) == "corrupt_checkpoint"
    assert not policy.decide(failure(kind="corrupt_checkpoint"), previous=None).restart  # not even the first
    peer = "RuntimeError: [../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    assert k(RuntimeError(peer), peer, LAUNCHER_FILE) == "peer_lost"
    assert k(RuntimeError("boom"), "RuntimeError: boom", USER_FILE) == "other"


def test_failure_of_names_the_raising_frame():
    e = raised(FileNotFoundError(2, "No such file or directory", "data.bin"))
    f = policy.failure_of(e, "FileNotFoundError: data.bin", attempt=1, step=None, from_step=0)
    assert f.type == "FileNotFoundError" and f.kind == "missing_file"
    assert f.place.startswith(__file__) and f.place.endswith(" in raised")
    assert policy.Failure.from_json(json.loads(json.dumps(f.to_json()))) == f
    assert policy.Failure.from_json(None) is None and policy.Failure.from_json({}) is None


# ---- the records: one attempt's failure, read by the next ----------------------------------------------
def make_run(tmp_path: Path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.write_run({"run_id": "x-0", "layout": {}})
    rd.set_status(Status.pending)
    return rd


class Requeues:
    requeue_exit_code = 3

    def request_requeue(self, job_id):
        pass


def test_the_next_attempt_reads_the_failure_that_ended_the_last(tmp_path):
    rd = make_run(tmp_path)
    assert restarts.begin_attempt(rd, max_restarts=3, job_id="1") == 1
    assert policy.start_of(rd, 1) == (0, None)
    first = failure(attempt=1, step=2)
    assert restarts.request_requeue(rd, Requeues(), attempt=1, max_restarts=3, reason="failure", detail="rank 0: x",
                                    rank=0, step=2, job_id="1", failure=first.to_json())
    assert rd.status().stop["failure"] == first.to_json()
    assert restarts.begin_attempt(rd, max_restarts=3, job_id="1") == 2
    (row,) = rd.restarts()
    assert row["failure"] == first.to_json() and row["failed_step"] == 2
    assert policy.start_of(rd, 2) == (0, first)
    # the same failure again, before a step of attempt 2: the run ends
    f, d = policy.judge(rd, raised(RuntimeError("boom")), "RuntimeError: boom", attempt=2, watch_step=None,
                        since=time.time())
    assert f.kind == "other" and d.restart  # another place than `first`'s (this file): not a repeat
    again = policy.failure_of(raised(RuntimeError("boom")), "RuntimeError: boom", attempt=2, step=None, from_step=0)
    assert not policy.decide(again, previous=policy.Failure(**{**again.to_json(), "attempt": 1})).restart


def test_an_attempt_that_fell_back_past_a_corrupt_checkpoint_started_where_it_resumed(tmp_path):
    rd = make_run(tmp_path)
    rd.record_restart({"attempt": 2, "reason": "failure", "from_step": 6, "failure": failure().to_json()})
    assert policy.start_of(rd, 2) == (6, failure())
    rd.record_fallback({"attempt": 2, "from_step": 4})  # latest (6) failed verification: it resumed from 4
    rd.record_fallback({"attempt": 3, "from_step": 2})  # a later attempt's
    assert policy.start_of(rd, 2) == (4, failure())


def test_a_resume_starts_afresh_and_logged_metrics_count_as_progress(tmp_path):
    rd = make_run(tmp_path)
    rd.record_restart({"attempt": 2, "reason": "resume", "from_step": 6,
                       "failure": failure().to_json()})
    assert policy.start_of(rd, 2) == (6, None)  # the user asked for it: no earlier failure holds
    t0 = time.time()
    with open(rd.metrics_path, "w") as fh:
        fh.write(json.dumps({"step": 6, "loss": 1.0, "time": t0 - 100}) + "\n")  # an earlier attempt's
    assert policy.last_logged_step(rd, since=t0) is None
    with open(rd.metrics_path, "a") as fh:
        fh.write(json.dumps({"step": 8, "loss": 1.0, "time": t0 + 1}) + "\n")
    assert policy.last_logged_step(rd, since=t0) == 8
    f, d = policy.judge(rd, raised(RuntimeError("x")), "RuntimeError: x", attempt=2, watch_step=7, since=t0)
    assert f.step == 8 and f.from_step == 6 and f.progressed and d.restart


def test_a_dataset_that_differs_from_its_manifest_is_not_restarted():
    from launcher.data.manifest import DatasetError

    exc = raised(DatasetError("/data/ds/shards/train-ab.bin: sha256 1234... differs from the manifest's"))
    f = policy.failure_of(exc, str(exc), attempt=1, step=None, from_step=0)
    d = policy.decide(f, previous=None)
    assert f.kind == "dataset" and not d.restart and "launcher data verify" in d.fix
