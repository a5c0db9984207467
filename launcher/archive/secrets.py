"""Secrets never reach the archive or the logs.

What is a secret:
  * the value of a variable whose NAME ends in a secret word (TOKEN, KEY, SECRET, PASSWORD, CREDENTIALS...:
    ``is_secret``), from the submitting environment (``os.environ``) or from any secret-named key of a run
    config (``cluster.env.HF_TOKEN``, ``wandb.api_key`` ...): ``known_secrets`` collects them;
  * a literal assigned to an environment-variable-like secret name in a config file of the source
    tree (``HF_TOKEN: hf_...`` in any YAML, ``export HF_TOKEN=...`` in a shell script: ``secrets_in_text``),
    whether or not this launch uses that file;
  * in shell lines (``cluster.setup``; a string of a YAML file of the tree; a shell script): the literal
    assigned to a secret name (``export HF_TOKEN2=hf_...``: ``shell_secrets``);
  * anywhere (config values, setup lines, files of the tree, the environment, the command line): the
    password of a URL (``https://user:PASSWORD@host``: ``url_passwords``);
  * a FILE whose name looks secret (``.env``, ``.env.*``, ``*.pem``, ``*.key``, ``id_rsa*``,
    ``*credentials*``, ``.netrc``, ``.pypirc``, ``*.p12`` ...: ``is_secret_file``): the code snapshot refuses it.

Where a known value goes: every archived text has it replaced by ``REDACTED`` wherever it occurs, under
any key (``scrub`` for text, ``scrub_bytes`` for bytes, ``scrub_tree`` for dicts and lists). Values
shorter than ``MIN_SECRET_LEN`` characters and a few words no secret is (true, false, none, null, auto)
are never treated as secrets, so short common values are not mangled everywhere they occur.
"""
from __future__ import annotations

import fnmatch
import functools
import os
import re
from pathlib import Path, PurePath
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Union

import yaml

REDACTED = "<redacted>"
# A name is secret when its LAST word (a trailing number aside: HF_TOKEN2) is one of these (HF_TOKEN,
# WANDB_API_KEY, db.password, apiKey, AWS_SECRET_ACCESS_KEY): words, not substrings, so tokenizer,
# max_tokens, key_order, num_keys or TOKENIZERS_PARALLELISM are settings and never redacted (a
# redaction would change what the job runs).
SECRET_WORDS = frozenset({"token", "key", "secret", "password", "passwd", "pwd", "credential", "credentials",
                          "apikey", "accesskey", "secretkey", "authtoken", "accesstoken"})
_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# environment that shapes training and is worth archiving (and each backend's own: Backend.env_prefixes)
TRAINING_ENV = ("NCCL_", "CUDA_", "OMP_", "TORCH_", "MKL_", "GLOO_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK",
                "PYTHONHASHSEED", "CUBLAS_", "NVIDIA_", "DS_", "WANDB_", "HYDRA_", "SUBMITIT_")
# A value shorter than this is never scrubbed from free text: "1", "yes", "gpu" would be replaced
# everywhere they occur. Secret-NAMED keys are redacted whatever their length (redact_config).
MIN_SECRET_LEN = 4
# values of secret-named variables that are settings, not secrets (TOKENIZERS_PARALLELISM=false)
NOT_SECRET_VALUES = frozenset({"true", "false", "none", "null", "auto", REDACTED})
# file names (matched case-insensitively against every path component) the code snapshot refuses
SECRET_FILES = (".env", ".env.*", ".envrc", "*.env", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore",
                "*.ppk", "*.kdbx", "*.gpg", "*.asc", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
                "*credentials*", ".netrc", "_netrc", ".pypirc", ".npmrc", ".git-credentials", ".htpasswd",
                ".ssh", ".gnupg", ".aws", ".docker")

Known = Mapping[str, Any]


def is_secret(name: str) -> bool:
    return _is_secret_name(str(name))


# names that end in a secret word but are the shell's own settings: PWD is the working directory
NOT_SECRET_NAMES = frozenset({"PWD", "OLDPWD"})


@functools.lru_cache(maxsize=4096)  # a sweep asks about the same few hundred key names per point
def _is_secret_name(name: str) -> bool:
    key = name.rsplit(".", 1)[-1]  # the key itself, not the sections above it
    words = _WORDS.findall(key)
    while words and words[-1].isdigit():  # a numbered secret: HF_TOKEN2, API_KEY_1
        words.pop()
    return bool(words) and words[-1].lower() in SECRET_WORDS and key not in NOT_SECRET_NAMES


def is_secret_file(path: Union[str, PurePath]) -> bool:
    """A file the code snapshot refuses: any component of its path looks like a secret store."""
    parts = PurePath(str(path)).parts
    return any(fnmatch.fnmatchcase(part.lower(), pat) for part in parts for pat in SECRET_FILES)


def is_secret_value(value: Any) -> bool:
    """Whether a secret-named variable's value is worth scrubbing (long enough, not a plain setting)."""
    if value is None or isinstance(value, (bool, dict, list, tuple)):
        return False
    text = str(value)
    return len(text) >= MIN_SECRET_LEN and text.strip().lower() not in NOT_SECRET_VALUES


def redact_env(env: Mapping[str, Any]) -> Dict[str, str]:
    """name -> value, with secret-named values replaced and known secret values scrubbed from the rest."""
    return {str(k): (REDACTED if is_secret(k) else scrub(str(v), env)) for k, v in env.items()}


def training_env(env: Mapping[str, str], scheduler: Sequence[str] = ()) -> Dict[str, str]:
    """The variables that shape training (NCCL_*, CUDA_*, OMP_*, TORCH_*, ...: TRAINING_ENV, and
    ``scheduler``: the prefixes of the job's backend, ``Backend.env_prefixes``), redacted: secret-named
    ones, and any value containing the value of a secret-named variable of ``env`` or a URL password
    (WANDB_BASE_URL=https://user:PASSWORD@host). A name without a trailing _ is matched whole."""
    names = (*TRAINING_ENV, *scheduler)
    kept = {k: v for k, v in sorted(env.items()) if any(k.startswith(n) if n.endswith("_") else k == n for n in names)}
    known = {k: v for k, v in env.items() if is_secret(k)}
    known.update((f"{k}:url_password[{j}]", pw) for k, v in kept.items() for j, pw in enumerate(url_passwords(v)))
    return {k: (REDACTED if is_secret(k) else scrub(str(v), known)) for k, v in kept.items()}


def secret_values(env: Known, min_len: int = MIN_SECRET_LEN) -> List[str]:
    """Values of secret-named entries (to scrub from free text such as a patch or a script), longest
    first so a secret containing another is replaced whole. Every name this module gives a value it
    found ends in a secret word (``...:url_password``, ``...cluster.setup[0]:HF_TOKEN2``)."""
    vals = {str(v) for k, v in env.items() if is_secret(k) and is_secret_value(v) and len(str(v)) >= min_len}
    return sorted(vals, key=len, reverse=True)


def _config_secrets(node: Any, path: str, out: Dict[str, str]) -> None:
    if isinstance(node, Mapping):
        for k, v in node.items():
            name = f"{path}.{k}" if path else str(k)
            if is_secret(k) and not isinstance(v, (Mapping, list, tuple)) and is_secret_value(v):
                out[name] = str(v)
                for j, part in enumerate(literal_parts(str(v))):  # `hf_x${nope}`, unresolved: hf_x
                    out[f"{name}[{j}]"] = part
            else:
                _config_secrets(v, name, out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _config_secrets(v, f"{path}[{i}]", out)


_INTERPOLATION = re.compile(r"\$\\?\{[^}]*\}")


def literal_parts(value: str) -> List[str]:
    """The literal text around the interpolations of a value written with some (``hf_x${nope}``:
    hf_x), each a secret of its own where the value is one: Hydra echoes an override of a sweep
    point with its interpolations escaped (``$\\{nope\\}hf_x``), so the whole value is never found."""
    if "{" not in value:
        return []
    return [p for p in _INTERPOLATION.split(value) if p != value and is_secret_value(p)]


def _plain(cfg: Any) -> Any:
    """A DictConfig as plain containers (resolved where it resolves), anything else unchanged."""
    try:
        # omegaconf: optional here; plain containers pass through
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover
        return cfg
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        except Exception:  # an interpolation that does not resolve: take the rest as written
            return OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    return cfg


def known_secrets(cfgs: Iterable[Any] = (), env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """name -> value of every secret the launch knows: the secret-named variables of ``env``
    (``os.environ`` by default) and the secret-named keys of each config (plain dicts or DictConfigs;
    ``cluster.env.HF_TOKEN``, ``wandb.api_key``, anywhere). Pass it to ``scrub``/``scrub_tree``."""
    env = os.environ if env is None else env
    out = {str(k): str(v) for k, v in env.items() if is_secret(k) and is_secret_value(v)}
    for k, v in env.items():
        for j, pw in enumerate(url_passwords(str(v))):
            out[f"{k}:url_password[{j}]"] = pw
    for i, cfg in enumerate(cfgs):
        plain = _plain(cfg)
        _config_secrets(plain, f"config[{i}]", out)
        _string_secrets(plain, f"config[{i}]", out)
        for j, line in enumerate(shell_lines_of(plain)):
            for name, value in shell_secrets(line):
                out[f"config[{i}].{SHELL_KEY}[{j}]:{name}"] = value
    return out


def _string_secrets(node: Any, path: str, out: Dict[str, str]) -> None:
    """The URL passwords of every string of a config (tags, a data URL, a setup line ...)."""
    if isinstance(node, Mapping):
        for k, v in node.items():
            _string_secrets(v, f"{path}.{k}", out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _string_secrets(v, f"{path}[{i}]", out)
    elif isinstance(node, str):
        for j, pw in enumerate(url_passwords(node)):
            out[f"{path}:url_password[{j}]"] = pw


SHORT_SECRET = 12  # values shorter than this are matched as whole tokens only


def _token(value: str) -> re.Pattern[str]:
    """Where ``value`` counts as found: anywhere for a long value (a token is found inside a URL or a
    longer string too); as a whole token for a short one, so that a secret that is a common word
    ("secret") does not rewrite ``secrets`` in code and text."""
    if len(value) >= SHORT_SECRET:
        return re.compile(re.escape(value))
    left = r"(?<![A-Za-z0-9_])" if (value[:1].isalnum() or value[:1] == "_") else ""
    right = r"(?![A-Za-z0-9_])" if (value[-1:].isalnum() or value[-1:] == "_") else ""
    return re.compile(left + re.escape(value) + right)


def scrub(text: str, env: Known) -> str:
    """Replace every secret value of ``env`` (values of its secret-named entries) occurring in ``text``
    as a whole token."""
    for value in secret_values(env):
        if value in text:
            text = _token(value).sub(REDACTED, text)
    return text


def scrub_bytes(data: bytes, env: Known) -> bytes:
    for value in secret_values(env):
        if value.encode() in data:
            data = re.compile(_token(value).pattern.encode()).sub(REDACTED.encode(), data)
    return data


def contains_secret(data: Union[str, bytes], env: Known) -> bool:
    if isinstance(data, bytes):
        return any(re.search(_token(v).pattern.encode(), data) for v in secret_values(env) if v.encode() in data)
    return any(_token(v).search(data) for v in secret_values(env) if v in data)


def scrub_tree(obj: Any, env: Known) -> Any:
    """``obj`` (dicts, lists, tuples, strings; keys too) with every secret value of ``env`` replaced
    in every string. Numbers, booleans and None are kept as they are (their type matters to the job)."""
    values = secret_values(env)
    if not values:
        return obj

    def text(s: str) -> str:
        for v in values:
            if v in s:
                s = s.replace(v, REDACTED)
        return s

    def walk(node: Any) -> Any:
        if isinstance(node, str):
            return text(node)
        if isinstance(node, Mapping):
            return {(text(k) if isinstance(k, str) else k): walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return node

    return walk(obj)


def scrub_file(path: Union[str, Path], env: Known) -> bool:
    """Rewrite ``path`` in place with every secret value of ``env`` replaced (keeps its mode);
    True if it held one. For files a tool wrote that the launcher cannot write itself (submitit's
    submission script)."""
    p = Path(path)
    if p.is_symlink() or not p.is_file():
        return False
    data = p.read_bytes()
    clean = scrub_bytes(data, env)
    if clean == data:
        return False
    mode = p.stat().st_mode
    tmp = p.with_name(p.name + ".scrub.tmp")
    tmp.write_bytes(clean)
    os.chmod(tmp, mode & 0o7777)
    os.replace(tmp, p)
    return True


def scrub_files(paths: Iterable[Union[str, Path]], env: Known) -> List[str]:
    """``scrub_file`` for each path; the ones that held a secret."""
    return [str(p) for p in paths if scrub_file(p, env)]


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

    def visit(key: str, value: Any, written: Any) -> Any:
        if env_reference(written) is None and is_secret_value(value):
            out[lifted_name(key)] = str(value)
        return value

    _secret_scalars(resolved, raw, "", visit)
    out.update(lift_shell(shell_lines_of(resolved))[1])
    return out


def redact_config(resolved: Dict[str, Any], known: Optional[Known] = None, raw: Any = None) -> Dict[str, Any]:
    """A resolved config with the values of secret-named keys (cluster.env.HF_TOKEN, anywhere)
    replaced, and, given ``known``, every known secret value scrubbed from every other string.
    Given ``raw`` (the config as written), a key written as ``${oc.env:NAME}`` keeps that reference
    and a secret literal becomes a reference to the variable that carries it (``lifted_secrets``):
    the job resolves either from its environment, so redaction never changes what it reads. Without
    ``raw`` (a record that is only read, never run), the value becomes REDACTED."""

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


# Secret values WRITTEN IN config files of the source tree (a cluster yaml with `env: {HF_TOKEN: ...}`
# that this launch does not even use; `export HF_TOKEN=...` in a shell script): an environment-
# variable-like secret name (upper case) assigned a literal. Python source is not read (a constant
# such as API_KEY_ENV = "WANDB_API_KEY" names a variable, it holds no secret).
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
_ASSIGNMENT = re.compile(r"""^\s*(?:export\s+)?([A-Z][A-Z0-9_]*)\s*[=:]\s*(['"]?)([^'"\s$#`]+)\2\s*(?:#.*)?$""")
YAML_SUFFIXES = (".yaml", ".yml")
ASSIGNMENT_SUFFIXES = (".sh", ".bash", ".zsh", ".cfg", ".ini", ".conf", ".toml", ".properties")


def _literal_secret(name: str, value: Any) -> bool:
    if not (isinstance(value, str) and _ENV_NAME.match(name) and is_secret(name) and is_secret_value(value)):
        return False
    # an interpolation or a reference to another variable is not a secret value
    return "${" not in value and not value.startswith("$") and not (_ENV_NAME.match(value) and is_secret(value))


def secrets_in_text(name: str, text: str) -> Dict[str, str]:
    """Secret literals a config file (by its name's suffix: YAML, shell, ini/toml/cfg) assigns to
    environment-variable-like secret names: ``{"<name>:HF_TOKEN": value}``, for ``scrub``."""
    out: Dict[str, str] = {}
    low = name.lower()
    if low.endswith(YAML_SUFFIXES):
        try:
            docs = list(yaml.safe_load_all(text))
        except Exception:  # not YAML after all (a template): read it line by line
            docs = None

        def walk(node: Any) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    if _literal_secret(str(k), v):
                        out[f"{name}:{k}"] = str(v)
                    else:
                        walk(v)
            elif isinstance(node, list):
                for v in node:
                    walk(v)
            elif isinstance(node, str):  # a setup line in a list (`- export HF_TOKEN=...`), a URL
                _line_secrets(name, node, out)

        if docs is not None:
            for d in docs:
                walk(d)
            return out
    elif not low.endswith(ASSIGNMENT_SUFFIXES):
        return out
    for line in text.splitlines():
        m = _ASSIGNMENT.match(line)
        if m and _literal_secret(m.group(1), m.group(3)):
            out[f"{name}:{m.group(1)}"] = m.group(3)
        _line_secrets(name, line, out)
    return out


def _line_secrets(name: str, text: str, out: Dict[str, str]) -> None:
    found = [(var, value) for var, value in shell_secrets(text, upper_only=True)]
    found += [("url_password", pw) for pw in url_passwords(text)]
    for var, value in found:
        key, n = f"{name}:{var}", 1
        while out.get(key, value) != value:  # the same name given another value elsewhere in the file
            n += 1
            key = f"{name}:{var}[{n}]"
        out[key] = value


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
# scheme://user:password@ (the password: no separator, no quote, no reference)
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@'\"]*:([^\s/@'\"]+)@")
# the loose form, for text that is not a shell line (an override `cluster.setup=['export A=x']`)
_TEXT_ASSIGN = re.compile(r"(?<![A-Za-z0-9_])([A-Za-z_][A-Za-z0-9_]*)=(['\"]?)([^'\"\s$`;&|<>(){}\[\],\\]+)")


def url_passwords(text: str) -> List[str]:
    """The passwords of the URLs in ``text`` that hold one (``https://user:PASSWORD@host``)."""
    if "://" not in text:
        return []
    return [pw for pw in _URL_PASSWORD.findall(text) if "$" not in pw and is_secret_value(pw)]


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
    for m in _URL_PASSWORD.finditer(line):
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
    return [(n, v) for n, v in out if not upper_only or _ENV_NAME.match(n)]


def lift_shell(lines: Iterable[str], key: str = SHELL_KEY) -> tuple:
    """(the lines with each secret literal the shell reads as written replaced by a reference to the
    variable that carries it, {variable: value}). Names: ``LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2``,
    ``..._URL_PASSWORD`` (``_2``, ``_3`` ... where one name takes other values). The same lines give
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


def shell_lines_of(cfg: Any) -> List[str]:
    """The config's setup lines (``cluster.setup``) as strings; [] where it has none."""
    node: Any = cfg
    for part in SHELL_KEY.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return [str(x) for x in node] if isinstance(node, (list, tuple)) and all(isinstance(x, str) for x in node) else []


def override_secrets(args: Iterable[str]) -> Dict[str, str]:
    """Secret values written on a command line of overrides (``+cluster.env.HF_TOKEN=...``, the
    parts of ``...=a,b``, a setup line's assignment, a URL password), for scrubbing a message that
    echoes the overrides (Hydra's errors), whatever is wrong with them."""
    out: Dict[str, str] = {}
    for i, arg in enumerate(args):
        arg = str(arg)
        if arg.startswith("-"):
            continue
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep:
            continue
        if is_secret(key.strip()):
            v = value.strip()
            parts = [v, v.strip("'\""), *re.split(r"[,\[\]()\s'\"\\]+", _INTERPOLATION.sub(" ", v))]
            for j, part in enumerate(parts):
                if is_secret_value(part):
                    out[f"argv[{i}]:{key}[{j}]"] = part
        for name, v in shell_secrets(value):
            out[f"argv[{i}]:{name}"] = v
        for j, pw in enumerate(url_passwords(value)):
            out[f"argv[{i}]:url_password[{j}]"] = pw
    return out


_LOOSE_ASSIGNMENT = re.compile(r"""^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.-]*)\s*[=:]\s*(['"]?)([^'"\s$`]+)\2\s*$""")


def secrets_in_secret_file(name: str, text: str) -> Dict[str, str]:
    """Values a secret-looking file (.env, .pypirc ...) assigns to secret names (any case), for
    ``scrub``: the file itself is never copied, but its values must not reach the archive elsewhere."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        m = _LOOSE_ASSIGNMENT.match(line)
        if m and is_secret(m.group(1)) and is_secret_value(m.group(3)) and "${" not in m.group(3):
            out[f"{name}:{m.group(1)}"] = m.group(3)
    return out


def is_redacted(value: Any) -> bool:
    """A value the archive redacted (never to be exported into a job's environment)."""
    return isinstance(value, str) and REDACTED in value
