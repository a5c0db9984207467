"""`launcher show | diff | reproduce`: read and re-run archived runs (thin over launcher.archive)."""
from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import OmegaConf
from rich.markup import escape
from rich.text import Text

from launcher.archive import compare, registry
from launcher.config.errors import ConfigErrors
from launcher.data import archived as data_archive
from launcher.printable import printable
from launcher.run.rundir import RunDir


def resolve_run_dir(root: Path, ident: str) -> Path:
    """A run id, a run dir, or a sweep id of a one-run sweep -> the run dir."""
    p = Path(ident)
    if RunDir(p).exists():
        return p.resolve()

    runs = registry.list_named(root, ident, lambda rows: [r for r in rows if ident in (r["run_id"], r["sweep_id"])],
                               refresh=False)
    if len(runs) > 1 and len({r["run_id"] for r in runs}) == 1:  # a copied run dir claims the same id
        sys.exit(f"launcher: {len(runs)} run dirs under {root} claim run id {ident!r}; give the run dir: "
                 + ", ".join(r["dir"] for r in runs))
    if len(runs) != 1:
        sys.exit(f"launcher: {ident!r} names {len(runs)} runs under {root}; give a run id (see `launcher runs`)")
    return Path(runs[0]["dir"])


def verify_record(rdir: Path):
    from launcher.features.verify_resume.run import record_of  # lazy: only show pays for it

    return record_of(rdir)


def cmd_show(args) -> int:
    rdir = resolve_run_dir(args._root, args.run)
    rd = RunDir(rdir)
    meta = rd.run() or {}
    st = rd.status()
    job = rd.job()
    checks = rd.checks()
    summary = {
        "run": meta,
        "status": st.to_json(),
        "seeds": rd.seeds(),
        "code": compare.code_summary(rdir),
        "topology": compare.topology_summary(rdir),
        "software": rd.software(),
        "runtime": rd.runtime(),
        "job": job.to_json() if job else None,
        "manifest_problems": rd.verify(),
        "data": rd.data_manifest(),
        "checks": checks.to_json() if checks else None,  # (a run staged before checks.json existed: none)
        "files": sorted(str(p.relative_to(rdir)) for p in rdir.rglob("*") if p.is_file()),
        "verify_resume": verify_record(rdir),
    }
    tampered = 1 if summary["manifest_problems"] else 0
    if args.json:
        print(compare.to_json(summary))
        return _report_tampering({rdir: summary["manifest_problems"]}, "show") or tampered
    # rich: only the command that prints loads it, not `launcher --help`
    from rich.console import Console
    from rich.table import Table

    c = Console(highlight=False)
    if not c.is_terminal:  # piped or captured: never wrap a path (a line someone copies or greps)
        c = Console(highlight=False, width=100_000)
    c.print(f"[bold]{escape(printable(meta.get('run_id')))}[/bold]  {st.state.value}  exit {st.exit_code}  "
            f"{escape(printable(rdir))}")
    t = Table(show_header=False)
    layout = meta.get("layout", {})
    s = st.summary or {}
    if meta.get("kind") == "hydra_app":  # a Hydra app's run: its task function, Hydra's dirs, its result
        app, hy = meta.get("app") or {}, meta.get("hydra") or {}
        _row(t, "app", f"{app.get('task_function')}  (config {app.get('config_name')}, job {hy.get('job_num')})")
        _row(t, "hydra", f"output {st.output_dir or hy.get('sweep_dir')}")
        if "return_value" in s:
            _row(t, "returned", repr(s["return_value"]))
    elif meta.get("not_used_by_recipe"):  # recipe=script: the script parallelises, batches and seeds itself
        _row(t, "layout", f"not used by this recipe (the script's own)  processes {layout.get('world_size')}  "
                            f"nodes {layout.get('nodes')}  per node {layout.get('procs_per_node')}")
    else:
        _row(t, "layout", f"engine {layout.get('engine')}  world {layout.get('world_size')}  dp {layout.get('dp')} "
                            f"tp {layout.get('tp')} pp {layout.get('pp')}  grad accum {layout.get('grad_accum')}")
    _row(t, "seed", str(meta.get("seed")))  # (recipe=script: run.json says it is not used)
    if checks is not None:
        _row(t, "checks", checks.describe())
    for line in data_archive.describe(summary["data"]):
        _row(t, "data", line)
    code = summary["code"]
    where = f"{code['repo']}  commit {code['commit']}  dirty {code['dirty']}" if code["commit"] else \
        f"{code['source'] or '?'}: {code['note'] or 'no commit recorded'}"
    _row(t, "code", f"{where}  snapshot {str(code['snapshot_sha256'])[:12]}")
    _row(t, "launcher", f"{code['launcher_version'] or '?'}  " + (
        f"commit {code['launcher_commit']}  dirty {code['launcher_dirty']}" if code["launcher_commit"]
        else "commit unknown (not run from a git checkout)"))
    topo = summary["topology"]
    _row(t, "hosts", ", ".join(map(str, topo["rank_hosts"])))
    _row(t, "job", str((summary["job"] or {}).get("job_id")))
    if s and "final_loss" in s:  # what the summary holds (a recipe's own summary may hold only the loss)
        text = f"loss {s['first_loss']} -> {s['final_loss']}" if "first_loss" in s else f"loss {s['final_loss']}"
        text += f" over {s['steps']} steps" if s.get("steps") is not None else ""
        text += f", {s['mean_tokens_per_s']:,.0f} tokens/s" if s.get("mean_tokens_per_s") is not None else ""
        _row(t, "metrics", text)
    if st.error:
        _row(t, "error", st.error)
    if summary["manifest_problems"]:
        _row(t, "manifest", "DOES NOT MATCH THE SEAL: " + ", ".join(summary["manifest_problems"]))
    if meta.get("reproduces"):
        _row(t, "reproduces", meta["reproduces"])
    if summary["verify_resume"]:  # launcher verify-resume of this run, or this run one of its pair
        _row(t, "verify-resume", summary["verify_resume"].get("line", ""))
    c.print(t)
    return _report_tampering({rdir: summary["manifest_problems"]}, "show")


def _row(table, key: str, value: str) -> None:
    """Archived text (errors, paths, hosts) is shown as it is, never read as rich markup, its control
    characters escaped (a rank's error may hold ESC/OSC sequences a terminal would obey)."""
    table.add_row(key, Text(printable(value)))


def _report_tampering(problems: dict, cmd: str) -> int:
    """Print every run whose archive no longer matches its seal; 1 if there is one."""
    bad = {rdir: p for rdir, p in problems.items() if p}
    for rdir, p in bad.items():
        print(printable(f"launcher {cmd}: {rdir} DOES NOT MATCH ITS SEAL (manifest.json): {'; '.join(p)}"),
              file=sys.stderr)
    return 1 if bad else 0


def cmd_diff(args) -> int:
    a = resolve_run_dir(args._root, args.run_a)
    b = resolve_run_dir(args._root, args.run_b)
    problems = {a: RunDir(a).verify(), b: RunDir(b).verify()}
    d = compare.diff_runs(a, b)
    d["tampered"] = {str(k): v for k, v in problems.items() if v}
    if args.json:
        print(compare.to_json(d))
        return _report_tampering(problems, "diff")
    for section in ("config", "seeds", "topology", "code"):
        items = d[section]
        print(f"{section}: {'same' if not items else ''}")
        for k, (va, vb) in items.items():
            print(f"  {k}: {va!r} -> {vb!r}")
    m = d["metrics"]
    if m["bitwise_identical"]:
        print(f"metrics: loss curves bitwise identical ({m['steps'][0]} steps)")
    else:
        print(f"metrics: loss curves differ (steps {m['steps'][0]} vs {m['steps'][1]}, first different step "
              f"{m['first_different_step']}, max |diff| {m['max_abs_diff']})")
    for side in ("a", "b"):  # a run resumed on another layout: what moved, and the bitwise check
        for line in d["reshards"][side]:
            print(f"resharded ({side}): {line}")
    return _report_tampering(problems, "diff")


def cmd_reproduce(args) -> int:
    # lazy: only this subcommand pays for it, not `launcher --help`
    from launcher.submit.pipeline import InvalidSweep
    from launcher.submit.reproduce import data_problems, provenance_problems, reproduce

    rdir = resolve_run_dir(args._root, args.run)
    from launcher.run import outcome  # lazy: only this subcommand pays for it, not `launcher --help`

    outcome.settle(RunDir(rdir))  # a run whose seal its job left due: sealed first, once the job has ended
    sealed = RunDir(rdir).verify()
    # the datasets it was launched with, every shard hashed against the archived manifests
    others = provenance_problems(rdir, [args._root, registry.default_root()]) + data_problems(
        rdir, list(args.overrides), args._root if args.root else None)
    if sealed or others:
        if not args.trust_unverified:
            _report_tampering({rdir: sealed}, "reproduce")
            for p in others:
                print(printable(f"launcher reproduce: {p}"), file=sys.stderr)
            what = ("changed after it was sealed" if sealed else "cannot be verified as the run it names"
                    if any(not p.startswith("dataset changed: ") for p in others)
                    else "was trained on data that changed since (named above)")
            print(f"launcher reproduce: refusing to reproduce an archive that {what} (--trust-unverified reproduces "
                  "it anyway, and records why in the reproduction's run.json)", file=sys.stderr)
            return 2
        for p in sealed + others:
            print(f"warning: reproducing an unverified archive (--trust-unverified): {p}", file=sys.stderr)
    try:
        got = reproduce(rdir, list(args.overrides), runs_root=args._root if args.root else None,
                        unverified=sealed + others)
    except (InvalidSweep, ConfigErrors, FileNotFoundError) as e:
        print(f"launcher reproduce: {e}", file=sys.stderr)
        return 2
    return got if isinstance(got, int) else 0  # a Hydra app's run: the app's own exit code


def cmd_resume(args) -> int:
    # lazy: only this subcommand pays for it, not `launcher --help`
    from launcher.submit.progress import wait_and_report
    from launcher.submit.resume import loaded_line, resume

    rdir = resolve_run_dir(args._root, args.run)
    from launcher.run import outcome  # lazy: only this subcommand pays for it, not `launcher --help`

    outcome.settle(RunDir(rdir))  # a job that ended without recording its outcome: recorded, so it can resume
    attempt = int(RunDir(rdir).status().attempt or 1) + 1  # the one this resume starts
    try:
        result = resume(rdir, steps=args.steps, changes=args.overrides)
    except (ConfigErrors, FileNotFoundError) as e:
        print(f"launcher resume: {e}", file=sys.stderr)
        return 2
    wait = args.wait if args.wait is not None else bool(result.backend.waits)
    if not wait:
        print(f"watch: launcher runs --sweep {result.sweep_id}" + (f" --root {args.root}" if args.root else ""))
        return 0
    point = type("P", (), {"cfg": OmegaConf.create(RunDir(rdir).config())})()
    ok = wait_and_report(result, [point], sys.stdout)  # with the checkpoints a node rejected, and the step it loaded
    loaded = loaded_line(RunDir(rdir), attempt)
    if loaded:
        print(loaded)
    return 0 if ok else 1
