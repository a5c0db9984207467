#!/usr/bin/env python3
"""Find flaky tests before CI does: run a selection of tests N times and report, per test, how often
it passed and how much its time moved.

Each run is one ``./scripts/test.sh SELECTION --junitxml=...`` (everything set up: the local Slurm
cluster, the browser; a selection under tests/unit alone runs as ``--fast``), or with ``--runner
pytest`` the interpreter's own pytest in the current environment. The runs' JUnit XML files give each
test's outcome and time; the table lists every test with its passes out of the runs, and the min /
median / max of its time, the flaky ones (passed some runs, not all) first.

    python scripts/flakes.py                                   # the integration tier, 3 runs, 3 workers
    python scripts/flakes.py -n 2 --workers 0 tests/integration/test_lint.py tests/integration/test_bad_input_cli.py
    python scripts/flakes.py -n 5 -k "asha or pbt"             # a -k selection of the integration tier
    python scripts/flakes.py -n 3 tests/integration/test_elastic.py -- --maxfail=1   # after --: pytest's
    python scripts/flakes.py --from a/integration.xml b/integration.xml c/integration.xml   # runs made already
    python scripts/flakes.py --from a/integration.xml --by-module      # the time per module (the budget)

``--from`` reads the JUnit XML of runs made already, one file per run (``LAUNCHER_TEST_REPORTS=DIR
./scripts/test.sh`` writes DIR/unit.xml and DIR/integration.xml: three fresh-clone ``.ci/run`` runs are
three runs of the integration tier); nothing is run. ``--by-module`` adds each module's test time (the
median over the runs, summed over its tests, both workers together) and each run's slowest tests.

Exit status 0 when every test passed (or was skipped) in every run, 1 otherwise (a flaky or failing
test, a run with no report). Keeps each run's XML and output in ``--out`` (default a new dir in /tmp).
Stdlib only.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
DEFAULT_SELECTION = ["tests/integration"]
# worst first: a test reported twice in one run (a call and a teardown error) keeps the worse outcome
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


@dataclass
class Result:
    """One test over the runs: its outcome and time in each run it was reported in."""

    outcomes: Dict[int, str] = field(default_factory=dict)
    times: Dict[int, float] = field(default_factory=dict)
    messages: Dict[int, str] = field(default_factory=dict)


def node_id(case: ET.Element) -> str:
    """pytest's node id of a JUnit testcase (xunit1: its ``file`` attribute; else from its classname)."""
    name, classname = case.get("name", "?"), case.get("classname", "")
    head, bracket, tail = name.rpartition("]")
    if "@" in tail:  # the xdist group tests/conftest.py writes into the id under --dist loadgroup
        name = head + bracket + tail[:tail.index("@")]
    file = case.get("file")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
        return "::".join(p for p in (file, cls, name) if p)
    return f"{classname.replace('.', '/')}.py::{name}" if classname else name


def outcome_of(case: ET.Element) -> Tuple[str, str]:
    """(outcome, the first line of its message) of a JUnit testcase."""
    for tag, what in (("error", "error"), ("failure", "failed"), ("skipped", "skipped")):
        el = case.find(tag)
        if el is not None:
            msg = (el.get("message") or el.text or "").strip().splitlines()
            return what, msg[0][:160] if msg else ""
    return "passed", ""


def read_junit(path: Path, run: int, results: Dict[str, Result]) -> int:
    """Add one run's testcases to ``results``; how many it held."""
    n = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        n += 1
        nid = node_id(case)
        outcome, msg = outcome_of(case)
        r = results.setdefault(nid, Result())
        if run not in r.outcomes or RANK[outcome] > RANK[r.outcomes[run]]:
            r.outcomes[run] = outcome
            if msg:
                r.messages[run] = msg
        r.times[run] = r.times.get(run, 0.0) + float(case.get("time") or 0.0)  # call + its setup/teardown rows
    return n


def command(args: argparse.Namespace, xml: Path) -> List[str]:
    """The command of one run."""
    selection = list(args.paths) or list(DEFAULT_SELECTION)
    opts = [*(["-k", args.k] if args.k else []), *(["-m", args.m] if args.m else []),
            *(["-n", str(args.workers), "--dist", "loadgroup"] if args.workers else []),
            f"--junitxml={xml}", "-o", "junit_family=xunit1", "-p", "no:cacheprovider", *args.pytest_args]
    if args.runner == "pytest":
        return [args.python, "-m", "pytest", "-q", *opts, *selection]
    pure = all(Path(p.split("::")[0]).resolve().is_relative_to(REPO / "tests" / "unit") for p in selection)
    return [str(REPO / "scripts" / "test.sh"), *(["--fast"] if pure else []), *opts, *selection]


def run_once(args: argparse.Namespace, out: Path, run: int) -> Tuple[Optional[Path], int, float, str]:
    """(the run's JUnit XML or None, its exit status, its wall seconds, pytest's last summary line)."""
    xml = out / f"run-{run}.xml"
    log = out / f"run-{run}.log"
    cmd = command(args, xml)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:  # this run's own process group, and nothing else
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
            f.write(f"\nflakes.py: the run passed --timeout={args.timeout:g} s and was stopped\n")
    wall = time.monotonic() - t0
    tail = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(tail) if " in " in ln and ("passed" in ln or "failed" in ln
                                                                     or "error" in ln or "skipped" in ln)),
                   tail[-1] if tail else "")
    return (xml if xml.is_file() else None), rc, wall, summary.strip("= ")


def fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def rows_of(results: Dict[str, Result], runs: int) -> List[dict]:
    """One row per test, the flaky ones first (passed some runs, not all), then the failing, then by
    the widest time spread."""
    rows = []
    for nid, r in results.items():
        passed = sum(1 for o in r.outcomes.values() if o == "passed")
        skipped = sum(1 for o in r.outcomes.values() if o == "skipped")
        bad = sum(1 for o in r.outcomes.values() if o in ("failed", "error"))
        missing = runs - len(r.outcomes)
        times = [r.times[i] for i in sorted(r.times) if r.outcomes.get(i) != "skipped"]
        t_min = min(times) if times else None
        t_med = statistics.median(times) if times else None
        t_max = max(times) if times else None
        if bad == 0 and missing == 0:
            verdict = "ok"
        elif passed + skipped > 0:
            verdict = "FLAKY"
        else:
            verdict = "FAILS"
        rows.append({"test": nid, "passed": passed, "skipped": skipped, "failed": bad, "missing": missing,
                     "runs": runs, "min_s": t_min, "median_s": t_med, "max_s": t_max, "verdict": verdict,
                     "outcomes": [r.outcomes.get(i, "missing") for i in range(1, runs + 1)],
                     "messages": {str(i): m for i, m in sorted(r.messages.items())}})
    order = {"FLAKY": 0, "FAILS": 1, "ok": 2}
    rows.sort(key=lambda row: (order[row["verdict"]], -((row["max_s"] or 0) - (row["min_s"] or 0)), row["test"]))
    return rows


def table(rows: Sequence[dict]) -> List[str]:
    width = min(100, max([len("test")] + [len(r["test"]) for r in rows]))
    out = [f"{'test':<{width}}  {'pass':>6}  {'min s':>7}  {'median s':>8}  {'max s':>7}  {'spread':>6}  verdict",
           "-" * (width + 52)]
    for r in rows:
        name = r["test"] if len(r["test"]) <= width else "..." + r["test"][-(width - 3):]
        spread = (f"{r['max_s'] / r['min_s']:.2f}x" if r["min_s"] and r["max_s"] is not None else "-")
        rate = f"{r['passed']}/{r['runs']}"
        verdict = r["verdict"] + (f" ({r['skipped']} skipped)" if r["skipped"] else "")
        out.append(f"{name:<{width}}  {rate:>6}  {fmt_s(r['min_s']):>7}  {fmt_s(r['median_s']):>8}  "
                   f"{fmt_s(r['max_s']):>7}  {spread:>6}  {verdict}")
        if r["verdict"] != "ok":
            for run, outcome in enumerate(r["outcomes"], 1):
                if outcome not in ("passed", "skipped"):
                    msg = r["messages"].get(str(run), "")
                    out.append(f"{'':<4}run {run}: {outcome}" + (f": {msg}" if msg else ""))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Arguments after -- are passed to pytest as they are.")
    ap.add_argument("paths", nargs="*", help="test files, dirs or node ids (default: tests/integration)")
    ap.add_argument("-n", "--runs", type=int, default=3, help="how many times to run the selection (default 3)")
    ap.add_argument("-k", default="", help="pytest's -k expression")
    ap.add_argument("-m", default="", help="pytest's -m marker expression (e.g. 'slurm', 'not slurm')")
    ap.add_argument("--workers", type=int, default=3,
                    help="pytest-xdist workers per run, with --dist loadgroup as CI runs the tier (0: one process)")
    ap.add_argument("--runner", choices=("test.sh", "pytest"), default="test.sh",
                    help="test.sh: ./scripts/test.sh sets everything up (default); pytest: this environment as is")
    ap.add_argument("--python", default=sys.executable, help="the interpreter for --runner pytest")
    ap.add_argument("--timeout", type=float, default=3 * 3600.0, help="seconds one run may take (then stopped)")
    ap.add_argument("--out", default="", help="where the runs' XML and output go (default: a new dir in /tmp)")
    ap.add_argument("--json", default="", help="also write the table as JSON to this file")
    ap.add_argument("--from", dest="reports", nargs="+", default=[], metavar="XML",
                    help="report over these JUnit XML files, one per run (nothing is run)")
    ap.add_argument("--by-module", action="store_true", help="also print the test time per module")
    args = ap.parse_args(argv)
    args.pytest_args = extra
    if args.reports:
        return report_only([Path(x) for x in args.reports], args)
    if args.runs < 1:
        ap.error("--runs must be >= 1")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="flakes-"))
    out.mkdir(parents=True, exist_ok=True)
    selection = " ".join(args.paths or DEFAULT_SELECTION) + (f" -k {args.k!r}" if args.k else "") + \
        (f" -m {args.m!r}" if args.m else "")
    print(f"flakes: {selection}, {args.runs} run(s), {args.workers or 1} worker(s), via {args.runner}; "
          f"output in {out}", flush=True)

    results: Dict[str, Result] = {}
    runs_info = []
    no_report = 0
    for run in range(1, args.runs + 1):
        xml, rc, wall, summary = run_once(args, out, run)
        n = read_junit(xml, run, results) if xml is not None else 0
        no_report += xml is None or n == 0
        runs_info.append({"run": run, "exit": rc, "wall_s": round(wall, 1), "tests": n, "summary": summary})
        print(f"run {run}/{args.runs}: exit {rc}, {wall:.1f} s, {n} test(s) reported: {summary}", flush=True)

    rows = rows_of(results, args.runs)
    return summarize(rows, runs_info, args, selection, no_report, out)


def by_module(rows: Sequence[dict]) -> List[str]:
    """Each module's test time (the sum of its tests' median times) and test count, largest first."""
    total: Dict[str, float] = {}
    count: Dict[str, int] = {}
    for r in rows:
        module = r["test"].split("::")[0]
        total[module] = total.get(module, 0.0) + (r["median_s"] or 0.0)
        count[module] = count.get(module, 0) + 1
    width = max([len("module")] + [len(m) for m in total])
    out = [f"{'module':<{width}}  {'tests':>5}  {'test s':>7}", "-" * (width + 16)]
    out += [f"{m:<{width}}  {count[m]:>5}  {t:>7.1f}" for m, t in sorted(total.items(), key=lambda kv: -kv[1])]
    out.append(f"{'(all)':<{width}}  {sum(count.values()):>5}  {sum(total.values()):>7.1f}")
    return out


def report_only(paths: Sequence[Path], args: argparse.Namespace) -> int:
    """The table over runs made already: one JUnit XML per run."""
    results: Dict[str, Result] = {}
    runs_info = []
    no_report = 0
    for run, path in enumerate(paths, 1):
        n = read_junit(path, run, results) if path.is_file() else 0
        no_report += n == 0
        runs_info.append({"run": run, "exit": None, "wall_s": None, "tests": n, "summary": str(path)})
        print(f"run {run}/{len(paths)}: {path}: {n} test(s) reported", flush=True)
    rows = rows_of(results, len(paths))
    return summarize(rows, runs_info, args, " ".join(map(str, paths)), no_report, None)


def summarize(rows: List[dict], runs_info: List[dict], args: argparse.Namespace, selection: str,
              no_report: int, out: Optional[Path]) -> int:
    """Print the table (and the modules' times), write the JSON; the exit status."""
    print()
    for line in table(rows):
        print(line)
    if args.by_module:
        print()
        for line in by_module(rows):
            print(line)
    flaky = sum(r["verdict"] == "FLAKY" for r in rows)
    failing = sum(r["verdict"] == "FAILS" for r in rows)
    walls = [i["wall_s"] for i in runs_info if i["wall_s"] is not None]
    print(f"\n{len(rows)} test(s) x {len(runs_info)} run(s): {len(rows) - flaky - failing} passed every run, "
          f"{flaky} flaky, {failing} failed every run"
          + (f"; run wall time {min(walls):.1f}-{max(walls):.1f} s" if walls else "")
          + (f"; {no_report} run(s) left no report" + (f" (see {out})" if out else "") if no_report else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"selection": selection, "runs": runs_info, "tests": rows}, indent=1))
    return 0 if rows and not flaky and not failing and not no_report else 1


if __name__ == "__main__":
    sys.exit(main())
