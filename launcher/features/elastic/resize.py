"""cluster.elastic's rule (pure: no torch, no scheduler call): when a run goes on after a lost node,
on how many nodes and with which changes, and when it grows back.

The run's job cannot decide this when its node is lost (its ranks are gone, its batch script may be
too), and nothing runs on the login node, so the run queues a one-node job for itself that decides
(launcher.features.elastic.regrow, ``--dependency=afternotok`` on the run's job). That job counts the nodes
it could have now (``usable``), tries node counts from the most down to ``cluster.elastic.min_nodes``
(``node_counts``) with the changes that keep everything but the node count (``changes``), and the
first one the rules, the recipe's planner and the reshard check accept (launcher.submit.resume.prepare)
is resumed; the same global batch on fewer data-parallel ranks is more gradient accumulation. A shrunk
run's rank 0 looks for idle nodes before each checkpoint (``grow_due``) and, when enough are back, ends
its job at that checkpoint with the same one-node job queued after it, which grows the run back.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple

from launcher.submit import reshard

if TYPE_CHECKING:
    from launcher.config.schema import RunConfig

# the scheduler's words for a job ended by the cluster rather than the run (Slurm's sacct states): the
# ones cluster.elastic goes on after. A cancel, a time limit or the run's own failure end it as before.
ACTS_ON = ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL")
GROW = "grow"  # the stop reason of a shrunk run ending its job to grow back (restarts.STOP_CODES)
SHRINK = "shrink"  # restarts.jsonl's reason of the attempt that goes on with fewer nodes
RESUME = "resume"  # the deciding job's word for a run whose job ended asking for a restart
IDLE_STATES = ("idle",)  # sinfo's node states a new job can start on at once
# exported by the batch script of a cluster.elastic run: its restarts are new jobs the deciding job
# submits (sbatch --no-requeue: Slurm requeues nothing, so a lost node ends the job and the deciding
# job runs); a rank's requeue request then only records why (launcher.runtime.restarts)
ENV = "LAUNCHER_ELASTIC"
BY = "cluster.elastic"  # status.json's stop.by of such a request: the job queued after this one restarts it


def settings(cfg: RunConfig) -> Dict[str, Any]:
    """cluster.elastic of a plain or typed config, as a dict (absent: off)."""
    el = ((cfg.get("cluster") or {}).get("elastic") if isinstance(cfg, dict) else
          getattr(getattr(cfg, "cluster", None), "elastic", None))
    if el is None:
        return {"enabled": False, "min_nodes": 1, "grow": True, "target_nodes": None}
    get = el.get if hasattr(el, "get") else (lambda k, d=None: getattr(el, k, d))
    return {"enabled": bool(get("enabled", False)), "min_nodes": int(get("min_nodes", 1) or 1),
            "grow": bool(get("grow", True)), "target_nodes": get("target_nodes", None)}


def target(cfg: RunConfig) -> int:
    """The node count the run grows back to: cluster.elastic.target_nodes, or cluster.nodes."""
    t = settings(cfg)["target_nodes"]
    nodes = int((cfg.get("cluster") or {}).get("nodes") or 1) if isinstance(cfg, dict) else int(cfg.cluster.nodes)
    return int(t) if t else nodes


def problems(values: Any, engine: str, zero: int, script: bool, dtype: Optional[str] = None) -> List[Tuple[str, str]]:
    """(key, problem) of a config whose cluster.elastic cannot work (the rule table's row; a backend
    without nodes to lose: the capabilities' row, launcher.backends.base.CAPABILITIES)."""
    if not values.get("cluster.elastic.enabled"):
        return []
    out: List[Tuple[str, str]] = []
    if script:
        out.append(("cluster.elastic.enabled", "recipe=script saves its own checkpoints, which the launcher "
                    "cannot load on another layout"))
    found = reshard.engine_problem(engine, zero, dtype)
    if found:
        out.append(("cluster.elastic.enabled", f"the run is on {found[0]} ({found[1]})"))
    if not values.get("train.checkpoint.universal"):
        out.append(("train.checkpoint.universal", "cluster.elastic goes on from the layout-independent state "
                    "(universal/), which train.checkpoint.universal=false does not write"))
    if not values.get("train.checkpoint.every"):
        out.append(("train.checkpoint.every", "cluster.elastic goes on from the latest checkpoint, and "
                    "train.checkpoint.every=0 saves none before the end (a lost node loses everything)"))
    if values.get("cluster.pack"):
        out.append(("cluster.pack", "a packed point is a job step of its pack's job, which its runner restarts: "
                    "cluster.elastic restarts whole jobs"))
    nodes = int(values.get("cluster.nodes") or 1)
    if int(values.get("cluster.elastic.min_nodes") or 1) > nodes:
        out.append(("cluster.elastic.min_nodes", f"{values.get('cluster.elastic.min_nodes')} is more than "
                    f"cluster.nodes={nodes}"))
    t = values.get("cluster.elastic.target_nodes")
    if t is not None and int(t) < nodes:
        out.append(("cluster.elastic.target_nodes", f"{t} is fewer than cluster.nodes={nodes}: the run would "
                    "never grow back to it"))
    return out


def node_counts(target_nodes: int, usable_nodes: int, min_nodes: int) -> List[int]:
    """The node counts to try, most first: from min(usable, target) down to min_nodes (none: too few)."""
    return list(range(min(int(usable_nodes), int(target_nodes)), max(1, int(min_nodes)) - 1, -1))


def changes(plain: Dict[str, Any], nodes: int) -> List[str]:
    """The ``key=value`` changes that put the run on ``nodes`` nodes and keep the rest: tp and pp as they
    are, dp what the nodes hold (where the config names it), the global batch kept (more accumulation),
    the node count to grow back to recorded."""
    cluster, par = plain.get("cluster") or {}, plain.get("parallelism") or {}
    out = [f"cluster.nodes={int(nodes)}"]
    if par.get("dp") is not None:
        world = int(nodes) * int(cluster.get("gpus_per_node") or 1)
        out.append(f"parallelism.dp={world // max(1, int(par.get('tp') or 1) * int(par.get('pp') or 1))}")
    if ((cluster.get("elastic") or {}).get("target_nodes")) is None:
        out.append(f"cluster.elastic.target_nodes={int(cluster.get('nodes') or 1)}")
    return out


def usable(rows: Iterable[Tuple[str, str]], own: Optional[str] = None) -> List[str]:
    """The nodes a job queued now could start on at once, from sinfo's (node, state) rows: the idle
    ones, and ``own`` (the deciding job's node: it holds one CPU and ends before the new job starts)."""
    out: List[str] = []
    for name, state in rows:
        word = state.strip().rstrip("*~#!%$@^-").lower()  # sinfo's flags: not responding, powered off...
        if (word in IDLE_STATES and state.strip() == word) or (own and name == own and word in ("mixed", "idle")):
            out.append(name)
    return sorted(set(out))


def grow_due(nodes: int, target_nodes: int, idle: int, grow: bool) -> bool:
    """Whether a shrunk run ends its job at this checkpoint to go back to ``target_nodes``: every missing
    node idle (a restart costs the start-up and the load: it is made once, for the whole way back)."""
    return bool(grow) and int(target_nodes) > int(nodes) and int(idle) >= int(target_nodes) - int(nodes)


def describe(layout: Dict[str, Any]) -> str:
    """A layout in one line: engine, dp x pp x tp, ZeRO, nodes, micro batch x accumulation = global batch."""
    lay = layout or {}
    n = lay.get("nodes")
    zero = f" ZeRO-{lay.get('zero')}" if lay.get("zero") else ""
    return (f"{lay.get('engine')}{zero} dp{lay.get('dp')} x pp{lay.get('pp')} x tp{lay.get('tp')} on {n} node(s), "
            f"micro batch {lay.get('micro_batch_size')} x grad accum {lay.get('grad_accum')} x dp{lay.get('dp')} = "
            f"global batch {lay.get('global_batch_size')}")


def decision(run_state: str, stop: Optional[Dict[str, Any]], job_word: str) -> Optional[str]:
    """What the deciding job does for a run (pure), from the run's state and stop record and the
    scheduler's word for its job: GROW (the job ended at a checkpoint to grow back), SHRINK (the cluster
    ended the job: a lost node, a cancelling preemption; the run goes on with the nodes there are),
    RESUME (a rank asked for a restart: a time limit, a failure worth one, a hang) or None (completed,
    cancelled, or the run's own end: nothing to do)."""
    word = (job_word or "").split()[0].rstrip("+").upper() if job_word else ""
    stop = stop or {}
    if run_state == "completed" or word == "CANCELLED":
        return None
    if run_state == "requeued" and stop.get("reason") == GROW:
        return GROW
    if word in ACTS_ON:
        return SHRINK
    if run_state == "requeued" and stop.get("by") == BY:
        return RESUME
    return None


def restart_reason(what: str, nodes_now: int, nodes_next: int, stop: Optional[Dict[str, Any]]) -> str:
    """restarts.jsonl's reason for the attempt the deciding job starts: shrink or grow where the node
    count changes (neither spends train.max_restarts), else the stop's own (time_limit, failure, hang,
    preempted: a restart like a requeue, counted)."""
    if nodes_next < nodes_now:
        return SHRINK
    if nodes_next > nodes_now:
        return GROW
    return str((stop or {}).get("reason") or ("scheduler" if what == SHRINK else what))


def waits_for_its_job(state: str, stop: Optional[Dict[str, Any]]) -> bool:
    """A run whose job ended on purpose and that the job queued after it restarts (ended to grow, or
    asked for a restart under cluster.elastic): nobody else records an outcome for it."""
    stop = stop or {}
    return state == "requeued" and (stop.get("reason") == GROW or stop.get("by") == BY)


def mark(stop: Dict[str, Any], environ: Any) -> Dict[str, Any]:
    """A requeue request's stop record, marked for the deciding job where the job is cluster.elastic's."""
    return {**stop, "by": BY} if environ.get(ENV) == "1" else stop


def summary_line(before: Dict[str, Any], after: Dict[str, Any], why: str) -> str:
    """The line the deciding job prints and the restart records: why, and the layout before and after."""
    return f"{why}: now {describe(after)} (was {describe(before)})"


def pick(candidates: Sequence[int], accept) -> Optional[Tuple[int, Any]]:
    """The first node count ``accept`` takes (it returns what it prepared, or raises), with that; None."""
    for n in candidates:
        try:
            return n, accept(n)
        except Exception as e:  # refused at this count (does not divide, would not fit): try fewer
            last = e
            continue
    if candidates:
        raise last
    return None
