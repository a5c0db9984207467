"""`launcher reproduce RUN`: launch a new run from an archived one — its resolved config, its code
snapshot and its seeds, never today's conf/ or today's code."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from launcher import script_recipe
from launcher.app import finish
from launcher.archive import compare, secrets
from launcher.archive.secrets import is_redacted
from launcher.config.compose import override_key
from launcher.config.errors import ConfigError, ConfigErrors
from launcher.config.schema import typed
from launcher.data import archived as data_archive
from launcher.run.rundir import RunDir, runs as runs_under, tree_sha256
from launcher.submit import pipeline
from launcher.submit.pipeline import Point

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig


def archived_point(run_dir: Path, overrides: List[str], runs_root: Optional[Path]):
    """The run config to reproduce `run_dir` with, plus any overrides (dotted key=value)."""
    rd = RunDir(run_dir)
    plain = rd.config()
    missing = secrets.missing_references(plain)
    if missing:
        raise ConfigErrors([ConfigError("RUN", missing, "the values the original launch was given")])
    plain.setdefault("submit", {})["runs_root"] = str(runs_root or rd.path.parent.parent)
    plain["submit"]["dry_run"] = False
    try:
        cfg = typed(plain)  # onto its recipe's schema (the launcher's, and the recipe's own groups)
        if overrides:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigErrors([ConfigError(str(key), str(e).splitlines()[0], "use a key of the archived config")]) from e
    ov = rd.overrides()
    # the archived run's group names passed its launch, from config dirs this command may not search
    # (its --config-dir): taken as given; a name an override changes is checked (launcher.config.group_options)
    accepted = {group: [node["name"]] for group, node in plain.items()
                if isinstance(node, dict) and isinstance(node.get("name"), str)}
    return Point(cfg=cfg, overrides=list(ov.get("overrides", [])) + list(overrides), choices=ov.get("choices", {}),
                 accepted_names=accepted)


def data_problems(run_dir: Path, overrides: Sequence[str] = (), runs_root: Optional[Path] = None) -> List[str]:
    """What changed, file by file, in the datasets the run was launched with (data_manifest.json) that
    the reproduction reads again (every shard hashed against the archived manifest; a dataset the
    overrides replace is not the archive's to check)."""
    archived = RunDir(run_dir).data_manifest()
    if not archived:
        return []
    try:
        point = archived_point(run_dir, list(overrides), runs_root)
        only: Optional[List[str]] = data_archive.paths(OmegaConf.to_container(point.cfg, resolve=True))
    except (ConfigErrors, OmegaConfBaseException):  # (reproduce reports those itself): check every dataset
        only = None
    return [f"dataset changed: {p}" for p in data_archive.problems(archived, hashes=True, only=only)]


def topology_warnings(run_dir: Path, cfg: RunConfig) -> List[str]:
    """What differs between the archived run's topology and the one requested, and what that changes."""
    topo = compare.topology_summary(run_dir)
    warns = []
    world = int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node)
    if topo.get("world_size") and world != topo["world_size"]:
        warns.append(
            f"world size {world} differs from the original {topo['world_size']}: the data-parallel degree and "
            "the order of gradient reductions change, so losses will match only to rounding, not bitwise"
        )
    gpu = str(cfg.cluster.gpu.name)
    if topo.get("gpu_models") and gpu not in topo["gpu_models"] and gpu != "cpu":
        warns.append(
            f"GPU type {gpu} differs from the original {', '.join(topo['gpu_models'])}: kernels and their "
            "numerics differ; expect matching curves only to rounding"
        )
    return warns


def provenance_problems(run_dir: Path, roots: Sequence[Path]) -> List[str]:
    """Why the archive at ``run_dir`` cannot be taken for the run it names, besides its seal (which
    RunDir.verify checks): it, or the code snapshot it names, lies outside every known runs root
    (``roots``: the command's --root, $LAUNCHER_RUNS), or its run id is not its dir's. Anyone can
    write a run dir with a matching manifest; only the runs roots the user names are known."""
    rd = RunDir(run_dir)
    known = list(dict.fromkeys(Path(os.path.realpath(r)) for r in roots if r is not None))

    def under(p: Path) -> bool:
        real = Path(os.path.realpath(p))
        return any(real == r or r in real.parents for r in known)

    where = ", ".join(map(str, known))
    problems = [] if under(rd.path) else [f"{rd.path} lies outside the known runs roots ({where})"]
    snap = rd.snapshot().get("path")
    if snap and not under(Path(snap)):
        problems.append(f"its code snapshot {snap} lies outside the known runs roots ({where})")
    claimed = (rd.run() or {}).get("run_id")
    if claimed != rd.run_id:
        problems.append(f"its run.json names run {claimed}, but the dir is that of run {rd.run_id}")
    return problems


def reproduce(run_dir: Path, overrides: List[str], runs_root: Optional[Path] = None, out=None,
              unverified: Sequence[str] = ()):
    """``unverified``: what did not verify about the archive, reproduced anyway (--trust-unverified):
    recorded in the reproduction's run.json (``trusted_unverified``)."""
    out = out or sys.stdout
    overrides = script_recipe.quote_args(list(overrides))  # `'recipe.args=[--lr=1e-3]'` as typed
    run_dir = Path(run_dir)
    rd = RunDir(run_dir)
    meta = rd.run()
    if not meta:
        raise FileNotFoundError(f"{run_dir} is not an archived run (no {RunDir.RUN})")
    snapshot = Path(rd.snapshot().get("path", ""))
    if not snapshot.is_dir():
        raise FileNotFoundError(f"run {meta['run_id']} has no code snapshot to reproduce from ({snapshot})")
    if meta.get("kind") == "hydra_app":
        if unverified:  # its runs are made by the app's own launcher, which records nothing of it
            raise ConfigErrors([ConfigError("--trust-unverified", "a Hydra app's run is reproduced only from an "
                                            "archive that verifies", "reproduce an intact run")])
        return reproduce_app(rd, snapshot, overrides, runs_root or rd.path.parent.parent, out)
    from launcher.features.pbt import replay  # sweep=pbt: a member is its whole lineage, replayed

    if replay.is_member(rd):
        extra_pbt: Dict[str, Any] = {**({"trusted_unverified": list(unverified)} if unverified else {})}
        return replay.reproduce_population(rd, overrides, runs_root, out, snapshot, extra_pbt, archived_point,
                                           topology_warnings)
    point = archived_point(run_dir, overrides, runs_root)
    for w in topology_warnings(run_dir, point.cfg):
        print(f"warning: {w}", file=sys.stderr)
    print(f"reproducing {meta['run_id']} with its archived config, seeds and code snapshot {snapshot}", file=out)
    extra: Dict[str, Any] = {"reproduces": meta["run_id"], "reproduces_dir": str(run_dir),
                             **({"trusted_unverified": list(unverified)} if unverified else {})}
    result = pipeline.launch([point], argv=list(sys.argv), out=out, code_snapshot=snapshot, extra_meta=extra)
    finish(result, [point])
    return result


# ---- a Hydra app's run ------------------------------------------------------------------------------
# A run of any Hydra app (hydra/launcher=launcher_slurm|launcher_local) is reproduced by starting that
# app again from its code snapshot, with the point's archived task overrides and the launch's Hydra
# overrides (the same launcher and its options), as ONE point: Hydra composes the config from the
# snapshot's own config files, so config, code and seed (the app's `seed` key) are the archived ones.
#
# The app runs from a WORKING COPY of the snapshot in the reproduction's own dir, never from the
# archived snapshot itself: an app that derives its output root from `__file__` (rootutils, the
# lightning-hydra-template) writes its logs and checkpoints next to the code it runs, and inside the
# archived snapshot those writes would break the seal of every run that executed it. The runs record
# the archived snapshot as their code (their seal hashes it); `work_dir` names the copy they ran.

WORK_DIRS = ".reproductions"  # under the runs root (a dot dir: not a sweep) one dir per reproduction

# Hydra overrides that belong to the original multirun, not to the point: where Hydra wrote its
# outputs, the sweeper that picked the point, the archive's place and the reproduction mark
_DROPPED_HYDRA = ("hydra.sweep.dir", "hydra.sweep.subdir", "hydra/sweeper", "hydra.sweeper.",
                  "hydra.launcher.runs_root", "hydra.launcher.reproduces", "hydra.launcher.code_snapshot",
                  "hydra.launcher.work_dir")


def _quoted(value: Any) -> str:
    """A value as one quoted string of Hydra's override grammar (a path with `,` or `=` stays one)."""
    return "'" + str(value).replace("'", "\\'") + "'"


def app_command(meta: Dict[str, Any], task_overrides: List[str], changes: List[str], snapshot: Path,
                runs_root: Path, python: str = sys.executable, work_dir: Optional[Path] = None) -> List[str]:
    """The command that starts the app of a Hydra-app run again from ``snapshot`` as one point (pure).
    ``changes`` (key=value) replace the archived overrides (task or Hydra) of the same key; an archived
    override whose value was redacted must be given again there. ``work_dir``: the snapshot's working
    copy the app and its jobs run instead (the runs still record ``snapshot`` as their code)."""
    code = work_dir or snapshot
    app = meta.get("app") or {}
    entry = app.get("entry") or {}
    changed = {override_key(c) for c in changes}
    hydra = [o for o in app.get("hydra_overrides") or []
             if not any(override_key(o) == d or override_key(o).startswith(d) for d in _DROPPED_HYDRA)]
    kept = [o for o in task_overrides if override_key(o) not in changed]
    hydra = [o for o in hydra if override_key(o) not in changed]
    hidden = [o.split("=", 1)[0] for o in kept + hydra if is_redacted(o.split("=", 1)[-1])]
    if hidden:
        raise ConfigErrors([ConfigError(k.lstrip("+~"), "was redacted in the archive (a secret): reproduce "
                                        "cannot know it", f"give it again: launcher reproduce {meta.get('run_id')} "
                                        f"{k}=<value>") for k in hidden])
    if entry.get("module"):
        start = [python, "-m", str(entry["module"])]
    elif entry.get("script"):
        script = Path(entry["script"])
        start = [python, str(script if script.is_absolute() else code / script)]
    else:
        raise ConfigErrors([ConfigError("RUN", f"run {meta.get('run_id')} does not record how its app was started "
                                        "(run.json app.entry: archived by an older launcher)",
                                        "run the app again with its archived overrides (overrides.yaml)")])
    # one point: Hydra's basic sweeper with no sweep parameters of its own, whatever the app's
    # config selects (an Optuna sweeper there would run n_trials copies of it)
    return [*start, "-m", *kept, *changes, *hydra, "hydra/sweeper=basic", "hydra.sweeper.params=null",
            f"hydra.launcher.runs_root={_quoted(runs_root)}",
            f"hydra.launcher.reproduces={_quoted(meta.get('run_id'))}",
            f"hydra.launcher.code_snapshot={_quoted(snapshot)}",
            *([f"hydra.launcher.work_dir={_quoted(work_dir)}"] if work_dir else [])]


def working_copy(snapshot: Path, dest: Path) -> Path:
    """A copy of ``snapshot`` at ``dest`` that the reproduction may write into: its directories are
    writable, its files stay read-only (as copied); its digest is checked against the snapshot's."""
    tmp = dest.with_name(dest.name + ".partial")
    shutil.copytree(snapshot, tmp, symlinks=True)
    for dirpath, _, _ in os.walk(tmp):
        os.chmod(dirpath, os.stat(dirpath).st_mode | 0o700)  # (copytree copied the snapshot's read-only modes)
    if tree_sha256(tmp) != tree_sha256(snapshot):
        raise OSError(f"the copy {tmp} of the code snapshot {snapshot} differs from it")
    os.replace(tmp, dest)
    return dest


def reproduce_app(rd: RunDir, snapshot: Path, changes: List[str], runs_root: Path, out) -> int:
    """Start the app again (blocking, as its launcher does by default) from a working copy of its
    snapshot; its exit code (1 when it ran but made no run: its module does not start the app when run
    with ``python -m``)."""
    meta = rd.run() or {}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + f"-{os.getpid()}"
    work = working_copy(snapshot, Path(runs_root) / WORK_DIRS / f"{meta['run_id']}.{stamp}")
    cmd = app_command(meta, list(rd.overrides().get("overrides") or []), list(changes), snapshot, Path(runs_root),
                      work_dir=work)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work), *filter(None, [env.get("PYTHONPATH")])])
    if (meta.get("app") or {}).get("entry", {}).get("module"):
        env["PYTHONSAFEPATH"] = "1"  # `python -m` would import from the working dir before the snapshot
    print(f"reproducing {meta['run_id']} (a run of {(meta.get('app') or {}).get('task_function')}) from its code "
          f"snapshot {snapshot}, run from its copy {work} (the app's own outputs go there): {' '.join(cmd[1:])}",
          file=out, flush=True)
    before = {r.path for r in runs_under(runs_root)}
    code = subprocess.call(cmd, env=env)
    made = [r for r in runs_under(runs_root)
            if r.path not in before and (r.run() or {}).get("reproduces") == meta["run_id"]]
    if code == 0 and not made:
        print(f"launcher reproduce: `{' '.join(cmd[1:3])}` made no run: does the module start the app when run "
              "with python -m?", file=sys.stderr)
        return 1
    return code
