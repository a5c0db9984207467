"""An exception the product raises may cross a process as a job's result (submitit pickles what the
job raised or returned; a Hydra app's JobReturn carries it). One whose ``__init__`` takes other
arguments than its message cannot be unpickled unless it says how (``__reduce__``): the waiting side
then read "Stopped.__init__() missing 2 required positional arguments" instead of the job's outcome."""
from __future__ import annotations

import ast
import pickle
import signal
from pathlib import Path

from hydra_plugins.launcher_plugin.requeue import Stopped
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.run.checkpoint_manifest import CheckpointCorrupt
from launcher.run.io import Unreadable
from launcher.runtime.restarts import AtRung, Interrupted
from launcher.training.engines.build import NotReinitialisable

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launcher", "recipes", "hydra_plugins")


def _exception_classes_with_init():
    """(file, class, defines __reduce__) of every class in the product's packages that derives from an
    exception class (a builtin one, a name ending in Error or Exception, or, at any depth, one of the
    product's own) and defines its own __init__."""
    classes = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            for c in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(c, ast.ClassDef):
                    bases = {getattr(b, "id", getattr(b, "attr", "")) for b in c.bases}
                    classes.append((str(path.relative_to(REPO)), c, bases))
    exceptions = {"Exception", "BaseException", "ValueError", "RuntimeError", "KeyError", "OSError", "TypeError"}
    grew = True
    while grew:  # the product's own exception classes, and classes derived from them
        before = len(exceptions)
        exceptions |= {c.name for _, c, bases in classes
                       if bases & exceptions or any(b.endswith(("Error", "Exception")) for b in bases)}
        grew = len(exceptions) > before
    found = []
    for path, c, _ in classes:
        methods = {f.name for f in c.body if isinstance(f, ast.FunctionDef)}
        if c.name in exceptions and "__init__" in methods:
            found.append((path, c.name, "__reduce__" in methods))
    return found


def test_every_exception_with_its_own_init_says_how_it_is_pickled():
    classes = _exception_classes_with_init()
    assert any(name == "Stopped" for _, name, _ in classes)  # the scan sees what it must
    missing = [f"{path}: {name}" for path, name, reduces in classes if not reduces]
    assert not missing, "define __reduce__ (the class and its __init__ arguments): " + ", ".join(missing)


def test_each_comes_back_whole():
    cases = [
        Stopped(signal.SIGUSR2, "time_limit", 31.0),
        Interrupted("preempted", 12),
        AtRung("wait", 20),
        NotReinitialisable(["head (Linear)", "norm (MyNorm)"]),
        ConfigError("optim.lr", "must be > 0", "optim.lr=3e-4"),
        ConfigErrors([ConfigError("a.b", "bad", "a.b=1"), ConfigError("c", "worse", "c=2")], where="for point 3"),
        CheckpointCorrupt({"step_20": ["model.pt: sha256 differs"], "step_10": ["checkpoint.json missing"]}),
        Unreadable("status.json: not JSON", Path("/runs/x/0/status.json")),
    ]
    for exc in cases:
        back = pickle.loads(pickle.dumps(exc))
        # (by name: Hydra's plugin scan may have imported the plugin's module again in this process)
        same_class = (type(back).__module__, type(back).__qualname__) == (type(exc).__module__, type(exc).__qualname__)
        assert same_class and str(back) == str(exc) and repr(vars(back)) == repr(vars(exc)), exc
