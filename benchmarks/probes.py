"""The round-4 probe list (shared/reviews/s4-probes.md) re-run as its reviewer ran it: the real
`launch` / `launcher` commands on the local Slurm cluster (scripts/slurm-local.sh up) and on local
runs, as a user or an attacker would type them, each probe's pass mark the review's "Expected" (a
defect) or "what held" (an OK row).

    .venv/bin/python benchmarks/probes.py [--only H1,M3,P17,...] [--list] [--keep]

Every row of the review's table, R1-R13 and P1-P66, is re-run. This module holds the framework and
the probes of the defects (H1, M1-M7, L1-L12) and notes (P32, P50, P55), with a few cheap rows that held
(R5, R10, R13, P26, P36, P43, P47); benchmarks/probes_held.py holds every other row that held (and the
notes P8, P38), registered after these. A row that is one of the defects is re-run by that defect's
probe, which names it in its title (P11 = H1, P12 = M2, R9 = M1, P7 = L2, ...). Each probe works in a
scratch runs root of its own; a probe that needs what this machine lacks (root, a daemon it may not
stop) says SKIP and why. Every job a probe queues is cancelled by name at its end. Prints one line per
probe (OK / FAIL / SKIP, the evidence, seconds) and exits 0 when none failed. About 6 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import py_compile
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOLD = "+cluster.sbatch_extra.begin=now+10hours"  # queued, never started
QUICK = ["train.steps=6", "optim.warmup_steps=0", "train.log_interval=0", "cluster.gpus_per_node=1"]
SLURM = ["cluster=local_slurm", "cluster.nodes=1", *QUICK]
FINAL = ("completed", "failed", "cancelled", "timeout", "pruned")


class Failed(AssertionError):
    pass


class Skipped(Exception):
    pass


def check(ok: bool, why: str) -> None:
    if not ok:
        raise Failed(why)


class Result:
    def __init__(self, rc: int, out: str, err: str, secs: float, max_rss_mb: float):
        self.rc, self.out, self.err, self.secs, self.max_rss_mb = rc, out, err, secs, max_rss_mb

    @property
    def text(self) -> str:
        return self.out + self.err

    def tail(self, n: int = 600) -> str:
        return self.text[-n:].replace("\n", " | ")


class Probe:
    """One probe's scratch dir, commands and jobs."""

    def __init__(self, pid: str, scratch: Path):
        self.pid, self.scratch, self.names = pid, scratch, []
        scratch.mkdir(parents=True, exist_ok=True)

    def root(self, name: str = "runs") -> Path:
        return self.scratch / name

    def job_name(self) -> str:
        name = f"probe{self.pid.lower()}{secrets.token_hex(2)}"
        self.names.append(name)
        return name

    def run(self, args: List[str], root: Optional[Path] = None, timeout: float = 300,
            env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None) -> Result:
        """The command to its end: exit code, output, seconds and the peak memory of its process."""
        e = dict(os.environ, LAUNCHER_RUNS=str(root or self.root()), PYTHONUNBUFFERED="1",
                 TMPDIR=str(self.scratch))
        e.update(env or {})
        out_f, err_f = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        t0 = time.perf_counter()
        proc = subprocess.Popen(args, stdout=out_f, stderr=err_f, env=e, cwd=str(cwd or REPO), text=True)
        deadline = t0 + timeout
        rusage = None
        while rusage is None:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rusage, proc.returncode = ru, os.waitstatus_to_exitcode(status)
                break
            if time.perf_counter() > deadline:
                proc.kill()
                _, status, rusage = os.wait4(proc.pid, 0)
                proc.returncode = 124
                break
            time.sleep(0.02)
        secs = time.perf_counter() - t0
        out_f.seek(0)
        err_f.seek(0)
        return Result(proc.returncode, out_f.read(), err_f.read(), secs, rusage.ru_maxrss / 1024)

    def launch(self, overrides: List[str], root: Optional[Path] = None, **kw) -> Result:
        return self.run([str(BIN / "launch"), *overrides], root, **kw)

    def launcher(self, args: List[str], root: Optional[Path] = None, **kw) -> Result:
        if args[0] == "data":  # the data commands read a dataset dir, no runs root
            return self.run([str(BIN / "launcher"), *args], root, **kw)
        return self.run([str(BIN / "launcher"), *args, "--root", str(root or self.root())], root, **kw)

    def runs(self, root: Optional[Path] = None) -> List[dict]:
        res = self.run([str(BIN / "launcher"), "runs", "--json", "--root", str(root or self.root())], root)
        check(res.rc == 0, f"launcher runs --json failed: {res.tail()}")
        return json.loads(res.out)

    def wait_final(self, n: int, root: Optional[Path] = None, timeout: float = 300) -> List[dict]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            got = self.runs(root)
            if len(got) >= n and all(r["status"] in FINAL for r in got):
                return got
            for sweep in {r["sweep_id"] for r in got if r.get("job_ended") and r["status"] not in FINAL}:
                self.launcher(["status", sweep], root, timeout=120)
            time.sleep(1.0)
        raise Failed(f"runs not final after {timeout} s")

    def queued(self, name: str) -> List[str]:
        out = subprocess.run(["squeue", "-h", "-r", "-n", name, "-o", "%i|%T"], capture_output=True, text=True,
                             timeout=60).stdout
        return [line for line in out.splitlines() if line.strip()]

    def cleanup(self) -> None:
        for name in self.names:
            subprocess.run(["scancel", "-n", name], capture_output=True, timeout=60)


def fill(path: Path) -> None:
    """Every free block of its file system taken (unbuffered: a buffer flushed at close would raise there)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)


def small_dataset(p: Probe) -> Path:
    """A tokenized dataset prepared from a small text in the probe's scratch dir (`launcher data prepare`)."""
    text = p.scratch / "a.txt"
    text.write_text("".join(f"line {i} of a small corpus, words and more words.\n" for i in range(4000)))
    ds = p.scratch / "ds"
    prep = p.launcher(["data", "prepare", str(text), "-o", str(ds)])
    check(prep.rc == 0, f"data prepare: {prep.tail()}")
    return ds


def no_traceback(res: Result, what: str) -> None:
    check("Traceback" not in res.text, f"{what}: a traceback: {res.tail()}")


def last_line(text: str, n: int = 110) -> str:
    """The last non-empty line of a command's output, short and quoted: a probe's evidence."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return repr(lines[-1][:n]) if lines else "''"


def one_local_run(p: Probe, root: Optional[Path] = None, extra: Tuple[str, ...] = ()) -> dict:
    res = p.launch([*QUICK, "train.checkpoint.every=3", *extra], root)
    check(res.rc == 0, f"a local run did not complete: {res.tail()}")
    (run,) = p.runs(root)
    check(run["status"] == "completed", f"the local run reads {run['status']}")
    return run


def copy_run(run: dict, dest_root: Path) -> Path:
    """A run copied into a root of its own (a probe changes the copy, never the original)."""
    src = Path(run["dir"])
    dst = dest_root / "copied" / src.name
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, dst, symlinks=True)
    subprocess.run(["chmod", "-R", "u+w", str(dst)], check=True)
    for shared in ("code", "env", ".seals", ".submitit"):  # what its links, marks and logs are in
        if (src.parent / shared).exists() and not (dst.parent / shared).exists():
            shutil.copytree(src.parent / shared, dst.parent / shared, symlinks=True)
    return dst


# ---- the probes ------------------------------------------------------------------------------------

PROBES: List[Tuple[str, str, Callable[[Probe], str]]] = []


def probe(pid: str, title: str):
    def register(fn: Callable[[Probe], str]) -> Callable[[Probe], str]:
        PROBES.append((pid, title, fn))
        return fn
    return register


@probe("H1", "cancel of a sweep on a full disk stops the jobs first (P11); doctor names the full disk (L3, P13); "
       "status settles the sweep once space is freed (P58)")
def full_disk(p: Probe) -> str:
    if os.geteuid() != 0:
        raise Skipped("needs root to mount an 80 MB tmpfs")
    small = p.scratch / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=80m", "tmpfs", str(small)], check=True, timeout=30)
    try:
        root = small / "runs"
        name, one = p.job_name(), p.job_name()
        res = p.launch(["-m", *SLURM, HOLD, f"submit.job_name={name}", "seed=range(20)"], root)
        check(res.rc == 0, f"the held sweep was not queued: {res.tail()}")
        res = p.launch([*SLURM, HOLD, f"submit.job_name={one}"], root)
        check(res.rc == 0, f"the held run was not queued: {res.tail()}")
        runs = p.runs(root)
        sweep = next(r["sweep_id"] for r in runs if len([x for x in runs if x["sweep_id"] == r["sweep_id"]]) == 20)
        lone = next(r for r in runs if r["sweep_id"] != sweep)
        filler = small / "filler"
        fill(filler)
        # the lone run's job starts on the full disk and dies of it
        job_id = json.loads((Path(lone["dir"]) / "job.json").read_text())["job_id"]
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True, timeout=60)
        deadline = time.time() + 180
        while p.queued(one) and time.time() < deadline:
            time.sleep(1)
        check(not p.queued(one), "the lone job did not end on the full disk in 180 s")
        cancel = p.launcher(["cancel", sweep], root, timeout=120)
        no_traceback(cancel, "cancel on a full disk")
        left = p.queued(name)
        check(not left, f"cancel on a full disk left {len(left)} task(s) queued: {cancel.tail()}")
        doctor = p.launcher(["doctor", lone["dir"]], root, timeout=120)
        no_traceback(doctor, "doctor on a full disk")
        check("disk_full" in doctor.text, f"doctor of a run that died of ENOSPC: {doctor.tail()}")
        filler.unlink()
        status = p.launcher(["status", sweep], root, timeout=120)
        no_traceback(status, "status after the disk was freed")
        states = {r["status"] for r in p.runs(root) if r["sweep_id"] == sweep}
        check(states == {"cancelled"}, f"the cancelled sweep's runs read {sorted(states)} once space was freed")
        return (f"cancel rc {cancel.rc}, queue empty, {cancel.tail(120)!r}; doctor: disk_full; "
                f"20 runs cancelled after space was freed")
    finally:
        p.cleanup()
        subprocess.run(["umount", "-l", str(small)], capture_output=True, timeout=60)


@probe("M1", "a tampered config hidden by deleting the manifest, status, seal mark, metrics, checkpoints (R9)")
def deep_deletion(p: Probe) -> str:
    run = one_local_run(p)
    rdir = Path(run["dir"])
    subprocess.run(["chmod", "-R", "u+w", str(rdir), str(rdir.parent / ".seals")], check=True)
    cfg = rdir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("lr: 0.001", "lr: 0.5"))
    for f in (rdir / "manifest.json", rdir / "status.json", rdir.parent / ".seals" / "0.json", rdir / "metrics.jsonl"):
        f.unlink()
    shutil.rmtree(rdir / "checkpoints")
    show = p.launcher(["show", str(rdir)])
    check(show.rc != 0 and "pending" not in show.out.split("status", 1)[-1][:40],
          f"show of the emptied run: rc {show.rc}: {show.tail()}")
    p.launcher(["status", run["sweep_id"]])
    check(not (rdir / "manifest.json").exists(), "a refresh sealed the tampered config.yaml")
    repro = p.launcher(["reproduce", str(rdir), "submit.dry_run=true"])
    check(repro.rc != 0, f"reproduce accepted the tampered run: {repro.tail()}")
    return f"show rc {show.rc} ({show.err.strip().splitlines()[-1][:100]!r}); not sealed again; reproduce refused"


@probe("M2", "array tasks cancelled while pending, from outside, settle cancelled (P12)")
def pending_array_cancelled(p: Probe) -> str:
    name = p.job_name()
    res = p.launch(["-m", *SLURM, HOLD, f"submit.job_name={name}", "cluster.array_parallelism=1", "seed=range(6)"])
    check(res.rc == 0, f"not queued: {res.tail()}")
    subprocess.run(["scancel", "-n", name], check=True, timeout=60)
    sweep = p.runs()[0]["sweep_id"]
    deadline = time.time() + 120
    states: List[str] = []
    while time.time() < deadline:
        p.launcher(["status", sweep])
        states = sorted(r["status"] for r in p.runs())
        if set(states) == {"cancelled"}:
            return "6 of 6 runs cancelled after `launcher status`"
        time.sleep(2)
    raise Failed(f"the runs read {states}")


@probe("M3", "two `launcher resume RUN` at once: one submits, the other is refused (P19)")
def two_resumes(p: Probe) -> str:
    run = one_local_run(p)
    args = [str(BIN / "launcher"), "resume", run["dir"], "--steps", "9", "--no-wait", "--root", str(p.root())]
    env = dict(os.environ, LAUNCHER_RUNS=str(p.root()), PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                              cwd=str(REPO)) for _ in range(2)]
    outs = [(pr.wait(timeout=300), pr.stdout.read()) for pr in procs]
    ok = [o for rc, o in outs if rc == 0]
    check(len(ok) == 1, f"{len(ok)} of 2 resumes submitted: " + " || ".join(o[-300:] for _, o in outs))
    refused = next(o for rc, o in outs if rc != 0)
    (done,) = p.wait_final(1)
    from_rows = [json.loads(line)["attempt"] for line in (Path(run["dir"]) / "restarts.jsonl").read_text().splitlines()
                 if line.strip()]
    check(done["status"] == "completed" and from_rows == [2], f"status {done['status']}, attempts {from_rows}")
    return f"one attempt 2, completed; the other: {refused.strip().splitlines()[-1][:120]!r}"


@probe("M4", "a poisoned bytecode-cache entry never reaches a snapshot or a job (P22)")
def poisoned_cache(p: Probe) -> str:
    import hashlib

    cache = p.scratch / "bytecode-cache"
    src = REPO / "recipes" / "gpt" / "rng.py"
    data = src.read_bytes()
    key = hashlib.sha256(data).hexdigest()
    marker = p.scratch / "BYTECODE_PWNED"
    evil = p.scratch / "rng.py"
    evil.write_bytes(data + f"\nopen({str(marker)!r}, 'w').write('ran')\n".encode())
    entry = cache / "bytecode" / sys.implementation.cache_tag / key[:2] / f"{key}.pyc"
    entry.parent.mkdir(parents=True)
    py_compile.compile(str(evil), cfile=str(entry), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    (entry.parent / (entry.name + ".sig")).write_text("0" * 64 + "\n")  # a forged signature
    res = p.launch(QUICK, env={"LAUNCHER_BYTECODE_CACHE": str(cache)})
    check(res.rc == 0, f"the run did not complete: {res.tail()}")
    check(not marker.exists(), "the poisoned bytecode ran")
    (run,) = p.runs()
    show = p.launcher(["show", run["dir"]])
    check(show.rc == 0, f"show: {show.tail()}")
    return "the planted entry was compiled again, never run; show intact"


@probe("M5", "a shard byte-flipped after `data prepare` is never trained on (P34)")
def flipped_shard(p: Probe) -> str:
    ds = small_dataset(p)
    shard = sorted((ds / "shards").glob("*.bin"))[0]
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0xFF
    shard.write_bytes(bytes(b))
    res = p.launch([*QUICK, "data=tokens", f"data.path={ds}"])
    if res.rc != 0:
        check(shard.name in res.text, f"refused without naming the shard: {res.tail()}")
        return f"launch refused (rc {res.rc}) naming {shard.name}"
    (run,) = p.runs()
    check(run["status"] == "failed", f"the run trained on the flipped shard and reads {run['status']}")
    doctor = p.launcher(["doctor", run["dir"]])
    check(shard.name in doctor.text, f"the failure does not name the shard: {doctor.tail()}")
    return f"the run failed naming {shard.name}"


@probe("M6", "`launcher cancel` never cancels a job that is not the run's own (P37)")
def foreign_job(p: Probe) -> str:
    victim = p.job_name()
    out = subprocess.run(["sbatch", "--parsable", "-H", "-J", victim, "-o", "/dev/null", "--wrap=true"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    victim_id = out.split(";")[0]
    name = p.job_name()
    res = p.launch([*SLURM, HOLD, f"submit.job_name={name}"])
    check(res.rc == 0, f"not queued: {res.tail()}")
    (run,) = p.runs()
    job_path = Path(run["dir"]) / "job.json"
    job = json.loads(job_path.read_text())
    own = job["job_id"]
    job["job_id"] = victim_id  # what a reused id looks like
    os.chmod(job_path, 0o644)
    job_path.write_text(json.dumps(job))
    cancel = p.launcher(["cancel", run["sweep_id"]])
    no_traceback(cancel, "cancel")
    state = subprocess.run(["squeue", "-h", "-j", victim_id, "-o", "%T"], capture_output=True, text=True,
                           timeout=60).stdout.strip()
    subprocess.run(["scancel", own, victim_id], capture_output=True, timeout=60)
    check(state == "PENDING", f"the foreign job reads {state or 'gone'} after cancel: {cancel.tail()}")
    return f"the foreign job stays PENDING; cancel said {cancel.text.strip().splitlines()[-1][:120]!r}"


@probe("M7", "a 1,000,000-point sweep is refused in seconds naming the key, nothing written (P44)")
def million_points(p: Probe) -> str:
    res = p.launch(["-m", *QUICK, "submit.dry_run=true", "seed=range(1000000)"], timeout=60)
    check(res.rc not in (0, 124), f"rc {res.rc}: {res.tail()}")
    check(res.secs < 10, f"refused after {res.secs:.1f} s")
    check("submit.max_points" in res.text, f"the key is not named: {res.tail()}")
    check(not p.root().exists() or not any(p.root().iterdir()), "something was written under the runs root")
    return f"refused in {res.secs:.1f} s naming submit.max_points"


@probe("L1", "`launcher logs|cancel RUN_DIR` outside --root find the run by its dir (P5)")
def logs_outside(p: Probe) -> str:
    run = one_local_run(p)
    elsewhere = p.root("elsewhere")
    logs = p.launcher(["logs", run["dir"]], elsewhere)
    check(logs.rc == 0 and logs.out.strip(), f"logs: {logs.tail()}")
    cancel = p.launcher(["cancel", run["dir"]], elsewhere)
    check("no run or sweep" not in cancel.text, f"cancel: {cancel.tail()}")
    no_traceback(cancel, "cancel")
    return f"logs rc 0 ({len(logs.out.splitlines())} lines); cancel: {cancel.text.strip().splitlines()[-1][:80]!r}"


SACCT_DOWN = """#!/bin/sh
echo "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection to host:localhost: \
Connection refused" >&2
exit 1
"""


@probe("L2", "while sacct fails (slurmdbd down), listings say so; `runs --json` carries the scheduler's word (P7)")
def sacct_down(p: Probe) -> str:
    name = p.job_name()
    res = p.launch([*SLURM, HOLD, f"submit.job_name={name}"])
    check(res.rc == 0, f"not queued: {res.tail()}")
    subprocess.run(["scancel", "-n", name], check=True, timeout=60)
    shim = p.scratch / "shim"  # sacct as it answers while slurmdbd is down (the daemon itself is shared)
    shim.mkdir()
    (shim / "sacct").write_text(SACCT_DOWN)
    os.chmod(shim / "sacct", 0o755)
    down = p.launcher(["runs"], env={"PATH": f"{shim}:{os.environ['PATH']}"})
    no_traceback(down, "runs while sacct fails")
    check("warning" in down.err and "sacct" in down.err, f"no word that sacct fails: {down.tail()}")
    deadline = time.time() + 60
    while not (row := p.runs()[0]).get("job_ended") and time.time() < deadline:
        time.sleep(1)
    check(bool(row.get("job_ended")) and bool(row.get("job_state")), f"runs --json row: {row}")
    return f"{last_line(down.err)}; runs --json: job_state {row['job_state']!r}"


@probe("L4", "a 10,000-point dry run: planned from the limits, one message, no slot kept back unsaid (P14)")
def ten_thousand_dry(p: Probe) -> str:
    res = p.launch(["-m", *SLURM, "submit.dry_run=true", "seed=range(10000)"], timeout=300)
    no_traceback(res, "dry run")
    lines = [line for line in res.err.splitlines() if line.strip()]  # the notes (stdout: every point's config)
    dup = [line for line, n in collections.Counter(lines).items() if n > 1 and len(line) > 40]
    check(not dup, f"printed twice: {dup[:2]}")
    if res.rc != 0:
        check("slot" in res.text or "wave" in res.text, f"refused without saying why: {res.tail()}")
    check(res.secs < 60, f"{res.secs:.0f} s")
    return f"rc {res.rc} in {res.secs:.1f} s: {lines[-1][:120] if lines else ''!r}"


@probe("L5", "a 5,000-character id: a one-line error in every command, no traceback (P20)")
def long_id(p: Probe) -> str:
    one_local_run(p)
    long = "x" * 5000
    said = []
    for args in (["show", long], ["reproduce", long], ["resume", long], ["doctor", long], ["report", long],
                 ["logs", long], ["cancel", long], ["status", long], ["results", long], ["diff", long, long],
                 ["data", "show", long], ["data", "verify", long]):
        res = p.launcher(args)
        no_traceback(res, args[0])
        check(res.rc != 0, f"{' '.join(args[:2])[:30]} accepted it")
        said.append(args[0])
    return f"{len(said)} commands refused it in one line"


@probe("L6", "SIGTERM to `launcher preflight` settles the rung's run (P21)")
def preflight_sigterm(p: Probe) -> str:
    env = dict(os.environ, LAUNCHER_RUNS=str(p.root()), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(BIN / "launcher"), "preflight", "--root", str(p.root()), "train.steps=100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(p.scratch),
                            start_new_session=False)
    deadline = time.time() + 240
    started = False
    while time.time() < deadline and not started:
        time.sleep(0.5)
        started = any(p.root().glob("*/*/rank_*.json")) or any(p.root().glob("*/*/metrics.jsonl"))
        if proc.poll() is not None:
            break
    check(started, f"no rung started in 240 s (rc {proc.poll()})")
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise Failed("preflight did not stop within 120 s of SIGTERM") from None
    runs = p.runs()
    open_runs = [r for r in runs if r["status"] not in FINAL]
    check(not open_runs, f"left unsettled: {[(r['run_id'], r['status']) for r in open_runs]}")
    return f"rc {proc.returncode}; {len(runs)} run(s), all final: {sorted({r['status'] for r in runs})}"


def _special(p: Probe) -> Tuple[dict, Path]:
    run = one_local_run(p, p.root("base"))
    return run, copy_run(run, p.root())


@probe("L7", "a FIFO as metrics.jsonl: status, report, doctor, diff refuse it by name, never hang (P29)")
def fifo_metrics(p: Probe) -> str:
    run, rdir = _special(p)
    (rdir / "metrics.jsonl").unlink()
    os.mkfifo(rdir / "metrics.jsonl")
    p.launcher(["runs", "--reindex"])
    for args in (["status", rdir.parent.name], ["report", str(rdir), "-o", str(p.scratch / "r.html")],
                 ["doctor", str(rdir)], ["diff", str(rdir), run["dir"]], ["show", str(rdir)]):
        res = p.launcher(args, timeout=40)
        check(res.rc != 124, f"{args[0]} hung on the FIFO")
        no_traceback(res, args[0])
    return "5 commands answered within 40 s, none hung"


@probe("L8", "a 1 GB sparse status.json is refused by its size, not read (P30)")
def sparse_status(p: Probe) -> str:
    run, rdir = _special(p)
    with open(rdir / "status.json", "r+b") as f:
        f.truncate(1 << 30)
    worst = 0.0
    for args in (["show", str(rdir)], ["status", rdir.parent.name], ["results", rdir.parent.name],
                 ["report", str(rdir), "-o", str(p.scratch / "r.html")], ["doctor", str(rdir)]):
        res = p.launcher(args, timeout=60)
        no_traceback(res, args[0])
        worst = max(worst, res.max_rss_mb)
    check(worst < 400, f"peak memory {worst:.0f} MB")
    return f"peak memory {worst:.0f} MB over 5 commands"


@probe("L9", "a rank log symlinked to /dev/zero: logs and doctor read a bounded tail (P31)")
def dev_zero_log(p: Probe) -> str:
    run, rdir = _special(p)
    logs = sorted((rdir.parent / ".submitit").glob("*log.out"))
    check(bool(logs), "no rank log found in the copy's submitit folder")
    for log in logs:
        log.unlink()
        log.symlink_to("/dev/zero")
    worst = 0.0
    for args in (["logs", str(rdir)], ["doctor", str(rdir)]):
        res = p.launcher(args, timeout=60)
        check(res.rc != 124, f"{args[0]} ran past 60 s")
        worst = max(worst, res.max_rss_mb)
    check(worst < 500, f"peak memory {worst:.0f} MB")
    return f"peak memory {worst:.0f} MB"


@probe("L10", "a 120 KB tag: the dry run's time stays linear in the override's length (P42)")
def long_tag(p: Probe) -> str:
    small = p.launch([*QUICK, "submit.dry_run=true", f"tags=[{'t' * 12_000}]"], timeout=120)
    big = p.launch([*QUICK, "submit.dry_run=true", f"tags=[{'t' * 120_000}]"], timeout=120)
    check(big.rc != 124, "the 120 KB tag ran past 120 s")
    check(big.secs < max(5.0, 3 * small.secs), f"12 KB {small.secs:.1f} s, 120 KB {big.secs:.1f} s")
    return f"12 KB {small.secs:.1f} s, 120 KB {big.secs:.1f} s (rc {big.rc})"


@probe("L11", "`data prepare` output readable by the team under umask 022 (P51)")
def dataset_mode(p: Probe) -> str:
    text = p.scratch / "a.txt"
    text.write_text("words of a corpus\n" * 2000)
    old = os.umask(0o022)
    try:
        res = p.launcher(["data", "prepare", str(text), "-o", str(p.scratch / "ds")])
    finally:
        os.umask(old)
    check(res.rc == 0, f"data prepare: {res.tail()}")
    ds = p.scratch / "ds"
    modes = {str(f.relative_to(p.scratch)): f.stat().st_mode & 0o777 for f in [ds, *ds.rglob("*")]}
    closed = {k: oct(v) for k, v in modes.items() if not v & 0o044}
    check(not closed, f"not readable by others: {closed}")
    return f"{len(modes)} paths, dir {oct(modes['ds'])}"


@probe("L12", "a runs root that is a file or under /proc is refused naming submit.runs_root (P52)")
def bad_roots(p: Probe) -> str:
    for bad in ("/etc/passwd", "/proc/1"):
        res = p.launch([*QUICK, f"submit.runs_root={bad}"], timeout=120)
        no_traceback(res, bad)
        check(res.rc != 0 and "submit.runs_root" in res.text, f"{bad}: rc {res.rc}: {res.tail()}")
    return "both refused naming submit.runs_root"


@probe("P32", "a deterministic exception in the same step of each attempt ends the run, not 3 restarts")
def repeated_exception(p: Probe) -> str:
    res = p.launch([*QUICK, "train.fail_at_step=3"], timeout=300)
    (run,) = p.runs()
    check(run["status"] == "failed", f"the run reads {run['status']}")
    attempts = [json.loads(line) for line in (Path(run["dir"]) / "restarts.jsonl").read_text().splitlines()
                if line.strip()] if (Path(run["dir"]) / "restarts.jsonl").exists() else []
    check(len(attempts) <= 1, f"{len(attempts) + 1} attempts")
    return f"failed after {len(attempts) + 1} attempts (rc {res.rc})"


@probe("P50", "a change between the run reading completed and its seal is caught, never sealed in (Slurm)")
def seal_window(p: Probe) -> str:
    name = p.job_name()
    res = p.launch([*SLURM, f"submit.job_name={name}"])
    check(res.rc == 0, f"not queued: {res.tail()}")
    (run,) = p.runs()
    rdir = Path(run["dir"])
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            state = json.loads((rdir / "status.json").read_text()).get("status")
        except (OSError, ValueError):
            state = None
        if state in FINAL:
            break
        time.sleep(0.02)
    else:
        raise Failed("the run did not end in 300 s")
    if (rdir / "manifest.json").exists():
        return f"read {state} with its manifest already in place: no window"
    cfg = rdir / "config.yaml"  # in the window: the run reads final, its seal job has not sealed it yet
    os.chmod(cfg, 0o644)
    cfg.write_text(cfg.read_text().replace("lr: 0.001", "lr: 0.5"))
    deadline = time.time() + 120
    while True:  # until the seal job has sealed it or refused to (show reads a due seal as intact)
        show = p.launcher(["show", str(rdir)])
        if (rdir / "manifest.json").exists() or show.rc != 0 or time.time() > deadline:
            break
        time.sleep(1)
    check(show.rc != 0 and "config.yaml" in show.text, f"the change in the window was sealed in: {show.tail()}")
    return f"changed in the window, then named by show: {show.err.strip().splitlines()[-1][-120:]!r}"


@probe("P55", "`launcher logs` of a copied archive prints the copy's logs, not its source's")
def copied_logs(p: Probe) -> str:
    run, rdir = _special(p)
    for log in (rdir.parent / ".submitit").glob("*log.out"):
        log.unlink()  # (a hard link of the original's? never written through)
        log.write_text("THE COPY'S LOG\n")
    res = p.launcher(["logs", str(rdir)])
    check("THE COPY'S LOG" in res.out, f"logs of the copy: {res.tail()}")
    return "the copy's own log"


@probe("R5", "nodes=10000, gpus_per_node=10000 refused in seconds naming both keys")
def huge_world(p: Probe) -> str:
    res = p.launch(["cluster=local_slurm", "cluster.nodes=10000", "cluster.gpus_per_node=10000",
                    "train.global_batch_size=400000000"], timeout=60)  # a batch the layout divides
    check(res.rc != 0 and "cluster.nodes" in res.text and res.secs < 10,
          f"rc {res.rc} in {res.secs:.1f} s: {res.tail()}")
    return f"refused in {res.secs:.1f} s"


@probe("R10", "junk run.json and a !!python config: one line each, nothing executed")
def junk_records(p: Probe) -> str:
    run, rdir = _special(p)
    marker = p.scratch / "YAML_PWNED"
    for i, junk in enumerate(["[1, 2]", "{}", "\x00\xff garbage", '"s"']):
        d = rdir.parent / f"junk{i}"
        d.mkdir()
        (d / "run.json").write_text(junk)
    (rdir / "config.yaml").write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    res = p.launcher(["runs", "--reindex"])
    no_traceback(res, "runs --reindex")
    check(not marker.exists(), "the !!python tag ran")
    return f"rc {res.rc}; {res.text.count('skipped')} 'skipped' line(s); nothing executed"


@probe("R13", "a YAML alias bomb in config.yaml is refused in a second")
def alias_bomb(p: Probe) -> str:
    run, rdir = _special(p)
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    (rdir / "config.yaml").write_text("\n".join(lines) + "\n")
    res = p.launcher(["runs", "--reindex"], timeout=60)
    no_traceback(res, "runs --reindex")
    check(res.secs < 10, f"{res.secs:.1f} s")
    return f"{res.secs:.1f} s, rc {res.rc}"


@probe("P26", "a truncated status.json: named, no traceback")
def truncated_status(p: Probe) -> str:
    run, rdir = _special(p)
    (rdir / "status.json").write_text('{"state": "comp')
    res = p.launcher(["show", str(rdir)])
    no_traceback(res, "show")
    check("status.json" in res.text, f"show: {res.tail()}")
    return f"show rc {res.rc}: names status.json"


@probe("P36", "`launcher cancel` of a foreign job id and of a completed run: nothing cancelled")
def cancel_foreign_id(p: Probe) -> str:
    run = one_local_run(p)
    victim = p.job_name()
    vid = subprocess.run(["sbatch", "--parsable", "-H", "-J", victim, "-o", "/dev/null", "--wrap=true"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().split(";")[0]
    a = p.launcher(["cancel", vid])
    b = p.launcher(["cancel", run["run_id"]])
    state = subprocess.run(["squeue", "-h", "-j", vid, "-o", "%T"], capture_output=True, text=True,
                           timeout=60).stdout.strip()
    p.cleanup()
    no_traceback(a, "cancel JOBID")
    no_traceback(b, "cancel RUN")
    check(state == "PENDING", f"the foreign job reads {state or 'gone'}")
    check(p.runs()[0]["status"] == "completed", "the completed run changed")
    return "foreign job untouched; the completed run stays completed"


@probe("P43", "train.steps beyond 64 bits refused naming the key")
def huge_steps(p: Probe) -> str:
    res = p.launch([*QUICK[1:], "train.steps=99999999999999999999999"], timeout=60)
    check(res.rc != 0 and "train.steps" in res.text, f"rc {res.rc}: {res.tail()}")
    no_traceback(res, "launch")
    return f"refused in {res.secs:.1f} s"


@probe("P47", "resume of a running run, retry with nothing failed, reproduce into /proc/self: one line each")
def refused_in_one_line(p: Probe) -> str:
    run = one_local_run(p)
    said = []
    for args in (["retry", run["sweep_id"], "--failed"], ["reproduce", run["dir"], "submit.runs_root=/proc/self"]):
        res = p.launcher(args, timeout=120)
        no_traceback(res, args[0])
        said.append(f"{args[0]} rc {res.rc}")
    return "; ".join(said)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated probe ids (default: all)")
    ap.add_argument("--list", action="store_true", help="list the probes and exit")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dirs")
    args = ap.parse_args()
    # probes_held imports this module as `probes`: the same module object (run as a script it is
    # __main__), so that its probes land in this PROBES, after this module's own
    sys.modules.setdefault("probes", sys.modules[__name__])
    import probes_held  # noqa: F401  (registers the rows that held)

    if args.list:
        for pid, title, _ in PROBES:
            print(f"{pid:5s} {title}")
        return
    wanted = {s.strip().upper() for s in args.only.split(",") if s.strip()}
    own = {pid for pid, _, _ in PROBES}
    # a row re-run by a defect's probe is chosen by the id its title names too (--only P11: H1)
    chosen = [pr for pr in PROBES if not wanted or wanted & ({pr[0]} | set(re.findall(r"\b[RP]\d+\b", pr[1])) - own)]
    if shutil.which("squeue") is None or subprocess.run(["squeue", "-h"], capture_output=True,
                                                        timeout=60).returncode != 0:
        sys.exit("the local Slurm cluster is not up: scripts/slurm-local.sh up, and export SLURM_CONF")
    scratch = Path(tempfile.mkdtemp(prefix="probes-"))
    verdicts: Dict[str, str] = {}
    try:
        for pid, title, fn in chosen:
            p = Probe(pid, scratch / pid)
            t0 = time.perf_counter()
            try:
                said, verdict = fn(p), "OK"
            except Skipped as e:
                said, verdict = str(e), "SKIP"
            except Failed as e:
                said, verdict = str(e), "FAIL"
            except Exception as e:  # the probe itself broke: a failure too, with its cause
                said, verdict = f"{type(e).__name__}: {e}", "FAIL"
            finally:
                p.cleanup()
            verdicts[pid] = verdict
            print(f"{pid:5s} {verdict:4s} {time.perf_counter() - t0:6.1f} s  {title}\n      {said}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    counts = {v: list(verdicts.values()).count(v) for v in ("OK", "FAIL", "SKIP")}
    print(f"{len(verdicts)} probes: {counts['OK']} OK, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
