"""The public training API of any recipe (docs/training-api.md): Checkpoint / Checkpointer, StepLoop,
MetricsSink. On the node only: it imports torch, which the login path never does."""
from launcher.training.checkpoint import Checkpoint, Checkpointer
from launcher.training.loop import StepLoop
from launcher.training.metrics import MetricsSink

__all__ = ["Checkpoint", "Checkpointer", "MetricsSink", "StepLoop"]
