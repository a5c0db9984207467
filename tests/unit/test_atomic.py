"""launcher.archive.atomic: a write never changes a file in place (runs of a sweep share hard-linked
files), deferred flushing writes the same bytes, and a private (staging) write makes its folder."""
import os

import pytest

from launcher.archive import atomic


@pytest.mark.parametrize("private", [False, True])
def test_a_write_replaces_a_linked_file_never_changes_it(tmp_path, private):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one")
    os.link(a, b)
    with atomic.deferred_sync(private=private):
        atomic.write_text(a, "two")
    assert a.read_text() == "two" and b.read_text() == "one"
    assert a.stat().st_ino != b.stat().st_ino


def test_deferred_writes_land_whole_and_make_their_folders(tmp_path):
    with atomic.deferred_sync(private=True):
        for i in range(20):
            atomic.write_json(tmp_path / f"run{i}" / "sub" / "x.json", {"i": i})
        with atomic.deferred_sync():  # nested: flushed by the outer one
            atomic.write_text(tmp_path / "plain.txt", "p")
    assert [atomic.read_json(tmp_path / f"run{i}" / "sub" / "x.json")["i"] for i in range(20)] == list(range(20))
    assert (tmp_path / "plain.txt").read_text() == "p"
    assert not list(tmp_path.rglob("*.tmp"))


def test_outside_deferral_writes_are_flushed_one_by_one(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    atomic.write_text(tmp_path / "x", "1")
    assert len(synced) == 1
    with atomic.deferred_sync():
        atomic.write_text(tmp_path / "y", "2")
        atomic.write_text(tmp_path / "z", "3")
    assert len(synced) == 1  # one syncfs of the file system instead


def test_ranks_adopting_a_sweeps_shared_files_at_once_all_succeed(tmp_path):
    """Every rank of a run links the sweep's shared records in when it starts; they race."""
    from concurrent.futures import ThreadPoolExecutor

    from launcher.run.rundir import RunDir, SweepDir

    sweep = SweepDir(tmp_path / "S")
    sweep.shared().write_code({"commit": "abc"}, "diff", {"path": "p"})
    sweep.shared().write_software({"python": "3"}, "torch==2")
    runs = [sweep.run(i) for i in range(2)]
    for rd in runs:
        rd.write_run({"run_id": rd.path.name})
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda rd: rd.adopt_shared(), runs * 8))
    for rd in runs:
        assert rd.git() == {"commit": "abc"} and rd.software() == {"python": "3"}
        assert all((rd.path / n).stat().st_ino == (sweep.shared().path / n).stat().st_ino
                   for n in RunDir.SHARED_FILES)
    other = RunDir(tmp_path / "other")
    other.write_code({"commit": "zzz"}, "", {})
    with pytest.raises(FileExistsError):  # a different file already there is never replaced silently
        runs[0].link_from(other, (RunDir.GIT,))


def test_a_points_seeds_and_overrides_come_from_the_sweep_record_until_it_starts(tmp_path):
    """stage writes every point's seeds and overrides in one file; a run reads them from there and
    writes its own seeds.json / overrides.yaml when it starts (or is sealed)."""
    from launcher.archive import atomic as at
    from launcher.run.rundir import RunDir, SweepDir

    sweep = SweepDir(tmp_path / "S")
    at.write_json(sweep.shared().path / SweepDir.POINTS, {
        str(i): {"seeds": {"seed": 10 + i}, "overrides": {"overrides": [f"seed={10 + i}"], "choices": {"model": "m"}}}
        for i in range(3)})
    rd = sweep.run(1)
    rd.write_run({"run_id": "S-1"})
    assert rd.seeds() == {"seed": 11} and rd.overrides()["overrides"] == ["seed=11"]
    assert not (rd.path / RunDir.SEEDS).exists()
    rd.overrides()["overrides"].append("x")  # a caller's copy: the record stays as written
    assert rd.overrides()["overrides"] == ["seed=11"]
    rd.adopt_shared()
    assert at.read_json(rd.path / RunDir.SEEDS) == {"seed": 11}
    assert "seed=11" in (rd.path / RunDir.OVERRIDES).read_text()
    assert rd.overrides()["choices"] == {"model": "m"}
    assert sweep.run(2).seeds() == {"seed": 12} and RunDir(tmp_path / "S" / "x").seeds() is None
