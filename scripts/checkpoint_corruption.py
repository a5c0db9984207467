"""A run's latest checkpoint corrupted before `launcher resume`, each way in turn, on real local runs
(2 ranks): with an earlier intact checkpoint (keep 2) the resume falls back to it, recorded; without
one (keep 1) `launcher resume` refuses it (what names and sizes show) or the job fails at once (what
only the sha256 shows), naming the file. Either way no restart is spent.

    .venv/bin/python scripts/checkpoint_corruption.py [--ways truncated,flipped,...] [--keep 1,2]

Each case launches its own run (a user recipe: Checkpoint + StepLoop over a tiny model, 5 steps, a
checkpoint every 2) and resumes it to step 7; ~25 s a case on 2 cores. CI runs one case
(tests/integration/test_user_recipe_runs.py) and every way in one process (tests/unit/test_training_api.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
RECIPE = '''import torch

from launcher.training import Checkpoint, StepLoop


def main(cfg, ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loop = StepLoop(cfg, ctx, Checkpoint(cfg, ctx, {'model': model, 'optimizer': opt}))
    for step in loop:
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        loop.log(loss=loss.item())
    return {'steps': loop.steps, 'resumed_from': loop.start}
'''


def truncated(ckpt: Path) -> None:
    os.truncate(ckpt / "state.pt", 1000)


def flipped(ckpt: Path) -> None:
    p = ckpt / "state.pt"
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def repointed(ckpt: Path) -> None:
    """A copy planted under a later step's name, `latest` pointed at it, the real one removed (P25)."""
    shutil.copytree(ckpt, ckpt.parent / "step_00000099")
    (ckpt.parent / "latest").write_text("step_00000099\n")
    shutil.rmtree(ckpt)


def deleted(ckpt: Path) -> None:
    (ckpt / "rng_rank_00001.pt").unlink()


def planted(ckpt: Path) -> None:
    (ckpt / "extra.pt").write_bytes(b"planted")


WAYS = {"truncated": truncated, "flipped": flipped, "repointed": repointed, "deleted": deleted,
        "planted": planted}


def sh(args, root: Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, LAUNCHER_RUNS=str(root), PYTHONUNBUFFERED="1")
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def case(tmp: Path, way: str, keep: int) -> dict:
    proj, root = tmp / "proj", tmp / "runs"
    (proj / "upkg").mkdir(parents=True)
    (proj / "upkg" / "__init__.py").write_text("")
    (proj / "upkg" / "ck.py").write_text(RECIPE)
    t0 = time.time()
    res = sh([BIN / "launch", "cluster=local", "wandb.enabled=false", "train.steps=5", "train.max_restarts=3",
              "recipe._target_=upkg.ck.main", "train.checkpoint.every=2", f"train.checkpoint.keep={keep}"], root, proj)
    if res.returncode != 0:
        raise SystemExit(f"launch failed: {res.stdout[-2000:]}{res.stderr[-2000:]}")
    run = Path(json.loads(sh([BIN / "launcher", "runs", "--json", "--root", root], root, proj).stdout)[0]["dir"])
    ckpts = run / "checkpoints"
    for p in ckpts.rglob("*"):
        p.chmod(p.stat().st_mode | 0o200)  # the sealed run's files are read-only
    WAYS[way](ckpts / (ckpts / "latest").read_text().strip())
    res = sh([BIN / "launcher", "resume", run, "--steps", "7"], root, proj)
    st = json.loads((run / "status.json").read_text())
    rp = run / "restarts.jsonl"
    rows = [json.loads(x) for x in rp.read_text().splitlines()] if rp.exists() else []
    fb = run / "checkpoint_fallbacks.jsonl"
    fallbacks = [json.loads(x) for x in fb.read_text().splitlines()] if fb.exists() else []
    return {"way": way, "keep": keep, "resume_rc": res.returncode, "status": st["status"], "attempt": st["attempt"],
            "restarts": [r["reason"] for r in rows], "no_restart": (st.get("no_restart") or {}).get("kind"),
            "error": st.get("error"), "resumed_from": (st.get("summary") or {}).get("resumed_from"),
            "fallback": fallbacks, "said": (res.stdout + res.stderr).strip(), "seconds": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--keep", default="2,1", help="2: an earlier checkpoint to fall back to; 1: none")
    args = ap.parse_args()
    bad = 0
    for keep in (int(k) for k in args.keep.split(",")):
        for way in args.ways.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                r = case(Path(tmp), way, keep)
            if keep > 1:
                fb = (r["fallback"] or [{}])[0]
                why = "; ".join(p for ps in (fb.get("rejected") or {}).values() for p in ps)
                ok = r["status"] == "completed" and r["resumed_from"] == 4 and bool(fb) and r["restarts"] == ["resume"]
                line = f"resumed from step {r['resumed_from']}, {r['status']}; fallback recorded: {why}"
            elif r["restarts"] == [] and r["resume_rc"] != 0:  # refused before anything was submitted
                said = " ".join(r["said"].split())
                ok = r["attempt"] == 1 and "checkpoints/step_" in said
                line = f"`launcher resume` refused it (rc {r['resume_rc']}): {said[:400]}"
            else:
                ok = (r["status"] == "failed" and r["no_restart"] == "corrupt_checkpoint"
                      and r["restarts"] == ["resume"] and r["attempt"] == 2)
                line = f"the job {r['status']} at once (no_restart: {r['no_restart']}): {r['error']}"
            bad += not ok
            print(f"[{'OK' if ok else 'FAIL'}] keep={keep} {way:10} restarts.jsonl reasons {r['restarts']} "
                  f"({r['seconds']} s)\n       {line}", flush=True)
    print("all detected, named, no restart spent" if not bad else f"{bad} case(s) not as expected")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
