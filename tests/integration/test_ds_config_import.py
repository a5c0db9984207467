"""launcher.training.ds_config imports neither torch nor deepspeed (checked in a fresh interpreter); DeepSpeed
joins the runtime's process group through launcher.training.deepspeed_dist without a JIT build."""
import subprocess
import sys


def test_pure_no_torch_or_deepspeed_import():
    code = (
        "import sys, launcher.training.ds_config as m; "
        "bad = [n for n in ('torch', 'deepspeed') if n in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


DS_INIT = """
import types, torch.distributed as dist
import deepspeed, deepspeed.comm as ds_comm, importlib
from launcher.training.deepspeed_dist import init_distributed
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ds_torch = importlib.import_module("deepspeed.comm.torch")
def refuse():
    raise SystemExit("the inference-only shared-memory op was built")
ds_torch.build_shm_op = refuse
assert init_distributed(types.SimpleNamespace(backend="gloo")) is deepspeed
assert ds_comm.is_initialized() and ds_comm.get_world_size() == 1
assert ds_torch.build_shm_op is refuse  # put back
dist.destroy_process_group()
"""


def test_deepspeed_joins_the_runtimes_group_without_building_the_shm_op():
    """launcher.training.deepspeed_dist.init_distributed: DeepSpeed's comm on the existing group, and the
    op DeepSpeed would JIT-compile for minutes on a CPU node (inference only) is never built."""
    res = subprocess.run([sys.executable, "-c", DS_INIT], capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
