"""How long a checkpoint blocks the training loop: asynchronous vs synchronous save, side by side.

The same state (a GPT's parameters and its AdamW state, after real optimizer steps) is saved by the
run's own checkpointer (launcher.training.checkpoint.Checkpointer) in a loop of real training steps,
once with train.checkpoint.async_save=false and once with true. "Blocked" is the wall time the loop
spends waiting for saves: inside save(), and (async) in the optimizer step that waits for the copy to
host memory the save started in the background. The async copy and write share the CPU with the
training step, so the median step time is printed too. Target: async blocked time <= 10% of the synchronous save.

    .venv/bin/python benchmarks/checkpoint_stall.py [--model gpt_125m] [--saves 3] [--every 4]
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


def run(model_name: str, async_save: bool, saves: int, every: int, tokens: int, threads: int) -> dict:
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
        step_times, history = [], []
        for step in range(1, saves * every + 1):
            t0 = time.perf_counter()
            loss = model(data, labels=data)
            loss.backward()
            opt.step()  # (an asynchronous save's copy must be done before this: the hook waits)
            opt.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - t0)
            history.append({"step": step, "loss": float(loss.detach())})
            if ck.due(step):
                ck.save(step, history)
        t0 = time.perf_counter()
        ck.finish()
        tail = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in rd.latest_checkpoint().rglob("*") if f.is_file())
    return {"blocked": ck.blocked_s / saves, "tail": tail, "step": statistics.median(step_times), "bytes": size,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt_125m")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--every", type=int, default=4, help="training steps between saves")
    ap.add_argument("--tokens", type=int, default=512, help="tokens per training step")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sync = run(args.model, False, args.saves, args.every, args.tokens, args.threads)
    asyn = run(args.model, True, args.saves, args.every, args.tokens, args.threads)
    s_sync, s_async = sync["blocked"], asyn["blocked"]
    print(f"model {args.model}: {sync['params'] / 1e6:.0f}M parameters, checkpoint {sync['bytes'] / 2**30:.2f} GiB, "
          f"{args.saves} saves, one every {args.every} training steps")
    print(f"{'':34}{'sync':>10}{'async':>10}")
    print(f"{'loop blocked per save (s)':34}{s_sync:10.3f}{s_async:10.3f}")
    print(f"{'median training step (s)':34}{sync['step']:10.3f}{asyn['step']:10.3f}")
    print(f"{'wait for the last write at the end (s)':34}{sync['tail']:10.3f}{asyn['tail']:10.3f}")
    ratio = s_async / s_sync
    print(f"async/sync blocked-time ratio: {ratio:.4f} (target <= 0.10) -> {'PASS' if ratio <= 0.10 else 'FAIL'}")


if __name__ == "__main__":
    main()
