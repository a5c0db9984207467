"""A third scheduler as another package brings it: a module defining a Backend and a
``launcher.backends`` entry point naming it, on the interpreter's path. `launch` finds it by name, dry-runs
with it, and refuses before anything is written a setting it cannot do, naming the key (its
capabilities: launcher.backends.base.CAPABILITIES; the pure side: tests/unit/test_backend_capabilities.py)."""
import os

import pytest

from helpers import launch

pytestmark = pytest.mark.timeout(120)

TOY = '''from launcher.backends.base import Backend


class Toy(Backend):
    name = "toy"

    def parameters(self, cfg, code_dir=None):
        return {"nodes": int(cfg.cluster.nodes)}

    def preview(self, cfg, folder, points, code_dir=None, job_name=None, parallelism=None):
        return f"# toy: would submit points {points}"


BACKEND = Toy()
'''


def test_a_backend_from_another_package_dry_runs_and_refuses_what_it_cannot_do(tmp_path):
    site = tmp_path / "site"
    info = site / "toy_backend-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "toy_backend.py").write_text(TOY)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[launcher.backends]\ntoy = toy_backend:BACKEND\n")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    runs = tmp_path / "runs"

    res = launch(["cluster.backend=toy", "submit.dry_run=true"], runs, extra_env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "# toy: would submit points [0]" in res.stdout

    res = launch(["cluster.backend=toy", "cluster.pack=true", "submit.dry_run=true"], runs, extra_env=env)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]  # an invalid config (as every refusal)
    assert "- cluster.pack: the toy backend cannot do this: it needs job steps inside one allocation" in res.stderr
    assert "fix: set cluster.pack=false" in res.stderr and "Traceback" not in res.stderr
    assert not runs.exists() or not any(runs.iterdir())  # nothing written
