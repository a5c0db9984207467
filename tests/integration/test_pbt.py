"""sweep=pbt on real jobs: 4 members of the GPT (model=gpt_tiny) over 3 generations (train.steps=6,
interval 2), the bottom quarter copying the top quarter's checkpoint with a perturbed optim.lr at each
boundary; every exploit is in the member's lineage, the copied member trains on with its new lr, and
`launcher reproduce` of the best member replays the whole population (the recorded decisions) and ends
with every step's loss and every checkpoint tensor bitwise equal to the original. On the local Slurm
cluster the same over one boundary (train.steps=4): members paused and released by Slurm."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List

import pytest
from test_fault_tolerance import QUICK, assert_identical

from helpers import BIN, launch, read_metrics, run_cmd, wait_final

BASE = ["model=gpt_tiny", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.steps=6",
        "train.global_batch_size=4", "train.micro_batch_size=2", "optim.warmup_steps=0", *QUICK]
PBT = ["optim.lr=1e-4,1e-3,3e-3,1e-2", "sweep=pbt", "sweep.interval=2", "sweep.quantile=0.25",
       "sweep.explore=[optim.lr]"]


def status_json(root: Path, sweep: str, env=None) -> Dict:
    res = run_cmd([str(BIN / "launcher"), "status", sweep, "--json", "--root", str(root)], root, timeout=120,
                  extra_env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def check_population(root: Path, runs: List[dict], env=None, boundaries=(2, 4)) -> dict:
    """Lineages recorded and acted on at each of ``boundaries`` (steps); returns the best member's run row."""
    from launcher.features.pbt import population
    from launcher.run.rundir import RunDir

    assert {r["status"] for r in runs} == {"completed"}, [r["status"] for r in runs]
    by = {int(Path(r["dir"]).name): r for r in runs}
    summ = status_json(root, runs[0]["sweep_id"], env)["rungs"]
    print("\n".join(summ["lines"]))
    gens = summ["generations"]
    assert [g["step"] for g in gens] == list(boundaries) and all(len(g["changes"]) == 1 for g in gens)
    metrics = {p: read_metrics(r["dir"]) for p, r in by.items()}
    for g in gens:
        (c,) = g["changes"]
        m, donor, step = c["member"], c["donor"], g["step"]
        # the ranking is the members' own losses at the boundary, the bottom copies from the top
        loss = {int(p): v for p, v in g["values"].items()}  # each member's report at the boundary
        assert [int(p) for p in g["ranking"]] == sorted(loss, key=lambda p: (loss[p], p)), g
        assert int(g["ranking"][-1]) == m and int(g["ranking"][0]) == donor, (g, loss)
        row = next(r for r in population.lineage(RunDir(by[m]["dir"])) if r["generation"] == g["generation"])
        assert (row["donor"], row["step"]) == (donor, step)
        assert row["after"]["optim.lr"] == pytest.approx(c["after"]["optim.lr"])
    # the first exploiter's metrics: the donor's rows up to the boundary (its checkpoint's), then its own
    # steps at its new lr (the schedule is lr x f(step): the ratio to another member's lr at that step)
    c0 = gens[0]["changes"][0]
    m, donor = c0["member"], c0["donor"]
    assert [x["loss"] for x in metrics[m][:2]] == [x["loss"] for x in metrics[donor][:2]]
    if not any(g["changes"][0]["member"] == m and g["generation"] == 1 for g in gens):
        other = next(p for p in by if p not in (m,) and all(c["member"] != p for g in gens for c in g["changes"]))
        lr_other = RunDir(by[other]["dir"]).config()["optim"]["lr"]
        got = next(x["lr"] for x in metrics[m] if x["step"] == 3) / c0["after"]["optim.lr"]
        want = next(x["lr"] for x in metrics[other] if x["step"] == 3) / lr_other
        assert got == pytest.approx(want, rel=1e-9)
    assert any(line.startswith(f"member {m}: gen 0: from {donor}@step 2, optim.lr") for line in summ["lines"])
    final = {int(p): v for p, v in summ["final"].items()}
    best = min(final, key=lambda p: (final[p], p))
    return by[best]


def reproduce_and_compare(root: Path, best: dict, env=None, timeout: float = 900) -> None:
    res = run_cmd([str(BIN / "launcher"), "reproduce", best["run_id"], "--root", str(root)], root, timeout=timeout,
                  extra_env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    print(res.stdout[-1500:])
    runs = wait_final(root, 8, timeout=timeout)
    again = [r for r in runs if r["sweep_id"] != best["sweep_id"] and Path(r["dir"]).name == Path(best["dir"]).name]
    (rep,) = again
    assert_identical(Path(rep["dir"]), Path(best["dir"]))  # every step's loss, weights, optimizer, RNG
    from launcher.features.pbt import population
    from launcher.run.rundir import RunDir

    # the same lineage: the same donors at the same steps with the same values
    strip = lambda rows: [{k: r[k] for k in ("generation", "step", "donor", "after")} for r in rows]  # noqa: E731
    assert strip(population.lineage(RunDir(rep["dir"]))) == strip(population.lineage(RunDir(best["dir"])))


@pytest.mark.timeout(1500)
def test_pbt_4_members_3_generations_on_local_and_reproduce(tmp_path):
    root = tmp_path / "runs"
    res = launch(["-m", *BASE, "cluster=local", *PBT], root, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(root, 4, timeout=120)
    best = check_population(root, runs)
    reproduce_and_compare(root, best)


@pytest.mark.slurm
@pytest.mark.timeout(1800)
def test_pbt_on_slurm(slurm, tmp_path):
    # the same decisions as on cluster=local, paused members held and released by Slurm, over one
    # boundary (the local test's second one adds nothing Slurm does); the lineage's bitwise replay: the
    # local test (launcher reproduce on Slurm: test_archive.py)
    root = tmp_path / "runs"
    res = launch(["-m", *BASE, "train.steps=4", "cluster=local_slurm", *PBT, "cluster.array_parallelism=4"], root,
                 extra_env=slurm, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = wait_final(root, 4, timeout=1200)
    check_population(root, runs, slurm, boundaries=(2,))
