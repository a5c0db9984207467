"""recipes.common.ds_config imports neither torch nor deepspeed (checked in a fresh interpreter)."""
import subprocess
import sys


def test_pure_no_torch_or_deepspeed_import():
    code = (
        "import sys, recipes.common.ds_config as m; "
        "bad = [n for n in ('torch', 'deepspeed') if n in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
