#!/usr/bin/env python3
"""Mutation check: break one line of the product at a time and see which test notices.

Each mutant is one exact text edit of one file. For each, the tracked (and untracked, not ignored)
files of this checkout are copied to a scratch dir, the edit is applied there, and the fast tier
(``pytest tests/unit``) runs in it with PYTHONPATH pointing at the copy. A mutant whose killer is an
integration test's node id is checked with that test only, and only with ``--integration``.

The old text must occur exactly once in its file: the code changes under this list, and a mutant
that silently stopped applying would report nothing. Drift is printed as DRIFT and makes the exit
status 1, as does a mutant that survives. The pure tier runs the same drift check in-process
(tests/unit/test_mutants_list.py), so a drifted mutant fails ``./scripts/test.sh --fast``.

    python scripts/mutants.py --list               # the table and any DRIFT, nothing run
    python scripts/mutants.py --only X4,X6         # run those
    python scripts/mutants.py --quick              # only each mutant's named unit tests (fast)
    python scripts/mutants.py --integration        # also the mutants killed by an integration test

Stdlib only.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
FAST = "fast"
# the pure test of this list (its drift check): in a mutated copy it would fail on the mutant's own
# edit and report every mutant killed, so a mutant run leaves it out
LIST_TEST = "tests/unit/test_mutants_list.py"
MUTANT_ENV = "LAUNCHER_MUTANT"  # set to the mutant's id in its run (the list's check skips itself there too)


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    old: str
    new: str
    killer: str  # "fast" (the unit tier) or the node id of an integration test
    what: str
    quick: Tuple[str, ...] = field(default=())  # the unit files or node ids that kill it (--quick runs only these)


M = Mutant
MUTANTS: List[Mutant] = [
    M("X1", "launcher/submit/pipeline.py", "    if problems or warned:\n        total, bad",
      "    if (problems or warned) and not good:\n        total, bad", FAST,
      "a sweep with a bad point launches the good ones", ("tests/unit/test_bad_input.py",)),
    M("X2", "launcher/run/transitions.py", "        if prev.is_final or self._unsealed_since():  # sealed once",
      "        if False:  # sealed once", FAST,
      "a final status can be overwritten", ("tests/unit/test_registry_outcome.py",)),
    M("X3", "launcher/archive/software.py", "    for name in KEY_PACKAGES:",
      "    import torch  # noqa\n    for name in KEY_PACKAGES:",
      "tests/integration/test_login_path.py::test_real_local_submission_imports_no_torch",
      "the login path imports torch (archiving software versions)"),
    M("X4", "launcher/training/checkpoint.py", "        if done % self.world:\n            return",
      "        if False:\n            return", FAST,
      "a checkpoint is committed before every rank marked it done", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("X5", "launcher/training/checkpoint.py", "background = self.async_save and not block and self._hooked()",
      "background = False and self.async_save and not block and self._hooked()", FAST,
      "async_save writes synchronously", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("X6", "launcher/training/async_save.py", "register_step_pre_hook(lambda *_: self.wait_copied())",
      "register_step_pre_hook(lambda *_: None)", FAST,
      "the optimizer step does not wait for the host copy", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("X7", "launcher/runtime/restarts.py", "    return rd.restarts_since_launch() < max_restarts",
      "    return rd.restarts_since_launch() <= max_restarts", FAST,
      "one requeue more than the restart budget", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("X8", "recipes/gpt/plan/checks.py", "order = sorted((e.step_time_s, i) for i, e in enumerate(ests) if e.feasible)",
      "order = sorted(((e.step_time_s, i) for i, e in enumerate(ests) if e.feasible), reverse=True)", FAST,
      "the memory fix offers the slowest fitting layout", ("tests/unit/test_plan_checks.py",)),
    M("X9", "recipes/gpt/parallel/grad_buckets.py", "self.scale, self.in_flight = group, 1.0 / world,",
      "self.scale, self.in_flight = group, 1.0,", "tests/integration/test_multirank_parts.py::test_grad_buckets_average_over_two_ranks",
      "data-parallel gradients are summed, not averaged"),
    M("X10", "launcher/run/sealing.py", "os.chmod(entry.path, entry.stat(follow_symlinks=False).st_mode & ~0o222)",
      "os.chmod(entry.path, entry.stat(follow_symlinks=False).st_mode)", FAST,
      "the seal leaves files writable", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("X11", "recipes/gpt/plan/search.py", "RULE_KINDS = (VALUE, SHAPE, LAYOUT)", "RULE_KINDS = (VALUE, SHAPE)", FAST,
      "the search ignores the layout rules", ("tests/unit/test_plan_estimators.py",)),
    M("X12", "launcher/submit/resume.py", "    if st.state not in FINAL and not queued_after:\n        raise ConfigErrors",
      "    if False:\n        raise ConfigErrors", FAST,
      "resume/retry accept a run that may still be running", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("X13", "launcher/run/reads.py", "fresh = since is None or p.stat().st_mtime >= since",
      "fresh = since is None or p.stat().st_mtime >= 0", FAST,
      "the peer watch counts errors older than its process", ("tests/unit/test_watchdog.py",)),
    M("X14", "launcher/submit/pipeline.py", "    checked = validate(points, indices)\n    first = checked[0].point.cfg",
      "    Path(str(points[0].cfg.submit.runs_root)).expanduser().joinpath('0', 'code').mkdir(parents=True, "
      "exist_ok=True)\n    checked = validate(points, indices)\n    first = checked[0].point.cfg",
      "tests/integration/test_bad_input_cli.py::test_launch_rejects_and_writes_nothing[model=gpt_175b]",
      "a refused launch leaves a sweep dir behind"),
    M("M15", "launcher/training/async_save.py", "        if not self._copied.is_set():\n            t0 = time.perf_counter()",
      "        if False:\n            t0 = time.perf_counter()", FAST,
      "wait_copied returns while the copy is in flight", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("M16", "launcher/runtime/restarts.py", "        if rd.restarts_since_launch() > max_restarts:\n            msg",
      "        if rd.restarts_since_launch() > max_restarts + 1:\n            msg", FAST,
      "a restart the scheduler makes past the budget is not refused", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("M17", "launcher/runtime/watchdog.py", "alarm(except_rank=self.rank, since=self._born)",
      "alarm(except_rank=self.rank, since=None)", FAST,
      "the peer watch ends a rank for an earlier attempt's error", ("tests/unit/test_watchdog.py",)),
    M("M18", "launcher/run/sealing.py", "os.chmod(entry.path, entry.stat(follow_symlinks=False).st_mode & ~0o222)",
      "os.chmod(entry.path, entry.stat(follow_symlinks=False).st_mode & ~0o022)", FAST,
      "the seal leaves files writable by their owner", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("M19", "launcher/runtime/context.py", "dist.all_reduce(votes)  # (SUM)",
      "dist.all_reduce(votes, op=dist.ReduceOp.MIN)", "tests/integration/test_multirank_parts.py::test_all_ranks_agree_on_a_stop_one_rank_saw",
      "ranks disagree on a stop only one of them was signalled"),
    M("M20", "launcher/runtime/restarts.py", 'STOP_CODES = {None: 0, "grow": 1, "preempted": 2, "time_limit": 3}',
      'STOP_CODES = {None: 0, "grow": 1, "preempted": 3, "time_limit": 2}', FAST,
      "preempted outranks the time limit", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("M21", "launcher/training/checkpoint.py", "        for old in self.rd.checkpoints()[:-self.keep]:",
      "        for old in self.rd.checkpoints()[:-self.keep - 1]:", FAST,
      "one checkpoint more than train.checkpoint.keep is kept", ("tests/unit/test_fault_tolerance_parts.py",)),
    M("M22", "recipes/gpt/plan/checks.py", "from __future__ import annotations\n",
      "from __future__ import annotations\nimport torch  # noqa\n",
      "tests/integration/test_login_path.py::test_no_torch_import[argv1]",
      "the login path (plan checks) imports torch"),
    M("M23", "launcher/submit/submission.py",
      "                        for r in (r for later in planned[i + 1:] for r in later.points):\n"
      "                            r.staged.finish(Status.failed, seal=False, exit_code=None, error=secrets.scrub(\n"
      "                                f\"not submitted: an earlier array of the sweep was refused ({e})\", known))\n"
      "                        said = f\"{refused}: array {i + 1} of {len(planned)} ({len(arr.points)} run(s)) was refused: {e}\"\n"
      "                        if whole and runs:\n"
      "                            said += \"; \" + _cancel_queued(planned[:i], job_ids, e, known)\n"
      "                        raise SubmissionRefused(secrets.scrub(said, known)) from e",
      "                        break", "tests/integration/test_sweep_arrays.py::test_a_refused_sbatch_is_recorded_not_submitted",
      "a refused sbatch is not recorded, and launch exits 0"),
    M("M24", "recipes/gpt/plan/spec.py", "    step_overhead_s: float = 0.0\n    activation_scale: float = 1.0",
      "    step_overhead_s: float = 0.01\n    activation_scale: float = 1.0", FAST,
      "the default calibration adds a step overhead", ("tests/unit/test_calibration.py",)),
    M("M25", "launcher/run/checkpoint_manifest.py",
      'if digest(ckpt / rel)["sha256"] != (want.get("sha256") if isinstance(want, dict) else None):',
      "if False:", FAST, "a checkpoint's sha256 is not compared (a flipped byte loads)",
      ("tests/unit/test_training_api.py",)),
    M("M26", "launcher/runtime/restart_policy.py", '        return "corrupt_checkpoint"', '        return "other"',
      FAST, "a corrupt checkpoint is restarted", ("tests/unit/test_restart_policy.py",)),
    M("M27", "launcher/run/checkpoint_manifest.py", "(bound is not None and RunDir.checkpoint_step(ckpt) >= bound)",
      "(False and RunDir.checkpoint_step(ckpt) >= bound)", FAST,
      "a fallback to a checkpoint later than the one latest names", ("tests/unit/test_checkpoint_manifest.py",)),
    M("M28", "launcher/training/checkpoint_resume.py",
      "        return sorted({p for ps in gathered for p in (ps or [])})\n",
      "        return found\n", FAST, "every rank decides on its own share's hashes (ranks may disagree)",
      ("tests/unit/test_training_api.py",)),
    M("M29", "launcher/training/async_save.py", "                cuda.set_device(started.device)",
      "                pass", FAST, "the checkpoint writer thread waits on GPU 0's context, not its rank's",
      ("tests/unit/test_checkpoint_cuda.py",)),
    M("M30", "launcher/training/async_save.py",
      "                started.event.synchronize()  # the pinned buffers",
      "                cuda.synchronize()  # the pinned buffers", FAST,
      "the async checkpoint waits for the whole (thread's current) device, not its copies' event",
      ("tests/unit/test_checkpoint_cuda.py",)),
    M("M31", "launcher/training/engines/ddp.py", "        state = load_on_one_rank(path / self.FILE, self.device)",
      "        state = torch.load(path / self.FILE, map_location=self.device, weights_only=True)",
      "tests/integration/test_multirank_parts.py::test_ddp_resume_reads_the_model_file_on_one_rank_only",
      "every ddp rank reads the whole model file on resume"),
    # sweep=asha (launcher/features/asha/schedule.py: the rule alone)
    M("M32", "launcher/features/asha/schedule.py", "    return max(1, n // max(1, int(reduction))) if n > 0 else 0",
      "    return max(1, -(-n // max(1, int(reduction)))) if n > 0 else 0", FAST,
      "a rung promotes ceil(n / reduction) points, one too many (16 -> 6, not 5)",
      ("tests/unit/test_asha.py::test_16_points_three_rungs_reduction_3_give_16_5_1",)),
    M("M33", "launcher/features/asha/schedule.py", "    if not rule.asynchronous:\n        if not complete:\n            return None",
      "    if not rule.asynchronous:\n        if False:\n            return None", FAST,
      "a synchronous rung is decided before every entrant reported or ended",
      ("tests/unit/test_asha.py::test_a_rung_waits_for_every_entrant_then_is_decided_once",)),
    # sweep=pbt (launcher/features/pbt/generations.py)
    M("M34", "launcher/features/pbt/generations.py", "after = {key: _times(current[donor][key], f) for key, f in factors.items()}",
      "after = {key: _times(current[m][key], f) for key, f in factors.items()}", FAST,
      "explore perturbs the member's own values, not the donor's it exploits",
      ("tests/unit/test_pbt.py::test_the_bottom_quantile_exploits_the_top_with_perturbed_values",)),
    M("M35", "launcher/features/pbt/generations.py", "bottom = [p for p in order[len(order) - k:] if p in can] if k else []",
      "bottom = [p for p in order[len(order) - k:]] if k else []", FAST,
      "a member that ended (not alive) still exploits a donor",
      ("tests/unit/test_pbt.py::test_max_mode_nan_a_missing_report_and_ints",)),
    # cluster.elastic (launcher/features/elastic/resize.py)
    M("M36", "launcher/features/elastic/resize.py", "range(min(int(usable_nodes), int(target_nodes)), max(1, int(min_nodes)) - 1, -1)",
      "range(int(usable_nodes), max(1, int(min_nodes)) - 1, -1)", FAST,
      "an elastic run goes on on more nodes than it was launched with",
      ("tests/unit/test_elastic.py::test_node_counts_go_from_the_most_usable_down_to_the_minimum",)),
    M("M37", "launcher/features/elastic/resize.py", '    if run_state == "completed" or word == "CANCELLED":\n        return None',
      '    if run_state == "completed":\n        return None', FAST,
      "the deciding job resumes an elastic run the user cancelled",
      ("tests/unit/test_elastic.py::test_the_decision_acts_where_the_cluster_ended_the_job_or_the_run_asked_the_job_after_it",)),
    # resharding (launcher/submit/reshard.py: what a resume on another layout may change)
    M("M38", "launcher/submit/reshard.py",
      'if old.get("global_batch_size") != new.get("global_batch_size") and "train.global_batch_size" not in changed:',
      'if False and "train.global_batch_size" not in changed:', FAST,
      "a resume on another layout silently changes the global batch",
      ("tests/unit/test_reshard_rules.py::test_a_changed_global_batch_is_refused_unless_asked_for",)),
    M("M39", "launcher/submit/reshard.py", "if checkpoint is not None and not has_universal(checkpoint):",
      "if False:", FAST, "a checkpoint with no universal/ state is accepted for another layout",
      ("tests/unit/test_reshard_rules.py::test_a_checkpoint_without_universal_state_is_refused",)),
    # cluster.pack (launcher/features/pack/runner.py: which points start on the pack's free nodes)
    M("M40", "launcher/features/pack/runner.py", "        if len(fit) < need.nodes:\n            continue",
      "        if len(fit) < need.nodes:\n            break", FAST,
      "no backfill: a point that does not fit now holds back the smaller ones after it",
      ("tests/unit/test_pack.py::test_a_point_that_does_not_fit_now_lets_a_later_smaller_one_start",)),
    M("M41", "launcher/features/pack/runner.py",
      "                and (self.mem is None or host_mem(need) is None or self.mem >= need.tasks * host_mem(need)))",
      "                and True)", FAST,
      "the planner's memory estimate does not bound the points per node",
      ("tests/unit/test_pack.py::test_the_planners_memory_estimate_bounds_points_per_node",)),
    # tokenized data (launcher/data/)
    M("M42", "launcher/data/tokens.py", "if self._doc_starts is not None else window * self.seq_len",
      "if self._doc_starts is not None else window * (self.seq_len + 1)", FAST,
      "packed windows do not share their boundary token (one token per window is never a label)",
      ("tests/unit/test_data_tokens.py::test_packing_cuts_the_stream_into_windows_that_share_one_token",)),
    M("M43", "launcher/data/manifest.py", "            if digest != sha:\n", "            if False:\n", FAST,
      "a prepared dataset's shard with a flipped byte passes its check (sha256 not compared)",
      ("tests/unit/test_data_manifest.py::test_flipped_byte_truncated_and_missing_shard_each_named",)),
    M("M44", "launcher/config/faults.py", "        return self.attempt is None or int(self.attempt) == int(attempt)\n",
      "        return True\n", FAST,
      "an injected fault fires on every attempt, not only its own (a drill's holds all fire at once)",
      ("tests/unit/test_faults.py::test_each_fault_fires_on_its_attempt_rank_and_step_only",)),
    M("M45", "launcher/sweeps.py", "    return max(int(room) - 1, 0)\n", "    return max(int(room), 0)\n", FAST,
      "a sweep in waves queues as many points as the room, none kept for the wave job (sbatch refuses it)",
      ("tests/unit/test_waves.py::test_the_points_queued_now_leave_one_slot_for_the_wave_job",)),
]


def _files(repo: Path) -> List[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo,
                         check=True, capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f]


def copy_repo(repo: Path, dest: Path) -> None:
    for rel in _files(repo):
        src = repo / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)


def drift(m: Mutant, root: Path) -> Optional[str]:
    """What no longer matches the code under ``root`` (the old text, once; the killer's and the quick
    tests' files and test functions), as text, or None."""
    path = root / m.file
    if not path.exists():
        return f"{m.file} does not exist"
    n = path.read_text().count(m.old)
    if n != 1:
        return f"old text found {n} times in {m.file} (expected once): {m.old.splitlines()[0].strip()!r}"
    for test in ([] if m.killer == FAST else [m.killer]) + list(m.quick):
        file, _, name = test.partition("::")
        if not (root / file).is_file():
            return f"test file {file} does not exist"
        func = name.split("[")[0].split("::")[-1]
        if func and not re.search(rf"^\s*(?:async )?def {re.escape(func)}\(", (root / file).read_text(), re.M):
            return f"no test {func} in {file}"
    return None


def apply(m: Mutant, root: Path) -> Optional[str]:
    """Apply the edit under ``root``; a problem (drift) as text, or None."""
    problem = drift(m, root)
    if problem:
        return problem
    path = root / m.file
    path.write_text(path.read_text().replace(m.old, m.new))
    return None


def _failed(output: str) -> str:
    """The first failing test's node id in pytest's output (or the tail of it)."""
    for line in output.splitlines():
        hit = re.match(r"(?:FAILED|ERROR) (.+?)(?: - |$)", line)  # node ids may hold spaces
        if hit:
            return hit.group(1)
    return output.strip().splitlines()[-1] if output.strip() else "?"


def pytest_command(python: str, targets: List[str]) -> List[str]:
    """The pytest run of a mutated copy: stops at the first failure; never the list's own check."""
    return [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--ignore={LIST_TEST}", *targets]


def run_one(m: Mutant, args: argparse.Namespace) -> Tuple[str, str]:
    """(verdict, detail): killed / survived / DRIFT / skipped."""
    if m.killer != FAST and not args.integration:
        return "skipped", "integration killer (run with --integration)"
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.id}-") as tmp:
        root = Path(tmp)
        copy_repo(REPO, root)
        problem = apply(m, root)
        if problem:
            return "DRIFT", problem
        if m.killer != FAST:
            targets = [m.killer]
        elif args.quick and m.quick:
            targets = list(m.quick)
        else:
            targets = ["tests/unit"]
        env = dict(os.environ, PYTHONPATH=str(root), PYTHONDONTWRITEBYTECODE="1", **{MUTANT_ENV: m.id})
        cmd = pytest_command(args.python, targets)
        try:
            res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return "timeout", f"pytest ran past {args.timeout} s"
        out = res.stdout + res.stderr
        if res.returncode == 0:
            return "survived", " ".join(targets)
        if res.returncode in (1, 3) or "FAILED" in out:
            return "killed", _failed(out)
        return "error", f"pytest exit {res.returncode}: {out.strip().splitlines()[-1] if out.strip() else ''}"


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="print the mutants and their expected killers; run nothing")
    ap.add_argument("--only", default="", help="comma-separated ids (X4,X6)")
    ap.add_argument("--integration", action="store_true", help="also run the mutants an integration test kills")
    ap.add_argument("--quick", action="store_true", help="run only each mutant's named unit tests, not all of tests/unit")
    ap.add_argument("--python", default=sys.executable, help="the interpreter with pytest and the project installed")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run")
    args = ap.parse_args(argv)
    chosen = MUTANTS
    if args.only:
        ids = [i.strip() for i in args.only.split(",") if i.strip()]
        unknown = sorted(set(ids) - {m.id for m in MUTANTS})
        if unknown:
            ap.error(f"unknown mutant id(s): {', '.join(unknown)}")
        chosen = [m for m in MUTANTS if m.id in ids]
    if args.list:  # and whether each still applies to this checkout (DRIFT: exit status 1)
        print(f"{'id':<5} {'file':<38} {'expected killer':<70} what")
        drifted = 0
        for m in chosen:
            print(f"{m.id:<5} {m.file:<38} {m.killer:<70} {m.what}")
            problem = drift(m, REPO)
            if problem:
                drifted += 1
                print(f"      DRIFT: {problem}")
        return 1 if drifted else 0
    bad = 0
    rows = []
    for m in chosen:
        verdict, detail = run_one(m, args)
        bad += verdict in ("survived", "DRIFT", "timeout", "error")
        rows.append((m.id, verdict, detail))
        print(f"{m.id:<5} {verdict:<9} {detail}", flush=True)
    print()
    print(f"{'id':<5} {'result':<9} killed by / why")
    for row in rows:
        print(f"{row[0]:<5} {row[1]:<9} {row[2]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
