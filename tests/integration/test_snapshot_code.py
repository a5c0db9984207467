"""The code snapshot and the code records (no launch): the launcher's recipes a user's code imports
are bundled, a file holding a secret is left out (never rewritten), the user's code and the
launcher's own are recorded apart. (Here, not in tests/unit: they run git.)"""
import subprocess
from pathlib import Path

import launcher
from launcher.archive import code, secrets, snapshot

REPO = Path(__file__).resolve().parents[2]


def tree(root: Path, files: dict) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_launchers_recipes_are_bundled_when_the_code_imports_them(tmp_path):
    src = tree(tmp_path / "src", {"mine/__init__.py": "", "mine/wrap.py": "from recipes.gpt import train\n"})
    info = snapshot.take(src, tmp_path / "s1" / "code", known={})
    dest = tmp_path / "s1" / "code"
    assert (dest / "mine" / "wrap.py").is_file() and (dest / "recipes" / "gpt" / "train.py").is_file()
    assert info["bundled"]["recipes"]["source"] == str(REPO / "recipes") and info["bundled"]["recipes"]["files"] > 5
    # no bytecode copied from the launcher's install: only the snapshot's own, compiled from its sources
    pyc = {p.parent.parent / (p.name.split(".")[0] + ".py") for p in (dest / "recipes").rglob("*.pyc")}
    assert pyc and all(src.is_file() for src in pyc), sorted(map(str, pyc))


def test_no_bundle_without_an_import_and_the_users_own_package_wins(tmp_path):
    plain = tree(tmp_path / "plain", {"mine/__init__.py": "", "mine/t.py": "import json\n"})
    assert snapshot.take(plain, tmp_path / "s1" / "code", known={})["bundled"] == {}
    assert not (tmp_path / "s1" / "code" / "recipes").exists()
    # named by the run's target instead of an import: bundled too
    assert "recipes" in snapshot.take(plain, tmp_path / "s2" / "code", known={}, imports=["recipes"])["bundled"]
    own = tree(tmp_path / "own", {"recipes/__init__.py": "", "recipes/mine.py": "import recipes.mine\n"})
    info = snapshot.take(own, tmp_path / "s3" / "code", known={})
    assert info["bundled"] == {} and sorted(p.name for p in (tmp_path / "s3" / "code" / "recipes").iterdir()
                                            if p.name != "__pycache__") == ["__init__.py", "mine.py"]


def test_a_file_holding_a_secret_is_left_out_and_named(tmp_path):
    value = "zz-" + "9" * 20
    src = tree(tmp_path / "src", {"mine/__init__.py": "", "mine/t.py": f"ORDER = '{value}'\n", "mine/u.py": "x = 1\n"})
    info = snapshot.take(src, tmp_path / "s" / "code", known={"config[0].recipe.params.api_key": value})
    dest = tmp_path / "s" / "code"
    assert not (dest / "mine" / "t.py").exists() and (dest / "mine" / "u.py").read_text() == "x = 1\n"
    assert info["held_secret"] == {"mine/t.py": ["recipe.params.api_key"]} and "redacted" not in info
    (line,) = snapshot.left_out_warnings(info)
    assert "mine/t.py" in line and "recipe.params.api_key" in line and value not in line
    assert not any(value.encode() in p.read_bytes() for p in dest.rglob("*") if p.is_file())
    assert secrets.REDACTED not in (dest / "mine" / "u.py").read_text()


def test_the_users_code_outside_git_and_the_launchers_own_are_recorded_apart(tmp_path):
    state = code.git_state(tmp_path)  # tmp_path is in no git repo: never the launcher's repo instead
    assert state["commit"] is None and state["repo"] is None and state["note"] == code.NOT_A_REPO
    own = code.launcher_state()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert own["version"] == launcher.__version__ and own["commit"] == head and own["path"] == str(REPO / "launcher")
    assert isinstance(own["dirty"], bool)


def test_hydra_outputs_of_earlier_runs_stay_out_and_no_repo_is_said(tmp_path):
    """An app outside git whose earlier Hydra runs wrote their output dirs into its tree (a sweep dir
    not named outputs/ or multirun/): no dir holding `.hydra/` or `multirun.yaml` is copied (every
    override of those runs is in there), the app's own code is, and its provenance says it has no repo
    (not this project's repo and commit). The snapshot's directories are read-only too."""
    app = tree(tmp_path / "app", {
        "app.py": "import hydra\n", "conf/config.yaml": "x: 1\n", "lib/util.py": "X = 1\n",
        "sweeps/a/multirun.yaml": "hydra: {overrides: {task: [+db.password_hint=hunter]}}\n",
        "sweeps/a/0/.hydra/overrides.yaml": "- +db.password_hint=hunter\n",
        "sweeps/a/0/.hydra/config.yaml": "x: 5\n", "sweeps/a/0/result.yaml": "v: 1\n",
        "logs/2026-01-01/10-00-00/.hydra/config.yaml": "x: 6\n",  # a hydra.run.dir
        "logs/2026-01-01/10-00-00/main.py": "# a stray copy\n"})
    assert code.repo_root(app) is None
    dest = tmp_path / "s" / "code"
    info = snapshot.take(app, dest, known={})
    copied = sorted(str(p.relative_to(dest)) for p in dest.rglob("*")
                    if p.is_file() and not p.name.startswith(".") and "__pycache__" not in p.parts)
    assert copied == ["app.py", "conf/config.yaml", "lib/util.py"], copied
    assert not any(b"hunter" in p.read_bytes() for p in dest.rglob("*") if p.is_file())
    assert info["git"]["repo"] is None and info["git"]["commit"] is None and info["git"]["note"] == "not a git repo"
    assert snapshot.info(dest)["git"]["note"] == "not a git repo"
    assert all(not p.stat().st_mode & 0o222 for p in [dest, *dest.rglob("*")]), "a writable file or dir"
    assert sorted(snapshot.tree_secrets(app)) == []  # (the left-out files are not read for secrets either)


def test_in_a_git_repo_untracked_hydra_outputs_stay_out(tmp_path):
    app = tree(tmp_path / "app", {"app.py": "import hydra\n", "out/b/0/.hydra/overrides.yaml": "- x=1\n",
                                  "out/b/0/keep.py": "# written by the run\n",
                                  "out/b/.submitit/1_submitted.pkl": "pickled job\n"})
    subprocess.run(["git", "init", "-q", str(app)], check=True)
    info = snapshot.take(app, tmp_path / "s" / "code", known={})
    assert info["files"] == 1 and (tmp_path / "s" / "code" / "app.py").is_file()
    assert info["git"]["repo"] == str(app.resolve())


def test_a_planted_bytecode_cache_entry_never_reaches_a_snapshot(tmp_path, monkeypatch):
    """A .pyc put in the bytecode cache under a clean source's digest (a team-shared cache, or a tampered
    one) carries no signature of this user's secret: the snapshot compiles that source again, and a
    signed entry (the launcher's own) is reused."""
    import hashlib
    import importlib.util
    import py_compile
    import sys

    monkeypatch.setenv("LAUNCHER_BYTECODE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    snapshot.cache_secret.cache_clear()
    source = b"VALUE = 1\n"
    key = hashlib.sha256(source).hexdigest()
    evil = tmp_path / "evil" / "mod.py"
    evil.parent.mkdir()
    evil.write_bytes(source + b"open(__file__ + '.PWNED', 'w')\n")
    planted = snapshot.bytecode_cache() / key[:2] / f"{key}.pyc"
    planted.parent.mkdir(parents=True)
    py_compile.compile(str(evil), cfile=str(planted), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)

    def snap(name: str) -> bytes:
        tree = tmp_path / name
        tree.mkdir()
        (tree / "mod.py").write_bytes(source)
        snapshot.compile_tree(tree, tree)
        return Path(importlib.util.cache_from_source(str(tree / "mod.py"))).read_bytes()

    first = snap("first")
    assert b"PWNED" not in first  # compiled from its own source, the planted entry ignored
    # the entry the launcher wrote over it is its compilation, signed, and reused by the next snapshot
    assert planted.read_bytes() == first and (planted.parent / f"{key}.pyc.sig").is_file()
    assert snap("second") == first
    assert snapshot.compile_tree(*(2 * [tmp_path / "second"])) == 0  # nothing compiled anew: the cache served
    assert (tmp_path / "config" / "launcher" / "bytecode.key").stat().st_mode & 0o777 == 0o600
    # and the snapshot's module is the clean one when imported
    sys.path.insert(0, str(tmp_path / "second"))
    try:
        import mod  # noqa: F401

        assert mod.VALUE == 1 and not Path(str(tmp_path / "second" / "mod.py") + ".PWNED").exists()
    finally:
        sys.path.remove(str(tmp_path / "second"))
        sys.modules.pop("mod", None)
