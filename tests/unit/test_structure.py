"""The shape of the code: one home per concept, and the direction of imports.

- the launcher never imports the recipes (recipes import the launcher's public API);
- nothing outside launcher/backends compares against a scheduler's name;
- no run-dir file name is spelled outside launcher/run/rundir.py (a recipe's own: its contract module);
- docs/archive.md lists exactly the files RunDir names and the shipped recipes' contracts declare;
- docs/architecture.md names every module, and only modules that exist.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, Tuple

from launcher import backends
from launcher.config import recipe_contract
from launcher.run.rundir import FILES, RunDir

REPO = Path(__file__).resolve().parents[2]
SHIPPED_RECIPES = (("gpt", "recipes.gpt.train.main"), ("commbench", "recipes.commbench.bench.main"))


def _modules(*roots: str) -> Iterator[Tuple[Path, ast.AST]]:
    for root in roots:
        for path in sorted((REPO / root).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _imports(tree: ast.AST) -> Iterator[str]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            yield str(node.args[0].value)


def test_launcher_never_imports_recipes():
    bad = [f"{p.relative_to(REPO)}: {name}" for p, tree in _modules("launcher", "hydra_plugins")
           for name in _imports(tree) if name == "recipes" or name.startswith("recipes.")]
    assert not bad, bad


def test_no_scheduler_name_branch_outside_backends():
    names = set(backends.names())
    bad = []
    for path, tree in _modules("launcher", "hydra_plugins", "recipes"):
        if "backends" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    consts = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                    for c in consts:
                        if isinstance(c, ast.Constant) and c.value in names:
                            bad.append(f"{path.relative_to(REPO)}:{node.lineno}: compares with {c.value!r}")
    assert not bad, bad



SCHEDULER_WORDS = re.compile(r"SLURM_|afterok|srun|scontrol|sbatch_extra\.dependency")


def _docstrings(tree: ast.AST) -> set:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def test_scheduler_words_live_in_backends():
    """Outside launcher/backends/ the launcher's code names no scheduler's variables, options or commands
    (its comments and docstrings may): what differs between schedulers is a backend's (capabilities,
    allocation, step command, step word, env prefixes)."""
    bad = []
    for path, tree in _modules("launcher"):
        if "backends" in path.relative_to(REPO).parts:
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and SCHEDULER_WORDS.search(node.value):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value[:60]!r}")
            elif isinstance(node, (ast.Name, ast.Attribute)) and SCHEDULER_WORDS.search(
                    node.id if isinstance(node, ast.Name) else node.attr):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, bad


def test_no_two_modules_of_the_launcher_share_a_name():
    names: dict = {}
    for path in (REPO / "launcher").rglob("*.py"):
        if path.name != "__init__.py":
            names.setdefault(path.name, []).append(path.relative_to(REPO).as_posix())
    assert not {n: ps for n, ps in names.items() if len(ps) > 1}


# a module a reader takes in at once, a class that holds one concept: past these, split by what the code holds
MODULE_LINES_MAX, CLASS_LINES_MAX = 500, 250


def test_no_module_or_class_of_the_launcher_outgrows_one_reading():
    long_modules, long_classes = [], []
    for path, tree in _modules("launcher"):
        lines = len(path.read_text().splitlines())
        if lines > MODULE_LINES_MAX:
            long_modules.append(f"{path.relative_to(REPO)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 >= CLASS_LINES_MAX:
                long_classes.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                                    f"{node.end_lineno - node.lineno + 1} lines")
    assert not long_modules and not long_classes, long_modules + long_classes


# what a feature's rule may import: the config's modules and the other rules (pure: no process, no torch,
# no scheduler); its login and node halves import it, never the other way
RULE_IMPORTS = ("launcher.config.schema", "launcher.config.faults", "launcher.run.status", "launcher.config.layout",
                "launcher.config.recipe_contract", "launcher.submit.reshard")


# each feature's pure rule (its login and node halves beside it import it)
FEATURE_RULES = ("elastic/resize.py", "asha/schedule.py", "pbt/generations.py", "preflight/ladder.py")


def _imported_modules(tree: ast.AST) -> Iterator[str]:
    """Every module an import names (``from launcher import a`` names launcher.a)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_a_features_rule_imports_only_the_config_and_other_rules():
    rules = [REPO / "launcher" / "features" / r for r in FEATURE_RULES]
    rule_modules = {p.relative_to(REPO).with_suffix("").as_posix().replace("/", ".") for p in rules}
    bad = [f"{p.relative_to(REPO)}: {name}" for p in rules for name in _imported_modules(ast.parse(p.read_text()))
           if name.split(".")[0] in ("launcher", "torch", "deepspeed", "submitit")
           and not any(name == m or name.startswith(m + ".") for m in (*RULE_IMPORTS, *rule_modules))]
    assert not bad, bad


def test_run_dir_file_names_live_in_rundir():
    names = "|".join(re.escape(Path(n).name) for n in
                     ("run.json", "config.yaml", "overrides.yaml", "seeds.json",
                      "plan.json", "checks.json", "git.json", "patch.diff", "snapshot.json",
                      "software.json", "pip-freeze.txt", "job.json", "sbatch.sh",
                      "status.json", "runtime.json", "training-env.json",
                      "ds_config.json", "metrics.jsonl", "manifest.json"))
    pattern = re.compile(rf"(^|/)({names})$")
    # a recipe's own files (its contract's run_files) are named in its contract module
    own = {REPO / "recipes" / pkg / "contract.py": {f.name for f in recipe_contract.of(target).run_files}
           for pkg, target in SHIPPED_RECIPES}
    own[REPO / "launcher" / "data" / "manifest.py"] = {"manifest.json"}  # a prepared dataset's, not a run dir's
    bad = []
    for path, tree in _modules("launcher", "hydra_plugins", "recipes"):
        if path.name == "rundir.py" or path.parent == REPO / "launcher" / "run":  # the run dir's own modules
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.search(node.value)
                    and node.value not in own.get(path, ())):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"(ranks/)?(rank|mesh|state)_|topology/(node_)?|ranks/?", node.value):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not bad, bad


def test_archive_doc_lists_exactly_the_run_dir_files():
    doc = (REPO / "docs" / "archive.md").read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    documented = {m for line in rows for m in re.findall(r"`([^`]+)`", line.split("|")[1])}
    assert documented == {f for f, _, _ in FILES} | {f.name for _, target in SHIPPED_RECIPES
                                                      for f in recipe_contract.of(target).run_files}
    # and every name RunDir spells is in the table
    spelled = {v for k, v in vars(RunDir).items() if k.isupper() and isinstance(v, str)}
    assert {s.rstrip("/") for s in spelled} <= {f.rstrip("/") for f in documented}


def test_architecture_doc_names_every_module():
    """Every module (a package's __init__.py where it holds more than a docstring and imports) is
    named by its path in docs/architecture.md, and every module path the doc names exists."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"\b((?:launcher|hydra_plugins|recipes)/[\w/]*\w\.py)\b", doc))
    holds_code = lambda tree: any(not isinstance(n, (ast.Import, ast.ImportFrom)) and not (  # noqa: E731
        isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)) for n in tree.body)
    modules = {p.relative_to(REPO).as_posix() for p, tree in _modules("launcher", "hydra_plugins", "recipes")
               if p.name != "__init__.py" or holds_code(tree)}
    assert not modules - named, f"modules docs/architecture.md does not list: {sorted(modules - named)}"
    assert not {n for n in named if not (REPO / n).is_file()}, "docs/architecture.md names modules that do not exist"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(*roots: str) -> dict:
    """module -> the project modules it imports anywhere in its body (top level and inside functions;
    ``from pkg import mod`` names the submodule, relative imports resolved)."""
    trees = {_module_name(p): (p, tree) for p, tree in _modules(*roots)}
    graph = {name: set() for name in trees}
    for name, (path, tree) in trees.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                # the module itself, else its nearest enclosing project package
                while t and t not in trees:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def _strongly_connected(graph: dict) -> list:
    """Tarjan's algorithm: the strongly connected components of ``graph``."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_strongly_connected_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert sorted(_strongly_connected(graph)) == [["a", "b", "c"], ["d"]]


def test_no_import_cycles():
    graph = _import_graph("launcher", "recipes", "hydra_plugins")
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    shown = ["\n  ".join(f"{m} -> {', '.join(sorted(graph[m] & set(c)))}" for m in c) for c in cycles]
    assert not cycles, "modules that import each other (directly or in a circle):\n  " + "\n\n  ".join(shown)


def _private_uses(tree: ast.AST) -> Iterator[str]:
    """Private names (``_x``, not dunders) of the project's other modules that a module uses: imported
    by name, or reached as an attribute of an imported project module."""
    private = lambda n: n.startswith("_") and not n.startswith("__")  # noqa: E731
    project = ("launcher", "hydra_plugins", "recipes")
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in project:
            for a in node.names:
                if private(a.name):
                    yield f"from {node.module} import {a.name}"
                else:
                    modules.add(a.asname or a.name)  # maybe a module (from launcher.runtime import task)
        elif isinstance(node, ast.Import):
            modules.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in project)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and private(node.attr):
            yield f"{node.value.id}.{node.attr}"


def test_no_module_uses_another_modules_private_names():
    uses = {f"{p.relative_to(REPO).as_posix()}: {use}" for p, tree in _modules("launcher", "hydra_plugins", "recipes")
            for use in _private_uses(tree)}
    assert not uses, sorted(uses)


def _calls(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            yield getattr(n.func, "attr", getattr(n.func, "id", ""))


def test_every_job_runs_through_the_one_attempt():
    """RunTask (a recipe) and a Hydra app's job both run inside launcher.runtime.attempt.attempt,
    which alone changes the run's status: neither calls set_status / finish itself."""
    trees = {p.name: tree for p, tree in _modules("launcher/runtime", "hydra_plugins/launcher_plugin")}
    jobs = {"task.py": next(n for n in trees["task.py"].body if isinstance(n, ast.FunctionDef) and n.name == "run"),
            "generic.py": next(n for n in trees["generic.py"].body if isinstance(n, ast.ClassDef)
                               and n.name == "_HydraJob")}
    for name, node in jobs.items():
        calls = set(_calls(node))
        assert "attempt" in calls, f"{name}: does not run through attempt()"
        assert not calls & {"set_status", "finish"}, f"{name}: changes the run's status itself"
    defined = [p for p, tree in _modules("launcher", "hydra_plugins") for n in tree.body
               if isinstance(n, ast.FunctionDef) and n.name == "attempt"]
    assert [p.relative_to(REPO).as_posix() for p in defined] == ["launcher/runtime/attempt.py"]
