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
    assert not list((dest / "recipes").rglob("__pycache__"))


def test_no_bundle_without_an_import_and_the_users_own_package_wins(tmp_path):
    plain = tree(tmp_path / "plain", {"mine/__init__.py": "", "mine/t.py": "import json\n"})
    assert snapshot.take(plain, tmp_path / "s1" / "code", known={})["bundled"] == {}
    assert not (tmp_path / "s1" / "code" / "recipes").exists()
    # named by the run's target instead of an import: bundled too
    assert "recipes" in snapshot.take(plain, tmp_path / "s2" / "code", known={}, imports=["recipes"])["bundled"]
    own = tree(tmp_path / "own", {"recipes/__init__.py": "", "recipes/mine.py": "import recipes.mine\n"})
    info = snapshot.take(own, tmp_path / "s3" / "code", known={})
    assert info["bundled"] == {} and sorted(p.name for p in (tmp_path / "s3" / "code" / "recipes").iterdir()) == \
        ["__init__.py", "mine.py"]


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
