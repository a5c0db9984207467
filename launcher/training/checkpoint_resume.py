"""A checkpoint's resume (the Checkpointer of launcher.training.checkpoint inherits it:
CheckpointResume): ``latest`` verified against its manifest, each rank hashing a share of its bytes,
and every rank told which checkpoint they all load (launcher.run.checkpoint_manifest); the load of
the engine's state and every RNG state, the metrics file rewound; a checkpoint saved on another layout loaded from its
layout-independent state (launcher.training.universal) and checked bit for bit."""
from __future__ import annotations

import inspect
import json
import shutil
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from launcher.config.layout import has_universal
from launcher.config.seeding import derive_seed
from launcher.run import checkpoint_manifest
from launcher.run.checkpoint_manifest import CheckpointCorrupt
from launcher.training import universal, universal_links
from launcher.training.checkpoint_files import META_FILE, RNG_FILE, reseed, set_rng_state


class CheckpointResume:
    """The Checkpointer's resume, and the engine's layout and states its saves record too. Uses the
    Checkpointer's ``ctx``, ``rd``, ``engine``, ``rank`` and ``seed``; sets ``resharded`` (the
    reshard record, when resume loaded another layout's checkpoint)."""

    ctx: Any
    rd: Any
    engine: Any
    rank: int
    seed: int
    resharded: Optional[Dict[str, Any]]
    _latest_meta: Optional[Dict[str, Any]]

    def resume(self) -> Tuple[int, List[Dict[str, Any]]]:
        """Load ``latest`` if there is one: (the step it was taken after, the metrics rows up to it);
        (0, []) for a fresh start. Partial checkpoints an earlier attempt left are deleted first. A
        restarted attempt's metrics file is rewound to those rows (rank 0): the steps after the
        checkpoint (all of them, without one) are redone and logged again, once each."""
        if self.rank == 0:
            for p in self.rd.stale_partials():
                shutil.rmtree(p, ignore_errors=True)
        latest = self._verified_latest()
        if hasattr(self.ctx, "progress"):  # verified: the start-up watch counts the load from here
            self.ctx.progress()
        step, rows = 0, []
        if latest is not None:
            meta = self._latest_meta or json.loads((latest / META_FILE).read_text())
            moves = universal.moved(meta.get("layout"), self._layout())
            if moves:
                self._reshard(latest, int(meta["step"]), meta["layout"], moves)
            else:
                self.engine.load_checkpoint(latest)
                set_rng_state(torch.load(latest / RNG_FILE.format(rank=self.rank), weights_only=False),
                              self._tracker())
            self.ctx.heartbeat()
            step, rows = int(meta["step"]), list(meta["metrics"])
        if self.rank == 0 and (step or int(self.ctx.attempt) > 1):
            self.rd.rewrite_metrics(rows)  # before this attempt logs a row (ctx appends to the file)
        return step, rows

    def _universal_state(self) -> Optional[Dict[str, Any]]:
        """The engine's layout-independent state (None: it has none; an engine may omit the method)."""
        get = getattr(self.engine, "universal_state", None)
        return get() if get is not None else None

    def _layout(self) -> Dict[str, Any]:
        layout = getattr(self.ctx, "layout", None)
        return layout.to_json() if layout is not None else {}

    def _reshard(self, ckpt: Path, step: int, saved: Dict[str, Any], moves: Dict[str, List[Any]]) -> None:
        """Resume from a checkpoint saved on another layout: every rank reads its own slices of the
        universal state, the load is checked bit for bit against what was saved (gathered), the RNG
        streams are re-derived for the new ranks (the saved ones belong to the old ranks), and rank 0
        records it all (reshard.jsonl) and says so."""
        what = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in moves.items())
        if not has_universal(ckpt):
            raise RuntimeError(f"the checkpoint {ckpt.name} was saved on another layout ({what}) and has no "
                               f"layout-independent state ({universal.DIR}/: train.checkpoint.universal was off, or "
                               "its engine writes none): resume it on its own layout")
        ok = getattr(self.engine, "universal_ok", None)  # asked without building the state (a gather)
        if not (ok() if ok is not None else self._universal_state() is not None):
            raise RuntimeError(f"the checkpoint {ckpt.name} was saved on another layout ({what}), and this "
                               f"engine ({type(self.engine).__name__}) does not load layout-independent "
                               "checkpoints: resume it on its own layout")
        t0 = time.perf_counter()
        # universal/, or where the save linked it to the engine's own files, a scratch copy written now
        state = universal_links.source(ckpt, self.rank, self.rd.reshard_source(step))
        load = self.engine.load_universal
        # (an engine that reads its own files beside the universal form too is told where the checkpoint is)
        load(state, checkpoint=ckpt) if "checkpoint" in inspect.signature(load).parameters else load(state)
        loaded_s = time.perf_counter() - t0
        check = universal.verify(self._universal_state(), state, self.rank,
                                 owned=bool(getattr(self.engine, "universal_owned", False)))
        universal_links.release(state, ckpt, self.rank)  # (verify ends with every rank's report: all read)
        # the engine's dropout streams (its tracker) stay as its new layout seeded them
        reseed(derive_seed(self.seed, "resharded", step, self.rank))
        record = {"step": step, "checkpoint": ckpt.name, "from": saved, "to": self._layout(), "moved": moves,
                  "load_s": round(loaded_s, 3), "verify": check, "rng": "torch, python and numpy generators "
                  "re-derived per rank: derive_seed(seed, 'resharded', step, rank); the engine's dropout "
                  "streams as its new layout seeds them", "bitwise_equal": not check["mismatched"]
                  and not check["missing"]}
        self.resharded = record
        if self.rank == 0:
            self.rd.record_reshard(record)
            print(f"launcher: resharded the checkpoint of step {step} ({what}): {check['tensors']} tensors, "
                  f"{check['bytes'] / 2**20:.1f} MiB gathered and "
                  + ("bitwise equal to the saved state" if record["bitwise_equal"] else
                     f"NOT equal to the saved state: {', '.join((check['mismatched'] + check['missing'])[:5])}"),
                  flush=True)
        if not record["bitwise_equal"]:
            raise RuntimeError(f"the resharded state differs from the checkpoint of step {step}: "
                               f"{', '.join((check['mismatched'] + check['missing'])[:5])} (reshard.jsonl)")

    def _verified_latest(self) -> Optional[Path]:
        """The checkpoint every rank resumes from, verified against its manifest (falling back past a
        corrupt one: launcher.run.checkpoint_manifest), so all load the same one or all raise the same
        CheckpointCorrupt (none waits for a rank that failed). Rank 0 checks names, sizes and steps and
        offers the newest candidate with its manifest; every rank hashes its share of the files
        (``checkpoint_manifest.shares``), and one gather tells all of them what any found."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        known_bad: Dict[str, List[str]] = {}
        offered: Optional[checkpoint_manifest.ResumePoint] = None  # rank 0's last offer
        while True:
            offer: Dict[str, Any] = {}
            failed: Optional[BaseException] = None
            if self.rank == 0 or world == 1:
                try:
                    point = checkpoint_manifest.resume_point(self.rd, contents=world == 1, known_bad=known_bad)
                    offered = point
                    offer = {"path": str(point.path) if point.path is not None else None}
                    if point.path is not None:  # its step and metrics rows: read here, not by every rank
                        offer["meta"] = json.loads((point.path / META_FILE).read_text())
                        offer["files"] = checkpoint_manifest.listed_files(point.path) if world > 1 else {}
                    if world == 1 and self.rank == 0:
                        checkpoint_manifest.adopt(self.rd, point, int(self.ctx.attempt))
                except CheckpointCorrupt as e:
                    failed, offer = e, {"corrupt": e.problems}
                except Exception as e:  # told to the others, then raised here
                    failed, offer = e, {"error": f"rank 0 could not verify the checkpoint: {type(e).__name__}: {e}"}
            if world > 1:
                box = [offer]
                dist.broadcast_object_list(box, src=0)
                offer = box[0]
            if failed is not None:
                raise failed
            if "corrupt" in offer:
                raise CheckpointCorrupt(offer["corrupt"])
            if "error" in offer:
                raise RuntimeError(offer["error"])
            path = Path(offer["path"]) if offer["path"] else None
            if path is None or world == 1:
                self._latest_meta = offer.get("meta")
                return path
            found = self._hash_share(path, offer["files"], world)
            if not found:
                if self.rank == 0 and offered is not None:  # the rejected ones moved aside, latest names this one
                    checkpoint_manifest.adopt(self.rd, offered, int(self.ctx.attempt))
                self._latest_meta = offer.get("meta")
                return path
            known_bad[path.name] = found  # every rank alike: rank 0 offers the next one

    def _hash_share(self, path: Path, files: Dict[str, Any], world: int) -> List[str]:
        """This rank's share of ``path``'s digests checked, and every rank's findings gathered (sorted)."""
        mine = checkpoint_manifest.shares(files, world)[self.rank]
        try:
            found = checkpoint_manifest.content_problems(path, files, mine)
        except OSError as e:
            found = [f"{path.parent.name}/{path.name}: rank {self.rank} could not read its share ({e})"]
        gathered: List[Any] = [None] * world
        dist.all_gather_object(gathered, found)
        return sorted({p for ps in gathered for p in (ps or [])})

    def _tracker(self) -> Any:
        """The engine's dropout RNG streams (its ``rng_tracker``: state_dict/load_state_dict), or None."""
        return getattr(self.engine, "rng_tracker", None)
