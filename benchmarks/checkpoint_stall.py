"""How long a checkpoint blocks the training loop: asynchronous vs synchronous save, and with the
universal (layout-independent) form on and off, side by side.

The same state (a GPT's parameters and its AdamW state, after real optimizer steps) is saved by the
run's own checkpointer (launcher.training.checkpoint.Checkpointer) in a loop of real training steps:
train.checkpoint.async_save=false and true, each with train.checkpoint.universal=false and true (the
universal form: torch.distributed.checkpoint's files by parameter name, beside the native ones).
"Blocked" is the wall time the loop spends waiting for saves: inside save(), and (async) in the
optimizer step that waits for the copy to host memory the save started in the background. The async
copy and write share the CPU with the training step, so the median step time is printed too.
Targets: async blocked time <= 10% of the synchronous save; with universal=true, async blocked time
within 1.5x of universal=false's. The first save of a run also builds what later saves reuse (with the
universal form named in the native files: the state by parameter name, once), so it is printed apart,
and the ratios are printed over all saves and over the later ones.

    .venv/bin/python benchmarks/checkpoint_stall.py [--model gpt_125m] [--saves 4] [--every 4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Ctx:
    """The part of RunContext the checkpointer uses (one process, no process group)."""

    rank, world_size, attempt = 0, 1, 1

    def __init__(self, rd):
        self.rundir = rd

    def heartbeat(self, step=None):
        pass


class _Engine:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def save_native(self, path):
        pass

    def optimizers(self):
        return [self.optimizer]

    def checkpoint_files(self):
        return {"model.pt": {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}}

    def universal_state(self):  # as the DDP engine's: the module and its optimizer by parameter name
        from launcher.training import universal

        return universal.module_state(self.model, self.optimizer)


def run(model_name: str, async_save: bool, saves: int, every: int, tokens: int, threads: int,
        universal: bool) -> dict:
    import torch
    from hydra import compose, initialize_config_dir

    from launcher.config.schema import register_configs
    from launcher.run.rundir import RunDir
    from launcher.training.checkpoint import Checkpointer
    from recipes.gpt.model import GPT

    torch.set_num_threads(threads)
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model_name}", f"train.steps={saves * every}",
                                           f"train.checkpoint.every={every}",
                                           f"train.checkpoint.async_save={str(async_save).lower()}",
                                           f"train.checkpoint.universal={str(universal).lower()}",
                                           "train.checkpoint.keep=1"])
    torch.manual_seed(0)
    model = GPT(cfg.model, recompute="none")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seq = min(int(cfg.model.seq_len), 128)
    batch = max(1, tokens // seq)
    data = torch.randint(0, int(cfg.model.vocab_size), (batch, seq))
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        rd = RunDir(Path(tmp) / "run")
        rd.path.mkdir()
        ck = Checkpointer(cfg, _Ctx(rd), _Engine(model, opt))
        step_times, history, per_save = [], [], []
        for step in range(1, saves * every + 1):
            t0 = time.perf_counter()
            loss = model(data, labels=data)
            loss.backward()
            opt.step()  # (an asynchronous save's copy must be done before this: the hook waits)
            opt.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            history.append({"step": step, "loss": float(loss.detach())})
            if ck.due(step):
                before = ck.blocked_s
                ck.save(step, history)
                per_save.append(ck.blocked_s - before)
        t0 = time.perf_counter()
        ck.finish()
        tail = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in rd.latest_checkpoint().rglob("*") if f.is_file())
    # the first save of a run also builds what later ones reuse (the universal state's names, once)
    later = statistics.median(per_save[1:]) if len(per_save) > 1 else per_save[0]
    return {"blocked": ck.blocked_s / saves, "first": per_save[0], "later": later, "tail": tail,
            "step": statistics.median(step_times), "bytes": size,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_125m")
    ap.add_argument("--saves", type=int, default=4)
    ap.add_argument("--every", type=int, default=4, help="training steps between saves")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per training step")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    res = {(a, u): run(args.model, a, args.saves, args.every, args.tokens, args.threads, u)
           for u in (False, True) for a in (False, True)}
    first = res[(False, False)]
    print(f"model {args.model}: {first['params'] / 1e6:.0f}M parameters, {args.saves} saves, one every "
          f"{args.every} training steps")
    cols = [("sync", False, False), ("async", True, False), ("sync+univ", False, True), ("async+univ", True, True)]
    print(f"{'':34}" + "".join(f"{c:>12}" for c, _, _ in cols))
    for label, key, fmt in (("checkpoint size (GiB)", "bytes", lambda v: v / 2 ** 30),
                            ("loop blocked per save (s)", "blocked", float),
                            ("  the first save (s)", "first", float),
                            ("  later saves, median (s)", "later", float),
                            ("median training step (s)", "step", float),
                            ("wait for the last write at the end (s)", "tail", float)):
        print(f"{label:34}" + "".join(f"{fmt(res[(a, u)][key]):12.3f}" for _, a, u in cols))
    for u in (False, True):
        ratio = res[(True, u)]["blocked"] / res[(False, u)]["blocked"]
        print(f"universal={str(u).lower()}: async/sync blocked-time ratio {ratio:.4f} (target <= 0.10) -> "
              f"{'PASS' if ratio <= 0.10 else 'FAIL'}")
    for what, key in (("per save, all saves", "blocked"), ("later saves (median)", "later")):
        ratio = res[(True, True)][key] / res[(True, False)][key]
        print(f"async: universal=true/false blocked-time ratio, {what}: {ratio:.2f} (target <= 1.5) -> "
              f"{'PASS' if ratio <= 1.5 else 'FAIL'}")

if __name__ == "__main__":
    main()
