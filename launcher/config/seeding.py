"""Seeds: one run seed, stable named sub-seeds, and the plan archived as seeds.json.

Pure (no torch): the login side writes the seed plan, the recipes seed their RNGs from the same
functions (``recipes.common.seeding.seed_everything`` does the torch part).
"""
from __future__ import annotations

import hashlib

_SEED_MASK = 0x7FFFFFFF  # 31 bits: valid for python, numpy and torch alike


def derive_seed(base_seed: int, *names: object) -> int:
    """A stable 31-bit seed derived from ``base_seed`` and ``names``.

    Uses sha256 (not Python's ``hash()``, which is salted per process), so the same
    inputs give the same seed on every rank, node and run.
    """
    key = "\x1f".join([str(int(base_seed))] + [str(n) for n in names])
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & _SEED_MASK


def data_seed(seed: int, explicit: object = None) -> int:
    """The data-order seed: data.seed when set, else derived from the run seed."""
    return int(explicit) if explicit is not None else derive_seed(int(seed), "data")


def dropout_seed(seed: int, dp_rank: int) -> int:
    """Per data-parallel replica, so dropout masks differ between replicas."""
    return derive_seed(int(seed), "dropout", int(dp_rank))


def tracker_seeds(seed: int, dp_rank: int, pp_rank: int, tp_rank: int) -> dict:
    """A tensor-parallel engine's dropout streams of one rank (its RNG tracker's): ``replicated`` is the
    same on every tensor-parallel rank (masks of replicated activations), ``model_parallel`` distinct
    per tensor-parallel rank (masks of split ones); both distinct per data-parallel replica and stage."""
    base = ("dropout", int(dp_rank), int(pp_rank))
    return {"replicated": derive_seed(int(seed), *base),
            "model_parallel": derive_seed(int(seed), *base, int(tp_rank))}


def seed_plan(seed: int, explicit_data_seed: object, dp: int) -> dict:
    """Every seed a run uses and how it was derived (archived as seeds.json)."""
    return {
        "seed": int(seed),
        "init": {"value": int(seed), "how": "torch/numpy/random seeded with `seed` before the model is built "
                                            "(identical init on every rank)"},
        "data": {"value": data_seed(seed, explicit_data_seed),
                 "how": "data.seed" if explicit_data_seed is not None else "derive_seed(seed, 'data')",
                 "order": "sample i of step s, dp rank r, micro batch k: s*G + r*(a*mb) + k*mb + j, "
                          "each sample a function of (data seed, i) only"},
        "dropout": {"how": "derive_seed(seed, 'dropout', dp_rank)",
                    "per_dp_rank": {str(r): dropout_seed(seed, r) for r in range(int(dp))},
                    "megatron": {
                        "how": "two named streams per rank (the megatron engine's RNG tracker); the ddp and "
                               "deepspeed engines draw from per_dp_rank",
                        "replicated": "derive_seed(seed, 'dropout', dp_rank, pp_rank): the same on every "
                                      "tensor-parallel rank; embedding and residual dropouts",
                        "model_parallel": "derive_seed(seed, 'dropout', dp_rank, pp_rank, tp_rank): distinct "
                                          "per tensor-parallel rank; attention-probability dropout, and the "
                                          "embedding and residual dropouts under sequence parallelism"}},
    }
