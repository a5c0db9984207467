"""What the RUN rows of the rule table (launcher.config.rules) ask beyond the config: the chosen
backend's limits and capabilities, the recipe's own check of its settings, the names under
cluster.env and cluster.sbatch_extra, the sweep scheduler's and cluster.elastic's problems. Each is a
predicate or a problem function over ``launcher.config.layout.Facts`` (or a backend's name). Pure (no torch).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from launcher import backends
from launcher.config import recipe_contract
from launcher.config.layout import Facts
from launcher.config.recipe_target import is_script
from launcher.config.values import SBATCH_OPTION
from launcher.features.elastic import resize as elastic

# oneDNN has fp16 kernels (so DeepSpeed's CPU accelerator accepts fp16) only on CPUs with these flags
FP16_CPU_FLAGS = frozenset({"avx512_fp16", "amx_fp16"})


def lacks_cpu_fp16(backend: str) -> bool:
    """Whether the backend's jobs run on a CPU without fp16 kernels (known only where they run on
    this host's CPU: ``Backend.host_cpu_flags``)."""
    flags = backends.get(backend).host_cpu_flags()
    return flags is not None and not (flags & FP16_CPU_FLAGS)


def settings_problem(f: Facts) -> Optional[str]:
    """What the recipe's own check (its contract's ``check``) finds wrong with its settings, or None."""
    check = recipe_contract.of(f.values.get("recipe._target_"), strict=False).check  # (broken: its own row)
    if check is None:
        return None
    try:
        check(f.values.tree)
    except ValueError as e:
        return str(e)
    return None


def host_gpus(backend: str) -> Optional[int]:
    return backends.get(backend).host_gpu_count()


def max_nodes(backend: str) -> Optional[int]:
    return backends.get(backend).max_nodes


def max_restarts(backend: str) -> Optional[int]:
    return backends.get(backend).max_restarts


def _cluster_mapping(f: Facts, name: str) -> Dict[Any, Any]:
    cl = f.values.tree.get("cluster")
    m = cl.get(name) if isinstance(cl, dict) else None
    return m if isinstance(m, dict) else {}


def env_names(f: Facts) -> List[Tuple[str, str]]:
    return [(f"cluster.env.{k}", "is not an environment variable name (letters, digits and _, not starting "
             "with a digit)") for k in _cluster_mapping(f, "env") if not str(k).isidentifier()]


def sbatch_names(f: Facts) -> List[Tuple[str, str]]:
    return [(f"cluster.sbatch_extra.{k}", "is not an sbatch option name (letters, digits, - and _)")
            for k in _cluster_mapping(f, "sbatch_extra") if not SBATCH_OPTION.match(str(k))]


def largest_divisor(n: int, upto: int) -> int:
    """Largest divisor of n that is <= upto (a suggestion for the fix line)."""
    return max(d for d in range(1, max(1, min(n, upto)) + 1) if n % d == 0)


def backend_names() -> List[str]:
    return backends.names()



def elastic_problems(f: Facts) -> List[Tuple[str, str]]:
    if not f.values.get("cluster.elastic.enabled"):
        return []
    return elastic.problems(f.values, f.resolved_engine, f.zero, is_script(f.values.tree.get("recipe")),
                            f.dtype)


def capability_problems(f: Facts) -> List[Tuple[str, str, str]]:
    """(key, problem, fix) of each setting that needs what the chosen backend cannot do."""
    return backends.get(f.backend).lacks(f.values.get) if f.backend in backend_names() else []


def sweep_problems(f: Facts, key: str) -> List[Tuple[str, str]]:
    """(key, problem) of a scheduler's settings (sweep=asha only; reduction: its bound row)."""
    from launcher.features.asha import schedule as asha  # pure

    sweep = f.values.tree.get("sweep") or {}
    if not sweep.get("scheduler"):
        return []
    steps = int(f.values.get("train.steps") or 0)
    if str(getattr(sweep.get("scheduler"), "value", sweep.get("scheduler"))) == "pbt":
        from launcher.features.pbt import generations as pbt  # pure

        found = pbt.problems(sweep, steps, f.values.tree)
        out = [(k, p) for k, p, _ in found if k == key or (key == "sweep.explore" and not k.startswith("sweep."))]
    else:
        out = [(k, p) for k, p, _ in asha.problems(sweep, steps) if k == key and k != "sweep.reduction"]
    if key == "sweep.scheduler" and is_script(f.values.tree.get("recipe")):
        out.append((key, "recipe=script runs a script the launcher cannot pause at a rung (no StepLoop)"))
    if key == "sweep.objective":
        declared = recipe_contract.of(f.values.get("recipe._target_"), strict=False).metrics
        why = asha.objective_problem(str(sweep.get("objective")), declared)
        if why:
            out.append((key, why))
    return out
