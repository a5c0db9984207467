"""Fixtures (a runs root per test, the local Slurm cluster) and the suite's tiers.

Tiers are markers applied automatically at collection, from what a test uses (its fixtures, and the
names its code and the helpers it calls refer to), so nobody has to remember to mark a test:

- ``slurm``   needs the local Slurm cluster (the ``slurm`` fixture)
- ``browser`` drives the headless browser (tests/browser.py)
- ``dist``    starts torch.distributed processes (mp.spawn, torchrun, a process group)
- ``launch``  starts any other process: the ``launch``/``launcher`` commands, a job, a subprocess

A test with none of them is pure: tests/unit holds only those (a tier marker there is a collection
error), and while a pure test runs, starting a process fails it (the guard below), so the static
scan can never let a launching test into the fast tier unnoticed. ``scripts/test.sh --fast`` runs
the pure tier with no Slurm or browser set up.
"""
from __future__ import annotations

import inspect
import multiprocessing.process
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Dict, Iterable, Set

import pytest

from helpers import EQUIV_BASE, launch, runs_json

TIERS = ("slurm", "browser", "dist", "launch")
_TESTS_DIR = Path(__file__).resolve().parent
UNIT_DIR = _TESTS_DIR / "unit"
_INTEGRATION_DIR = _TESTS_DIR / "integration"

# What puts a test in a tier: the objects the names of its code resolve to (in the globals of the
# function that uses them), following into functions of the tests' own modules (tests/helpers.py,
# the test module), never into the product's code.
_DIST_MODULES = ("torch.multiprocessing", "torch.distributed.run", "torch.distributed.launcher",
                 "torch.distributed.elastic")
_LAUNCH_MODULES = ("subprocess", "multiprocessing", "concurrent.futures.process", "submitit")


@pytest.fixture
def runs_root(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    return root


@pytest.fixture(scope="session")
def slurm() -> Dict[str, str]:
    """The local Slurm cluster from scripts/slurm-local.sh. Under scripts/test.sh it must be up."""
    conf = os.environ.get("SLURM_CONF")
    ok = bool(conf) and shutil.which("sinfo") is not None
    # asked again for a while: a busy controller answers sinfo with an error now and then, and one
    # worker's session would otherwise skip (or, under test.sh, fail) every Slurm test it runs
    deadline = time.monotonic() + 60
    while ok:
        try:
            res = subprocess.run(["sinfo", "-h", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
            if res.returncode == 0 and "node" in res.stdout:
                break
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            ok = False
        else:
            time.sleep(1.0)
    if not ok:
        if os.environ.get("LAUNCHER_REQUIRE_SLURM") == "1":
            pytest.fail("local Slurm cluster is not up (scripts/slurm-local.sh up)")
        pytest.skip("local Slurm cluster not up: run scripts/slurm-local.sh up and export SLURM_CONF")
    return {"SLURM_CONF": conf}


def _restart_dead_slurmd(base: str) -> None:
    """A slurmd of the local cluster that died is started again before the next Slurm test. Debian's
    slurmd has crashed (SIGSEGV in its hostlist code, two task launches at once; a core in
    .slurm-local/log/): the drill running then fails as it should, but a node left DOWN would fail every
    later drill that needs it. Said on stderr; one worker heals at a time (the others wait on the lock)."""
    import fcntl

    conf = os.environ.get("SLURM_CONF")
    if not conf:
        return
    run = Path(conf).parent / "run"

    def dead() -> list:
        out = []
        for pidfile in sorted(run.glob("slurmd-*.pid")):
            try:
                os.kill(int(pidfile.read_text().split()[0]), 0)
            except (ValueError, IndexError, OSError):
                out.append(pidfile.stem)
        return out

    if not dead():
        return
    with open(f"{base}.heal", "a+") as heal:
        fcntl.flock(heal, fcntl.LOCK_EX)
        gone = dead()
        if gone:
            print(f"\n[tests] {', '.join(gone)} had died (see {Path(conf).parent / 'log'}): starting it again",
                  file=sys.stderr)
            subprocess.run([str(Path(__file__).resolve().parent.parent / "scripts" / "slurm-local.sh"), "up"],
                           check=True, timeout=300, capture_output=True)


@pytest.fixture(autouse=True)
def _slurm_share(request: pytest.FixtureRequest):
    """The local cluster is shared by the two workers' Slurm tests: each holds a shared lock on it, and
    a ``slurm_whole`` test (a node set DOWN, a 20-task array) an exclusive one, so nothing of the other
    worker runs beside it. A turnstile taken first keeps a waiting exclusive test from starving."""
    if not request.node.get_closest_marker("slurm"):
        yield
        return
    import fcntl
    import hashlib
    import tempfile

    key = hashlib.sha256(os.environ.get("SLURM_CONF", "").encode()).hexdigest()[:12]
    base = Path(tempfile.gettempdir()) / f"launcher-tests-slurm-{key}"
    whole = request.node.get_closest_marker("slurm_whole") is not None
    _restart_dead_slurmd(base)
    with open(f"{base}.turnstile", "a+") as gate, open(f"{base}.lock", "a+") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if whole else fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def equivalence_reference(tmp_path_factory) -> Path:
    """The uninterrupted single-process reference of the engine-equivalence drills (helpers.EQUIV_BASE,
    DDP, one process): run once per session, shared by every module that compares a layout with it."""
    root = tmp_path_factory.mktemp("equivalence-reference") / "runs"
    res = launch([*EQUIV_BASE, "cluster.gpus_per_node=1", "parallelism.engine=ddp"], root, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = runs_json(root)
    assert run["status"] == "completed", run
    return Path(run["dir"])


# ---------------------------------------------------------------------------------------- tiers --

def _code_names(code: types.CodeType) -> Set[str]:
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _is_tests_code(obj) -> bool:
    src = getattr(inspect.getmodule(obj), "__file__", None)
    return bool(src) and Path(src).resolve().is_relative_to(_TESTS_DIR)


def _tier_of_object(obj) -> str:
    name = obj.__name__ if isinstance(obj, types.ModuleType) else getattr(obj, "__module__", "") or ""
    if name.startswith(_DIST_MODULES):
        return "dist"
    if name.startswith(_LAUNCH_MODULES):
        return "launch"
    if inspect.isclass(obj) and obj.__name__ == "Browser" and _is_tests_code(obj):
        return "browser"
    return ""


def _tiers_reached(fn, seen: Set[int]) -> Set[str]:
    """The tiers of what fn's code refers to, following into the functions (and classes' methods)
    of the tests' own modules that it uses."""
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return set()
    seen.add(id(code))
    found: Set[str] = set()
    glb = getattr(fn, "__globals__", {})
    for name in _code_names(code):
        if name not in glb:
            continue
        obj = glb[name]
        tier = _tier_of_object(obj)
        if tier:
            found.add(tier)
        elif isinstance(obj, types.ModuleType) and _is_tests_code(obj):
            found |= _members_reached(vars(obj).values(), obj.__name__, seen)
        elif (inspect.isfunction(obj) or inspect.isclass(obj)) and _is_tests_code(obj):
            found |= _members_reached([obj], obj.__module__, seen)
    return found


def _members_reached(objs: Iterable, module: str, seen: Set[int]) -> Set[str]:
    found: Set[str] = set()
    for obj in objs:
        if getattr(obj, "__module__", None) != module:
            continue
        if inspect.isclass(obj):
            found |= {_tier_of_object(obj)} - {""}
            found |= _members_reached(
                [m for m in vars(obj).values() if inspect.isfunction(m)], module, seen)
        elif inspect.isfunction(obj):
            found |= _tiers_reached(obj, seen)
    return found


def tiers_of(item: pytest.Item) -> Set[str]:
    """The tier markers a test gets from what it uses."""
    found = {t for t in TIERS if item.get_closest_marker(t)}
    seen: Set[int] = set()
    fn = getattr(item, "function", None)
    if fn is not None:
        found |= _tiers_reached(fn, seen)
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(info, "names_closure", ()):
        if name == "slurm":
            found.add("slurm")
        for fixdef in info.name2fixturedefs.get(name, ()):
            # (_slurm_share acts for Slurm tests alone: its restart of a dead slurmd is theirs, not every test's)
            if name not in ("slurm", "_pure_tests_start_no_process", "_slurm_share"):
                found |= _tiers_reached(fixdef.func, seen)
    if found & {"slurm", "browser", "dist"} or _INTEGRATION_DIR in Path(str(item.fspath)).resolve().parents:
        found.add("launch")  # all of them start processes; so does the integration tier by definition
    return found


# The Slurm tests' modules in two groups of about equal time (CI's --durations), so the two workers
# each wait on the scheduler beside the other; _slurm_share keeps a `slurm_whole` test alone.
SLURM_SECOND_GROUP = frozenset({"test_fault_tolerance.py", "test_archive.py", "test_hydra_requeue.py",
                                "test_script_recipe.py", "test_hydra_app.py", "test_sweep_results.py", "test_asha.py",
                                "test_preflight_real.py", "test_waves.py",
                                # its module fixture submits outside any test: beside the whole-cluster tests
                                "test_doctor_failures.py"})


def xdist_group_of(item: pytest.Item, tiers: Set[str]) -> str:
    """Under ``pytest -n 2 --dist loadgroup`` (scripts/test.sh) a group runs on one worker, in order:
    the Slurm tests in two groups by module (they share the 4-node cluster), those that need it alone
    (marked ``slurm_whole``) in a third, every test of the shared reference run in another (it is made once), and
    each other integration module in its own (its module-scoped reference runs are made once). Pure
    tests go wherever a worker is free."""
    if "slurm" in tiers:
        if item.get_closest_marker("slurm_whole") is not None:
            # a group of their own: xdist hands out the groups with the most tests first, so these few
            # come late, beside the local modules (which take no lock), not beside another Slurm test
            # whose end they would wait for, the other worker idle while they run
            return "slurm-whole"
        return "slurm-b" if Path(str(item.fspath)).name in SLURM_SECOND_GROUP else "slurm-a"
    if "equivalence_reference" in getattr(getattr(item, "_fixtureinfo", None), "names_closure", ()):
        return "equivalence"
    if "launch" in tiers:
        return Path(str(item.fspath)).name
    return ""


def _group_in_id(item: pytest.Item) -> None:
    """``--dist loadgroup`` keeps a group on one worker by the ``@group`` suffix of each test's id.
    pytest 9.2 keeps that id structured (``Item._id``) and pytest-xdist 3.8 still writes the string
    field older pytests read, which nothing reads now: every test would be scheduled on its own, each
    module's reference runs made once per worker (pytest-xdist#1386). The suffix is put where pytest
    reads it; with an older pytest (no ``_pytest.nodeid``) xdist's own works and this does nothing."""
    try:
        from _pytest.nodeid import coerce_node_id
    except ImportError:
        return
    names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                    for m in item.iter_markers("xdist_group")})
    if names and "@" not in item.nodeid.rpartition("]")[2].rpartition("::")[2]:
        item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(names)}")


def _longest_first(items) -> None:
    """xdist hands out the groups with the most tests first, and groups of as many tests in the order
    they were collected: so among them, those holding a long test (its ``timeout`` mark, the only
    estimate a fresh clone has) come first. A 3-minute test handed out last would be the suite's tail,
    one worker busy, the others done. The ``slurm-whole`` group keeps its late place (xdist_group_of)."""
    def group(item) -> str:
        m = item.get_closest_marker("xdist_group")
        return str(m.args[0] if m.args else m.kwargs.get("name", "")) if m else item.nodeid

    def timeout(item) -> float:
        m = item.get_closest_marker("timeout")
        return float(m.args[0] if m.args else m.kwargs.get("timeout", 0)) if m else 0.0

    longest: Dict[str, float] = {}
    for item in items:
        g = group(item)
        longest[g] = 0.0 if g == "slurm-whole" else max(longest.get(g, 0.0), timeout(item))
    items.sort(key=lambda item: -longest[group(item)])  # stable: a group's tests keep their order


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    misplaced = []
    for item in items:
        tiers = tiers_of(item)
        for t in sorted(tiers):
            if not item.get_closest_marker(t):
                item.add_marker(getattr(pytest.mark, t))
        group = xdist_group_of(item, tiers)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
        if getattr(config.option, "loadgroup", False):  # set by xdist's --dist loadgroup
            _group_in_id(item)
        if tiers and UNIT_DIR in Path(str(item.fspath)).resolve().parents:
            misplaced.append(f"{item.nodeid} ({', '.join(sorted(tiers))})")
    if getattr(config.option, "loadgroup", False):
        _longest_first(items)
    if misplaced:
        raise pytest.UsageError(
            "tests/unit holds only pure tests; these start processes or need a service, so they belong "
            "in tests/integration:\n  " + "\n  ".join(misplaced))


class ProcessInPureTest(AssertionError):
    pass


# What a pure test may not start: an interpreter or one of the project's commands (a launch, a job,
# a rank), a submission or cancellation, a browser, a shell. The small tools the product itself
# asks (git for the code snapshot, the scheduler's read-only queries for its limits, which answer
# "unknown" where no cluster is up) stay allowed.
_REFUSED = re.compile(r"^(python[0-9.]*|launch|launcher|torchrun|deepspeed|sbatch|srun|salloc|scancel|"
                      r"chromium.*|google-chrome|sh|bash)$")


def _refuse(what: str):
    def refuse(*_a, **_k):
        raise ProcessInPureTest(
            f"a pure test started a process ({what}): it belongs in tests/integration, and the tier scan "
            "in tests/conftest.py should learn the name it used")
    return refuse


def _guarded_popen(real_init):
    def init(self, args, *a, **k):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        exe = os.path.basename(str(k.get("executable") or (argv[0] if argv else "")))
        if k.get("shell") or _REFUSED.match(exe.split()[0] if exe else ""):
            _refuse(f"{exe}")()
        real_init(self, args, *a, **k)
    return init


@pytest.fixture(autouse=True)
def _pure_tests_start_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """While a test with no tier marker runs, starting a process fails it."""
    if any(request.node.get_closest_marker(t) for t in TIERS):
        yield
        return
    monkeypatch.setattr(subprocess.Popen, "__init__", _guarded_popen(subprocess.Popen.__init__))
    monkeypatch.setattr(os, "fork", _refuse("os.fork"))
    monkeypatch.setattr(os, "posix_spawn", _refuse("os.posix_spawn"))
    monkeypatch.setattr(os, "system", _refuse("os.system"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse("multiprocessing"))
    yield


# The warm servers the suite's local runs started (launcher.runtime.warm_server) end idle after minutes;
# the session stops those it started (by their pids) rather than leave them behind it.
_SESSION_START = time.time()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controlling process stops them once
        return
    from launcher.runtime import warm_server

    try:
        servers = warm_server.running()
    except OSError:
        return
    for path, pid in servers.items():
        try:
            started = path.with_suffix(".pid").stat().st_mtime
            if started >= _SESSION_START:
                os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
