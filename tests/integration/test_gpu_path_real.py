"""submitit's local executor hands a job the GPUs it asks for (CUDA_VISIBLE_DEVICES in a real
local job; the pure GPU path: tests/unit/test_gpu_path.py)."""
import subprocess
import sys

from launcher.backends.local import gpu_parameters


def test_submitit_local_hands_a_job_the_gpus_it_asks_for(tmp_path):
    """What the local executor really exports to its tasks (no GPU needed to see it)."""
    code = (
        "import os, submitit\n"
        f"ex = submitit.LocalExecutor(folder={str(tmp_path)!r})\n"
        "ex.update_parameters(timeout_min=1, tasks_per_node=1, **PARAMS)\n"
        "job = ex.submit(os.getenv, 'CUDA_VISIBLE_DEVICES')\n"
        "print(repr(job.result()))\n"
    )
    def visible(params):
        res = subprocess.run([sys.executable, "-c", f"PARAMS = {params!r}\n" + code], capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return eval(res.stdout.strip().splitlines()[-1])
    assert visible({}) == ""  # asked for none: every GPU hidden (the job would train on CPU)
    assert visible(gpu_parameters(2, True, "2,3")) == "2,3"
