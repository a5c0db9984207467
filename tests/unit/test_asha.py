"""sweep=asha's rule (launcher.features.asha.schedule, pure) and its refusals at launch, each naming the key."""
from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.features.asha import schedule as asha
from launcher.run.status import FINAL, RunStatus, Status
from launcher.submit.pipeline import InvalidSweep, Point, validate as check

RULE = asha.Rule(rungs=(5, 15, 45), reduction=3, mode="min", steps=45)


def reports(values):
    return {p: v for p, v in enumerate(values)}


def run_sweep(rule, values_at, n, failed_before=None):
    """Drive the rule as the sweep dir would: every alive point reports at each pause rung in turn.
    ``values_at(rung, point)``: the objective; ``failed_before``: rung -> points that end before it."""
    st = asha.State(points=tuple(range(n)))
    failed_before = failed_before or {}
    alive = list(range(n))
    per_rung = []
    for i, _ in enumerate(rule.pause_rungs):
        per_rung.append(len(alive))
        for p in alive:
            if p in failed_before.get(i, ()):
                st.ended.add(p)
                continue
            st.reports.setdefault(i, {})[p] = values_at(i, p)
            assert asha.decide_all(rule, st) == [] or p == alive[-1] or set(failed_before.get(i, ())) & set(alive)
        d = st.decisions[i]
        alive = list(d.promoted)
    per_rung.append(len(alive))
    return per_rung, alive, st


def test_16_points_three_rungs_reduction_3_give_16_5_1():
    per_rung, winner, st = run_sweep(RULE, lambda i, p: (p * 7) % 16 + i, 16)
    assert per_rung == [16, 5, 1]
    # the best at rung 0 are the points with the lowest (p * 7) % 16: 0, 7, 14, 5, 12
    assert st.decisions[0].promoted == tuple(sorted([0, 7, 14, 5, 12]))
    assert winner == [0]
    assert len(st.decisions[0].pruned) == 11 and len(st.decisions[1].pruned) == 4


def test_a_rung_waits_for_every_entrant_then_is_decided_once():
    st = asha.State(points=(0, 1, 2, 3))
    rule = asha.Rule(rungs=(2, 4), reduction=2, steps=6)
    for p, v in [(0, 3.0), (1, 1.0), (2, 2.0)]:
        st.reports.setdefault(0, {})[p] = v
        assert asha.decide_all(rule, st) == []
        assert asha.verdict(rule, st, p, 0) == "wait"
    st.reports[0][3] = 0.5
    (d,) = asha.decide_all(rule, st)
    assert d.promoted == (1, 3) and d.pruned == (0, 2)
    assert asha.verdict(rule, st, 3, 0) == "promoted" and asha.verdict(rule, st, 0, 0) == "pruned"
    assert asha.decide_all(rule, st) == []  # nothing new
    st.reports[0][0] = -100.0  # a late row changes nothing: decisions stand
    assert asha.decide(rule, st, 0).promoted == (1, 3)


def test_max_mode_ties_nan_and_a_failed_point():
    rule = asha.Rule(rungs=(1,), reduction=2, mode="max", steps=3)
    st = asha.State(points=(0, 1, 2, 3, 4, 5), reports={0: {0: 1.0, 1: 2.0, 2: 2.0, 3: math.nan, 4: 5.0}},
                    ended={5})
    (d,) = asha.decide_all(rule, st)
    assert d.promoted == (1, 2, 4)  # highest first; 1 and 2 tie, both in; NaN and the failed point worst
    assert d.pruned == (0, 3, 5)
    assert asha.ranked({0: 1.0, 1: 1.0, 2: 0.5}, "min") == [2, 0, 1]  # tie: lower point index first


def test_a_point_that_ends_before_its_rung_does_not_block_it_and_is_never_promoted():
    rule = asha.Rule(rungs=(2,), reduction=2, steps=4)
    st = asha.State(points=(0, 1), reports={0: {0: 9.0}})
    assert asha.decide_all(rule, st) == []
    st.ended.add(1)  # failed before step 2 (its value would have been the best: it is not there)
    (d,) = asha.decide_all(rule, st)
    assert d.promoted == (0,) and d.pruned == (1,)
    st = asha.State(points=(0, 1), ended={0, 1})  # every point failed: none promoted
    (d,) = asha.decide_all(rule, st)
    assert d.promoted == () and d.pruned == (0, 1)


def test_a_later_rung_is_decided_only_after_the_one_before():
    rule = asha.Rule(rungs=(1, 2), reduction=2, steps=3)
    st = asha.State(points=(0, 1), reports={1: {0: 1.0}})
    assert asha.decide_all(rule, st) == [] and asha.State.entrants(st, 1) == ()


def test_the_rung_at_train_steps_is_the_end_not_a_pause():
    assert RULE.pause_rungs == (5, 15)
    assert asha.Rule(rungs=(5, 15), reduction=3, steps=45).pause_rungs == (5, 15)
    assert asha.keep(16, 3) == 5 and asha.keep(5, 3) == 1 and asha.keep(2, 3) == 1 and asha.keep(0, 3) == 0


def test_asynchronous_promotes_early_and_prunes_once_complete():
    rule = asha.Rule(rungs=(2, 4), reduction=2, asynchronous=True, steps=6)
    st = asha.State(points=(0, 1, 2, 3))
    st.reports[0] = {0: 3.0}
    assert asha.verdict(rule, st, 0, 0) == "wait"
    st.reports[0][1] = 1.0  # 2 reports >= reduction: the best 1 goes on at once
    asha.decide_all(rule, st)
    assert asha.verdict(rule, st, 1, 0) == "promoted" and asha.verdict(rule, st, 0, 0) == "wait"
    st.reports[0].update({2: 5.0, 3: 0.5})
    asha.decide_all(rule, st)
    d = st.decisions[0]
    assert d.complete and d.promoted == (1, 3) and d.pruned == (0, 2)


def test_rule_of_a_config():
    cfg = {"sweep": {"scheduler": "asha", "rungs": [2, 4, 8], "reduction": 3, "mode": "max"}, "train": {"steps": 8}}
    rule = asha.Rule.of(cfg)
    assert rule == asha.Rule((2, 4, 8), 3, "max", False, 8) and rule.pause_rungs == (2, 4)
    assert asha.Rule.of({"sweep": {"scheduler": None}}) is None and asha.Rule.of({}) is None


def test_summary_counts_rungs_and_compute_against_the_grid():
    rows = [{"kind": "report", "point": p, "rung": 0, "step": 2, "value": float(p), "seconds": 2.0, "from_step": 0,
             "world": 1} for p in range(4)]
    rows.append({"kind": "decision", "rung": 0, "promoted": [0], "pruned": [1, 2, 3]})
    rows.append({"kind": "end", "point": 0, "step": 8, "seconds": 6.0, "from_step": 2, "world": 1})
    summ = asha.summary(rows, asha.Rule((2, 8), 4, steps=8), [0, 1, 2, 3])
    assert [r["reported"] for r in summ["rungs"]] == [4, 0]
    assert summ["rungs"][0]["promoted"] == [0] and summ["rungs"][0]["best_point"] == 0
    assert summ["spent_s"] == 14.0 and summ["grid_s"] == 32.0  # 4 points x 1 s/step x 8 steps
    assert "compute" in asha.describe(summ)[-1]
    # each start's cost (process start to the first step) is spent again at every resume; the grid
    # starts each point once
    rows = [{**r, "startup_s": 10.0} if r["kind"] in ("report", "end") else r for r in rows]
    summ = asha.summary(rows, asha.Rule((2, 8), 4, steps=8), [0, 1, 2, 3])
    assert summ["spent_s"] == 14.0 + 50.0 and summ["grid_s"] == 32.0 + 40.0 and summ["starts"] == 5


def test_paused_is_not_final_pruned_is():
    assert Status.paused.value not in FINAL and Status.pruned.value in FINAL
    assert RunStatus(state=Status.pruned).is_final and not RunStatus(state=Status.paused).is_final


def test_problems_pure():
    keys = lambda sweep, steps: [k for k, _, _ in asha.problems(sweep, steps)]  # noqa: E731
    assert keys({"rungs": [5, 15, 45], "reduction": 3}, 45) == []
    assert keys({"rungs": [15, 5], "reduction": 3}, 45) == ["sweep.rungs"]
    assert keys({"rungs": [5, 50], "reduction": 3}, 45) == ["sweep.rungs"]
    assert keys({"rungs": [5], "reduction": 1}, 45) == ["sweep.reduction"]
    assert keys({"rungs": [], "reduction": 3}, 45) == ["sweep.rungs"]
    assert asha.objective_problem("loss", ("loss", "time_*_s")) is None
    assert asha.objective_problem("time_data_s", ("loss", "time_*_s")) is None
    assert "los" in asha.objective_problem("los", ("loss",))
    assert asha.objective_problem("anything", ()) is None  # undeclared: not checked


def compose_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(list(overrides)))


BASE = ["model=gpt_tiny", "train.steps=8", "sweep=asha"]


@pytest.mark.parametrize("overrides,key,words", [
    (["sweep.rungs=[2,4,16]"], "sweep.rungs", "beyond train.steps=8"),
    (["sweep.rungs=[4,2,8]"], "sweep.rungs", "not increasing"),
    (["sweep.rungs=[2,2,8]"], "sweep.rungs", "not increasing"),
    (["sweep.rungs=[2,4,8]", "sweep.reduction=1"], "sweep.reduction", ">= 2"),
    (["sweep.rungs=[2,4,8]", "sweep.objective=los"], "sweep.objective", "no key of the recipe's metrics"),
])
def test_bad_schedules_are_refused_at_launch_naming_the_key(overrides, key, words):
    with pytest.raises(InvalidSweep) as ei:
        check([Point(compose_cfg([*BASE, *overrides]), [*BASE, *overrides])])
    text = str(ei.value)
    assert "nothing was submitted" in text and key in text and words in text, text


def test_a_script_recipe_is_refused_naming_the_scheduler():
    over = ["recipe=script", "recipe.module=json.tool", "train.steps=8", "sweep=asha", "sweep.rungs=[2,4]"]
    with pytest.raises(InvalidSweep) as ei:
        check([Point(compose_cfg(over), over)])
    assert "sweep.scheduler" in str(ei.value) and "cannot pause" in str(ei.value), str(ei.value)


def test_a_good_schedule_passes_and_no_option_is_todays_behaviour():
    assert len(check([Point(compose_cfg([*BASE, "sweep.rungs=[2,4,8]"]), BASE)])) == 1
    cfg = compose_cfg(["model=gpt_tiny"])
    assert cfg.sweep.scheduler is None and asha.Rule.of(cfg) is None
    cfg = compose_cfg(BASE)
    assert asha.Rule.of(cfg).rungs == (5, 15, 45)  # the option's defaults (refused here: beyond train.steps)


def test_the_report_shows_the_rungs_and_the_compute():
    from launcher import report

    rows = [{"kind": "report", "point": p, "rung": 0, "step": 2, "value": 3.0 - p, "seconds": 1.0, "startup_s": 4.0,
             "from_step": 0, "world": 1} for p in range(3)]
    rows.append({"kind": "decision", "rung": 0, "promoted": [2], "pruned": [0, 1]})
    html = report.rungs_section(asha.summary(rows, asha.Rule((2, 4), 3, steps=4), [0, 1, 2]))
    assert "Successive halving" in html and "compute spent" in html and "2: 1" in html
