"""`launcher report`: pages built from small synthetic run dirs written through RunDir's writers (no
training). Each page must parse with balanced tags, embed one PNG per expected plot, reference
nothing outside itself, and escape what the archive holds."""
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from launcher import report
from launcher.cli.main import main
from launcher.run.job_record import JobRecord
from launcher.run.rundir import RunDir, SweepDir
from launcher.run.status import Status
from recipes.commbench.contract import RESULTS

EVIL = "<script>alert(1)</script>"
VOID = {"meta", "img", "br", "hr", "link", "input", "col", "area", "base", "source", "wbr"}


class Page(HTMLParser):
    """The tags of a page: fails on an end tag that closes something else; collects src/href/id."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.stack, self.imgs, self.refs, self.ids, self.text = [], [], [], set(), []
        self.scripts = 0
        self.feed(text)
        self.close()

    def handle_starttag(self, name, attrs):
        a = dict(attrs)
        if name not in VOID:
            self.stack.append(name)
        if name == "img":
            self.imgs.append(a.get("src") or "")
        if name == "script":
            self.scripts += 1
        self.refs += [v or "" for k, v in attrs if k in ("src", "href")]
        if "id" in a:
            self.ids.add(a["id"])

    def handle_startendtag(self, name, attrs):
        self.handle_starttag(name, attrs)
        if name not in VOID:
            self.stack.pop()

    def handle_endtag(self, name):
        assert self.stack and self.stack[-1] == name, f"</{name}> closes {self.stack[-1:]}"
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def parse(text: str) -> Page:
    assert text.startswith("<!DOCTYPE html>")
    p = Page(text)
    assert p.stack == [], f"unclosed tags: {p.stack}"
    assert p.scripts == 0  # the escaped config value must not become a script
    # every resource is inside the page: plots are data: URIs, links are anchors of the page
    for ref in p.refs:
        assert ref.startswith("data:image/png;base64,") or ref.startswith("#"), ref
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", text)
    assert "@import" not in text and "url(" not in text
    for src in p.imgs:
        assert re.fullmatch(r"data:image/png;base64,[A-Za-z0-9+/]+=*", src)
    return p


LAYOUT = {"dp": 2, "tp": 2, "pp": 1, "zero": 0, "micro_batch_size": 2, "grad_accum": 2, "engine": "megatron",
          "procs_per_node": 2, "world_size": 4, "nodes": 2, "global_batch_size": 8, "sequence_parallel": False,
          "offload_optimizer": False, "offload_params": False}
PLAN = {"model": {"name": "gpt_tiny", "tokens_per_step": 1000},
        "layouts": [{"dp": 2, "tp": 2, "pp": 1, "zero": 0, "step_time_s": 0.5, "tflops_per_gpu": 2.0, "mfu": 0.1,
                     "memory_bytes": {"params": 1000, "grads": 1000, "optimizer": 2000, "activations": 500,
                                      "buffers": 0, "total": 4500}}]}


def make_run(sweep: SweepDir, index: int, *, steps=6, seed=1, metrics=True, status="completed", error=None,
             lr="1e-3", hydra_app=False) -> RunDir:
    rd = sweep.run(index)
    rd.path.mkdir(parents=True)
    cfg = {"name": "gpt_tiny", "seed": seed, "train": {"steps": steps}, "submit": {"objective": "final_loss"},
           "note": EVIL}
    rd.write_config(cfg)
    rd.write_overrides([f"seed={seed}", f"optim.lr={lr}"], {"model": "gpt_tiny"})
    rd.write_seeds({"seed": seed, "init": {"value": seed, "how": "the seed"}})
    rd.write_job(JobRecord(backend="local", job_id=f"{100 + index}"))
    rd.write_software({"python": "3.11", "torch": "2.x"}, "torch==2\n")
    if hydra_app:
        rd.write_run({"run_id": sweep.run_id(index), "sweep_id": sweep.sweep_id, "index": index, "seed": seed,
                      "backend": "local", "kind": "hydra_app", "app": {"task_function": "my_app.main",
                                                                       "config_name": "config"},
                      "hydra": {"job_num": index, "sweep_dir": "multirun/x"}})
        rd.finish(Status(status), exit_code=0, summary={"return_value": 0.25 + index})
        return rd
    rd.write_plan(PLAN)
    rd.write_run({"run_id": sweep.run_id(index), "sweep_id": sweep.sweep_id, "index": index, "seed": seed,
                  "backend": "local", "layout": LAYOUT, "tags": []})
    for r in range(4):
        rd.write_rank(r, {"rank": r, "hostname": f"host{r // 2}", "slurmd_nodename": f"node{r // 2}",
                          "node_rank": r // 2})
        rd.write_state(r, {"rank": r, "pp_stage": 0, "dp_rank": r // 2, "params": 1000, "grads": 1000,
                           "optimizer": 2200 if r == 3 else 2000})
    rd.write_mesh(0, {"rank": 0, "dp": 0, "pp": 0, "tp": 0})
    for n in range(2):
        rd.write_topology(f"node{n}", n, {"host": {"hostname": f"host{n}", "slurmd_nodename": f"node{n}"},
                                         "cpu": {"model": "Test CPU", "cores": 4},
                                         "memory": {"memtotal_bytes": 8 * 2**30}, "gpus": {"count": 0}})
    rd.write_environment({"NCCL_DEBUG": "WARN"}, {"torch": "2.x+cpu", "cuda": None})
    rows = []
    if metrics:
        # steady step time 1.0 s after two warm-up steps: measured vs planned 0.5 s is +100%
        rows = [{"step": s, "loss": 6.0 - 0.1 * s - 0.01 * seed, "lr": 1e-3, "grad_norm": 0.5,
                 "tokens_per_s": 1000.0 if s > 2 else 300.0, "step_time_s": 1.0 if s > 2 else 3.0,
                 "tflops": 1.0, "mfu": 0.05} for s in range(1, steps + 1)]
        rd.rewrite_metrics(rows)
    summary = {"final_loss": rows[-1]["loss"], "first_loss": rows[0]["loss"], "steps": steps,
               "mean_tokens_per_s": 1000.0} if rows else {}
    rd.finish(Status(status), exit_code=0 if status == "completed" else 1, error=error, summary=summary)
    return rd


@pytest.fixture
def sweep(tmp_path):
    return SweepDir(tmp_path / "runs" / "20260101-000000-abcd")


def test_run_page_plots_plan_layout_and_escaping(sweep):
    rd = make_run(sweep, 0, error=f"RuntimeError: {EVIL}", status="failed")
    text = report.run_report(rd.path)
    page = parse(text)
    assert len(page.imgs) == 6  # loss, lr, grad_norm, tokens/s, MFU, step time
    for title in ("loss", "learning rate", "gradient norm", "tokens/s", "MFU", "step time (s)"):
        assert f'alt="{title}"' in text
    assert EVIL not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text  # config and error
    body = "".join(page.text)
    assert sweep.run_id(0) in body and "failed" in body and str(rd.path) in body
    # planner vs measured, with the relative error where both exist
    assert re.search(r"step time \(s\)</td><td[^>]*>0\.5</td><td[^>]*>1</td><td>\+100\.0%</td>", text)
    assert re.search(r"throughput \(tokens/s\)</td><td[^>]*>2,000</td><td[^>]*>1,000</td><td>-50\.0%</td>", text)
    assert re.search(r"optimizer bytes per rank \(largest\)</td><td>0\.00 MiB</td><td>0\.00 MiB</td><td>\+10\.0%</td>",
                     text)
    assert re.search(r"MFU</td><td[^>]*>0\.1</td><td[^>]*>0\.05</td><td>-50\.0%</td>", text)
    assert "peak GPU memory per rank (rank 0)</td><td>0.00 MiB</td><td>not recorded</td><td></td>" in text
    # the rank grid: rank, dp, pp, tp, node, host (and the megatron record where present)
    cells = re.findall(r"<tr><td class=\"num\">(\d)</td><td class=\"num\">(\d)</td><td class=\"num\">(\d)</td>"
                       r"<td class=\"num\">(\d)</td><td class=\"num\">(\d)</td><td>(node\d)</td><td>(\w*)</td></tr>",
                       text)
    assert cells == [("0", "0", "0", "0", "0", "node0", "agrees"), ("1", "0", "0", "1", "0", "node0", ""),
                     ("2", "1", "0", "0", "1", "node1", ""), ("3", "1", "0", "1", "1", "node1", "")]
    assert text.count('class="grid"') == 2  # one block per dp replica
    for heading in ("Topology", "Software", "Seeds", "Config"):
        assert f"<h2>{heading}</h2>" in text
    assert "Test CPU" in text
    assert re.search(r"<details><summary>resolved config \(config\.yaml\)</summary><pre>", text)


def test_a_run_without_metrics_still_gets_a_page(sweep):
    rd = make_run(sweep, 0, metrics=False)
    text = report.run_report(rd.path)
    page = parse(text)
    assert page.imgs == []
    assert "No per-step metrics" in text
    assert "step time (s)</td><td" in text and "not recorded" in text  # the plan is still shown


def test_a_hydra_apps_run_shows_what_it_returned(sweep):
    rd = make_run(sweep, 0, hydra_app=True)
    text = report.run_report(rd.path)
    page = parse(text)
    assert page.imgs == [] and "<h2>Metrics</h2>" not in text and "<h2>Layout</h2>" not in text
    assert re.search(r"returned</th><td[^>]*>0\.25</td>", text) and "my_app.main" in text


def test_a_commbench_run_draws_bandwidth_against_message_size(sweep):
    """recipes/commbench's commbench.json: bus bandwidth and time per op against size, peaks per op."""
    import json

    rd = make_run(sweep, 0, metrics=False)
    rd.write_config({**rd.config(), "recipe": {"_target_": "recipes.commbench.bench.main"}})  # its contract's section
    rows = [{"op": op, "bytes": b, "time_us": t, "algbw_gbs": b / t / 1e3, "busbw_gbs": f * b / t / 1e3,
             "scope": "inter"}
            for op, f in (("all_reduce", 1.0), ("all_gather", 0.5)) for b, t in ((1024, 10.0), (4096, 20.0))]
    (rd.path / RESULTS).write_text(json.dumps({"world_size": 2, "nodes": ["node1", "node2"],
                                                        "backend": "gloo", "rows": rows, "skipped": []}))
    text = report.run_report(rd.path)
    page = parse(text)
    assert len(page.imgs) == 2 and all(src.startswith("data:image/png;base64,") for src in page.imgs)
    assert re.findall(r'alt="([^"]*)"', text) == ["bus bandwidth vs message size", "time per operation vs message size"]
    assert "<h2>Communication</h2>" in text and "<h2>Metrics</h2>" not in text
    # peaks: all_reduce 4096 B in 20 us = 0.2048 GB/s; all_gather half of that on 2 ranks
    assert re.search(r"<td>all_reduce</td><td>inter</td><td[^>]*>4096</td><td[^>]*>0\.2048</td>", text), text
    assert re.search(r"<td>all_gather</td><td>inter</td><td[^>]*>4096</td><td[^>]*>0\.1024</td>", text)


def test_report_command_writes_beside_the_sealed_run(sweep, capsys):
    rd = make_run(sweep, 0)
    make_run(sweep, 1, seed=2)
    assert main(["report", sweep.run_id(0), "--root", str(sweep.path.parent)]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out == sweep.path / "report-0.html" and out.is_file()
    parse(out.read_text())
    assert rd.verify() == []  # the sealed run dir holds nothing new
    dest = sweep.path.parent.parent / "r.html"
    assert main(["report", str(rd.path), "-o", str(dest)]) == 0
    assert capsys.readouterr().out.strip() == str(dest) and sweep.run_id(0) in dest.read_text()


def test_sweep_page_lists_every_point_with_plots(sweep, capsys):
    make_run(sweep, 0, seed=1, lr="1e-3")
    make_run(sweep, 1, seed=2, lr="3e-3")
    make_run(sweep, 2, seed=3, lr="1e-2", status="failed", error=f"boom {EVIL}")
    assert main(["report", sweep.sweep_id, "--root", str(sweep.path.parent)]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out == sweep.path / "report.html"
    text = out.read_text()
    page = parse(text)
    assert len(page.imgs) == 3  # loss curves of every point, objective vs seed, objective vs optim.lr
    assert 'alt="loss per step, every point"' in text and 'alt="final_loss vs seed"' in text
    assert 'alt="final_loss vs optim.lr"' in text
    assert EVIL not in text and "boom &lt;script&gt;" in text
    for i in range(3):
        rid = sweep.run_id(i)
        assert f'href="#{report.anchor(rid)}"' in text and report.anchor(rid) in page.ids
    # best first: seed 3's loss is lowest but it failed, so it comes last
    order = re.findall(r'<a href="#run-[^"]+">([^<]+)</a>', text)
    assert order == [sweep.run_id(1), sweep.run_id(0), sweep.run_id(2)]
    assert "optim.lr" in text and "3e-3" in text


def test_hydra_app_sweep_shows_return_values(sweep, capsys):
    make_run(sweep, 0, hydra_app=True)
    make_run(sweep, 1, seed=2, hydra_app=True)
    assert main(["report", str(sweep.path)]) == 0
    text = Path(capsys.readouterr().out.strip()).read_text()
    parse(text)
    assert "<th>returned</th>" in text and "1.25" in text and "objective" in text


