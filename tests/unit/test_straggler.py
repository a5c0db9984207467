"""The straggler rule (pure) and its verdict through the stop agreement every rank settles."""
from __future__ import annotations

import json

import torch

from launcher.features.nodes import record
from launcher.features.nodes.straggler import Detector, Thresholds, own_and_data, ratios, thresholds_of
from launcher.run.rundir import RunDir
from launcher.runtime.context import STOP_VOTES, RunContext


def test_ratios_compare_each_rank_with_the_others_median_and_ignore_microseconds():
    assert [round(x, 6) for x in ratios([0.1, 0.1, 0.3, 0.1])] == [1.0, 1.0, 3.0, 1.0]
    assert ratios([0.2, 0.1]) == [2.0, 0.5]
    assert [round(x, 6) for x in ratios([0.04, 0.02, 0.02])] == [0.8, 0.4, 0.4]  # milliseconds: under the floor
    assert max(ratios([0.0001, 0.0002, 0.0001])) < 0.1  # data time of microseconds: nobody's straggling


def test_a_rank_slow_over_the_window_is_named_then_requeued_and_a_hiccup_is_not():
    d = Detector(Thresholds(ratio=1.5, requeue_ratio=3.0, window=5), world=4)
    fast = [0.1, 0.1, 0.1, 0.1]
    for _ in range(10):  # one slow step in a window is a hiccup, not a straggler
        assert d.feed(fast, [0.0] * 4) is None
    assert d.feed([0.1, 0.1, 0.9, 0.1], [0.0] * 4) is None
    found = [d.feed([0.1, 0.1, 0.2, 0.1], [0.0] * 4) for _ in range(5)]
    assert found[-1] is not None and (found[-1].rank, found[-1].kind, found[-1].requeue) == (2, "own", False)
    assert 1.9 <= found[-1].ratio <= 2.1
    for _ in range(5):
        f = d.feed([0.1, 0.1, 0.4, 0.1], [0.0] * 4)
    assert f.requeue and f.rank == 2
    slow_data = Detector(Thresholds(ratio=1.5, requeue_ratio=0.0, window=3), world=3)
    for _ in range(3):
        g = slow_data.feed([0.1] * 3, [0.02, 0.3, 0.02])
    assert (g.rank, g.kind, g.requeue) == (1, "data", False)  # requeue ratio 0: named only


def test_the_switches_and_the_own_time_from_a_metrics_row():
    off = Detector(thresholds_of({"cluster": {"health": {"straggler_ratio": 0, "straggler_requeue_ratio": 0}}}), 2)
    assert all(off.feed([0.1, 5.0], [0.0, 0.0]) is None for _ in range(50))
    assert not thresholds_of({"cluster": {"health": {"enabled": False}}}).on
    assert thresholds_of({}) == Thresholds()
    # DDP's row: the rank waited 0.3 s in backward and 0.05 s in the loss all-reduce of a 0.5 s cycle
    row = {"time_data_s": 0.02, "time_forward_s": 0.05, "time_backward_s": 0.3, "time_loss_sync_s": 0.05}
    own, data = own_and_data(row, 0.5)
    assert abs(own - 0.13) < 1e-9 and data == 0.02
    assert own_and_data({"time_own_s": 0.2}, 9.0) == (0.2, 0.0)


def _ctx(tmp_path, rank, world, cfg):
    rd = RunDir(tmp_path / "root" / "sweep" / "0")  # (the ledger: the runs root's nodes/)
    rd.path.mkdir(parents=True, exist_ok=True)
    watch = record.Stragglers(cfg, rd, rank, world, f"node{rank + 1}", attempt=1, job_id="7", can_requeue=True)
    from launcher.config.layout import Layout

    return RunContext(rank=rank, world_size=world, local_rank=0, local_world_size=1, node_rank=rank,
                      hostname=f"node{rank + 1}", rundir=rd, layout=Layout(dp=world), device="cpu", backend="gloo",
                      stragglers=watch)


def test_every_rank_reaches_the_same_verdict_from_the_summed_votes_and_the_slow_rank_notes_its_node(tmp_path):
    """Two ranks, as the engines' all-reduce gives it: each rank's votes carry its timings at its own
    slots; their sum is what both settle on. Rank 1 is 4x slower: both stop with "straggler" at the same
    step, rank 1 noted its own node in the ledger once."""
    cfg = {"cluster": {"health": {"straggler_ratio": 1.5, "straggler_requeue_ratio": 3.0, "straggler_window": 3}}}
    ctxs = [_ctx(tmp_path, r, 2, cfg) for r in (0, 1)]
    verdicts = []
    for step in range(1, 5):
        for c in ctxs:
            c.heartbeat(step)
        ctxs[0].step_times(0.1, 0.0)
        ctxs[1].step_times(0.4, 0.0)
        votes = [c.stop_votes("cpu") for c in ctxs]
        assert votes[0].numel() == STOP_VOTES + 4
        summed = torch.stack(votes).sum(0).tolist()
        for c in ctxs:
            c.settle_stop(summed)
        verdicts.append([c.should_stop() for c in ctxs])
    assert verdicts[:2] == [[None, None]] * 2 and verdicts[2] == ["straggler", "straggler"]
    events = [json.loads(p.read_text()) for p in (tmp_path / "root" / "nodes" / "events").glob("*.json")]
    assert [(e["node"], e["kind"], e["rank"], e["step"]) for e in events] == [("node2", "straggler", 1, 3)]
    assert "4.00x the other ranks' median" in events[0]["detail"]
    err = ctxs[1].interrupted("straggler", 3)
    assert err.why.startswith("rank 1 on node node2 is a straggler")
