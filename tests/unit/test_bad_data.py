"""Commands that survive bad data (issue 27): one junk run dir, a full disk, a read-only archive, a
runs root too long for SQLite, a YAML alias bomb, a copied run dir, terminal control sequences and
matplotlib's mathtext in archived text each leave every whole-root command working; and a local run's
process is known by its pid AND its start time, so a reused pid is never taken for it.

Each class has the reported attack as one case and one more of the same class that no report listed
(its test name ends in ``_unlisted``). Pure: run dirs built in tmp_path, the CLI's main called in
process; a full disk and a read-only mount are simulated where the library meets the OS."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import sqlite3
import time
from pathlib import Path

import pytest

from launcher.archive import atomic, index, registry, yamlio
from launcher.backends import local
from launcher.cli.main import main
from launcher.printable import printable
from launcher.run.job_record import JobRecord
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import Status

RED_TITLE = "\x1b[31mRED\x1b]0;TITLE-PWNED\x07"
NO_PID = 4194305  # above the largest pid_max Linux allows: never a live process


def _run(root: Path, sweep: str, i: int, lr: float, loss: float, status: Status = Status.completed, **fields):
    rd = SweepDir(root / sweep).run(i)
    rd.write_config({"train": {"steps": 2}, "optim": {"lr": lr}, "name": fields.pop("name", "x")})
    rd.write_overrides([f"optim.lr={lr}"] + fields.pop("extra_overrides", []), {})
    rd.rewrite_metrics([{"step": 1, "loss": loss + 1}, {"step": 2, "loss": loss}])
    rd.write_run({"run_id": f"{sweep}-{i}", "sweep_id": sweep, "index": i, "backend": "local"})
    if status.value in ("completed", "failed"):
        rd.finish(status, exit_code=0 if status is Status.completed else 1, summary={"final_loss": loss}, **fields)
    else:
        rd.set_status(status, **fields)
    return rd


def _good_sweep(root: Path, sweep: str = "S") -> list:
    return [_run(root, sweep, i, lr, loss) for i, (lr, loss) in enumerate([(0.1, 2.0), (0.01, 1.5)])]


def _junk_run(d: Path, files: dict) -> Path:
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    return d


RUN = json.dumps({"run_id": "J-0", "sweep_id": "J", "index": 0})
JUNK = {  # the five kinds P30 reported, and one no report listed
    "run.json a list": {"run.json": "[1,2]"},
    "run.json without run_id": {"run.json": '{"x": 1}'},
    "run.json binary": {"run.json": b"\xff\xfe" + bytes(range(256)) + b"\x00" * 42},
    "status.json a string": {"run.json": RUN, "status.json": '"s"'},
    "config.yaml a python tag": {"run.json": RUN, "config.yaml": '!!python/object/apply:os.system ["echo pwned"]'},
    "status.json an unknown status (unlisted)": {"run.json": RUN, "status.json": '{"status": "exploded"}'},
}


def _root_with_junk(tmp_path: Path) -> tuple:
    root = tmp_path / "runs"
    _good_sweep(root)
    junk = {}
    for i, (kind, files) in enumerate(JUNK.items()):
        # most in a sweep of their own (as P30 made them), one among the good runs
        junk[kind] = _junk_run(root / "S" / "7" if i == 2 else root / f"J{i}" / "0", files)
    return root, junk


# ---- one junk run dir never takes the root down ------------------------------------------------------


def test_whole_root_commands_skip_and_name_every_junk_dir(tmp_path, capsys):
    """Over a root holding six kinds of junk dir, each whole-root command succeeds, lists the good runs
    and names every junk dir with what is wrong with it."""
    root, junk = _root_with_junk(tmp_path)
    png = tmp_path / "plot.png"
    commands = [["runs"], ["runs", "--reindex"], ["runs", "--json"], ["status", "S"], ["status", "S", "--json"],
                ["results", "S"], ["results", "S", "--plot", str(png)], ["report", "S"], ["runs"]]
    for argv in commands:
        assert main([*argv, "--root", str(root)]) == 0, argv
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        for kind, d in junk.items():
            assert f"skipped {d}:" in err, (argv, kind, err)
        if argv == ["runs", "--json"]:
            assert sorted(r["run_id"] for r in json.loads(out)) == ["S-0", "S-1"]
    assert png.stat().st_size > 0 and (root / "S" / "report.html").is_file()
    main(["runs", "--root", str(root)])
    err = capsys.readouterr().err
    assert "run.json holds a JSON list, not an object" in err and "run.json has no run_id" in err
    assert "status.json holds a JSON string, not an object" in err
    assert "run.json is not JSON" in err and "status.json is not a status record" in err
    assert "config.yaml is not a plain YAML mapping" in err


def test_a_junk_dir_fixed_later_is_listed_and_no_longer_named(tmp_path, capsys):
    root, junk = _root_with_junk(tmp_path)
    assert main(["runs", "--root", str(root)]) == 0
    d = junk["run.json a list"]
    (d / "run.json").write_text(json.dumps({"run_id": "J0-0", "sweep_id": "J0", "index": 0}))
    capsys.readouterr()
    assert main(["runs", "--json", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "J0-0" in [r["run_id"] for r in json.loads(out)] and f"skipped {d}" not in err


def test_show_of_a_junk_dir_says_what_is_wrong(tmp_path, capsys):
    _, junk = _root_with_junk(tmp_path)
    d = junk["status.json a string"]
    assert main(["show", str(d)]) == 2
    err = capsys.readouterr().err
    assert str(d) in err and "status.json" in err and "Traceback" not in err


def test_junk_lines_of_metrics_and_restarts_are_skipped_unlisted(tmp_path):
    """Not a whole run dir but its JSON-lines files: binary junk and lines that are no object."""
    rd = _good_sweep(tmp_path)[0]
    for p in (rd.metrics_path, rd.path / RunDir.RESTARTS):
        if p.exists():
            os.chmod(p, 0o644)  # sealed read-only
        with open(p, "ab") as f:
            f.write(b"\xff\xfe\x00junk\n[1, 2]\n\"s\"\n")
    assert [m["step"] for m in rd.metrics()] == [1, 2] and rd.restarts() == []


# ---- a full disk ---------------------------------------------------------------------------------------


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_a_job_ended_unrecorded_leaves_status_working(tmp_path, monkeypatch, capsys):
    """P20: the job died on ENOSPC with status.json still running; `launcher status` (which records the
    lost outcome) and `runs` work while the disk is full, and say why nothing was recorded."""
    root = tmp_path / "runs"
    _good_sweep(root)
    lost = _run(root, "S", 2, 0.5, 3.0, status=Status.running)
    lost.write_job(JobRecord(backend="local", job_id=str(NO_PID)))
    monkeypatch.setattr(atomic, "write_text", _disk_full)
    monkeypatch.setattr(index, "upsert", lambda *a: (_ for _ in ()).throw(
        sqlite3.OperationalError("database or disk is full")))
    assert main(["status", "S", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert f"cannot record the outcome of {lost.path} (No space left on device)" in err
    assert "S-2" in out and lost.status().state is Status.running
    assert main(["runs", "--root", str(root)]) == 0
    assert "S-2" in capsys.readouterr().out


def test_a_write_on_a_full_disk_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "status.json"
    path.write_text("old\n")
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(OSError) as ei:
        atomic.write_text(path, "new\n")
    assert ei.value.errno == errno.ENOSPC and ei.value.filename == str(path)
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_a_launch_on_a_full_disk_removes_its_partial_snapshot(tmp_path, monkeypatch):
    """P19: the snapshot fills the disk: a clear refusal, and no code.partial (nor sweep dir) left."""
    from types import SimpleNamespace

    from launcher.archive import snapshot
    from launcher.submit import pipeline

    def take(root, dest, **kw):
        (dest.with_name(dest.name + ".partial") / "pkg").mkdir(parents=True)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dest.with_name(dest.name + ".partial") / "x"))

    monkeypatch.setattr(snapshot, "take", take)
    monkeypatch.setattr(snapshot, "tree_secrets", lambda root: {})
    root = tmp_path / "runs"
    root.mkdir()
    point = SimpleNamespace(resolved={"recipe": {"_target_": "recipes.gpt.main"}}, known={}, index=0,
                            backend=SimpleNamespace(name="local"))
    with pytest.raises(pipeline.InvalidSweep) as ei:
        pipeline.create([point], root, [], None, None)
    assert "No space left on device" in str(ei.value) and "nothing was submitted" in str(ei.value)
    assert list(root.iterdir()) == []


def test_a_full_disk_while_listing_refreshes_the_index_unlisted(tmp_path, monkeypatch, capsys):
    """SQLite's "database or disk is full" while `runs` adds runs it has not seen: listed from the dirs."""
    root = tmp_path / "runs"
    _good_sweep(root)
    assert main(["runs", "--root", str(root)]) == 0
    _good_sweep(root, "T")  # a sweep the index has not seen: listing would add it
    monkeypatch.setattr(index, "upsert", lambda *a: (_ for _ in ()).throw(
        sqlite3.OperationalError("database or disk is full")))
    capsys.readouterr()
    assert main(["runs", "--json", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert sorted(r["run_id"] for r in json.loads(out)) == ["S-0", "S-1", "T-0", "T-1"]
    assert "database or disk is full" in err and "listing the runs from their dirs" in err


# ---- a read-only archive -------------------------------------------------------------------------------


def _read_only(monkeypatch) -> None:
    """From now on the root is as a read-only mount shows it (root bypasses file modes): SQLite cannot
    create the index, and no file can be made."""
    real = sqlite3.connect

    def connect(path, *a, **kw):
        if not Path(path).exists():
            raise sqlite3.OperationalError("unable to open database file")
        return real(path, *a, **kw)

    def refuse(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(a[0]) if a else None)

    monkeypatch.setattr(index.sqlite3, "connect", connect)
    monkeypatch.setattr(atomic, "write_text", refuse)


def test_a_read_only_archive_without_its_index_lists_and_shows(tmp_path, monkeypatch, capsys):
    """P21: `runs` and `show RUN_ID` on a read-only archive without registry.sqlite."""
    root = tmp_path / "runs"
    _good_sweep(root)
    _read_only(monkeypatch)
    assert main(["runs", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "S-0" in out and "S-1" in out and "cannot be written" in err
    assert main(["show", "S-1", "--root", str(root)]) == 0
    assert "S-1" in capsys.readouterr().out
    assert not index.db_path(root).exists() and not list(root.glob(".registry*"))


def test_reindex_of_a_read_only_archive_unlisted(tmp_path, monkeypatch, capsys):
    root = tmp_path / "runs"
    _good_sweep(root)
    _read_only(monkeypatch)
    assert main(["runs", "--reindex", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "nothing was changed" in err and "S-0" in out and not list(root.glob(".registry*"))


# ---- a runs root too long for SQLite -------------------------------------------------------------------


def _long_root(tmp_path: Path) -> Path:
    root = tmp_path.joinpath(*["e" * 120] * 5)
    assert len(str(index.db_path(root))) > index.MAX_PATH
    return root


def test_a_runs_root_too_long_for_the_index_is_refused_before_queueing(tmp_path):
    """P44: refused by the pre-submit check, naming submit.runs_root (nothing staged, nothing queued)."""
    from hydra import compose, initialize_config_dir

    from launcher.app import CONF_DIR
    from launcher.submit.pipeline import InvalidSweep, Point, validate

    root = _long_root(tmp_path)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"submit.runs_root={root}"])
    with pytest.raises(InvalidSweep) as ei:
        validate([Point(cfg)])
    text = str(ei.value)
    assert "submit.runs_root" in text and "SQLite" in text and "nothing was submitted" in text
    assert index.path_problem(tmp_path) is None


def test_runs_and_a_late_index_write_under_a_long_root(tmp_path, capsys):
    """`runs --root D` lists from the dirs; record() after a job was queued warns instead of crashing."""
    root = _long_root(tmp_path)
    rds = _good_sweep(root)
    registry.record(root, [rd.path for rd in rds])
    assert "the runs are archived in their dirs" in capsys.readouterr().err
    assert main(["runs", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "S-0" in out and f"SQLite opens none longer than {index.MAX_PATH}" in err


def test_status_of_a_sweep_under_a_long_root_unlisted(tmp_path, capsys):
    root = _long_root(tmp_path)
    _good_sweep(root)
    assert main(["status", "S", "--json", "--root", str(root)]) == 0
    assert json.loads(capsys.readouterr().out)["counts"] == {"completed": 2}


# ---- YAML aliases ----------------------------------------------------------------------------------------


def _alias_bomb(levels: int = 8) -> str:
    lines, prev = ["a: &a [1, 2, 3, 4, 5, 6, 7, 8, 9]"], "a"
    for i in range(levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*{prev}"] * 9) + "]")
        prev = f"l{i}"
    return "\n".join(lines) + "\n"


def test_a_1kb_alias_bomb_is_refused_at_once(tmp_path, capsys):
    """P31: 8 levels of nested aliases (9**9 values) in one config.yaml: --reindex skips it in well
    under a second, and the index stays small."""
    root = tmp_path / "runs"
    _good_sweep(root)
    bomb = _junk_run(root / "B" / "0", {"run.json": json.dumps({"run_id": "B-0", "sweep_id": "B"}),
                                        "config.yaml": _alias_bomb()})
    assert len(_alias_bomb()) < 1024
    t0 = time.monotonic()
    assert main(["runs", "--reindex", "--root", str(root)]) == 0
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert f"skipped {bomb}" in err and "aliases expand it to more than" in err
    assert index.db_path(root).stat().st_size < 200_000
    assert yamlio.load("x: &x {a: 1}\ny: *x\n") == {"x": {"a": 1}, "y": {"a": 1}}  # a small alias is fine


def test_a_recursive_alias_is_refused_unlisted(tmp_path):
    """A node that holds itself (``&a [*a]``) would make the index's JSON dump fail."""
    with pytest.raises(yamlio.TooLarge, match="recursive"):
        yamlio.load("a: &a [1, *a]\n")
    rd = RunDir(_junk_run(tmp_path / "R" / "0", {"run.json": json.dumps({"run_id": "R-0", "sweep_id": "R"}),
                                                 "overrides.yaml": "o: &o [*o]\n"}))
    with pytest.raises(ValueError, match="overrides.yaml"):
        rd.overrides()


# ---- a copied run dir ------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, symlinks=True)  # as `cp -a`: modes and times kept


def test_a_copied_run_dir_takes_no_run_id_over(tmp_path, capsys):
    """P32: after `cp -a S/0 S/7`, --reindex lists both, `show S-0` asks for the dir, and each dir opens
    as itself."""
    root = tmp_path / "runs"
    rds = _good_sweep(root)
    _copy(rds[0].path, root / "S" / "7")
    assert main(["runs", "--reindex", "--json", "--root", str(root)]) == 0
    out, err = capsys.readouterr()
    dirs = sorted(r["dir"] for r in json.loads(out))
    assert dirs == sorted(str(p) for p in (rds[0].path, rds[1].path, root / "S" / "7"))
    assert "reindexed 3" in err and "2 run dirs claim run id S-0" in err
    with pytest.raises(SystemExit) as ei:
        main(["show", "S-0", "--root", str(root)])
    assert str(rds[0].path) in str(ei.value) and str(root / "S" / "7") in str(ei.value)
    assert main(["show", str(rds[0].path), "--json", "--root", str(root)]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["run_id"] == "S-0"


def test_a_run_dir_copied_into_another_sweep_unlisted(tmp_path, capsys):
    """Copied into a sweep the index has not seen, without --reindex: the original stays indexed."""
    root = tmp_path / "runs"
    rds = _good_sweep(root)
    assert main(["runs", "--root", str(root)]) == 0
    (root / "T").mkdir()
    _copy(rds[0].path, root / "T" / "0")
    capsys.readouterr()
    assert main(["runs", "--json", "--root", str(root)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert sorted(r["dir"] for r in rows if r["run_id"] == "S-0") == sorted([str(rds[0].path), str(root / "T" / "0")])


# ---- terminal control sequences --------------------------------------------------------------------------


def test_show_and_doctor_escape_a_ranks_esc_and_osc_sequences(tmp_path, capsys):
    """P18: a recipe raised RuntimeError with ESC[31m and an OSC window-title sequence."""
    root = tmp_path / "runs"
    rd = _run(root, "S", 0, 0.1, 1.0, status=Status.failed, error=f"RuntimeError: {RED_TITLE}")
    assert main(["show", str(rd.path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "TITLE-PWNED" in out
    assert main(["doctor", str(rd.path), "--no-scheduler"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "TITLE-PWNED" in out


def test_doctor_escapes_an_8bit_csi_in_a_rank_error_file_unlisted(tmp_path, capsys):
    """A C1 control (U+009B, the 8-bit CSI some terminals obey) in ranks/rank_0.error, the doctor's
    evidence."""
    root = tmp_path / "runs"
    rd = SweepDir(root / "S").run(0)
    rd.write_config({"train": {"steps": 2}})
    rd.write_run({"run_id": "S-0", "sweep_id": "S", "index": 0})
    rd.write_rank_error(0, "Traceback (most recent call last):\n"
                           "RuntimeError: \x9b31mred\x9b0m \x1b]52;c;cHduZWQ=\x07\n")  # OSC 52: a clipboard write
    rd.finish(Status.failed, exit_code=1, error="RuntimeError: \x9b31mred", failed_rank=0)
    assert main(["doctor", str(rd.path), "--no-scheduler"]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in ("\x9b", "\x1b", "\x07")) and r"\x9b31mred" in out
    assert printable("a\tb\nc\x1b[0m\x7f\x9b") == "a\tb\nc\\x1b[0m\\x7f\\x9b"


# ---- matplotlib's mathtext -------------------------------------------------------------------------------


def test_a_swept_string_with_dollars_is_drawn_as_text(tmp_path, capsys):
    """P22: name='a$\\undefinedcmd{$' swept: `results --plot` and `report SWEEP` draw it."""
    root = tmp_path / "runs"
    for i, name in enumerate(["a$\\undefinedcmd{$", "plain"]):
        _run(root, "S", i, 0.1, 1.0 + i, name=name, extra_overrides=[f"name={name}"])
    png = tmp_path / "p.png"
    assert main(["results", "S", "--plot", str(png), "--root", str(root)]) == 0
    assert png.stat().st_size > 0
    assert main(["report", "S", "--root", str(root)]) == 0


def test_a_metric_phase_name_with_dollars_on_the_run_page_unlisted(tmp_path):
    """A recipe's own phase timer named with ``$...$`` (time_<phase>_s): the run page's phase plot."""
    from launcher import report

    rd = _run(tmp_path / "runs", "S", 0, 0.1, 1.0)
    rd.rewrite_metrics([{"step": s, "loss": 1.0, "time_$x^$_s": 0.1, "time_forward_s": 0.2} for s in (1, 2)])
    assert "step time by phase" in report.run_report(rd.path)


# ---- local runs: a process is its pid and its start time -------------------------------------------------


@pytest.fixture
def sigints(monkeypatch):
    """This test's own process stands for the unrelated one that now holds a dead run's pid: the
    SIGINTs it gets are counted (none must come from a cancel of the dead run)."""
    got = []
    old = signal.signal(signal.SIGINT, lambda *a: got.append(time.monotonic()))
    yield got
    signal.signal(signal.SIGINT, old)


def test_a_reused_pid_is_not_the_run_and_is_never_signalled(sigints):
    """P42: job.json names a pid another process now holds (the dead controller's start time differs)."""
    pid = os.getpid()
    start = local.process_start(pid)
    reused = JobRecord(backend="local", job_id=str(pid), process_start=start - 1)
    state = local.BACKEND.states([reused.to_json()])[str(pid)]
    assert state.status is Status.failed and state.raw == "EXITED"
    local.BACKEND.cancel(reused, wait_s=0.5)
    time.sleep(0.1)
    assert sigints == []  # no SIGINT reached the other process
    own = JobRecord.from_json(JobRecord(backend="local", job_id=str(pid), process_start=start).to_json())
    assert local.BACKEND.states([own.to_json()])[str(pid)].status is Status.running
    local.BACKEND.cancel(own, wait_s=0.2)  # the run's own process is signalled
    time.sleep(0.1)
    assert len(sigints) == 1


def test_waiting_for_ranks_ignores_a_reused_rank_pid_unlisted(tmp_path):
    """wait_for_local_ranks (before a seal) waits for the ranks' own processes, not for a pid reused."""
    import socket

    rd = RunDir(tmp_path)
    rd.write_rank(0, {"rank": 0, "hostname": socket.gethostname(), "pid": os.getpid(),
                      "process_start": local.process_start(os.getpid()) + 7})
    t0 = time.monotonic()
    local.wait_for_local_ranks(rd, timeout_s=10)
    assert time.monotonic() - t0 < 2
    assert local.process_start(NO_PID) is None and not local.same_process(NO_PID, None)
