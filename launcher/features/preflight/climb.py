"""`launcher preflight`: the ladder (launcher.features.preflight.ladder) composed, checked, submitted and judged.

Every rung is composed and checked before anything is submitted (a rung the launch checks refuse
names itself and nothing is queued). On a backend with dependencies (``Backend.after``: Slurm's
dependency on the previous rung ending well) the rungs go out at once as dependent jobs: the ladder
climbs in the queue without this process. Elsewhere (local) each rung starts when the one before it
has passed. Waiting,
the rungs are judged in order; at the first no-go the rungs above it are cancelled and the failing
rung's diagnosis (launcher doctor) is printed. The ladder is recorded in
``<runs_root>/preflight/<id>.json``: `launcher preflight --show ID` judges it again from its runs.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from rich.console import Console
from rich.table import Table
from rich.text import Text

from launcher import backends, doctor
from launcher.app import compose_point
from launcher.archive import atomic
from launcher.config import recipe_contract, schema
from launcher.config.compose import override_key
from launcher.features.preflight import ladder
from launcher.features.verify_resume.verdict import Verdict
from launcher.run.outcome import settle
from launcher.run.rundir import RunDir, now_iso
from launcher.run.status import RunStatus, Status
from launcher.submit.pipeline import InvalidSweep, launch, validate
from launcher.submit.progress import cancel_run, cancel_runs, wait_and_report

RECORD_DIR = "preflight"


class InvalidLadder(ValueError):
    """A rung's config is refused by the launch checks (or cannot be composed): nothing was submitted."""


@dataclass
class Prepared:
    base: Any  # the config as `launch` would run it
    rungs: List[ladder.Rung]
    points: Dict[str, Any]  # rung name -> Point (rungs that are not skipped)
    runs_root: Path


def prepare(overrides: List[str], steps: int, start: Optional[str] = None) -> Prepared:
    """Compose the config and every rung, and check each rung as `launch` would. Raises InvalidLadder.
    ``start``: the rung the ladder starts at (``--from``); the rungs below it are skipped, not climbed."""
    if start is not None and start not in ladder.RUNGS:
        raise InvalidLadder(f"--from {start}: no such rung (the rungs: {', '.join(ladder.RUNGS)})")
    try:
        point = compose_point(overrides)
    except Exception as e:  # Hydra/OmegaConf: unknown key, bad type, bad group option
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise InvalidLadder(f"cannot compose the config: {e}{cause}") from None
    base = point.cfg
    try:
        validate([point])
    except InvalidSweep as e:
        raise InvalidLadder("the config itself is refused (fix it first; the ladder climbs towards it):\n"
                            f"{e}") from None
    rungs = ladder.ladder(base, steps=steps)
    if start is not None:
        below = ladder.RUNGS[:ladder.RUNGS.index(start)]
        rungs = [dataclasses.replace(r, skip=f"below --from {start}: not climbed this time") if r.name in below else r
                 for r in rungs]
    points = {}
    for rung in rungs:
        if rung.skip:
            continue
        try:
            point = compose_point(rung_lines(overrides, rung))
            validate([point])
        except InvalidSweep as e:
            raise InvalidLadder(f"rung {rung.name} ({rung.title}) is refused:\n{e}") from None
        except Exception as e:
            raise InvalidLadder(f"rung {rung.name}: cannot compose its config: {e}") from None
        points[rung.name] = point
    return Prepared(base, rungs, points, Path(str(base.submit.runs_root)).expanduser().resolve())


def new_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def rung_lines(overrides: List[str], rung: ladder.Rung) -> List[str]:
    """The user's overrides and the rung's; a rung that runs another recipe (``recipe=<option>``) drops
    the user's lines for groups that recipe has not (the comm rung's benchmark has no ``model``)."""
    option = next((o.split("=", 1)[1] for o in rung.overrides if o.startswith("recipe=")), None)
    if option is None:
        return [*overrides, *rung.overrides]
    foreign = schema.foreign_groups(schema.recipe_options().get(option))
    own = [o for o in overrides if override_key(o).split(".")[0] not in foreign]
    return [*own, *rung.overrides]


def record_path(runs_root: Path, pid: str) -> Path:
    return runs_root / RECORD_DIR / f"{pid}.json"


def _submit(prep: Prepared, rung: ladder.Rung, overrides: List[str], pid: str, after: Optional[str]) -> Any:
    """Launch one rung (one run); ``after``: the job it waits for in the queue (a backend with dependencies)."""
    extra = rung_lines(overrides, rung)
    if after:
        extra += backends.get(str(prep.base.cluster.backend)).after(after)
    point = compose_point(extra) if after else prep.points[rung.name]
    said = io.StringIO()  # the pipeline's listing: the ladder prints its own
    result = launch([point], argv=["launcher", "preflight", *overrides], out=said,
                    extra_meta={"preflight": {"id": pid, "rung": rung.name}})
    return result


def _rung_entry(rung: ladder.Rung) -> Dict[str, Any]:
    return {"name": rung.name, "title": rung.title, "overrides": list(rung.overrides), "notes": list(rung.notes),
            "skip": rung.skip, "run_id": None, "run_dir": None, "job_id": None}


def run(overrides: List[str], steps: int, wait: bool, out=None, start: Optional[str] = None) -> int:
    """The `launcher preflight` command: 0 when every rung is a go, 1 at a no-go, 2 when refused."""
    out = out or sys.stdout
    try:
        prep = prepare(overrides, steps, start)
    except InvalidLadder as e:
        print(f"launcher preflight: {e}", file=sys.stderr)
        return 2
    pid = new_id()
    path = record_path(prep.runs_root, pid)
    record = {"id": pid, "created": now_iso(), "overrides": list(overrides), "steps": steps, "from": start,
              "rungs": [_rung_entry(r) for r in prep.rungs]}
    atomic.write_json(path, record)
    from launcher.submit import signals  # SIGTERM, SIGHUP and Ctrl-C stop the ladder as one: settled, not left

    signals.install()
    try:
        return _climb(prep, record, path, overrides, wait, out)
    except KeyboardInterrupt as e:  # (Terminated too) every rung not ended yet is cancelled and sealed
        why = str(e) or "interrupted"
        open_runs = [RunDir(en["run_dir"]) for en in record["rungs"]
                     if en.get("run_dir") and not RunDir(en["run_dir"]).is_final()]
        if open_runs:
            cancel_runs(open_runs, f"not run: preflight stopped ({why})")
        print(f"launcher preflight: stopped ({why}); {len(open_runs)} rung(s) not ended were cancelled: "
              f"launcher preflight --show {pid} --root {prep.runs_root}", file=sys.stderr)
        return getattr(e, "exit_code", 130)


def _climb(prep: Prepared, record: Dict[str, Any], path: Path, overrides: List[str], wait: bool, out) -> int:
    """The rungs queued (dependent jobs) or run one after another, then judged (``run``'s body)."""
    pid = record["id"]

    queued = backends.get(str(prep.base.cluster.backend)).dependencies  # every rung queued now, each after the last
    wait = wait or not queued  # local rungs start one after another: someone has to wait
    print(f"preflight {pid}: {sum(1 for r in prep.rungs if not r.skip)} rung(s), "
          f"{'queued as dependent jobs' if queued else 'run one after another'}  ({path})", file=out, flush=True)
    results: Dict[str, Any] = {}
    judged: List[str] = []  # rungs already waited for and judged (locally, each before the next starts)
    after = None
    for rung, entry in zip(prep.rungs, record["rungs"]):
        if rung.skip:
            continue
        if not queued and results:  # locally: the next rung starts only after this one passed
            last = next(reversed(results))
            judged.append(last)
            if not _wait_and_judge(prep, record, last, results[last], out):
                break
        try:
            res = _submit(prep, rung, overrides, pid, after if queued else None)
        except Exception:  # a half-queued ladder is worse than none: the rungs already queued go
            for e in record["rungs"]:
                if e.get("run_dir"):
                    cancel_run(RunDir(e["run_dir"]), f"not run: preflight could not queue rung {rung.name}")
            raise
        sub = res.runs[0]
        entry.update(run_id=sub.run_id, run_dir=str(sub.run_dir), job_id=sub.job_id)
        atomic.write_json(path, record)
        print(f"  {rung.name:<6} {sub.run_id}  job {sub.job_id}", file=out, flush=True)
        results[rung.name] = res
        after = sub.job_id
    if not wait:
        print(f"not waiting: launcher preflight --show {pid} --root {prep.runs_root}", file=out)
        return 0
    for name, res in results.items():
        if name not in judged and not _wait_and_judge(prep, record, name, res, out):
            break
    atomic.write_json(path, record)  # with the resume rung's comparison: `--show` reads it, not torch again
    return show_record(record, out)


def _wait_and_judge(prep: Prepared, record: Dict[str, Any], name: str, result: Any, out) -> bool:
    """Wait for one rung's run; at a no-go cancel the rungs above it. True when it passed."""
    point = prep.points[name]
    wait_and_report(result, [point], out, timeout_s=int(point.cfg.submit.wait_timeout_s), quiet=True)
    entry = next(e for e in record["rungs"] if e["name"] == name)
    verdict = judge_entry(entry, entry_status(entry), record)
    if verdict.passed:
        return True
    later = record["rungs"][record["rungs"].index(entry) + 1:]
    for e in later:
        if e.get("run_dir"):
            cancel_run(RunDir(e["run_dir"]), f"not run: preflight stopped at rung {name}")
    return False


def entry_status(entry: Dict[str, Any]) -> RunStatus:
    """The status of a recorded rung's run (pending where it has none), settled: a job its scheduler
    says ended without recording an outcome gets the one its state implies (launcher.run.outcome)."""
    if not entry.get("run_dir"):
        return RunStatus()
    rd = RunDir(entry["run_dir"])
    settle(rd)
    return rd.status()


def judge_entry(entry: Dict[str, Any], status: RunStatus, record: Optional[Dict[str, Any]] = None) -> ladder.Verdict:
    """A recorded rung's verdict, from what its run left (``status``: ``entry_status(entry)``; ``record``:
    the ladder, for the resume rung's comparison with the full rung's run)."""
    if entry.get("skip"):
        return ladder.Verdict(ladder.SKIPPED, reasons=[entry["skip"]])
    if not entry.get("run_dir"):
        return ladder.Verdict(ladder.NOT_RUN)
    rd = RunDir(entry["run_dir"])
    if status.state is Status.cancelled and str(status.error or "").startswith("not run"):
        return ladder.Verdict(ladder.NOT_RUN, reasons=[str(status.error)])
    cfg = rd.config() or {}
    cl = cfg.get("cluster") or {}
    if entry["name"] == "comm":
        read = recipe_contract.of(recipe_contract.tree_get(cfg, "recipe._target_"), strict=False).results
        bench = read(rd.path) if read is not None else None  # the benchmark's results (its contract reads them)
        return ladder.judge_comm(status, bench, float(cl.get("inter_node_bandwidth") or 0.0))
    if entry["name"] == "resume":
        return _judge_resume(entry, status, rd, record)
    calibrated = bool((cl.get("calibration") or {}).get("fitted_at"))
    return ladder.judge_training(status, rd.metrics(), rd.plan(), calibrated)


def _judge_resume(entry: Dict[str, Any], status: RunStatus, rd: RunDir,
                  record: Optional[Dict[str, Any]]) -> ladder.Verdict:
    full = next((e for e in (record or {}).get("rungs", []) if e["name"] == "full" and e.get("run_dir")), None)
    reference = entry_status(full) if full else RunStatus()
    verdict = None
    if full and reference.state is Status.completed and status.state is Status.completed:
        kept = entry.get("compared") or {}
        if kept.get("full") == str(full["run_dir"]) and kept.get("verdict"):
            verdict = Verdict(**kept["verdict"])  # two ended runs compare the same for ever: kept in the record
        else:
            steps = int((rd.config() or {}).get("train", {}).get("steps") or 0)
            verdict = _compared(str(full["run_dir"]), str(rd.path), steps)
            entry["compared"] = {"full": str(full["run_dir"]), "verdict": verdict.to_json()}
    return ladder.judge_resume(status, reference, verdict)


@functools.lru_cache(maxsize=8)
def _compared(full_dir: str, resume_dir: str, steps: int) -> Any:
    """verify-resume's comparison of two completed runs (a torch process of its own): their files no
    longer change, so the ladder's wait and its closing table share one."""
    from launcher.features.verify_resume import run as verify

    return verify.compare(RunDir(full_dir), RunDir(resume_dir), steps, 0.0)


def diagnosis(entry: Dict[str, Any]) -> Optional[Tuple[str, str, List[str], str]]:
    """(kind, why, evidence, fix) of a failed rung's run (launcher doctor)."""
    if not entry.get("run_dir"):
        return None
    d = doctor.classify(RunDir(entry["run_dir"]), scheduler=True)
    if d.kind in doctor.NOT_FAILED:
        return None
    return d.kind, d.summary, list(d.detail), d.fix


def _num(x: Optional[float], unit: str = "") -> str:
    if x is None:
        return "-"
    if unit == "B":
        return f"{x / 2**20:,.1f} MiB"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pair(v: ladder.Verdict, key: str, unit: str = "") -> str:
    m, p = v.measured.get(key), v.planned.get(key)
    if m is None and p is None:
        return "-"
    ratio = f" ({m / p:.2g}x)" if m and p else ""
    return f"{_num(m, unit)} / {_num(p, unit)}{ratio}"


def show_record(record: Dict[str, Any], out=None) -> int:
    """Print the go / no-go table of a recorded ladder (and the diagnosis of its first no-go)."""
    out = out or sys.stdout
    con = Console(file=out, width=None if getattr(out, "isatty", lambda: False)() else 170, highlight=False)
    table = Table("rung", "what", "run", "status", "tokens/s\nmeasured / plan", "memory per GPU\nmeasured / plan",
                  "link GB/s\nmeasured / config", "verdict", "notes", title=f"preflight {record['id']}")
    first_bad = None
    verdicts = []
    for e in record["rungs"]:
        status = entry_status(e)
        v = judge_entry(e, status, record)
        verdicts.append(v)
        st = status.state.value if e.get("run_dir") else ""
        style = {ladder.GO: "green", ladder.WARN: "yellow", ladder.NO_GO: "bold red"}.get(v.verdict, "dim")
        notes = list(e.get("notes") or []) + v.reasons
        table.add_row(e["name"], Text(e["title"]), Text(e.get("run_id") or "-"), st,
                      _pair(v, "tokens_per_s"), _pair(v, "memory_bytes", "B"), _pair(v, "busbw_gbs"),
                      Text(v.verdict, style=style), Text("; ".join(notes)))
        if v.verdict == ladder.NO_GO and first_bad is None:
            first_bad = (e, v, st)
    con.print(table)
    if not any(v.calibrated for v in verdicts):
        con.print("planned tokens/s: the planner's constants are not calibrated for this cluster "
                  "(`launcher plan --calibrate RUN...`), so throughput is shown, not judged")
    if first_bad is not None:
        e, v, st = first_bad
        d = diagnosis(e) if st != "completed" else None
        con.print(Text(f"no-go at rung {e['name']} ({e['title']}), run {e['run_id']}", style="bold red"))
        if d is not None:
            kind, why, evidence, fix = d
            con.print(Text(f"doctor: {kind}: {why}"))
            for line in evidence[:6]:
                con.print(Text(f"  {line}"))
            con.print(Text(f"fix: {fix}"))
        else:
            for r in v.reasons:
                con.print(Text(f"why: {r}"))
            if v.fix:
                con.print(Text(f"fix: {v.fix}"))
        con.print(Text(f"more: launcher doctor {e['run_id']}; launcher report {e['run_id']}"))
        return 1
    if any(v.verdict == ladder.RUNNING for v in verdicts):
        con.print("not finished: some rungs are still queued or running")
        return 3
    con.print(Text("go: every rung passed", style="bold green"))
    return 0


def show(pid: str, runs_root: Path, out=None) -> int:
    path = record_path(runs_root, pid)
    record = atomic.read_json(path)
    if record is None:
        records = runs_root / RECORD_DIR
        known = sorted(p.stem for p in records.glob("*.json")) if records.is_dir() else []
        print(f"launcher preflight: no preflight {pid!r} under {runs_root}"
              + (f" (known: {', '.join(known[-5:])})" if known else ""), file=sys.stderr)
        return 2
    before = [dict(e) for e in record["rungs"]]
    rc = show_record(record, out)
    if record["rungs"] != before:  # a comparison made now (a ladder queued with --no-wait): kept for the next
        atomic.write_json(path, record)
    return rc
