"""recipe=commbench end to end: real launches, real gloo collectives, rows checked against the
nccl-tests bus-bandwidth factors (recipes/commbench, docs/commbench.md)."""
import base64
import json
import os
import re
from pathlib import Path

import pytest

from helpers import BIN, REPO, launch, read_metrics, run_cmd, runs_json, wait_final

pytestmark = [pytest.mark.timeout(300), pytest.mark.dist]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "sendrecv")
SIZES = [1024 << i for i in range(9)]  # 1 KiB .. 256 KiB
# small and quick: a few iterations per size, no wandb
SMALL = ["recipe=commbench", "recipe.params.min_bytes=1024",
         "recipe.params.max_bytes=262144", "recipe.params.warmup_iters=2",
         "recipe.params.iters=5", "recipe.params.dtype=fp32"]
FACTORS = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "sendrecv": 1.0}  # n = 2


def _check_rows(rdir: Path, scope: str) -> dict:
    bench = json.loads((rdir / "commbench.json").read_text())
    assert bench["world_size"] == 2 and bench["backend"] == "gloo" and bench["hosts"]
    done = {r["op"] for r in bench["rows"]}
    # a backend without an op must say why; this torch's gloo has all four
    assert done | {s["op"] for s in bench["skipped"]} == set(OPS) and all(s["reason"] for s in bench["skipped"])
    assert done == set(OPS), bench["skipped"]
    for op in OPS:
        assert [r["bytes"] for r in bench["rows"] if r["op"] == op] == SIZES, op
    for r in bench["rows"]:
        assert r["time_us"] > 0 and r["algbw_gbs"] > 0, r
        assert r["algbw_gbs"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9, rel=1e-9), r
        assert r["busbw_gbs"] / r["algbw_gbs"] == pytest.approx(FACTORS[r["op"]], rel=1e-12), r
        assert r["scope"] == scope, r
    # one metrics row per (op, size), the same numbers
    metrics = read_metrics(rdir)
    assert [(m["op"], m["bytes"]) for m in metrics] == [(r["op"], r["bytes"]) for r in bench["rows"]]
    assert [m["step"] for m in metrics] == list(range(1, len(SIZES) * len(OPS) + 1))
    return bench


def _report_plots(run: dict, runs_root: Path, docs_name: str) -> None:
    """`launcher report RUN` of a commbench run draws bus bandwidth and time against message size
    (LAUNCHER_DOCS_SCREENSHOTS=1: the bandwidth plot goes to docs/<docs_name>)."""
    res = run_cmd([str(BIN / "launcher"), "report", run["run_id"], "--root", str(runs_root)], runs_root, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = Path(res.stdout.strip().splitlines()[-1]).read_text()
    imgs = {alt: data for data, alt in re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)">',
                                                   text)}
    assert set(imgs) == {"bus bandwidth vs message size", "time per operation vs message size"}, list(imgs)
    assert "<h2>Communication</h2>" in text and "peak bus bandwidth per operation" in text
    if os.environ.get("LAUNCHER_DOCS_SCREENSHOTS"):
        (REPO / "docs" / docs_name).write_bytes(base64.b64decode(imgs["bus bandwidth vs message size"]))


def test_commbench_two_local_ranks(runs_root):
    res = launch([*SMALL, "cluster=local", "cluster.gpus_per_node=2"], runs_root, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(runs_root)
    assert run["status"] == "completed" and run["exit_code"] == 0, run
    rdir = Path(run["dir"])
    _check_rows(rdir, "intra")
    summary = json.loads((rdir / "status.json").read_text())["summary"]
    assert summary["world_size"] == 2 and summary["rows"] == len(SIZES) * len(OPS)
    assert all(summary[f"{op}_peak_busbw_gbs"] > 0 for op in OPS)
    _report_plots(run, runs_root, "commbench-intra.png")


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_commbench_two_slurm_nodes_is_inter_node(slurm, runs_root):
    res = launch([*SMALL, "cluster=local_slurm", "cluster.nodes=2", "cluster.gpus_per_node=1"], runs_root,
                 extra_env=slurm)
    assert res.returncode == 0, res.stdout + res.stderr
    (run,) = wait_final(runs_root, 1, timeout=300)
    assert run["status"] == "completed", run
    bench = _check_rows(Path(run["dir"]), "inter")
    assert len(set(bench["nodes"])) == 2  # one rank per Slurm node
    _report_plots(run, runs_root, "commbench-inter.png")
