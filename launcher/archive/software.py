"""The software a run used: interpreter, key package versions, the launcher (version, commit), every
installed distribution (as `pip freeze --all` lists them)."""
from __future__ import annotations

import json
import os
import platform
import re
import site
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple
from urllib.parse import unquote, urlparse

from launcher.archive import code

KEY_PACKAGES = ("torch", "deepspeed", "hydra-core", "omegaconf", "submitit", "wandb", "numpy")


def versions() -> Dict[str, Any]:
    out: Dict[str, Any] = {"python": platform.python_version(), "executable": sys.executable}
    for name in KEY_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["launcher"] = code.launcher_state()  # its version and commit, apart from the user's code (code/git.json)
    return out


def pip_freeze(path: Optional[List[str]] = None) -> str:
    """The installed distributions as `pip freeze --all` lists them (``name==version``; ``name @ URL`` for
    one installed from a URL; ``-e URL`` for an editable one), read in this interpreter from their
    metadata (importlib.metadata; PEP 610's direct_url.json for the URL ones). No pip: an environment
    made without it (uv) is recorded all the same, and no process is started (`pip freeze` took ~0.5 s
    of CPU at every launch). ``path``: the directories searched (default sys.path)."""
    try:
        return _freeze(path)
    except Exception as e:  # archive what we can, never fail a launch
        return f"# the installed distributions could not be read: {type(e).__name__}: {e}\n"


def _freeze(path: Optional[List[str]]) -> str:
    lines: Dict[str, Tuple[str, str]] = {}
    site_dirs = {os.path.realpath(p) for p in (*getattr(site, "getsitepackages", list)(), site.getusersitepackages())}
    for dist in metadata.distributions(**({} if path is None else {"path": path})):
        name, version = _name_version(dist)
        if not name:
            continue
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key not in lines:  # the first on sys.path is the one imported, and the one pip lists
            lines[key] = (name.lower(), _line(dist, name, version, site_dirs))
    return "".join(f"{line}\n" for _, line in sorted(lines.values()))


_HEADER = re.compile(r"^(Name|Version):[ \t]*(.*?)[ \t]*$", re.M)


def _name_version(dist: metadata.Distribution) -> Tuple[Optional[str], Optional[str]]:
    """Its Name and Version, read from the metadata's header block alone (``dist.metadata`` parses the
    whole file as an email, its long description included: ~0.8 ms a distribution, most of a launch's
    record of the environment)."""
    text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
    found: Dict[str, str] = {}
    for field, value in _HEADER.findall(text.replace("\r\n", "\n").split("\n\n", 1)[0]):
        found.setdefault(field, value)
    return found.get("Name") or None, found.get("Version")


def _line(dist: metadata.Distribution, name: str, version: Optional[str], site_dirs: Set[str]) -> str:
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        direct = None
    if isinstance(direct, dict) and isinstance(direct.get("url"), str):
        url, vcs = direct["url"], direct.get("vcs_info")
        if isinstance(vcs, dict) and vcs.get("vcs"):
            url = f"{vcs['vcs']}+{url}@{vcs.get('commit_id', '')}"
        if (direct.get("dir_info") or {}).get("editable"):  # a local project: as pip prints it
            return _editable(unquote(urlparse(url).path), name) if url.startswith("file://") else f"-e {url}"
        return f"{name} @ {url}"
    # a legacy editable install (`setup.py develop`, an egg-link): its metadata lies in the project itself
    home = os.path.realpath(str(dist.locate_file("")))
    if home not in site_dirs and any(os.path.exists(os.path.join(home, f)) for f in ("setup.py", "pyproject.toml")):
        return _editable(home, name)
    return f"{name}=={version}"


def _editable(path: str, name: str) -> str:
    """An editable project's line as pip prints it: ``-e git+REMOTE@COMMIT#egg=NAME`` for a git checkout
    with a remote (origin first; its commit is what the environment runs), else ``-e PATH``. Git is asked
    only where a .git lies at or above the project (three short commands, for the few editable ones)."""
    if not any((parent / ".git").exists() for parent in (Path(path), *Path(path).parents)):
        return f"-e {path}"
    remotes = (code.git(Path(path), "config", "--get-regexp", r"remote\..*\.url") or "").splitlines()
    commit = (code.git(Path(path), "rev-parse", "HEAD") or "").strip()
    top = code.repo_root(Path(path))
    if not remotes or not commit:
        return f"-e {path}"
    url = next((r for r in remotes if r.startswith("remote.origin.url ")), remotes[0]).split(" ", 1)[1].strip()
    if not re.match(r"\w+://", url):  # pip's own rewriting of a remote: a local path, or scp-like to ssh://
        scp = re.match(r"^(\w+@)?([^/:]+):(\w[^:]*)$", url)
        url = (Path(url).resolve().as_uri() if os.path.exists(os.path.join(path, url)) or os.path.exists(url)
               else f"ssh://{scp.group(1) or ''}{scp.group(2)}/{scp.group(3)}" if scp else url)
    line = f"-e git+{url}@{commit}#egg={name.replace('-', '_')}"
    sub = os.path.relpath(os.path.realpath(path), os.path.realpath(str(top))) if top else "."
    return line if sub == "." else f"{line}&subdirectory={sub}"
