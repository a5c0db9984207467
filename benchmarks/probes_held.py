"""The round-4 probes that held (shared/reviews/s4-probes.md: R1-R13, P1-P66 whose verdict is OK, and the
notes P8 and P38), re-run as the reviewer ran them; each probe's pass mark is the review's "what held".

Imported by probes.py's main(), which runs them after its own: the framework (Probe, check, the @probe
registry) lives there. A probe that only reads or copies an archive works on a copy of one sealed local
run made once per session (``pristine``, as the reviewer's `sealed_pristine`); the Slurm run that carries
secrets is made once too (``secret_run``). A row this machine cannot re-run says SKIP and why.
"""
from __future__ import annotations

import concurrent.futures
import html.parser
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from probes import (
    BIN,
    HOLD,
    QUICK,
    REPO,
    SLURM,
    Failed,
    Probe,
    Skipped,
    check,
    copy_run,
    fill,
    last_line,
    no_traceback,
    one_local_run,
    probe,
    small_dataset,
)

# ---- shared fixtures ---------------------------------------------------------------------------

_FIXTURES: Dict[Tuple[Path, str], Any] = {}
# secret values the secret_run carries: random per session, so any hit is this session's leak
SECRET = {"HF_TOKEN": f"hf_{os.urandom(12).hex()}", "MY_DB_PASSWORD": f"pw{os.urandom(12).hex()}",
          "HF_TOKEN2": f"hf_{os.urandom(12).hex()}"}


def fixture(p: Probe, name: str, make: Callable[[Probe], Any]) -> Any:
    """``make``'s result, made once per session in a scratch dir of its own beside the probes'."""
    key = (p.scratch.parent, name)
    if key not in _FIXTURES:
        maker = Probe(f"fix{name}", p.scratch.parent / f"fixture-{name}")
        try:
            _FIXTURES[key] = make(maker)
        finally:
            maker.cleanup()
    return _FIXTURES[key]


def pristine(p: Probe) -> dict:
    """One sealed local run (6 steps, checkpoints at 3 and 6), never changed: probes change copies."""
    def make(maker: Probe) -> dict:
        run = one_local_run(maker)
        wait_sealed(Path(run["dir"]))
        return run
    return fixture(p, "pristine", make)


def pristine_copy(p: Probe) -> Tuple[dict, Path]:
    run = pristine(p)
    return run, copy_run(run, p.root())


def secret_launch(p: Probe, name: str) -> List[str]:
    """A Slurm run's overrides that carry secrets: two in cluster.env, one exported by a setup line."""
    return [*SLURM, f"submit.job_name={name}", f"+cluster.env.HF_TOKEN={SECRET['HF_TOKEN']}",
            f"+cluster.env.MY_DB_PASSWORD={SECRET['MY_DB_PASSWORD']}",
            f"cluster.setup=['export HF_TOKEN2={SECRET['HF_TOKEN2']}']"]


def secret_run(p: Probe) -> Tuple[dict, Path]:
    """(the run, its runs root): a completed, sealed Slurm run launched with secret_launch's secrets."""
    def make(maker: Probe) -> Tuple[dict, Path]:
        res = maker.launch(secret_launch(maker, maker.job_name()))
        check(res.rc == 0, f"the secret-carrying run was not queued: {res.tail()}")
        (run,) = maker.wait_final(1)
        check(run["status"] == "completed", f"the secret-carrying run reads {run['status']}")
        wait_sealed(Path(run["dir"]))
        return run, maker.root()
    return fixture(p, "secrets", make)


def merged(base: List[str], *extra: str) -> List[str]:
    """``base`` with ``extra`` overriding the keys they share (each key given once on the command line)."""
    keys = {e.split("=", 1)[0].lstrip("+~") for e in extra}
    return [b for b in base if b.split("=", 1)[0].lstrip("+~") not in keys] + list(extra)


def wait_sealed(rdir: Path, timeout: float = 120) -> None:
    """Until the run's manifest is written (a Slurm run's seal job comes after `completed`)."""
    deadline = time.time() + timeout
    while not (rdir / "manifest.json").exists():
        check(time.time() < deadline, f"{rdir} not sealed after {timeout:.0f} s")
        time.sleep(0.5)


def tiny_repo(p: Probe, name: str = "tree") -> Path:
    """A git source tree of its own to launch from (the snapshot takes it; the launcher's recipes bundled)."""
    tree = p.scratch / name
    tree.mkdir()
    (tree / "README.md").write_text("a user's tree\n")
    for args in (["init", "-q"], ["add", "README.md"],
                 ["-c", "user.name=probe", "-c", "user.email=p@example.com", "commit", "-qm", "init"]):
        subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, timeout=60)
    return tree


def snapshot_info(root: Path) -> dict:
    (info,) = root.glob("*/code/.snapshot.json")
    return json.loads(info.read_text())


def env_of(p: Probe, root: Optional[Path] = None, **extra: str) -> Dict[str, str]:
    """The environment Probe.run gives a command, for one started in the background."""
    return dict(os.environ, LAUNCHER_RUNS=str(root or p.root()), PYTHONUNBUFFERED="1", TMPDIR=str(p.scratch),
                **extra)


def hits(root: Path, needles: List[str]) -> List[str]:
    """Files under ``root`` holding any of ``needles`` (symlinks not followed)."""
    found = []
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = Path(dirpath, f)
            if path.is_symlink() or not path.is_file():
                continue
            data = path.read_bytes()
            found += [str(path.relative_to(root)) for n in needles if n.encode() in data]
    return found


def chmod_w(*paths: Path) -> None:
    subprocess.run(["chmod", "-R", "u+w", *map(str, paths)], check=True, timeout=60)


def read_cmds(p: Probe, rdir: Path, other: str) -> List[List[str]]:
    """What the reviewer ran on a tampered archive: every command that reads one."""
    sweep = json.loads((rdir / "run.json").read_text())["sweep_id"]
    return [["runs", "--reindex"], ["show", str(rdir)], ["status", str(rdir)], ["doctor", str(rdir)],
            ["logs", str(rdir)], ["report", str(rdir), "-o", str(p.scratch / "r.html")],
            ["results", sweep], ["diff", str(rdir), other]]


def read_all(p: Probe, rdir: Path, other: str, timeout: float = 60) -> Dict[str, Any]:
    """Each reading command once: no traceback, none hung, rc 0-2; their results by name."""
    out = {}
    for args in read_cmds(p, rdir, other):
        res = p.launcher(args, timeout=timeout)
        check(res.rc != 124, f"{args[0]} ran past {timeout:.0f} s")
        no_traceback(res, args[0])
        check(res.rc in (0, 1, 2), f"{args[0]} rc {res.rc}: {res.tail()}")
        out[" ".join(args[:2]) if args[0] == "runs" else args[0]] = res
    return out


# ---- R: the round-3 findings re-tested ----------------------------------------------------------


@probe("R1", "a symlinked dir planted in a sealed snapshot: show names it, reproduce refuses, nothing runs")
def planted_symlink(p: Probe) -> str:
    run = one_local_run(p)  # its own: a copy's snapshot is the original's (code/snapshot.json)
    rdir = Path(run["dir"])
    code = rdir.parent / "code"
    chmod_w(code)
    evil, marker = p.scratch / "evil", p.scratch / "SITECUSTOMIZE_RAN"
    evil.mkdir()
    (evil / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (code / "sitecustomize").symlink_to(evil)
    show = p.launcher(["show", str(rdir)])
    check(show.rc != 0 and "symlink" in show.text, f"show rc {show.rc}: {show.tail()}")
    repro = p.launcher(["reproduce", str(rdir)], timeout=300)
    no_traceback(repro, "reproduce")
    check(repro.rc != 0, f"reproduce accepted it: {repro.tail()}")
    check(not marker.exists(), "the planted module ran")
    check(len(p.runs()) == 1, "reproduce published a run")
    return f"show: {last_line(show.text)}; reproduce rc {repro.rc}, nothing ran"


def _interrupted_launch(p: Probe, sig: int) -> Tuple[int, str, str, List[dict]]:
    """A 20-point held sweep whose launch gets ``sig`` as soon as its array is queued: (rc, output,
    job name, the runs `launcher runs` lists after it)."""
    name = p.job_name()
    proc = subprocess.Popen([str(BIN / "launch"), "-m", *SLURM, HOLD, f"submit.job_name={name}", "seed=range(20)"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env_of(p),
                            cwd=str(REPO))
    deadline = time.time() + 240
    while proc.poll() is None and not p.queued(name) and time.time() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(sig)
    out = proc.communicate(timeout=120)[0]
    rc = 128 - proc.returncode if proc.returncode < 0 else proc.returncode  # as a shell says it
    check(bool(p.queued(name)) or rc != 0, f"nothing was queued: {out[-400:]}")
    listing = p.run([str(BIN / "launcher"), "runs", "--root", str(p.root())])  # repairs a launch cut short
    no_traceback(listing, "runs after the interrupted launch")
    partial = [str(x) for x in p.root().rglob("*.partial")]
    check(not partial, f".partial left after `launcher runs`: {partial[:3]}")
    return rc, out + listing.text, name, p.runs()


def _queue_emptied(p: Probe, name: str, runs: List[dict]) -> str:
    if p.queued(name) and runs:
        p.launcher(["cancel", runs[0]["sweep_id"]], timeout=120)
    left = p.queued(name)
    check(not left, f"{len(left)} task(s) still queued after `launcher cancel`")
    return "queue empty"


@probe("R2", "SIGTERM to launch just after sbatch: stopped, every run published or repaired, cancel empties the queue")
def sigterm_after_sbatch(p: Probe) -> str:
    rc, out, name, runs = _interrupted_launch(p, signal.SIGTERM)
    check(len(runs) == 20, f"{len(runs)} of 20 runs listed")
    # the signal lands a few ms after sbatch: mid-launch (stopped), or once it had submitted all
    said = "stopped (SIGTERM received)" if "SIGTERM" in out else "after it had submitted" if "submitted" in out \
        else "killed"
    return f"launch rc {rc}, {said}; 20 runs, no .partial; {_queue_emptied(p, name, runs)}"


@probe("R3", "name='x${nope}' with an HF_TOKEN override, single and -m: one-line error naming `name`, no secret")
def interpolation_error(p: Probe) -> str:
    said = []
    for multi in ([], ["-m"]):
        res = p.launch([*multi, *QUICK, "submit.dry_run=true", "name=x${nope}",
                        f"+cluster.env.HF_TOKEN={SECRET['HF_TOKEN']}"], timeout=120)
        no_traceback(res, "launch")
        check(res.rc != 0 and "- name: cannot be resolved" in res.text, f"rc {res.rc}: {res.tail()}")
        check(SECRET["HF_TOKEN"] not in res.text, f"the token is printed: {res.tail()}")
        said.append(f"{'-m' if multi else 'single'} rc {res.rc}")
    return "; ".join(said) + ": '- name: cannot be resolved', the token never printed"


@probe("R4", "the three Hydra override errors (group option, key, syntax) with a secret: never print it")
def override_errors(p: Probe) -> str:
    token = f"+cluster.env.HF_TOKEN={SECRET['HF_TOKEN']}"
    said = []
    for bad in ("cluster=nope", "nokey=1", "train.steps=[1,"):
        res = p.launch([*QUICK, "submit.dry_run=true", token, bad], timeout=120)
        check(res.rc != 0, f"{bad} accepted")
        check(SECRET["HF_TOKEN"] not in res.text, f"{bad}: the token is printed: {res.tail()}")
        said.append(f"{bad} rc {res.rc}{' (redacted)' if '<redacted>' in res.text else ''}")
    return "; ".join(said)


@probe("R6", "cluster.setup `export HF_TOKEN2=...` of a Slurm run: zero hits under the runs root")
def setup_secret(p: Probe) -> str:
    run, root = secret_run(p)
    found = hits(root, list(SECRET.values()))
    check(not found, f"secret values found in {found[:5]}")
    return f"0 hits for 3 secrets in {sum(len(f) for _, _, f in os.walk(root))} files"


@probe("R7", "a symlink to .docker/config.json in the source tree: listed as refused, never copied")
def docker_link(p: Probe) -> str:
    tree = tiny_repo(p)
    cfg = p.scratch / "home" / ".docker" / "config.json"
    cfg.parent.mkdir(parents=True)
    auth = f"AUTH{os.urandom(8).hex()}"
    cfg.write_text(json.dumps({"auths": {"registry.example.com": {"auth": auth}}}))
    (tree / "dockercfg").symlink_to(cfg)
    res = p.launch([*SLURM, HOLD, f"submit.job_name={p.job_name()}"], cwd=tree)
    check(res.rc == 0, f"launch: {res.tail()}")
    info = snapshot_info(p.root())
    check("dockercfg" in info["refused"], f"refused: {info['refused']}")
    found = hits(p.root(), [auth])
    check(not found, f"the auth value is in {found}")
    return f"refused {info['refused']}; 0 hits under the root"


def _checkpoints(rdir: Path) -> List[Path]:
    return sorted(d for d in (rdir / "checkpoints").iterdir() if d.is_dir() and not d.is_symlink())


@probe("R8", "a checkpoint added, one removed, `latest` re-pointed, model.pt truncated: show names each")
def checkpoint_tampering(p: Probe) -> str:
    run = pristine(p)
    said = []
    for what in ("added", "removed", "re-pointed", "truncated"):
        rdir = copy_run(run, p.root(what))
        ckpts = _checkpoints(rdir)
        if what == "added":
            shutil.copytree(ckpts[-1], rdir / "checkpoints" / "step_99")
        elif what == "removed":
            shutil.rmtree(ckpts[0])
        elif what == "re-pointed":
            latest = rdir / "checkpoints" / "latest"
            check(latest.exists() or latest.is_symlink(), f"no checkpoints/latest: {os.listdir(rdir / 'checkpoints')}")
            if latest.is_symlink():
                latest.unlink()
                latest.symlink_to(ckpts[0].name)
            else:
                latest.write_text(latest.read_text().replace(ckpts[-1].name, ckpts[0].name))
        else:
            model = sorted(ckpts[-1].rglob("model.pt"))[0]
            with open(model, "r+b") as f:
                f.truncate(model.stat().st_size // 2)
        show = p.launcher(["show", str(rdir)], root=p.root(what))
        named = {"added": "added", "removed": "missing", "re-pointed": "re-pointed", "truncated": "changed"}[what]
        check(show.rc != 0 and named in show.text, f"{what}: show rc {show.rc}: {show.tail()}")
        said.append(f"{what}: rc {show.rc} '{named}'")
    return "; ".join(said)


def _tmpfs(p: Probe, size_mb: int) -> Path:
    if os.geteuid() != 0:
        raise Skipped(f"needs root to mount a {size_mb} MB tmpfs")
    small = p.scratch / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(small)], check=True, timeout=30)
    return small


def _umount(small: Path) -> None:
    subprocess.run(["umount", "-l", str(small)], capture_output=True, timeout=60)


@probe("R11", "`launcher runs` on a full disk: a warning that the index cannot be written, the runs listed, rc 0")
def runs_full_disk(p: Probe) -> str:
    run = pristine(p)
    small = _tmpfs(p, 64)
    try:
        root = small / "runs"
        copy_run(run, root)
        fill(small / "filler")
        res = p.launcher(["runs", "--json"], root)
        no_traceback(res, "runs")
        check(res.rc == 0 and "cannot be written" in res.err, f"rc {res.rc}: {res.tail()}")
        check(len(json.loads(res.out)) == 1, f"listed: {res.out[:200]}")
        return f"rc 0, 1 run listed: {last_line(res.err)}"
    finally:
        _umount(small)


def _tty(p: Probe, args: List[str], root: Path) -> str:
    """A launcher command's output as a terminal shows it (`script`: a pty)."""
    cmd = shlex.join([str(BIN / "launcher"), *args, "--root", str(root)])
    res = p.run(["script", "-qec", cmd, "/dev/null"], root, env={"TERM": "xterm", "COLUMNS": "200"}, timeout=120)
    no_traceback(res, f"{args[0]} on a tty")
    return res.text


@probe("R12", "ESC/OSC sequences in an archived name, tags, config and error: no raw ESC]0; or ESC[2J on a tty")
def escapes_on_tty(p: Probe) -> str:
    run, rdir = pristine_copy(p)
    osc, clear = "\x1b]0;PWNED\x07", "\x1b[2J"
    evil = f"n{osc}{clear}"
    for rel, keys in (("run.json", ("name", "tags")), ("status.json", ("error",))):
        rec = json.loads((rdir / rel).read_text())
        rec.update({k: [evil] if k == "tags" else evil for k in keys})
        (rdir / rel).write_text(json.dumps(rec))
    cfg = rdir / "config.yaml"
    yaml_evil = '"n\\e]0;PWNED\\a\\e[2J"'
    text = re.sub(r"(?m)^name: .*$", lambda _: f"name: {yaml_evil}", cfg.read_text())
    cfg.write_text(re.sub(r"(?m)^tags: .*$", lambda _: f"tags: [{yaml_evil}]", text))
    p.launcher(["runs", "--reindex"])
    raw, shown = [], []
    for args in (["show", str(rdir)], ["diff", str(rdir), run["dir"]], ["runs", "--all"], ["status", str(rdir)],
                 ["results", run["sweep_id"]], ["doctor", str(rdir)]):
        out = _tty(p, args, p.root())
        raw += [args[0] for seq in ("\x1b]0;", clear) if seq in out]
        shown += [args[0]] if "PWNED" in out else []
    check(not raw, f"raw sequences printed by {sorted(set(raw))}")
    check(bool(shown), "no command printed the planted text: the probe proves nothing")
    return f"6 commands on a pty, {len(shown)} show the text ({', '.join(shown)}): none prints a raw ESC]0; or ESC[2J"


# ---- P: new probes ------------------------------------------------------------------------------


class _Audit(html.parser.HTMLParser):
    """What in a page could run: a script or svg element, an on* attribute, an image not embedded."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: List[str] = []

    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        if tag in ("script", "svg", "iframe", "object", "embed"):
            self.bad.append(f"<{tag}>")
        self.bad += [f"<{tag} {k}=>" for k, _ in attrs if k.lower().startswith("on")]
        src = dict(attrs).get("src")
        if tag == "img" and not (src or "").startswith("data:"):
            self.bad.append(f"<img src={src!r}>")


XSS = {"name": "'<script>alert(1)</script>'", "tags": "['<img src=x onerror=alert(2)>']",
       "+recipe.params.note": "'</script><svg onload=alert(3)>'"}


@probe("P1", "XSS in name, tags, a recipe param and metric keys: the run and sweep reports hold no script")
def report_xss(p: Probe) -> str:
    res = p.launch(["-m", *QUICK, *(f"{k}={v}" for k, v in XSS.items()), "seed=1,2"], timeout=300)
    check(res.rc == 0, f"the sweep did not complete: {res.tail()}")
    runs = p.runs()
    check(len(runs) == 2, f"{len(runs)} runs")
    for r in runs:  # metric keys no run of the recipe writes: planted, $...$ for matplotlib's mathtext too
        with open(Path(r["dir"]) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": 7, "<img src=y onerror=alert(4)>": 1.0, "$\\frac{x$<svg onload=alert(5)>": 2.0})
                    + "\n")
    pages = {"run": p.scratch / "run.html", "sweep": p.scratch / "sweep.html"}
    for what, target in (("run", runs[0]["dir"]), ("sweep", runs[0]["sweep_id"])):
        rep = p.launcher(["report", target, "-o", str(pages[what])], timeout=120)
        no_traceback(rep, f"{what} report")
        check(rep.rc == 0, f"{what} report rc {rep.rc}: {rep.tail()}")
    said = []
    for what, page in pages.items():
        text = page.read_text()
        audit = _Audit()
        audit.feed(text)
        check(not audit.bad, f"{what} report: {audit.bad[:5]}")
        check("&lt;script&gt;" in text or "&lt;img" in text, f"{what} report: the planted text is not shown")
        said.append(f"{what} {len(text) // 1024} KB clean")
    return "; ".join(said)


def _probe_user() -> str:
    if os.geteuid() != 0:
        raise Skipped("needs root to add a second Unix user")
    user = f"probeu{os.urandom(2).hex()}"
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", user], check=True, capture_output=True, timeout=60)
    return user


def _as_user_hits(user: str, since: Path, needles: List[str]) -> List[str]:
    """Files ``user`` can read in /tmp, /var/tmp and /dev/shm, changed since ``since``, holding a needle."""
    pattern = " ".join(f"-e {shlex.quote(n)}" for n in needles)
    cmd = (f"find /tmp /var/tmp /dev/shm -xdev -type f -newer {shlex.quote(str(since))} -readable -size -64M "
           f"-print0 2>/dev/null | xargs -0 -r grep -lF {pattern} 2>/dev/null")
    out = subprocess.run(["su", user, "-s", "/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=120)
    return [line for line in out.stdout.splitlines() if line.strip()]


@probe("P2", "a second Unix user reads /tmp, /var/tmp, /dev/shm during and after a job with secrets: no hit")
def other_user_reads(p: Probe) -> str:
    user = _probe_user()
    since = Path(f"/tmp/probe-p2-since-{os.urandom(3).hex()}")
    try:
        since.touch()
        os.chmod(since, 0o644)
        name = p.job_name()
        res = p.launch(merged(secret_launch(p, name), "train.steps=60"))
        check(res.rc == 0, f"not queued: {res.tail()}")
        (run,) = p.runs()
        deadline = time.time() + 180
        while not (Path(run["dir"]) / "metrics.jsonl").exists() and p.queued(name) and time.time() < deadline:
            time.sleep(0.5)
        during = _as_user_hits(user, since, list(SECRET.values()))
        p.wait_final(1)
        after = _as_user_hits(user, since, list(SECRET.values()))
        check(not during and not after, f"{user} found secrets: during {during[:3]}, after {after[:3]}")
        return f"{user}: 0 hits during and after the job"
    finally:
        since.unlink(missing_ok=True)
        subprocess.run(["userdel", "-f", user], capture_output=True, timeout=60)


# what shapes training (the review's allowlist: RANK, SLURM_*, MASTER_*, and the NCCL/CUDA/... families)
ENV_ALLOWED = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|PYTHONHASHSEED|(MASTER|SLURM|NCCL|CUDA|CUBLAS|OMP|TORCH|MKL|"
                         r"GLOO|NVIDIA|DS|WANDB|HYDRA|SUBMITIT)_\w+)$")


@probe("P3", "a world-readable run dir: training-env.json an allowlist with no secret, .submitit pickles none")
def readable_run_dir(p: Probe) -> str:
    run, root = secret_run(p)
    rdir = Path(run["dir"])
    env = json.loads((rdir / "env" / "training-env.json").read_text())
    env = env.get("env", env) if isinstance(env, dict) else env
    odd = sorted(k for k in env if not ENV_ALLOWED.match(k))
    check(not odd, f"training-env.json holds {odd[:8]}")
    text = json.dumps(env)
    check(not any(v in text for v in SECRET.values()), "training-env.json holds a secret value")
    pkls = list(rdir.parent.glob(".submitit/**/*.pkl"))
    check(bool(pkls), "no .submitit pickle to read")
    found = [str(f.name) for f in pkls for v in SECRET.values() if v.encode() in f.read_bytes()]
    check(not found, f"pickles holding a secret: {found}")
    return f"{len(env)} variables, all allowlisted; {len(pkls)} pickle(s), no secret"


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant_pickles(rdir: Path, marker: Path) -> List[Path]:
    """Every .submitit pickle and checkpoint .pt of a run's copy replaced by one that runs a command."""
    sub = rdir.parent / ".submitit"
    sub.mkdir(exist_ok=True)
    targets = [*sub.rglob("*.pkl"), *(rdir / "checkpoints").rglob("*.pt")]
    targets += [] if any(t.suffix == ".pkl" for t in targets) else [sub / f"0_0_{rdir.name}_submitted.pkl"]
    for t in targets:
        if t.exists():
            t.unlink()
        t.write_bytes(pickle.dumps(_Evil(marker)))
    return targets


@probe("P4", "untrusted archive with __reduce__ pickles in .submitit and checkpoints: no command unpickles")
def pickles_never_loaded(p: Probe) -> str:
    run, rdir = pristine_copy(p)
    marker = p.scratch / "UNPICKLED"
    planted = plant_pickles(rdir, marker)
    read_all(p, rdir, run["dir"])
    for args in (["runs"], *([cmd, str(rdir), "submit.dry_run=true"] for cmd in ("reproduce", "resume"))):
        res = p.launcher(args, timeout=120)
        no_traceback(res, args[0])
    check(not marker.exists(), "a planted pickle ran")
    return f"{len(planted)} pickles planted; 11 commands, no marker"


@probe("P6", "slurmctld stopped mid-run for ~15 s, then restarted: runs works, the run completes")
def controller_outage(p: Probe) -> str:
    name = p.job_name()
    steps = 400
    res = p.launch(merged(SLURM, f"submit.job_name={name}", f"train.steps={steps}", "train.checkpoint.every=50"))
    check(res.rc == 0, f"not queued: {res.tail()}")
    (run,) = p.runs()
    rdir = Path(run["dir"])
    deadline = time.time() + 180
    while not (rdir / "metrics.jsonl").exists() or len((rdir / "metrics.jsonl").read_text().splitlines()) < 100:
        check(time.time() < deadline, "the job did not reach step 100 in 180 s")
        time.sleep(0.2)
    # the controller stopped for 15 s by the script that started it (scripts/slurm-local.sh), a listing
    # asked during the outage
    outage = subprocess.Popen([str(REPO / "scripts" / "slurm-local.sh"), "restart-controller", "15"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(5)
    during = p.launcher(["runs"], timeout=120)
    out, _ = outage.communicate(timeout=180)
    check(outage.returncode == 0, f"the controller did not come back: {out[-600:]}")
    no_traceback(during, "runs during the outage")
    check(during.rc == 0, f"runs failed during the outage: {during.tail()}")
    (done,) = p.wait_final(1, timeout=600)
    rows = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    restarts = (rdir / "restarts.jsonl").read_text().splitlines() if (rdir / "restarts.jsonl").exists() else []
    check(done["status"] == "completed", f"the run reads {done['status']} after the outage")
    check(len(rows) == steps and not restarts, f"{len(rows)} rows of {steps}, {len(restarts)} restart(s)")
    shown = "running" if "running" in during.text else during.tail(120)
    return f"runs during the outage: rc 0 ({shown}); the run completed {steps} rows with no restart"


@probe("P8", "`scancel -f -s KILL` of a running job: the run is recorded cancelled after `launcher status` (note)")
def scancel_kill(p: Probe) -> str:
    name = p.job_name()
    res = p.launch(merged(SLURM, f"submit.job_name={name}", "train.steps=100000"))
    check(res.rc == 0, f"not queued: {res.tail()}")
    (run,) = p.runs()
    rdir = Path(run["dir"])
    deadline = time.time() + 180
    while not (rdir / "metrics.jsonl").exists():
        check(time.time() < deadline, "the job did not start training in 180 s")
        time.sleep(0.5)
    job_id = json.loads((rdir / "job.json").read_text())["job_id"]
    subprocess.run(["scancel", "-f", "-s", "KILL", str(job_id)], check=True, timeout=60)
    deadline = time.time() + 120
    while p.queued(name):
        check(time.time() < deadline, "the killed job is still queued after 120 s")
        time.sleep(1)
    listed = p.runs()[0]
    status = p.launcher(["status", run["sweep_id"]], timeout=120)
    no_traceback(status, "status")
    (after,) = p.runs()
    check(after["status"] == "cancelled", f"after `launcher status` the run reads {after['status']}: {status.tail()}")
    return f"listed {listed['status']} ({listed.get('job_state')}); recorded cancelled by `launcher status`"


def _node_of(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%N|%T"], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    node, _, state = out.partition("|")
    return node if state == "RUNNING" else ""


@probe("P9", "node set DOWN under a running job: requeued from its checkpoint, completed, no step twice")
def node_down(p: Probe) -> str:
    name = p.job_name()
    steps = 150
    # exclusive: the node downed runs this job alone (the cluster may be shared by other sessions' tests)
    res = p.launch(merged(SLURM, f"submit.job_name={name}", f"train.steps={steps}", "train.checkpoint.every=10",
                          "cluster.exclusive=true"))
    check(res.rc == 0, f"not queued: {res.tail()}")
    (run,) = p.runs()
    rdir = Path(run["dir"])
    deadline = time.time() + 180
    while not (rdir / "checkpoints" / "latest").exists():
        check(time.time() < deadline, "no checkpoint in 180 s")
        time.sleep(0.2)
    job_id = json.loads((rdir / "job.json").read_text())["job_id"]
    node = _node_of(job_id)
    check(bool(node), f"job {job_id} is not running")
    others = subprocess.run(["squeue", "-h", "-w", node, "-o", "%i"], capture_output=True, text=True,
                            timeout=60).stdout.split()
    if len(others) > 1:  # a node down kills every job on it: never one that is not this probe's
        raise Skipped(f"{node} runs other jobs too ({others}): not downed")
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=probe_p9"], check=True, timeout=60)
    try:
        deadline = time.time() + 60
        while _node_of(job_id) == node and time.time() < deadline:
            time.sleep(0.2)
        # a user's `launcher status` while Slurm requeues the job (for ~2 s sacct still says NODE_FAIL)
        early = p.launcher(["status", run["sweep_id"]], timeout=120)
        no_traceback(early, "status during the requeue")
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=60)
    queue = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                           timeout=60).stdout.strip()
    (done,) = p.wait_final(1, timeout=300)
    if done["status"] != "completed":
        error = json.loads((rdir / "status.json").read_text()).get("error")
        raise Failed(f"the run reads {done['status']} ({error}) although Slurm requeued its job (squeue: {queue}) "
                     f"after {node} went down")
    rows = [json.loads(line) for line in (rdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seen = [r["step"] for r in rows if "step" in r]
    restarts = [json.loads(line) for line in (rdir / "restarts.jsonl").read_text().splitlines() if line.strip()] \
        if (rdir / "restarts.jsonl").exists() else []
    check(done["status"] == "completed", f"the run reads {done['status']}")
    check(bool(restarts), "no restart recorded: the node went down after the job?")
    check(all(r.get("from_step") for r in restarts), f"restarted from scratch: {restarts}")
    check(len(seen) == len(set(seen)) == steps, f"{len(seen)} rows, {len(set(seen))} unique steps of {steps}")
    return (f"{node} downed; restarted from step {restarts[-1]['from_step']}; completed with {steps} unique steps, "
            "0 duplicates")


@probe("P10", "a 40-point sweep into a 96 MB tmpfs: archived; `launcher runs` on the full disk works (and P54)")
def sweep_small_disk(p: Probe) -> str:
    small = _tmpfs(p, 96)  # (a launch wants 64 MiB free)
    try:
        root = small / "runs"
        name = p.job_name()
        res = p.launch(["-m", *SLURM, HOLD, f"submit.job_name={name}", "seed=range(40)"], root)
        check(res.rc == 0, f"the sweep was not archived: {res.tail()}")
        used = shutil.disk_usage(small).used >> 20
        fill(small / "filler")
        runs = p.launcher(["runs", "--json"], root, timeout=120)
        no_traceback(runs, "runs on the full disk")
        check(runs.rc == 0 and len(json.loads(runs.out)) == 40, f"runs rc {runs.rc}: {runs.tail()}")
        return f"archived in {res.secs:.1f} s ({used} MB); runs on the full disk {runs.secs:.1f} s, rc 0, 40 runs"
    finally:
        p.cleanup()
        _umount(small)


def _limit_refusal(p: Probe, points: int, max_submit: int, during: Optional[Callable[[], None]] = None) -> Any:
    """A held sweep past cluster.max_submit_jobs, waves off: (its result, whether anything is queued)."""
    name = p.job_name()
    args = [str(BIN / "launch"), "-m", *SLURM, HOLD, f"submit.job_name={name}", "submit.waves=false",
            f"cluster.max_submit_jobs={max_submit}", f"seed=range({points})"]
    worker = threading.Thread(target=during) if during else None
    if worker:
        worker.start()
    res = p.run(args, timeout=240)
    if worker:
        worker.join()
    return res, p.queued(name)


@probe("P15", "a sweep whose room is taken by 40 foreign held jobs (20 during composition): refused, nothing queued")
def room_taken(p: Probe) -> str:
    foreign = p.job_name()

    def queue_foreign(n: int = 20) -> None:
        for _ in range(n):
            subprocess.run(["sbatch", "-H", "-J", foreign, "-o", "/dev/null", "--wrap=true"], capture_output=True,
                           timeout=60)
    mine = len(subprocess.run(["squeue", "-h", "-r", "-u", "root", "-o", "%i"], capture_output=True, text=True,
                              timeout=60).stdout.split())
    # 20 queued first, so that the refusal is certain; 20 more while the launch composes its points
    queue_foreign()
    res, queued = _limit_refusal(p, 10, mine + 25, queue_foreign)
    no_traceback(res, "launch")
    check(res.rc != 0 and "can be submitted" in res.text, f"rc {res.rc}: {res.tail()}")
    check(not queued, f"{len(queued)} task(s) queued")
    return f"refused: {last_line(res.err, 160)}"


@probe("P16", "cluster.max_submit_jobs=3 with 5 points (waves off): refused naming MaxSubmitJobs, nothing written")
def max_submit(p: Probe) -> str:
    res, queued = _limit_refusal(p, 5, 3)
    no_traceback(res, "launch")
    check(res.rc != 0 and "MaxSubmitJobs" in res.text, f"rc {res.rc}: {res.tail()}")
    check(not queued, f"{len(queued)} task(s) queued")
    written = [str(x) for x in p.root().rglob("*")] if p.root().exists() else []
    check(not written, f"written under the root: {written[:3]}")
    return f"refused: {last_line(res.err, 140)}"


SBATCH_SHIM = """#!/bin/bash
# fails every array submission after the first: the 2nd of 3 arrays and any retry of it
script="${@: -1}"
if grep -q -- '--array' "$script" 2>/dev/null; then
  n=$(( $(cat "$COUNT" 2>/dev/null || echo 0) + 1 )); echo $n > "$COUNT"
  if [ $n -ge 2 ]; then echo "sbatch: error: Batch job submission failed: probe shim refused array $n" >&2; exit 1; fi
fi
exec REAL "$@"
"""


@probe("P17", "sbatch fails the 2nd of 3 arrays (max_array_size=3, 7 points): all settled, the queue empty")
def sbatch_fails(p: Probe) -> str:
    shim = p.scratch / "shim"
    shim.mkdir()
    (shim / "sbatch").write_text(SBATCH_SHIM.replace("REAL", shutil.which("sbatch") or "sbatch"))
    os.chmod(shim / "sbatch", 0o755)
    name = p.job_name()
    res = p.launch(["-m", *SLURM, HOLD, f"submit.job_name={name}", "cluster.max_array_size=3", "seed=range(7)"],
                   env={"PATH": f"{shim}:{os.environ['PATH']}", "COUNT": str(p.scratch / "count")})
    no_traceback(res, "launch")
    check(res.rc != 0, f"launch rc 0 although sbatch failed: {res.tail()}")
    left = p.queued(name)
    runs = p.runs()
    states = sorted(r["status"] for r in runs)
    check(not left, f"{len(left)} task(s) left queued")
    check(len(runs) in (0, 7) and set(states) <= {"cancelled", "failed"},
          f"{len(runs)} runs: {states}")
    return f"launch rc {res.rc}: {last_line(res.err, 100)}; {len(runs)} runs {sorted(set(states))}; queue empty"


@probe("P18", "2 x `launch -m` (3 points each) and 6 x `runs --reindex` at once on one root: 6 runs, 6 ids, 6 rows")
def concurrent_launches(p: Probe) -> str:
    name = p.job_name()
    launch = [str(BIN / "launch"), "-m", *SLURM, HOLD, f"submit.job_name={name}", "seed=range(3)"]
    reindex = [str(BIN / "launcher"), "runs", "--reindex", "--root", str(p.root())]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        done = list(pool.map(lambda a: p.run(a, timeout=240), [launch, launch, *[reindex] * 6]))
    for res in done:
        no_traceback(res, "a concurrent command")
    check(all(r.rc == 0 for r in done[:2]), f"a launch failed: {[r.tail(200) for r in done[:2]]}")
    runs = p.runs()
    ids = {r["run_id"] for r in runs}
    dirs = [d for d in p.root().glob("*/*") if (d / "run.json").exists()]
    check(len(runs) == len(ids) == len(dirs) == 6, f"{len(runs)} rows, {len(ids)} ids, {len(dirs)} dirs")
    return "6 runs, 6 ids, 6 index rows; no traceback in 8 commands"


FUZZ = ["", "-", "../..", "/dev/zero", "/proc/self", "ü漢 'q'%n"]
FUZZED = [["runs"], ["logs"], ["cancel"], ["show"], ["diff", "x"], ["reproduce"], ["doctor"], ["status"],
          ["retry"], ["results"], ["report"], ["data", "show"], ["data", "verify"]]


@probe("P20", "CLI fuzz: 13 subcommands x 6 bad arguments: a one-line error, no traceback (not L5's long id)")
def cli_fuzz(p: Probe) -> str:
    rdir = pristine_copy(p)[1]
    p.launcher(["runs", "--reindex"])
    calls = [[*cmd, arg] for cmd in FUZZED for arg in FUZZ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        done = list(pool.map(lambda a: (a, p.launcher(a, timeout=60)), calls))
    bad = [f"{' '.join(a)!r}: rc {r.rc}" for a, r in done if r.rc == 124 or "Traceback" in r.text]
    check(not bad, f"{len(bad)} call(s) hung or raised: {bad[:4]}")
    check(rdir.exists() and p.runs()[0]["status"] == "completed", "a fuzzed call changed the run")
    return f"{len(calls)} calls, each rc {sorted({r.rc for _, r in done})}, no traceback"


def _tampered_reads(p: Probe, tamper: Callable[[Path], None], file: str) -> str:
    """A copy of the pristine run changed by ``tamper``: every reading command fine, show names ``file``."""
    run, rdir = pristine_copy(p)
    tamper(rdir)
    out = read_all(p, rdir, run["dir"])
    show = out["show"]
    check(file in show.text, f"show does not name {file}: {show.tail()}")
    return f"8 commands rc {sorted({r.rc for r in out.values()})}; show: {last_line(show.text)}"


@probe("P23", "metrics.jsonl truncated mid-line: every command fine, show names the change")
def metrics_truncated(p: Probe) -> str:
    def tamper(rdir: Path) -> None:
        m = rdir / "metrics.jsonl"
        with open(m, "r+b") as f:
            f.truncate(m.stat().st_size - 20)
    return _tampered_reads(p, tamper, "metrics.jsonl")


@probe("P24", "3 KB of random bytes appended to metrics.jsonl: every command fine, show names the change")
def metrics_junk(p: Probe) -> str:
    def tamper(rdir: Path) -> None:
        with open(rdir / "metrics.jsonl", "ab") as f:
            f.write(os.urandom(3072))
    return _tampered_reads(p, tamper, "metrics.jsonl")


@probe("P25", "random bytes as restarts.jsonl: every command fine, show names the change")
def restarts_junk(p: Probe) -> str:
    return _tampered_reads(p, lambda rdir: (rdir / "restarts.jsonl").write_bytes(os.urandom(3072)), "restarts.jsonl")


@probe("P27", "a 60 MB single line in metrics.jsonl: bounded memory, no traceback")
def metrics_long_line(p: Probe) -> str:
    run, rdir = pristine_copy(p)
    with open(rdir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 7, "loss": 1.0, "pad": "x" * 60_000_000}) + "\n")
    out = read_all(p, rdir, run["dir"], timeout=120)
    worst = max(r.max_rss_mb for r in out.values())
    check(worst < 500, f"peak memory {worst:.0f} MB")
    return f"8 commands, peak memory {worst:.0f} MB"


@probe("P28", "NaN, Infinity and 1e999 in a metrics row: every command fine")
def metrics_non_finite(p: Probe) -> str:
    run, rdir = pristine_copy(p)
    with open(rdir / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": NaN, "tokens_per_s": Infinity, "lr": 1e999, "grad_norm": -Infinity}\n')
    out = read_all(p, rdir, run["dir"])
    return f"8 commands rc {sorted({r.rc for r in out.values()})}, no traceback"


@probe("P33", "sbatch injection in submit.job_name, sbatch_extra comment and mail-user: quoted, nothing ran")
def sbatch_injection(p: Probe) -> str:
    marks = [p.scratch / f"INJECTED{i}" for i in range(5)]
    name = f"{p.job_name()}$(touch {marks[0]})`touch {marks[1]}`;touch {marks[2]}"
    p.names.append(name)
    res = p.launch([*SLURM, f"submit.job_name='{name}'", f"+cluster.sbatch_extra.comment='$(touch {marks[3]})'",
                    f"+cluster.sbatch_extra.mail-user='x@example.com;touch {marks[4]}'"])
    check(res.rc == 0, f"not queued: {res.tail()}")
    (run,) = p.wait_final(1)
    rdir = Path(run["dir"])
    wait_sealed(rdir)
    ran = [m.name for m in marks if m.exists()]
    check(not ran, f"injected commands ran: {ran}")
    lines = [line for line in (rdir / "sbatch.sh").read_text().splitlines()
             if line.startswith("#SBATCH") and ("touch" in line)]
    check(len(lines) == 3 and all("'" in line for line in lines), f"#SBATCH lines: {lines}")
    job_id = json.loads((rdir / "job.json").read_text())["job_id"]
    sacct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", str(job_id), "-o", "JobName%300"], capture_output=True,
                           text=True, timeout=60).stdout.strip()
    check(sacct == name, f"sacct shows {sacct!r}")
    return f"run {run['status']}, sealed; 3 #SBATCH lines quoted; sacct shows the literal name; no marker"


@probe("P35", "a shard flipped after its run: reproduce and `data verify` name it and refuse")
def tampered_shard_refused(p: Probe) -> str:
    ds = small_dataset(p)
    run = one_local_run(p, extra=("data=tokens", f"data.path={ds}"))
    shard = sorted((ds / "shards").glob("train-*.bin"))[0]
    b = bytearray(shard.read_bytes())
    b[len(b) // 2] ^= 0xFF
    shard.write_bytes(bytes(b))
    verify = p.launcher(["data", "verify", str(ds)])
    check(verify.rc != 0 and shard.name in verify.text, f"data verify rc {verify.rc}: {verify.tail()}")
    repro = p.launcher(["reproduce", run["dir"], "submit.dry_run=true"], timeout=120)
    no_traceback(repro, "reproduce")
    check(repro.rc != 0 and shard.name in repro.text, f"reproduce rc {repro.rc}: {repro.tail()}")
    return f"verify rc {verify.rc}, reproduce rc {repro.rc}: both name {shard.name}"


WALL_DURATION = re.compile(r"time\.time\(\)\s*-\s*[\w.]+")


@probe("P38", "clock going backwards (code read): step time, watchdog, attempt and rung seconds monotonic (note)")
def clocks(p: Probe) -> str:
    def read(rel: str) -> str:
        return (REPO / rel).read_text()
    check("perf_counter" in read("recipes/gpt/train.py"), "the step time does not use perf_counter")
    watchdog = read("launcher/runtime/watchdog.py")  # (its time.time() dates files: not a duration)
    check("time.monotonic()" in watchdog and not WALL_DURATION.search(watchdog),
          "the hang watchdog measures with the wall clock")
    wall = []
    for rel in ("launcher/training/loop.py", "launcher/runtime/attempt.py"):  # the review's: rung and attempt seconds
        wall += [f"{rel}:{i}" for i, line in enumerate(read(rel).splitlines(), 1) if WALL_DURATION.search(line)
                 and "deadline" not in line]
    check(not wall, f"durations from the wall clock (a step back gives negative seconds): {', '.join(wall)}")
    return "perf_counter / monotonic everywhere a duration is measured"


@probe("P39", "an untracked FIFO and a 300 MB file in the source tree: FIFO left out, big file skipped_large")
def fifo_and_big_file(p: Probe) -> str:
    tree = tiny_repo(p)
    os.mkfifo(tree / "pipe")
    with open(tree / "big.bin", "wb") as f:
        f.truncate(300 << 20)  # sparse: its size is what the snapshot reads first
    res = p.launch([*SLURM, HOLD, f"submit.job_name={p.job_name()}"], cwd=tree, timeout=120)
    check(res.rc == 0, f"launch rc {res.rc}: {res.tail()}")
    info = snapshot_info(p.root())
    code = next(p.root().glob("*/code"))
    check("big.bin" in info["skipped_large"], f"skipped_large: {info['skipped_large']}")
    check(not (code / "pipe").exists() and not (code / "big.bin").exists(), "the FIFO or big.bin was copied")
    return f"launch {res.secs:.1f} s; skipped_large {info['skipped_large']}; FIFO left out"


@probe("P40", "a non-git source tree at `dir with space/ü漢 'q'` with a FIFO: snapshot taken, Slurm run completed")
def odd_tree(p: Probe) -> str:
    tree = p.scratch / "dir with space" / "ü漢 'q'"
    tree.mkdir(parents=True)
    shutil.copytree(REPO / "recipes", tree / "recipes", ignore=shutil.ignore_patterns("__pycache__"))
    os.mkfifo(tree / "pipe")
    res = p.launch([*SLURM, f"submit.job_name={p.job_name()}"], cwd=tree, timeout=120)
    check(res.rc == 0, f"launch rc {res.rc}: {res.tail()}")
    info = snapshot_info(p.root())
    check(info["source"] == str(tree), f"snapshot of {info['source']}")
    (run,) = p.wait_final(1)
    check(run["status"] == "completed", f"the run reads {run['status']}")
    return f"snapshot of {info['files']} files from the odd tree; run completed"


@probe("P41", "`report -o` onto a symlink to a victim file: the link replaced, the victim untouched")
def report_onto_link(p: Probe) -> str:
    _, rdir = pristine_copy(p)
    victim, link = p.scratch / "victim.txt", p.scratch / "out.html"
    victim.write_text("precious\n")
    link.symlink_to(victim)
    res = p.launcher(["report", str(rdir), "-o", str(link)], timeout=120)
    check(res.rc == 0, f"report rc {res.rc}: {res.tail()}")
    check(victim.read_text() == "precious\n", "the victim was overwritten")
    check(not link.is_symlink() and "<html" in link.read_text().lower(), "the link was not replaced by the page")
    return "the link replaced by the page; the victim untouched"


@probe("P45", "a runs root holding links to /, to another root and a `..` loop: reindex fast, none from outside")
def root_links(p: Probe) -> str:
    run = pristine(p)
    copy_run(run, p.root())
    copy_run(run, p.root("other"))
    for name, target in (("to-slash", "/"), ("other-root", str(p.root("other"))), ("loop", "..")):
        (p.root() / name).symlink_to(target)
    res = p.launcher(["runs", "--reindex"], timeout=120)
    no_traceback(res, "runs --reindex")
    check(res.rc == 0 and res.secs < 15, f"rc {res.rc} in {res.secs:.1f} s: {res.tail()}")
    runs = p.runs()
    outside = [r["dir"] for r in runs if not Path(r["dir"]).resolve().is_relative_to(p.root().resolve())]
    check(len(runs) == 1 and not outside, f"{len(runs)} runs; from outside: {outside}")
    return f"--reindex {res.secs:.1f} s, 1 run, none from outside"


@probe("P46", "SIGKILL to launch just after sbatch: the next `launcher runs` publishes or repairs, no job orphaned")
def sigkill_after_sbatch(p: Probe) -> str:
    rc, out, name, runs = _interrupted_launch(p, signal.SIGKILL)
    repaired = "repaired an interrupted launch" in out
    check(len(runs) == 20 or repaired, f"{len(runs)} runs listed, no repair said: {out[-300:]}")
    check(not repaired or not p.queued(name), "repaired, but its jobs are still queued")
    how = "repaired" if repaired else "published"
    return f"launch rc {rc}; {how} ({len(runs)} runs); {_queue_emptied(p, name, runs)}"


@probe("P48", "a copied archive whose snapshot.json names the original root: reproduce refuses")
def copied_archive(p: Probe) -> str:
    _, rdir = pristine_copy(p)
    res = p.launcher(["reproduce", str(rdir), "submit.dry_run=true"], timeout=120)
    no_traceback(res, "reproduce")
    check(res.rc != 0 and "snapshot" in res.text, f"rc {res.rc}: {res.tail()}")
    return f"refused: {last_line(res.text, 140)}"


@probe("P49", "a forged code/snapshot.json path in a copied archive: named changed, reproduce refuses")
def forged_snapshot_path(p: Probe) -> str:
    _, rdir = pristine_copy(p)
    forged = p.scratch / "forged-code"
    shutil.copytree(rdir.parent / "code", forged, symlinks=True)
    rec_path = rdir / "code" / "snapshot.json"
    rec = json.loads(rec_path.read_text())
    key = next(k for k, v in rec.items() if isinstance(v, str) and v.startswith("/"))
    rec[key] = str(forged)
    rec_path.write_text(json.dumps(rec))
    res = p.launcher(["reproduce", str(rdir), "submit.dry_run=true"], timeout=120)
    no_traceback(res, "reproduce")
    check(res.rc != 0 and "code/snapshot.json changed" in res.text, f"rc {res.rc}: {res.tail()}")
    return f"refused: 'code/snapshot.json changed' ({key} forged)"


@probe("P56", "the pickle-planted run (P4) under `diff`: the changed model.pt and rng files named")
def planted_diff(p: Probe) -> str:
    run, rdir = pristine_copy(p)
    plant_pickles(rdir, p.scratch / "UNPICKLED")
    res = p.launcher(["diff", str(rdir), run["dir"]])
    no_traceback(res, "diff")
    check("model.pt changed" in res.text and "rng" in res.text, f"diff: {res.tail()}")
    check(not (p.scratch / "UNPICKLED").exists(), "a planted pickle ran")
    return f"diff names model.pt and rng changed (rc {res.rc})"


@probe("P59", "reproduce of a run needing its lifted setup secret: names the variable, never the value")
def lifted_secret(p: Probe) -> str:
    run, root = secret_run(p)
    check(not any(k.startswith("LAUNCHER_SECRET_") for k in os.environ), "this shell exports a lifted secret")
    given = {f"LAUNCHER_SECRET_CLUSTER_ENV_{k}": SECRET[k] for k in ("HF_TOKEN", "MY_DB_PASSWORD")}  # not the setup one
    res = p.launcher(["reproduce", run["dir"], "submit.dry_run=true"], root, timeout=120, env=given)
    no_traceback(res, "reproduce")
    wanted = "export LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2=..."
    check(res.rc != 0 and wanted in res.text, f"rc {res.rc}: {res.tail()}")
    check(not any(v in res.text for v in SECRET.values()), "a secret value is printed")
    return f"refused: {wanted!r}, no value"


@probe("P66", "`launcher report RUN` default output: beside the run (<sweep>/report-<i>.html), the seal intact")
def report_default(p: Probe) -> str:
    _, rdir = pristine_copy(p)
    res = p.launcher(["report", str(rdir)], timeout=120)
    check(res.rc == 0, f"report rc {res.rc}: {res.tail()}")
    want = rdir.parent / f"report-{rdir.name}.html"
    check(Path(res.out.strip()) == want and want.exists(), f"written to {res.out.strip()!r}")
    show = p.launcher(["show", str(rdir)])
    check(show.rc == 0, f"show after the report: {show.tail()}")
    return f"{want.relative_to(p.root())}; show rc 0"
