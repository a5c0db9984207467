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

The parts: launcher.archive.scrubbing (what a secret looks like; scrubbing known values out of text,
bytes, trees and files), launcher.archive.env_lift (secret literals of a config and of its setup lines
lifted into the job's environment; references read back), and this module: finding the secrets a launch
knows (``known_secrets``, ``secrets_in_text``, ``override_secrets``). Every public name of the three is
importable from here.
"""
from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Tuple

from launcher import by_section
from launcher.archive import yamlio
from launcher.archive.env_lift import (
    ENV_NAME,
    LIFTED_PREFIX,
    SHELL_KEY,
    env_reference,
    env_references,
    from_env_reference,
    lift_shell,
    lifted_name,
    lifted_secrets,
    missing_references,
    redact_config,
    shell_lines_of,
    shell_secrets,
)
from launcher.archive.scrubbing import (
    MIN_SECRET_LEN,
    NOT_SECRET_NAMES,
    NOT_SECRET_VALUES,
    REDACTED,
    SECRET_FILES,
    SECRET_WORDS,
    SHORT_SECRET,
    TRAINING_ENV,
    URL_PASSWORD,
    Known,
    contains_secret,
    is_redacted,
    is_secret,
    is_secret_file,
    is_secret_value,
    redact_env,
    scrub,
    scrub_bytes,
    scrub_file,
    scrub_files,
    scrub_tree,
    secret_values,
    training_env,
    url_passwords,
)

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

__all__ = [
    # launcher.archive.scrubbing
    "MIN_SECRET_LEN", "NOT_SECRET_NAMES", "NOT_SECRET_VALUES", "REDACTED", "SECRET_FILES", "SECRET_WORDS",
    "SHORT_SECRET", "TRAINING_ENV", "URL_PASSWORD", "Known", "contains_secret", "is_redacted", "is_secret",
    "is_secret_file", "is_secret_value", "redact_env", "scrub", "scrub_bytes", "scrub_file", "scrub_files",
    "scrub_tree", "secret_values", "training_env", "url_passwords",
    # launcher.archive.env_lift
    "ENV_NAME", "LIFTED_PREFIX", "SHELL_KEY", "env_reference", "env_references", "from_env_reference",
    "lift_shell", "lifted_name", "lifted_secrets", "missing_references", "redact_config", "shell_lines_of",
    "shell_secrets",
    # this module
    "ASSIGNMENT_SUFFIXES", "YAML_SUFFIXES", "known_secrets", "literal_parts", "override_secrets",
    "secrets_in_secret_file", "secrets_in_text",
]

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


def _plain(cfg: RunConfig) -> Any:
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
    seen = set()  # (name below the config, value): the points of a sweep share them, named once
    for i, cfg in enumerate(cfgs):
        plain = _plain(cfg)
        found: Dict[str, str] = {}
        if isinstance(plain, Mapping):  # section by section, each distinct one read once (launcher.by_section)
            for k, v in plain.items():
                found.update(by_section.once("secrets", _section_secrets, k, v))
        else:
            _config_secrets(plain, "", found)
            _string_secrets(plain, "", found)
        for j, line in enumerate(shell_lines_of(plain)):
            for name, value in shell_secrets(line):
                found[f"{SHELL_KEY}[{j}]:{name}"] = value
        for rel, value in found.items():
            if (rel, value) not in seen:
                seen.add((rel, value))
                rel = rel.lstrip(".")
                out[f"config[{i}]{rel}" if rel.startswith("[") else f"config[{i}].{rel}"] = value
    return out


def _section_secrets(key: Any, value: Any) -> List[Tuple[str, str]]:
    """(name below the config, value) of each secret in the section ``key: value``."""
    found: Dict[str, str] = {}
    _config_secrets({key: value}, "", found)
    _string_secrets(value, str(key), found)
    return list(found.items())


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


# Secret values WRITTEN IN config files of the source tree (a cluster yaml with `env: {HF_TOKEN: ...}`
# that this launch does not even use; `export HF_TOKEN=...` in a shell script): an environment-
# variable-like secret name (upper case) assigned a literal. Python source is not read (a constant
# such as API_KEY_ENV = "WANDB_API_KEY" names a variable, it holds no secret).
_ASSIGNMENT = re.compile(r"""^\s*(?:export\s+)?([A-Z][A-Z0-9_]*)\s*[=:]\s*(['"]?)([^'"\s$#`]+)\2\s*(?:#.*)?$""")
YAML_SUFFIXES = (".yaml", ".yml")
ASSIGNMENT_SUFFIXES = (".sh", ".bash", ".zsh", ".cfg", ".ini", ".conf", ".toml", ".properties")


def _literal_secret(name: str, value: Any) -> bool:
    if not (isinstance(value, str) and ENV_NAME.match(name) and is_secret(name) and is_secret_value(value)):
        return False
    # an interpolation or a reference to another variable is not a secret value
    return "${" not in value and not value.startswith("$") and not (ENV_NAME.match(value) and is_secret(value))


def secrets_in_text(name: str, text: str) -> Dict[str, str]:
    """Secret literals a config file (by its name's suffix: YAML, shell, ini/toml/cfg) assigns to
    environment-variable-like secret names: ``{"<name>:HF_TOKEN": value}``, for ``scrub``."""
    out: Dict[str, str] = {}
    low = name.lower()
    if low.endswith(YAML_SUFFIXES):
        try:
            docs = yamlio.safe_load_all(text)
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
