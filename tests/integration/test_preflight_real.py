"""`launcher preflight` on the 2-node local Slurm cluster: a good config climbs every rung (queued at
once as dependent jobs); a config broken on purpose for one rung stops there, with that rung's
diagnosis, and the rungs above it never run. The broken ladders start at their rung (`--from`: the
rungs below it are the good ladder's, climbed once above), the way a user climbs again after a fix.
The config broken for the last rung (tuned) is judged
on the good ladder's runs wherever its rungs compose to the same config (smoke, node, full), with
its own comm and tuned runs made beside the good ladder (no second climb)."""
import json
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import BIN, explain, launch, run_cmd, wait_final

pytestmark = [pytest.mark.timeout(900), pytest.mark.slurm, pytest.mark.dist]

# tp=2 x pp=2 over 2 nodes of 2 processes: every rung has something to do
GOOD = ["model=gpt_tiny", "precision=fp32", "parallelism=3d", "cluster=local_slurm", "cluster.nodes=2",
        "cluster.gpus_per_node=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.log_interval=0",
        "seed=5"]
STEPS = "6"


def preflight(extra, runs_root, slurm, start=None):
    begin = ["--from", start] if start else []
    res = run_cmd([str(BIN / "launcher"), "preflight", *GOOD, *extra, "--steps", STEPS, *begin], runs_root, timeout=840,
                  extra_env={**slurm, "COLUMNS": "250"})
    (record,) = [json.loads(p.read_text()) for p in (runs_root / "preflight").glob("*.json")]
    return res, record


def rows(stdout):
    """{rung: verdict} from the printed table."""
    out = {}
    for line in stdout.splitlines():
        m = re.match(r"^[│|]\s*(smoke|node|comm|full|tuned|resume)\s*[│|]", line)
        if m:
            cells = [c.strip() for c in re.split(r"[│|]", line)[1:-1]]
            out[m.group(1)] = cells[7]
    return out


# fp16 with a loss scale that overflows every step: broken for the tuned rung alone (the training rungs
# below it run fp32)
TUNED_BROKEN = ["precision=fp16", "precision.loss_scale=1e30"]


def _but_the_loss_scale(point) -> dict:
    """A rung's composed config without precision.loss_scale (an fp32 run never reads it)."""
    cfg = OmegaConf.to_container(point.cfg, resolve=True)
    cfg["precision"].pop("loss_scale")
    return cfg


def test_a_good_config_climbs_every_rung_as_dependent_jobs(slurm, runs_root):
    from launcher.features.preflight.climb import prepare, rung_lines

    # the config broken for the tuned rung (TUNED_BROKEN) climbs on top of this ladder: a rung of its
    # ladder that composes to the same config as the good one's (but for precision.loss_scale) is the
    # good ladder's run; the others (the comm rung benchmarks in the config's fp16, the tuned rung
    # trains in it) are run here, beside the good ladder
    broken_cfg = [*GOOD, *TUNED_BROKEN]
    good, broken = prepare(GOOD, int(STEPS)), prepare(broken_cfg, int(STEPS))
    assert [r.name for r in good.rungs] == [r.name for r in broken.rungs] == ["smoke", "node", "comm", "full", "tuned",
                                                                              "resume"]
    assert not any(r.skip for r in (*good.rungs, *broken.rungs))
    same = [g.name for g, b in zip(good.rungs, broken.rungs) if g.overrides == b.overrides
            and _but_the_loss_scale(good.points[g.name]) == _but_the_loss_scale(broken.points[b.name])]
    assert same == ["smoke", "node", "full", "resume"], same
    own_roots = {}
    for rung in broken.rungs:
        if rung.name not in same:
            own_roots[rung.name] = runs_root.parent / f"fp16-{rung.name}"
            queued = launch(rung_lines(broken_cfg, rung), own_roots[rung.name], timeout=300, extra_env=slurm)
            assert queued.returncode == 0, queued.stdout[-3000:] + queued.stderr[-3000:]

    res, record = preflight([], runs_root, slurm)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert rows(res.stdout) == {r: "go" for r in ("smoke", "node", "comm", "full", "tuned", "resume")}, res.stdout
    assert "go: every rung passed" in res.stdout
    rungs = record["rungs"]
    jobs = [r["job_id"] for r in rungs]
    # each rung after the first waited in the queue for the one before it
    for prev, r in zip(rungs, rungs[1:]):
        sbatch = (Path(r["run_dir"]) / "sbatch.sh").read_text()
        assert f"--dependency=afterok:{prev['job_id']}" in sbatch, (r["name"], sbatch)
    assert len(set(jobs)) == 6
    # the resume rung: stopped halfway by the stop path, requeued, resumed, bitwise against the full rung
    # (the ladder's comparison, launcher.features.verify_resume's, is kept in the record for --show)
    named = {r["name"]: r for r in rungs}
    kept = named["resume"]["compared"]
    assert kept["full"] == named["full"]["run_dir"], kept
    assert kept["verdict"]["kind"] == "bitwise" and kept["verdict"]["stopped_at"] == [3], kept
    run = {r["name"]: json.loads((Path(r["run_dir"]) / "status.json").read_text()) for r in rungs}
    assert run["smoke"]["world_size"] == 1 and run["node"]["world_size"] == 2
    assert run["comm"]["world_size"] == 4 and run["full"]["world_size"] == 4
    bench = json.loads((Path(rungs[2]["run_dir"]) / "commbench.json").read_text())
    assert len(bench["hosts"]) == 2 and any(r["scope"] == "inter" for r in bench["rows"])
    tuned = json.loads(Path(rungs[4]["run_dir"], "run.json").read_text())
    assert tuned["preflight"] == {"id": record["id"], "rung": "tuned"}
    # --show judges the recorded ladder again from its runs
    again = run_cmd([str(BIN / "launcher"), "preflight", "--show", record["id"], "--root", str(runs_root)],
                    runs_root, timeout=120, extra_env={**slurm, "COLUMNS": "250"})
    assert again.returncode == 0 and rows(again.stdout) == rows(res.stdout), again.stdout + again.stderr

    # the broken config's ladder, the good one's runs where they compose the same and its own elsewhere,
    # judged by `launcher preflight --show`: no-go at tuned with the overflow's diagnosis
    entries = []
    for entry, rung in zip(rungs, broken.rungs):
        if rung.name in own_roots:
            (own,) = wait_final(own_roots[rung.name], 1, timeout=300)
            # the tuned run trains every step: its no-go is the judge's
            assert own["status"] == "completed", explain(own)
            entry = {**entry, "title": rung.title, "overrides": list(rung.overrides), "notes": list(rung.notes),
                     "run_id": own["run_id"], "run_dir": own["dir"], "job_id": own["job_id"]}
        entries.append(entry)
    fp16 = {**record, "id": record["id"] + "-fp16", "overrides": broken_cfg, "rungs": entries}
    (runs_root / "preflight" / f"{fp16['id']}.json").write_text(json.dumps(fp16))
    res = run_cmd([str(BIN / "launcher"), "preflight", "--show", fp16["id"], "--root", str(runs_root)], runs_root,
                  timeout=120, extra_env={**slurm, "COLUMNS": "250"})
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-2000:]
    # (its resume rung is the good ladder's run: the same config)
    assert rows(res.stdout) == {"smoke": "go", "node": "go", "comm": "go", "full": "go", "tuned": "no-go",
                                "resume": "go"}, res.stdout
    assert "no-go at rung tuned" in res.stdout and "non-finite gradient norm" in res.stdout, res.stdout


BROKEN = [
    # a model that runs out of memory in its first step: the smoke rung, out of memory in the step
    ("smoke", ["train.fail_at_step=2", "train.fail_rank=0", "train.fail_mode=oom"], "doctor: oom_step"),
    # a failure only a second process meets (rank 1): the node rung
    ("node", ["train.fail_at_step=2", "train.fail_rank=1", "train.fail_mode=exception"], "doctor: exception"),
    # a cluster config that promises an interconnect the nodes do not have: the comm rung
    ("comm", ["cluster.inter_node_bandwidth=10000"], "cluster.inter_node_bandwidth=10000"),
    # a hang after the short rungs' last step: the full rung, found by the hang watchdog (armed by a rank's
    # first step, so the start-up does not count: 6 s is 30 of gpt_tiny's steps)
    ("full", ["train.fail_at_step=5", "train.fail_mode=sleep", "train.hang_timeout_s=6"], "doctor: hang"),
    # the tuned rung (TUNED_BROKEN): judged in test_a_good_config_climbs_every_rung_as_dependent_jobs, on the
    # good ladder's runs where its rungs compose the same
]


@pytest.mark.parametrize("rung,extra,why", BROKEN, ids=[b[0] for b in BROKEN])
def test_a_config_broken_for_one_rung_stops_there_with_its_diagnosis(rung, extra, why, slurm, runs_root):
    res, record = preflight(extra, runs_root, slurm, start=rung)
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-2000:]
    order = ["smoke", "node", "comm", "full", "tuned", "resume"]
    at = order.index(rung)
    verdicts = rows(res.stdout)
    # below --from: not climbed, no run
    assert [verdicts[r] for r in order[:at]] == ["skipped"] * at, res.stdout
    assert not any(r["run_dir"] for r in record["rungs"][:at]) and record["from"] == rung, record
    assert verdicts[rung] == "no-go", res.stdout
    assert all(verdicts[r] == "not run" for r in order[at + 1:]), res.stdout
    assert f"no-go at rung {rung}" in res.stdout and why in res.stdout, res.stdout
    # the rungs above never trained: cancelled in the queue, no step recorded
    for r in record["rungs"][at + 1:]:
        status = json.loads((Path(r["run_dir"]) / "status.json").read_text())
        assert status["status"] == "cancelled" and status["error"].startswith("not run"), status
        metrics = Path(r["run_dir"]) / "metrics.jsonl"
        assert not metrics.exists() or not metrics.read_text()
