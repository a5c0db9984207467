"""The code snapshot: a copy of the source tree taken once per launch and shared by its sweep
points. Jobs import from it (PYTHONPATH, working directory), so a job that starts hours later runs
the code as it was at submission, and a reproduction runs the original run's code.

What it holds (one rule): in a git repo, the files git tracks plus the untracked files git does not
ignore (never an ignored file); outside one, every .py/.yaml/.yml/.cfg/.toml file. From those it
leaves out what is not code (launcher.archive.tree, the rule the git patch follows too): the
launcher's own output dirs (SKIP_DIRS), the runs root and any other runs root or sweep dir of the
launcher found by its files, Hydra's output dirs of earlier runs (``.hydra/``, ``multirun.yaml``, a dir
holding either: every override of that run is in there), files over MAX_FILE_BYTES
(``skipped_large``), symlinks pointing out of the tree (``links_out``: link -> target, said at launch
by ``left_out_warnings``), and REFUSES secret-looking files (.env, .env.*, *.pem, *.key,
id_rsa*, *credentials*, .netrc, .pypirc, *.p12, anything under .ssh/, .gnupg/, .aws/, .docker/ ...:
``secrets.is_secret_file``) and symlinks into them wherever they point (listed in ``refused``). A
snapshot holds no symlink: a link inside the tree is copied as the file it names. The code is never rewritten:
a file holding a known secret value is left out whole (``held_secret``: the file and the names of the
values, never the values; ``left_out_warnings`` says it at launch, with the fix).

A user's tree outside the launcher's repo that imports the launcher's own ``recipes`` package (or
names it in ``recipe._target_``) gets a copy of it (``bundled``), so the job runs those recipes as
they were at launch too, not from the launcher's install. The patch of uncommitted changes is an
archive record, not code the job runs: known secret values are redacted in it.

A snapshot is read-only once taken, its directories too: runs are sealed with its digest, so a
stray write (a file next to ``__file__``, a bytecode cache) fails instead of breaking their seals."""
from __future__ import annotations

import ast
import functools
import hashlib
import hmac
import importlib.util
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Set

from launcher.archive import atomic, code, secrets, snapshot_reuse
from launcher.archive.tree import INFO_FILE, MAX_FILE_BYTES, SKIP_DIRS, is_output_dir, not_code

PATCH_FILE = ".patch.diff"  # uncommitted changes of the source repo at snapshot time


def source_files(root: Path) -> List[str]:
    """Files git tracks plus untracked ones it does not ignore (relative paths); or, outside a
    git repo, every .py/.yaml/.yml/.cfg/.toml file under root. (``take`` then refuses the
    secret-looking ones.)"""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return sorted(p for p in out.stdout.split("\0") if p and (root / p).is_file())
    except (OSError, subprocess.SubprocessError):
        pass
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not is_output_dir(Path(dirpath, d))]
        for f in filenames:
            if f.endswith((".py", ".yaml", ".yml", ".cfg", ".toml")):
                files.append(str(Path(dirpath, f).relative_to(root)))
    return sorted(files)


def _tree_files(root: Path, exclude: Iterable[Path] = ()) -> List[str]:
    """``source_files`` minus what is not code (``not_code``: output dirs, ``exclude``)."""
    left_out = not_code(root, exclude)
    return [rel for rel in source_files(root) if not left_out(rel)]


def _secret_looking(root: Path, rel: str) -> bool:
    """The file's path, or (a symlink) the path of what it points to, looks like a secret store: a
    link into ~/.docker/, ~/.ssh/, ~/.aws/ ... is one whatever its own name."""
    if secrets.is_secret_file(rel):
        return True
    src = root / rel
    if not src.is_symlink():
        return False
    real = Path(os.path.realpath(src))
    inside = _inside(root, real)
    return secrets.is_secret_file(inside if inside is not None else real)


def _inside(root: Path, real: Path) -> Optional[Path]:
    """``real`` (a resolved path) relative to the tree at ``root``, or None: it lies outside."""
    try:
        return real.relative_to(os.path.realpath(root))
    except ValueError:
        return None


def _link_out(root: Path, rel: str) -> Optional[str]:
    """Where a symlink of the tree points when that is outside the tree (None: not a link, or one
    inside): the snapshot copies the tree, never files from elsewhere."""
    src = root / rel
    if not src.is_symlink() or _inside(root, Path(os.path.realpath(src))) is not None:
        return None
    return os.readlink(src)


def _candidates(root: Path) -> List[str]:
    files = _tree_files(root)
    # secret files git ignores (the usual .env) are never copied, but their values are secrets too
    files += [p.name for p in root.glob(".env*") if p.is_file() and p.name not in files]
    return files


def tree_secrets(root: Path) -> Dict[str, str]:
    """Secret values written in the source tree (name -> value, for ``secrets.scrub``): literals
    assigned to secret names in its config files (``secrets.secrets_in_text``) and in its
    secret-looking files (.env ...: ``secrets.secrets_in_secret_file``), used by this launch or not."""
    root = Path(root)
    found: Dict[str, str] = {}
    for rel in _candidates(root):
        secret_file = _secret_looking(root, rel)
        if not secret_file and not rel.lower().endswith(secrets.YAML_SUFFIXES + secrets.ASSIGNMENT_SUFFIXES):
            continue
        try:
            if (root / rel).stat().st_size > MAX_FILE_BYTES:
                continue
            text = (root / rel).read_text(errors="replace")
        except OSError:
            continue
        found.update(secrets.secrets_in_secret_file(rel, text) if secret_file else secrets.secrets_in_text(rel, text))
    return found


LAUNCHER_ROOT = Path(__file__).resolve().parents[2]  # the tree the launcher runs from (its repo, or site-packages)
BUNDLED = ("recipes",)  # the launcher's own packages a user's code may import


def _launcher_package(name: str) -> Optional[Path]:
    """Where this launcher's own top-level package ``name`` lives (found, not imported)."""
    here = LAUNCHER_ROOT / name
    if (here / "__init__.py").is_file():
        return here
    spec = importlib.util.find_spec(name)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def _imported(rel: str, data: bytes) -> Set[str]:
    """The top-level names a Python file imports (only those of BUNDLED are looked for)."""
    if not rel.endswith(".py") or not any(name.encode() in data for name in BUNDLED):
        return set()
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return set()
    out: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def _holders(data: bytes, known: Mapping[str, Any]) -> List[str]:
    """The names of the known secrets whose values ``data`` holds (names only: never the values)."""
    return sorted(name.split("].", 1)[-1] for name, value in known.items()
                  if secrets.contains_secret(data, {name: value}))


def take(root: Path, dest: Path, known: Optional[Mapping[str, Any]] = None,
         exclude: Iterable[Path] = (), imports: Iterable[str] = (), tree_included: bool = False) -> Dict[str, object]:
    """Copy the source tree at `root` to `dest` (read-only); returns its description. ``known``:
    the secret values kept out (``secrets.known_secrets``; default: those of os.environ), to which
    the tree's own (``tree_secrets``) are added unless ``tree_included`` says ``known`` holds them
    (a launch gathers them once for its snapshot, staging and output);
    ``exclude``: directories never copied (the runs root, should it lie inside the tree);
    ``imports``: top-level modules the run names (its recipe._target_), besides those its code imports."""
    root = Path(root)
    known = {**(secrets.known_secrets() if known is None else known), **({} if tree_included else tree_secrets(root))}
    exclude = [*exclude, dest.parent]  # the runs root, and the sweep dir this snapshot goes to
    tmp = dest.with_name(dest.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    digest = hashlib.sha256()
    copied, skipped, refused = 0, [], []
    held: Dict[str, List[str]] = {}
    links_out: Dict[str, str] = {}
    needed: Set[str] = set(imports)
    scan_imports = Path(os.path.realpath(root)) != LAUNCHER_ROOT  # (the launcher's own repo holds BUNDLED)

    def copy(src: Path, rel: str) -> None:
        nonlocal copied
        if src.stat().st_size > MAX_FILE_BYTES:
            skipped.append(rel)
            return
        data = src.read_bytes()
        if secrets.contains_secret(data, known):  # left out whole: the code the job runs is never rewritten
            held[rel] = _holders(data, known)
            return
        if scan_imports:
            needed.update(_imported(rel, data))
        target = tmp / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        shutil.copystat(src, target)
        digest.update(rel.encode() + b"\0" + data)
        copied += 1

    files = _tree_files(root, exclude)
    imports = list(imports)
    secret, base = cache_secret(), cache_base()
    entry = snapshot_reuse.previous(base, root, secret)
    # (the files' stats before they are read: a change while they are copied is a change next time)
    tree_fp, settled = snapshot_reuse.fingerprint(root, files, known, imports, secret) if secret else ("", False)
    reused = None  # the last snapshot of the same tree, its files linked (launcher.archive.snapshot_reuse)
    if entry is not None and snapshot_reuse.matches(entry, tree_fp):
        reused = snapshot_reuse.link_into(entry, tmp, fresh=(INFO_FILE, PATCH_FILE))
    bundled: Dict[str, Dict[str, object]] = {}
    if reused is not None:
        copied, skipped, held, links_out = reused["files"], reused["skipped_large"], reused["held_secret"], \
            reused["links_out"]
        refused, bundled = list(entry.get("tree_refused") or []), reused["bundled"]
        scan_imports = False
    for rel in files if reused is None else ():
        if _secret_looking(root, rel):
            refused.append(rel)
            continue
        target = _link_out(root, rel)
        if target is not None:
            links_out[rel] = target
            continue
        copy(root / rel, rel)
    tree_refused = list(refused)
    if scan_imports:
        for name in sorted(needed & set(BUNDLED)):
            pkg = _launcher_package(name)
            if pkg is None or (tmp / name).exists():  # the user's own package of that name wins
                continue
            before = copied
            for dirpath, dirnames, filenames in os.walk(pkg):
                dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
                for f in sorted(filenames):
                    rel = str(Path(name, Path(dirpath, f).relative_to(pkg)))
                    if f.endswith((".py", ".yaml", ".yml")) and not _secret_looking(pkg.parent, rel):
                        copy(Path(dirpath, f), rel)
            bundled[name] = {"source": str(pkg), "files": copied - before}
    tmp.mkdir(parents=True, exist_ok=True)

    git = code.git_state(root, known, exclude=exclude)
    patch = secrets.scrub(str(git.pop("patch", "") or ""), known)
    refused = sorted(set(refused) | set(git.pop("patch_excluded", None) or []))
    atomic.write_text(tmp / PATCH_FILE, patch)
    # where the launch ran, inside the tree (None: outside it): recipe=script's ranks start there
    # (launcher.runtime.script.work_dir), as a script under torchrun starts in the dir it was launched from
    launch_dir = _inside(root, Path(os.path.realpath(os.getcwd())))
    sha = reused["sha256"] if reused is not None else digest.hexdigest()
    info = {"source": str(root), "launch_dir": launch_dir.as_posix() if launch_dir is not None else None,
            "files": copied, "skipped_large": skipped, "refused": refused,
            "held_secret": held, "links_out": links_out, "bundled": bundled, "sha256": sha,
            "taken": __import__("time").strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git}
    info = secrets.scrub_tree(info, known)
    atomic.write_json(tmp / INFO_FILE, info)
    # its bytecode, once: jobs never write into a snapshot (PYTHONDONTWRITEBYTECODE, read-only), so
    # without it every rank of every attempt would compile the code it imports again (~1 s each)
    if reused is None:  # (a reused snapshot's bytecode was linked with its sources)
        compile_tree(tmp, dest)
    os.replace(tmp, dest)  # visible only once complete
    make_read_only(dest)
    if settled:  # the newest snapshot of this tree, for the next launch to link
        dirs = sorted(str(b["source"]) for b in bundled.values())
        snapshot_reuse.record(base, root, secret, {  # (a reused one's bundled files were fingerprinted just now)
            "fingerprint": tree_fp, "bundled_dirs": dirs,
            "bundled": entry["bundled"] if reused is not None else snapshot_reuse.bundled_fingerprint(dirs),
            "dest": str(dest), "sha256": sha, "tree_refused": tree_refused})
    return info


def left_out_warnings(info: Mapping[str, Any]) -> List[str]:
    """One line per file the snapshot left out because it holds a known secret value, or because it is
    a symlink out of the tree, with the fix."""
    return [f"the code snapshot leaves out {rel}: it holds the value of {', '.join(names) or 'a secret'}, and the "
            "snapshot never changes code, so the job runs without that file. Fix: keep the value out of the tree "
            "(read it from the environment, os.environ[...]), or, if it is no secret, rename the config key "
            "(a key named *key*, *token*, *secret*, *password* holds a secret)"
            for rel, names in sorted(dict(info.get("held_secret") or {}).items())] + [
            f"the code snapshot leaves out {rel}: a symlink to {target}, outside the source tree (the snapshot "
            "copies the tree, never files from elsewhere), so the job runs without it. Fix: copy the file into "
            "the tree, or give the job its path in the config"
            for rel, target in sorted(dict(info.get("links_out") or {}).items())]


def make_read_only(path: Path) -> None:
    """Every file and directory under ``path`` read-only (directories last: nothing can be added)."""
    dirs = []
    for dirpath, _, filenames in os.walk(path):
        dirs.append(dirpath)
        for f in filenames:
            p = os.path.join(dirpath, f)
            os.chmod(p, os.stat(p).st_mode & ~0o222)
    for d in reversed(dirs):
        os.chmod(d, os.stat(d).st_mode & ~0o222)


def info(dest: Path) -> Optional[Dict[str, object]]:
    return atomic.read_json(dest / INFO_FILE)


def cache_base() -> Optional[Path]:
    """This user's snapshot caches (bytecode by content, the last snapshot of each tree): $LAUNCHER_BYTECODE_CACHE,
    else $XDG_CACHE_HOME/launcher (None: LAUNCHER_BYTECODE_CACHE=off, no cache)."""
    where = os.environ.get("LAUNCHER_BYTECODE_CACHE", "")
    if where.lower() in ("0", "off", "false", "no"):
        return None
    return Path(where) if where else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "launcher"


def bytecode_cache() -> Optional[Path]:
    """Where compiled snapshot files are kept by content (None: LAUNCHER_BYTECODE_CACHE=off). Each launch
    snapshots the tree again; most files are unchanged, and compiling them all costs ~1 s a launch."""
    base = cache_base()
    return base / "bytecode" / sys.implementation.cache_tag if base is not None else None


@functools.lru_cache(maxsize=1)
def cache_secret() -> Optional[bytes]:
    """The secret that signs this user's bytecode-cache entries: made once (32 random bytes, mode 0600) in
    the user's config dir, never in the cache, so an entry planted in a cache a team shares, or tampered
    with, carries no valid signature and is compiled again. None (no cache used) where it cannot be kept
    private."""
    path = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "launcher" / "bytecode.key"
    for _ in range(2):
        try:
            st = path.stat()
            data = path.read_bytes()
            return data if len(data) >= 32 and not st.st_mode & 0o077 and st.st_uid == os.getuid() else None
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another launch made it first: read that one
            continue
        except OSError:
            return None
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(32))
    return None


def _signature(secret: bytes, key: str, pyc: bytes) -> str:
    """A cache entry's signature: the source's digest (its name) and the compiled bytes, under the secret."""
    return hmac.new(secret, key.encode() + b"\0" + pyc, hashlib.sha256).hexdigest()


def compile_tree(tmp: Path, dest: Path) -> int:
    """Compile every .py under ``tmp`` (to be moved to ``dest``) into its __pycache__ as an unchecked-hash
    pyc: the snapshot is read-only, so its sources never change under their bytecode. A pyc depends only on
    the source bytes (the import fixes its file name to where it is loaded from), so it is taken from the
    content-addressed cache when there and signed by this user's secret (``cache_secret``: an entry the
    launcher did not write, or changed since, is never copied into a snapshot). Returns the number
    compiled anew."""
    secret = cache_secret()
    cache = bytecode_cache() if secret is not None else None
    fresh = 0
    for py in sorted(tmp.rglob("*.py")):
        rel = py.relative_to(tmp)
        pyc = Path(importlib.util.cache_from_source(str(py)))
        data = py.read_bytes()
        key = hashlib.sha256(data).hexdigest()
        cached = cache / key[:2] / f"{key}.pyc" if cache is not None else None
        if cached is not None and secret is not None and cached.is_file():
            try:
                blob, sig = cached.read_bytes(), cached.with_name(cached.name + ".sig").read_text().strip()
            except OSError:
                blob, sig = b"", ""
            if hmac.compare_digest(sig, _signature(secret, key, blob)):
                pyc.parent.mkdir(exist_ok=True)
                pyc.write_bytes(blob)
                continue
        try:
            py_compile.compile(str(py), cfile=str(pyc), dfile=str(dest / rel), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        except (py_compile.PyCompileError, SyntaxError, ValueError):
            continue  # the job reports it when it imports the file
        fresh += 1
        if cached is not None:
            try:
                cached.parent.mkdir(parents=True, exist_ok=True)
                part = cached.with_name(f"{cached.name}.{os.getpid()}.part")
                shutil.copyfile(pyc, part)
                os.replace(part, cached)
                sig_part = cached.with_name(f"{cached.name}.sig.{os.getpid()}.part")
                sig_part.write_text(_signature(secret, key, pyc.read_bytes()) + "\n")
                os.replace(sig_part, cached.with_name(cached.name + ".sig"))
            except OSError:
                pass  # a cache that cannot be written only costs the compile
    return fresh
