"""Secret literals lifted out of a run's config into the job's environment, so that no archived file
holds them and the job still reads what it was given.

A secret-named key of a config written as ``${oc.env:NAME}`` keeps that reference; a literal becomes
``${oc.env:LAUNCHER_SECRET_<KEY>}`` (``redact_config``), its value exported by the launch
(``lifted_secrets``). A secret literal in a setup line (``cluster.setup``) is lifted the same way
(``lift_shell``: the line reads ``"$LAUNCHER_SECRET_..."``). On a later launch or on the node,
``missing_references`` / ``from_env_reference`` read those references back.
"""
from __future__ import annotations

import os
import pickle
import re
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from launcher import by_section
from launcher.archive.scrubbing import (
    NOT_SECRET_NAMES,
    REDACTED,
    URL_PASSWORD,
    Known,
    is_secret,
    is_secret_value,
    scrub_tree,
    secret_values,
)

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

# A secret-named key may take its value from the job's environment: the archive keeps the reference,
# and the job resolves it where it runs (sbatch passes the submitting environment on).
_ENV_REFERENCE = re.compile(r"^\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,(.*))?\}$", re.S)


def env_reference(value: Any) -> Optional[str]:
    """``${oc.env:NAME}`` (or with a default that is no secret) -> NAME; anything else -> None."""
    m = _ENV_REFERENCE.match(value.strip()) if isinstance(value, str) else None
    if m is None or (m.group(2) is not None and is_secret_value(m.group(2).strip().strip("'\""))):
        return None
    return m.group(1)


LIFTED_PREFIX = "LAUNCHER_SECRET_"  # the environment variable a secret literal of the config travels in


def lifted_name(key: str) -> str:
    """The environment variable that carries the secret literal of config key ``key`` to the job."""
    return LIFTED_PREFIX + re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_").upper()


def _secret_scalars(node: Any, written: Any, path: str, visit: Any) -> Any:
    """``node`` (resolved) with ``visit(key, value, written)`` applied to each non-empty scalar under a
    secret-named key; ``written``: the same config unresolved (None where unknown)."""
    if isinstance(node, dict):
        written = written if isinstance(written, Mapping) else {}
        out = {}
        for k, v in node.items():
            name = f"{path}.{k}" if path else str(k)
            if is_secret(str(k)) and not isinstance(v, (dict, list)) and v not in (None, ""):
                out[k] = visit(name, v, written.get(k))
            else:
                out[k] = _secret_scalars(v, written.get(k), name, visit)
        return out
    if isinstance(node, list):
        written = written if isinstance(written, (list, tuple)) and len(written) == len(node) else [None] * len(node)
        return [_secret_scalars(v, w, f"{path}[{i}]", visit) for i, (v, w) in enumerate(zip(node, written))]
    return node


def lifted_secrets(resolved: Dict[str, Any], raw: Any) -> Dict[str, str]:
    """The secret literals of a config (secret-named keys not written as ``${oc.env:NAME}``), by the
    environment variable that carries each to the job: the archive holds a reference to it instead of
    the value, so the job reads the value it was given and no archived file holds it."""
    out: Dict[str, str] = {}
    if isinstance(resolved, dict):  # section by section, each distinct one read once (launcher.by_section)
        for k, v in resolved.items():
            w = raw.get(k) if isinstance(raw, Mapping) else None
            out.update(by_section.once("lifted", _lifted, {k: v}, None if raw is None else {k: w}))
    else:
        out.update(_lifted(resolved, raw))
    out.update(lift_shell(shell_lines_of(resolved))[1])
    return out


def _lifted(resolved: Any, raw: Any) -> Dict[str, str]:
    """lifted_secrets' secret-named keys (its setup lines apart) of a config, or of one section of it."""
    out: Dict[str, str] = {}

    def visit(key: str, value: Any, written: Any) -> Any:
        if env_reference(written) is None and is_secret_value(value):
            out[lifted_name(key)] = str(value)
        return value

    _secret_scalars(resolved, raw, "", visit)
    return out


def redact_config(resolved: Dict[str, Any], known: Optional[Known] = None, raw: Any = None) -> Dict[str, Any]:
    """A resolved config with the values of secret-named keys (cluster.env.HF_TOKEN, anywhere)
    replaced, and, given ``known``, every known secret value scrubbed from every other string.
    Given ``raw`` (the config as written), a key written as ``${oc.env:NAME}`` keeps that reference
    and a secret literal becomes a reference to the variable that carries it (``lifted_secrets``):
    the job resolves either from its environment, so redaction never changes what it reads. Without
    ``raw`` (a record that is only read, never run), the value becomes REDACTED."""

    if not isinstance(resolved, dict):
        return _redacted(resolved, raw, known)
    # section by section, each distinct one redacted once (launcher.by_section), a copy of it each time:
    # what is returned is the caller's to change
    known_key = tuple(sorted(secret_values(known))) if known else ()
    out: Dict[str, Any] = {}
    for k, v in resolved.items():
        w = raw.get(k) if isinstance(raw, Mapping) else None
        out.update(pickle.loads(by_section.once("redacted", _redacted_section, k, v, w, raw is None, known_key)))
    return out


def _redacted_section(key: Any, value: Any, written: Any, unwritten: bool, known_key: Tuple[str, ...]) -> bytes:
    known = {f"known[{i}]:password": v for i, v in enumerate(known_key)}  # secret-named: scrub takes the values
    return pickle.dumps(_redacted({key: value}, None if unwritten else {key: written}, known),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _redacted(resolved: Any, raw: Any, known: Optional[Known]) -> Any:
    """redact_config of a whole config (or of one top-level section of it, as ``{key: value}``)."""

    def visit(key: str, value: Any, written: Any) -> Any:
        if raw is None:
            return REDACTED
        if env_reference(written) is not None:
            return written
        if is_secret_value(value):
            return "${oc.env:" + lifted_name(key) + "}"
        return value  # a setting under a secret-looking name (true, auto, a 3-character value)

    out = _secret_scalars(resolved, raw, "", visit)
    lines = shell_lines_of(out)
    if lines:  # the setup lines as the job's script runs them: secret literals read from the variables
        out["cluster"] = {**out["cluster"], "setup": lift_shell(lines)[0]}
    return scrub_tree(out, known) if known else out


def missing_references(archived: Any, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why a new job of an archived config could not read its secrets (None: every variable its
    ``${oc.env:NAME}`` references need is set here, and the job inherits them)."""
    env = os.environ if env is None else env
    missing = [n for n in env_references(archived) if n not in env]
    if not missing:
        return None
    return (f"the run reads {', '.join(missing)} from the environment (secrets are never archived); "
            f"export {' '.join(m + '=...' for m in missing)} and run the command again")


def env_references(node: Any) -> List[str]:
    """The variables every ``${oc.env:NAME}`` of an archived config (no default) and every
    ``$LAUNCHER_SECRET_...`` of its setup lines need, sorted."""
    found: Set[str] = set()

    def walk(n: Any) -> None:
        if isinstance(n, Mapping):
            for v in n.values():
                walk(v)
        elif isinstance(n, (list, tuple)):
            for v in n:
                walk(v)
        elif isinstance(n, str):
            m = _ENV_REFERENCE.match(n.strip())
            if m and m.group(2) is None:
                found.add(m.group(1))
            found.update(_SHELL_REFERENCE.findall(n))  # a setup line's lifted secret ("$LAUNCHER_SECRET_...")

    walk(node)
    return sorted(found)


def from_env_reference(value: Any, env: Mapping[str, str]) -> Any:
    """On the node: an archived ``${oc.env:NAME[,default]}`` as the job's environment resolves it
    (the value unchanged otherwise; None when NAME is unset and there is no default)."""
    m = _ENV_REFERENCE.match(value.strip()) if isinstance(value, str) else None
    if m is None:
        return value
    default = m.group(2).strip().strip("'\"") if m.group(2) is not None else None
    return env.get(m.group(1), default)


# ---- secrets in shell lines and URLs ------------------------------------------------------------
# `cluster.setup` lines run in the job's batch script. A secret literal assigned there
# (`export HF_TOKEN2=hf_...`) or a URL password in one (`pip install git+https://u:PW@host/x`) is
# lifted as a config secret is: the launch exports it in LAUNCHER_SECRET_<...> (the job inherits it)
# and the line the script runs, and the archive keeps, reads that variable instead ("$LAUNCHER_...":
# no braces, so that OmegaConf never takes it for an interpolation). The shell then reads the same
# value, so only values the shell takes literally are lifted: single-quoted; double-quoted without
# \ $ ` !; unquoted of characters no shell expands. Any other form is still a known secret (scrubbed
# from every archived text) but stays in the submitted script as written.
SHELL_KEY = "cluster.setup"  # the config's shell lines
_SHELL_REFERENCE = re.compile(r"\$(" + LIFTED_PREFIX + r"[A-Z0-9_]+)")
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_.,:/+=@%^-]+")
_SHELL_WORD_END = " \t;&|)"
_SHELL_ASSIGN = re.compile(r"(?<![^\s;&|(])([A-Za-z_][A-Za-z0-9_]*)=")
# an environment-variable-like name (upper case): what a file of the tree assigns a secret to
ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
# the loose form, for text that is not a shell line (an override `cluster.setup=['export A=x']`)
_TEXT_ASSIGN = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)=(['\"]?)([^'\"\s$`;&|<>(){}\[\],\\]+)")


def _quoting(line: str) -> List[Optional[str]]:
    """The shell's quoting before each character of ``line`` (and at its end): None, "'", '"' or "\\"."""
    states: List[Optional[str]] = []
    quote: Optional[str] = None
    escaped = False
    for ch in line:
        states.append("\\" if escaped else quote)
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
    states.append(quote)
    return states


def _shell_literals(line: str) -> List[tuple]:
    """(start, end, kind, name, value, quoting) of each secret literal of a shell line the shell reads
    as written: ``NAME=value`` with a secret NAME, and URL passwords. ``kind``: "assign" (the span is
    the whole value word, quotes included) or "url" (the span is the password)."""
    states = _quoting(line)
    found = []
    for m in _SHELL_ASSIGN.finditer(line):
        if states[m.start()] is not None or not is_secret(m.group(1)) or m.group(1) in NOT_SECRET_NAMES:
            continue
        start = m.end()
        first = line[start:start + 1]
        if first in ("'", '"'):
            end = line.find(first, start + 1)
            value = line[start + 1:end] if end > 0 else ""
            if end < 0 or (first == '"' and any(c in value for c in '\\$`!')):
                continue
            end += 1
        else:
            w = _SHELL_SAFE.match(line, start)
            if w is None:
                continue
            end, value = w.end(), w.group()
        if end < len(line) and line[end] not in _SHELL_WORD_END:
            continue  # the word goes on (`A=x"$y"`, `A=x*`): not a value the launcher can read
        if is_secret_value(value):
            found.append((start, end, "assign", m.group(1), value, None))
    for m in URL_PASSWORD.finditer(line):
        pw, start, end = m.group(1), m.start(1), m.end(1)
        quote = states[start]
        if "$" in pw or not is_secret_value(pw) or quote == "\\" or len(set(states[start:end + 1])) > 1:
            continue
        if (quote is None and not _SHELL_SAFE.fullmatch(pw)) or (quote == '"' and any(c in pw for c in '\\`!')):
            continue
        if not any(s <= start < e for s, e, *_ in found):  # not inside a value lifted whole
            found.append((start, end, "url", "url_password", pw, quote))
    return sorted(found)


def shell_secrets(text: str, upper_only: bool = False) -> List[tuple]:
    """(name, value) of each secret literal assigned in ``text`` (a shell line, or any text holding
    one): ``export HF_TOKEN2=hf_...``. ``upper_only``: environment-variable-like names only (text of
    a file of the tree, where lower-case names are settings of other tools)."""
    out = [(name, value) for _, _, kind, name, value, _ in _shell_literals(text) if kind == "assign"]
    for m in _TEXT_ASSIGN.finditer(text):  # the loose form finds values inside quoted text too
        name, value = m.group(1), m.group(3)
        if is_secret(name) and name not in NOT_SECRET_NAMES and is_secret_value(value) and (name, value) not in out:
            out.append((name, value))
    return [(n, v) for n, v in out if not upper_only or ENV_NAME.match(n)]


def lift_shell(lines: Iterable[str], key: str = SHELL_KEY) -> tuple:
    """(the lines with each secret literal the shell reads as written replaced by a reference to the
    variable that carries it, {variable: value}). Names: ``LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2``,
    ``...URL_PASSWORD`` (``_2``, ``_3`` ... where one name takes other values). The same lines give
    the same names, so the launch (which exports them) and the backend (whose script reads them)
    agree."""
    values: Dict[str, str] = {}
    out = []
    for line in lines:
        line = str(line)
        new, last = [], 0
        for start, end, _kind, name, value, quote in _shell_literals(line):
            var, n = lifted_name(f"{key}.{name}"), 1
            while values.get(var, value) != value:
                n += 1
                var = lifted_name(f"{key}.{name}_{n}")
            values[var] = value
            ref = {None: f'"${var}"', '"': f"${var}", "'": f"'\"${var}\"'"}[quote]
            new += [line[last:start], ref]
            last = end
        out.append("".join(new) + line[last:])
    return out, values


def shell_lines_of(cfg: RunConfig) -> List[str]:
    """The config's setup lines (``cluster.setup``) as strings; [] where it has none."""
    node: Any = cfg
    for part in SHELL_KEY.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return [str(x) for x in node] if isinstance(node, (list, tuple)) and all(isinstance(x, str) for x in node) else []
