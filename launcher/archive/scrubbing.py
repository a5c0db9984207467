"""What a secret looks like, and known secret values scrubbed out of what is archived.

A NAME is secret when it ends in a secret word (``is_secret``: HF_TOKEN, wandb.api_key), a VALUE is
worth scrubbing when it is long enough and no plain setting (``is_secret_value``), a FILE is refused
by the code snapshot when its path looks like a secret store (``is_secret_file``), and a URL's password
is a secret wherever it occurs (``url_passwords``). Given the known secrets (name -> value:
launcher.archive.secrets.known_secrets), ``scrub`` / ``scrub_bytes`` / ``scrub_tree`` / ``scrub_file``
replace each value with ``REDACTED``; ``training_env`` is the environment worth archiving, redacted.
"""
from __future__ import annotations

import fnmatch
import functools
import os
import re
from pathlib import Path, PurePath
from typing import Any, Dict, Iterable, List, Mapping, Sequence, Union

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


def is_redacted(value: Any) -> bool:
    """A value the archive redacted (never to be exported into a job's environment)."""
    return isinstance(value, str) and REDACTED in value


def secret_values(env: Known, min_len: int = MIN_SECRET_LEN) -> List[str]:
    """Values of secret-named entries (to scrub from free text such as a patch or a script), longest
    first so a secret containing another is replaced whole. Every name launcher.archive.secrets gives
    a value it found ends in a secret word (``...:url_password``, ``...cluster.setup[0]:HF_TOKEN2``)."""
    vals = {str(v) for k, v in env.items() if is_secret(k) and is_secret_value(v) and len(str(v)) >= min_len}
    return sorted(vals, key=len, reverse=True)


# scheme://user:password@ (the password: no separator, no quote, no reference)
# a scheme starts where no scheme character precedes it and is at most 32 long: the search is linear in the
# text (an unbounded scheme was tried from every letter of a long word: a 40 KB tag took 6 s)
URL_PASSWORD = re.compile(r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]{0,31}://[^\s:/@'\"]*:([^\s/@'\"]+)@")


def url_passwords(text: str) -> List[str]:
    """The passwords of the URLs in ``text`` that hold one (``https://user:PASSWORD@host``)."""
    if "://" not in text:
        return []
    return [pw for pw in URL_PASSWORD.findall(text) if "$" not in pw and is_secret_value(pw)]


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
