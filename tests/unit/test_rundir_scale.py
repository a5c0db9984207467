"""What one rank asks of the shared run dir does not grow with the job: N ranks (8, 64, 512) simulated in
this process against a counting file-system layer (tests/rank_sim.py; 4,096 ranks:
benchmarks/rundir_scale.py). Start-up, the peer watch, a peer's failure, a checkpoint and a hang:
every rank's file operations stay flat as N grows, except the one rank that does a job-wide part
(rank 0's shared records, the checkpoint's committer, the hang's gatherer), whose work is linear in N
at most; the scheduler is asked for the master's address once per job, not once per rank."""
from __future__ import annotations

import pytest

import rank_sim

SIZES = (8, 64, 512)
SLACK = 4  # operations a rank may add as N grows 64-fold (none is expected)


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = {}
    for world in SIZES:
        out[world] = rank_sim.simulate(tmp_path_factory.mktemp(f"n{world}") / "runs", world)
    print("\n" + rank_sim.table(out))
    return out


def _all_but_one(values):
    """The per-rank values without the largest one (the rank doing the job-wide part)."""
    return sorted(values)[:-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", rank_sim.PHASES)
def test_each_ranks_file_operations_stay_flat_as_the_job_grows(counts, phase):
    small, big = SIZES[0], SIZES[-1]
    base = max(_all_but_one(counts[small].per_rank(phase, small)))
    for world in SIZES[1:]:
        ops = counts[world].per_rank(phase, world)
        assert len(ops) == world and min(ops) > 0 or phase == "failure", (phase, world)
        assert max(_all_but_one(ops)) <= base + SLACK, (phase, world, base, sorted(ops)[-5:])
        # the one rank with a job-wide part: linear in N at most
        assert max(ops) <= 8 * world + 100, (phase, world, max(ops))
    total = lambda w: sum(counts[w].per_rank(phase, w))  # noqa: E731
    assert total(big) / big <= total(small) / small + SLACK, (phase, total(small), total(big))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("phase", rank_sim.PHASES)
def test_no_rank_lists_a_directory_that_grows_with_the_job(counts, phase):
    """Only the one rank with a job-wide part lists a directory of every rank (the hang's gatherer
    counts the dumps, the checkpoint's committer writes its manifest); every other rank's listings
    return a few entries whatever N is: a checkpoint is committed by a count in the job's store, not
    by listing the done markers."""
    for world in SIZES:
        listed = counts[world].dirents_per_rank(phase, world)
        assert max(_all_but_one(listed)) <= 4, (phase, world, sorted(listed)[-5:])
        assert max(listed) <= 6 * world, (phase, world, max(listed))  # linear in N at most


@pytest.mark.timeout(120)
def test_the_scheduler_is_asked_for_the_master_address_once_per_job(counts):
    """DNS does not know the node names (the simulation's resolver refuses them): rank 0 asks scontrol
    once and leaves the answer in the run dir; no other rank asks."""
    for world in SIZES:
        assert dict(counts[world].scontrol) == {0: 1}, (world, dict(counts[world].scontrol))


@pytest.mark.timeout(120)
def test_the_layer_counts_what_it_is_given(tmp_path):
    """The counting layer itself: a listing, its entries, an fsync and a write-rename are counted for
    the rank that asks, and nothing outside the root or outside a rank's turn is."""
    import os

    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_text("x")
    (root / "b").write_text("y")
    layer = rank_sim.Layer(root)
    with layer:
        layer.phase, layer.rank = "p", 3
        assert sorted(os.listdir(root)) == ["a", "b"]
        with open(root / "c", "w") as f:
            f.write("z")
            f.flush()
            os.fsync(f.fileno())
        os.replace(root / "c", root / "d")
        (tmp_path / "outside").write_text("not counted")
        layer.rank = None
        os.listdir(root)  # no rank's turn: not counted
    assert dict(layer.counts.kinds["p"]) == {"listdir": 1, "open": 1, "fsync": 1, "replace": 1}
    assert layer.counts.ops["p"][3] == 4 and layer.counts.dirents["p"][3] == 2
    assert os.listdir is not None and (root / "d").read_text() == "z"


@pytest.mark.timeout(120)
def test_each_rank_hashes_about_its_own_bytes_at_commit_and_at_resume(counts):
    """The digests cost each rank its own bytes, not rank 0 the whole checkpoint: at commit every rank
    hashes what it wrote (the committer the marks from memory), at resume a share of the files; the
    most any rank hashes stays within 2x its own files' bytes at every N, and every file is hashed once."""
    for world in SIZES:
        c = counts[world]
        for phase in ("checkpoint", "resume"):
            for rank in range(world):
                assert c.hashed[phase].get(rank, 0) <= 2 * c.own[rank], (phase, world, rank, c.own[rank])
        # every file of the checkpoint (each rank's files and its done mark) hashed once at resume
        assert sum(c.hashed["resume"].values()) == sum(c.own.values()), world
