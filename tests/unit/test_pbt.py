"""sweep=pbt: the rule (launcher.features.pbt.generations, pure), its refusals at launch naming the key,
and its node side on real run dirs (launcher.features.pbt.population: no job): reports, the decision by
the member completing a generation, the donor's checkpoint copied and verified, the values laid over
the config, lineages."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.features.asha import rungs
from launcher.features.pbt import generations as pbt, population
from launcher.run import checkpoint_manifest
from launcher.run.rundir import SweepDir
from launcher.run.status import Status
from launcher.submit.pipeline import InvalidSweep, Point, validate as check

RULE = pbt.Rule(interval=2, quantile=0.25, explore=("optim.lr",), factors=(0.8, 1.25), seed=7, steps=6)


def lrs(n=4):
    return {p: {"optim.lr": 0.001 * (p + 1)} for p in range(n)}


def test_boundaries_and_rungs():
    assert RULE.pause_rungs == (2, 4) and RULE.rungs == (2, 4, 6)
    assert pbt.boundaries(3, 9) == (3, 6) and pbt.boundaries(0, 9) == ()


def test_the_bottom_quantile_exploits_the_top_with_perturbed_values():
    values = {0: 3.0, 1: 1.0, 2: 2.0, 3: 4.0}
    d = pbt.decide(RULE, 0, values, lrs())
    assert d.ranking == (1, 2, 0, 3)
    (c,) = d.changes  # 4 x 0.25: one member, the worst, copies the best
    assert (c.member, c.donor) == (3, 1)
    assert c.before == {"optim.lr": 0.004}
    assert c.after["optim.lr"] in (pytest.approx(0.002 * 0.8), pytest.approx(0.002 * 1.25))
    assert c.after["optim.lr"] == pytest.approx(0.002 * c.factors["optim.lr"])


def test_a_decision_is_a_function_of_the_reports_and_the_seed():
    values = {p: float((p * 7) % 8) for p in range(8)}
    now = lrs(8)
    q = pbt.Rule(interval=2, quantile=0.5, explore=("optim.lr",), seed=3, steps=10)
    first = [pbt.decide(q, g, values, now).to_json() for g in range(4)]
    assert first == [pbt.decide(q, g, values, now).to_json() for g in range(4)]
    d = pbt.decide(q, 0, values, now)
    assert sorted(c.member for c in d.changes) == sorted(d.ranking[4:])  # the bottom half
    assert {c.donor for c in d.changes} <= set(d.ranking[:4])
    # the choices vary with the generation and the seed (over enough draws, not all the same)
    draws = {(c.donor, c.factors["optim.lr"]) for g in range(20) for c in pbt.decide(q, g, values, now).changes}
    assert len(draws) > 2
    other = pbt.Rule(interval=2, quantile=0.5, explore=("optim.lr",), seed=4, steps=10)
    assert [pbt.decide(other, g, values, now).to_json() for g in range(4)] != first


@pytest.mark.parametrize("n,q,k", [(4, 0.25, 1), (4, 0.5, 2), (3, 0.25, 1), (8, 0.25, 2), (1, 0.5, 0), (5, 0.5, 2)])
def test_quantile_cut(n, q, k):
    assert pbt.cut(n, q) == k


def test_max_mode_nan_a_missing_report_and_ints():
    rule = pbt.Rule(interval=2, quantile=0.5, explore=("train.micro_batch_size",), factors=(2.0,), mode="max",
                    seed=1, steps=6)
    now = {p: {"train.micro_batch_size": 2} for p in range(4)}
    d = pbt.decide(rule, 0, {0: 1.0, 1: float("nan"), 2: 5.0, 3: None}, now, alive=[0, 1, 2])
    assert d.ranking[:2] == (2, 0)
    # 3 ended (not alive): it copies nobody; 1 (NaN) is in the bottom and copies a top member
    assert [c.member for c in d.changes] == [1]
    assert d.changes[0].after == {"train.micro_batch_size": 4}


def test_rule_of_a_config_and_problems():
    cfg = {"seed": 11, "train": {"steps": 6}, "sweep": {"scheduler": "pbt", "interval": 2, "explore": ["optim.lr"]}}
    r = pbt.Rule.of(cfg)
    assert (r.interval, r.seed, r.explore, r.steps) == (2, 11, ("optim.lr",), 6)
    assert pbt.Rule.of({"sweep": {"scheduler": "asha"}}) is None
    tree = {"optim": {"lr": 0.1, "name": "adamw"}}
    keys = lambda sweep, steps=6: [k for k, _, _ in pbt.problems(sweep, steps, tree)]  # noqa: E731
    assert keys({"interval": 2, "quantile": 0.25, "explore": ["optim.lr"], "factors": [0.8, 1.25]}) == []
    assert keys({"interval": 0, "explore": []}) == ["sweep.interval"]
    assert keys({"interval": 6, "explore": []}) == ["sweep.interval"]
    assert keys({"interval": 2, "quantile": 0.75}) == ["sweep.quantile"]
    assert keys({"interval": 2, "quantile": 0.0}) == ["sweep.quantile"]
    assert keys({"interval": 2, "explore": ["optim.lrr"]}) == ["optim.lrr"]
    assert keys({"interval": 2, "explore": ["optim.name"]}) == ["optim.name"]
    assert keys({"interval": 2, "explore": ["optim.lr"], "factors": [0.0]}) == ["sweep.factors"]


def test_lineage_lines():
    rows = [{"generation": 0, "step": 2, "donor": 1, "before": {"optim.lr": 0.004}, "after": {"optim.lr": 0.0025}}]
    assert pbt.lineage_line(3, rows) == "member 3: gen 0: from 1@step 2, optim.lr 0.004->0.0025"
    assert pbt.lineage_line(0, []) == "member 0: its own line (no exploit)"


# ---- refusals at launch ----------------------------------------------------------------------------


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


BASE = ["model=gpt_tiny", "train.steps=6", "sweep=pbt"]


@pytest.mark.parametrize("overrides,key,words", [
    (["sweep.explore=[optim.lrr]"], "optim.lrr", "not a key of the config"),
    (["sweep.interval=0"], "sweep.interval", "positive"),
    (["sweep.interval=-2"], "sweep.interval", "positive"),
    (["sweep.interval=6"], "sweep.interval", ">= train.steps=6"),
    (["sweep.quantile=0.6"], "sweep.quantile", "outside (0, 0.5]"),
    (["sweep.quantile=0"], "sweep.quantile", "outside (0, 0.5]"),
])
def test_bad_pbt_settings_are_refused_at_launch_naming_the_key(overrides, key, words):
    with pytest.raises(InvalidSweep) as ei:
        check([Point(compose_cfg([*BASE, *overrides]), [*BASE, *overrides])])
    text = str(ei.value)
    assert "nothing was submitted" in text and key in text and words in text, text


def test_a_good_pbt_sweep_passes():
    cfg = compose_cfg(BASE)
    assert len(check([Point(cfg, BASE)])) == 1
    rule = pbt.Rule.of(cfg)
    assert rule.pause_rungs == (2, 4) and rule.explore == ("optim.lr",) and rule.seed == int(cfg.seed)


# ---- the node side on run dirs ---------------------------------------------------------------------

CFG = {"seed": 5, "cluster": {"backend": "local"}, "train": {"steps": 6}, "optim": {"lr": 0.001},
       "sweep": {"scheduler": "pbt", "interval": 2, "quantile": 0.25, "explore": ["optim.lr"],
                 "factors": [0.8, 1.25], "mode": "min", "objective": "loss"}}


def fake_checkpoint(rd, step, tag):
    ckpt = rd.checkpoint_dir(step)
    ckpt.mkdir(parents=True)
    (ckpt / "model.pt").write_text(f"weights of {tag} at {step}")
    (ckpt / "meta.json").write_text(json.dumps({"step": step, "metrics": []}))
    checkpoint_manifest.write(ckpt, step, [])
    rd.set_latest(ckpt)


def sweep(tmp_path, n=4, replay=None):
    sd = SweepDir(tmp_path / "sweep")
    for i in range(n):
        rd = sd.run(i)
        rd.path.mkdir(parents=True)
        cfg = json.loads(json.dumps(CFG))
        cfg["optim"]["lr"] = 0.001 * (i + 1)
        if replay:
            cfg["sweep"]["replay"] = replay
        rd.write_config(cfg)
        rd.write_run({"run_id": sd.run_id(i), "index": i})
        rd.set_status(Status.running, attempt=1, job_id=str(1000 + i))
    return sd


def report(sd, p, step, value):
    rd = sd.run(p)
    rule = rungs.rule_of(rd)
    assert isinstance(rule, pbt.Rule)
    return rungs.report(rd, rule, step, value, attempt=1, seconds=1.0, from_step=step - 2, world=1,
                        job_id=rd.status().job_id)


def generation_0(sd, losses):
    for p in range(4):
        fake_checkpoint(sd.run(p), 2, p)
    return [report(sd, p, 2, v) for p, v in losses]


def test_the_member_completing_a_generation_decides_and_every_member_resumes(tmp_path):
    sd = sweep(tmp_path)
    got = generation_0(sd, [(0, 3.0), (1, 1.0), (2, 2.0), (3, 0.5)])
    assert got == ["wait", "wait", "wait", "promoted"]  # 3 is the best: unchanged, it goes on in place
    states = [sd.run(p).status() for p in range(4)]
    assert [s.state for s in states] == [Status.requeued] * 3 + [Status.running]
    assert all(s.stop["reason"] == "promoted" for s in states[:3])
    # 0 (the worst) copied 3's checkpoint, verified, as its latest; its lr: 3's times a factor
    m = sd.run(0)
    assert m.latest_checkpoint() == m.checkpoint_dir(2)
    assert (m.checkpoint_dir(2) / "model.pt").read_text() == "weights of 3 at 2"
    assert checkpoint_manifest.problems(m.checkpoint_dir(2)) == []
    (row,) = population.lineage(m)
    assert row["donor"] == 3 and row["donor_run"] == sd.run(3).run_id and row["step"] == 2
    assert row["checkpoint_sha256"] == population.manifest_sha256(sd.run(3).checkpoint_dir(2))
    assert row["before"] == {"optim.lr": 0.001}
    assert row["after"]["optim.lr"] == pytest.approx(0.004 * row["factors"]["optim.lr"])
    plain = population.apply(m, m.config())
    assert plain["optim"]["lr"] == row["after"]["optim.lr"]
    assert population.lineage(sd.run(1)) == [] and population.apply(sd.run(1), sd.run(1).config())["optim"]["lr"] \
        == 0.002
    summ = rungs.summary(sd)
    assert summ["scheduler"] == "pbt" and summ["generations"][0]["changes"][0]["member"] == 0
    assert any(line.startswith("member 0: gen 0: from 3@step 2, optim.lr 0.001->") for line in summ["lines"])


def test_a_decider_that_exploits_pauses_and_is_resumed(tmp_path):
    sd = sweep(tmp_path)
    got = generation_0(sd, [(0, 3.0), (1, 1.0), (2, 2.0), (3, 4.0)])
    assert got == ["wait"] * 4  # 3 (the worst) decided and copies 1: it starts again from the copy
    assert [sd.run(p).status().state for p in range(4)] == [Status.requeued] * 4
    assert population.lineage(sd.run(3))[0]["donor"] == 1


def test_a_member_that_fails_is_decided_without(tmp_path):
    sd = sweep(tmp_path)
    for p in range(3):
        fake_checkpoint(sd.run(p), 2, p)
    assert [report(sd, p, 2, v) for p, v in [(0, 3.0), (1, 1.0), (2, 2.0)]] == ["wait"] * 3
    sd.run(3).finish(Status.failed, seal=False, exit_code=1, error="boom")
    rungs.on_end(sd.run(3))
    assert [sd.run(p).status().state for p in range(4)] == [Status.requeued] * 3 + [Status.failed]
    (g,) = pbt.generations(sd.rung_rows()).values()
    assert g.ranking[-1] == 3 and all(c.member != 3 for c in g.changes)


def test_replay_follows_the_recorded_decisions(tmp_path):
    orig = sweep(tmp_path / "a")
    generation_0(orig, [(0, 3.0), (1, 1.0), (2, 2.0), (3, 0.5)])
    rec = pbt.generations(orig.rung_rows())[0]
    again = sweep(tmp_path / "b", replay=str(orig.path))
    # other values (a reproduction on other hardware): the decision is still the recorded one
    generation_0(again, [(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)])
    got = pbt.generations(again.rung_rows())[0]
    assert got.changes == rec.changes
    assert population.lineage(again.run(0))[0]["replayed_from"] == str(orig.path)
    assert population.values_now(again.run(0)) == population.values_now(orig.run(0))


def test_the_report_and_status_lines_show_lineages(tmp_path):
    from launcher import report as html_report
    from launcher.cli import sweep_cmds

    sd = sweep(tmp_path)
    generation_0(sd, [(0, 3.0), (1, 1.0), (2, 2.0), (3, 0.5)])
    summ = rungs.summary(sd)
    assert "member 0: gen 0: from 3@step 2" in str(html_report.rungs_section(summ))
    runs = [{"sweep_id": sd.path.name, "dir": str(sd.run(p).path)} for p in range(4)]
    lines = sweep_cmds.rung_summary(runs)["lines"]
    assert any(line.startswith("member 0: gen 0: from 3@step 2") for line in lines)
    assert Path(sd.path / "rungs.jsonl").is_file()
