"""Every Python program written inside the shell scripts (``python -c '...'`` and ``python - <<'EOF'``
heredocs of scripts/ and benchmarks/) parses under the oldest Python the project supports
(setup.cfg: python_requires): a GPU machine's or a site's older interpreter runs them as they are, and a
SyntaxError there costs a device loan. f-strings nesting their own quotes (Python 3.12's grammar) fail
this on 3.10 and 3.11."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("scripts/*.sh"), *REPO.glob("benchmarks/*.sh")])
OLDEST = (3, 10)
# a -c program in single quotes (a shell single-quoted string holds no single quote), and a quoted heredoc
_DASH_C = re.compile(r"""(?:python3?|\$PY|"\$PY"|"\$1"|\$\{?PY\}?)\s+(?:-u\s+)?-c\s+'([^']*)'""")
_HEREDOC = re.compile(r"""(?:python3?|\$PY|"\$PY")\s+-\s[^\n]*<<\s*'(\w+)'\n(.*?)\n\1\n""", re.S)


def programs(text: str) -> List[str]:
    return [m.group(1) for m in _DASH_C.finditer(text)] + [m.group(2) for m in _HEREDOC.finditer(text)]


def _oldest() -> Tuple[int, int]:
    spec = re.search(r"python_requires\s*=\s*>=\s*(\d+)\.(\d+)", (REPO / "setup.cfg").read_text())
    return (int(spec.group(1)), int(spec.group(2))) if spec else OLDEST


def test_the_scripts_embed_programs_and_the_pattern_finds_them():
    found = {p.name: programs(p.read_text()) for p in SCRIPTS}
    assert len(found["gpu_mfu.sh"]) >= 3 and len(found["gpu_smoke.sh"]) >= 2, found
    assert _oldest() == OLDEST


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_each_embedded_program_parses_on_the_oldest_supported_python(script):
    # compiled by this interpreter (3.11 here: it rejects 3.12's f-strings) and parsed for the oldest grammar
    for src in programs(script.read_text()):
        try:
            compile(src, f"{script.name}:<embedded>", "exec", dont_inherit=True)
            ast.parse(src, feature_version=_oldest())
        except SyntaxError as e:
            pytest.fail(f"{script.name}: an embedded program does not parse on Python {_oldest()}: {e}\n{src[:400]}")
