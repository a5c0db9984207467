"""The tests run what users run: an override in tests/ that turns a shipped default off (the defaults
that shape a run's stop paths: wandb, the async checkpoint writer, the restart budget) says why in one
line beside it (a ``#`` comment on its line or the line above), and the shared helpers set none."""
import ast
import dataclasses
import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

from launcher.config import schema

TESTS = Path(__file__).resolve().parents[1]
# the keys whose shipped values the stop paths run with (each read from the schema, never restated)
GUARDED = ("wandb.enabled", "wandb.mode", "train.checkpoint.async_save", "train.max_restarts")
SHARED_HELPERS = (TESTS / "helpers.py", TESTS / "conftest.py", TESTS / "rank_sim.py")


def shipped(key: str) -> str:
    """The schema's default of ``key`` as an override writes it (``true``, ``offline``, ``3``)."""
    node: Any = schema.RunConfig
    *path, leaf = key.split(".")
    for part in path:
        f = {f.name: f for f in dataclasses.fields(node)}[part]
        node = f.default_factory if f.default_factory is not dataclasses.MISSING else f.default  # type: ignore[misc]
    f = {f.name: f for f in dataclasses.fields(node)}[leaf]
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    return str(value).lower() if isinstance(value, bool) else str(value)


def overrides_off_default(path: Path) -> List[Tuple[int, str]]:
    """(line, override) of every string literal in ``path`` that sets a GUARDED key to another value."""
    defaults = {k: shipped(k) for k in GUARDED}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = re.fullmatch(r"\+{0,2}([\w.]+)=(\S*)", node.value.strip())
            if m and m.group(2) and m.group(1) in defaults and m.group(2).lower() != defaults[m.group(1)].lower():
                found.append((node.lineno, node.value))
    return found


def has_reason(lines: List[str], lineno: int) -> bool:
    here, above = lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""
    return "#" in here.split('"')[-1] or above.strip().startswith("#")


def test_the_guarded_defaults_are_read_from_the_schema():
    got: Dict[str, str] = {k: shipped(k) for k in GUARDED}
    assert got == {"wandb.enabled": "true", "wandb.mode": "offline", "train.checkpoint.async_save": "true",
                   "train.max_restarts": "3"}


def test_every_override_of_a_shipped_default_in_tests_says_why():
    unexplained = []
    for path in sorted(TESTS.rglob("*.py")):
        lines = path.read_text().splitlines()
        for lineno, override in overrides_off_default(path):
            if not has_reason(lines, lineno):
                unexplained.append(f"{path.relative_to(TESTS)}:{lineno}: {override}")
    assert not unexplained, "overrides of a shipped default without a one-line reason:\n" + "\n".join(unexplained)


def test_the_shared_helpers_turn_no_default_off():
    offending = [f"{p.name}:{n}: {o}" for p in SHARED_HELPERS if p.exists() for n, o in overrides_off_default(p)]
    assert not offending, offending


def test_the_scan_finds_an_unexplained_override(tmp_path):
    f = tmp_path / "t.py"
    f.write_text('A = ["x=1", "wandb.enabled=false"]\nB = ["train.max_restarts=0"]  # about the budget\n'
                 'C = ["wandb.enabled=true"]\n')
    lines = f.read_text().splitlines()
    found = overrides_off_default(f)
    assert [n for n, _ in found] == [1, 2]
    assert [has_reason(lines, n) for n, _ in found] == [False, True]
