"""What of a source tree is code: the one rule the code snapshot (launcher.archive.snapshot: what it
copies) and the git record (launcher.archive.code: what the patch and the dirty flag hold) share.

Not code: the launcher's own output dirs (SKIP_DIRS), any runs root of the launcher, configured now
or not, and its sweep dirs and snapshots (found by the files only the launcher writes there,
``launcher_marks``), Hydra's output dirs (``.hydra/``, ``multirun.yaml``, a dir holding either: every
override of that run is in there), the directories a caller names (the runs root, wherever it lies),
and files over MAX_FILE_BYTES (data files and checkpoints)."""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Callable, Dict, Iterable, Tuple

MAX_FILE_BYTES = 5 * 1024 * 1024  # data files and checkpoints are not code
SKIP_DIRS = {".git", ".venv", "__pycache__", ".slurm-local", "runs", "outputs", "multirun", "wandb",
             ".submitit"}  # (submitit's folder: pickled jobs hold the app's config)
HYDRA_MARKS = (".hydra", "multirun.yaml")  # what Hydra writes into a run's / a multirun's output dir
INFO_FILE = ".snapshot.json"  # a code snapshot's description (launcher.archive.snapshot.take), in its top dir


def is_hydra_output(path: Path) -> bool:
    """A directory Hydra wrote as a run's or a sweep's output dir (any hydra.run.dir / sweep.dir):
    it holds the composed config and every override of that run, not code."""
    return any((path / mark).exists() for mark in HYDRA_MARKS)


@functools.cache
def launcher_marks() -> Tuple[str, ...]:
    """What only the launcher writes into a dir (relative paths): a runs root's registry, a sweep dir's
    launch journal, seals and code snapshot's description, a code snapshot's description."""
    from launcher.archive import index
    from launcher.run.rundir import SweepDir

    return (index.DB_NAME, SweepDir.LAUNCH_JOURNAL, SweepDir.SEALS, f"{SweepDir.CODE}/{INFO_FILE}", INFO_FILE)


def is_launcher_output(path: Path) -> bool:
    """A runs root of the launcher (any, configured now or not: its registry), a sweep dir of one (its
    journal, seals or code snapshot) or a code snapshot, wherever it lies: runs and copies, not code."""
    return any((path / mark).exists() for mark in launcher_marks())


def is_output_dir(path: Path) -> bool:
    """A directory that holds output, not code: a launcher output dir (SKIP_DIRS), Hydra's (its ``.hydra/``,
    or a dir holding one or a ``multirun.yaml``), a launcher runs root, sweep dir or snapshot."""
    return (path.name in SKIP_DIRS or path.name in HYDRA_MARKS or is_hydra_output(path)
            or is_launcher_output(path))


def not_code(root: Path, exclude: Iterable[Path] = ()) -> Callable[[str], bool]:
    """Whether a path of the tree at ``root`` (relative to it) is output, not code: under a directory of
    ``exclude`` (the runs root, wherever it lies) or leading there through a symlink, or under a directory
    below root (never root itself) that ``is_output_dir``. Each directory is looked at once. (File sizes
    are the caller's: MAX_FILE_BYTES.)"""
    root = Path(root)
    skip = [Path(os.path.realpath(d)) for d in exclude]
    outputs: Dict[Path, bool] = {}

    def output_dir(rel: Path) -> bool:
        if rel not in outputs:
            outputs[rel] = is_output_dir(root / rel)
        return outputs[rel]

    reals: Dict[Path, str] = {}

    def real_dir(rel: Path) -> str:  # each directory resolved once, not each file's whole path
        if rel not in reals:
            reals[rel] = os.path.realpath(root / rel)
        return reals[rel]

    def check(rel: str) -> bool:
        path = Path(rel)
        if path.name in SKIP_DIRS or path.name in HYDRA_MARKS:
            return True
        # from the top down (a file deep in runs/ is settled by runs/); the last parent is ".", root itself
        if any(output_dir(parent) for parent in reversed(list(path.parents)[:-1])):
            return True
        if skip:
            full = root / rel
            real = Path(os.path.realpath(full) if os.path.islink(full)
                        else os.path.join(real_dir(path.parent), path.name))
            return any(d == real or d in real.parents for d in skip)
        return False

    return check
