"""A backend declares what it can do (launcher.backends.base.CAPABILITIES): a setting that needs what
the chosen backend lacks is refused by one rule row before anything is queued, naming the setting's
key and its fix. Shown with a toy backend registered here, as a third scheduler would be (another
package registers one through the ``launcher.backends`` entry point: tests/integration/test_backend_plugin.py)."""
import inspect

import pytest
from test_bad_input import _refused, compose_cfg

from launcher import backends
from launcher.backends.base import CAPABILITIES, Backend
from launcher.submit.pipeline import Point, validate


class Toy(Backend):
    """A scheduler that runs one job per point and nothing more: no packs, no nodes to lose, no pauses,
    no dependencies."""
    name = "toy"

    def parameters(self, cfg, code_dir=None):
        return {"nodes": int(cfg.cluster.nodes), "tasks_per_node": int(cfg.cluster.gpus_per_node)}

    def preview(self, cfg, folder, points, code_dir=None, job_name=None, parallelism=None):
        return f"# toy: points {points}"


@pytest.fixture
def toy():
    backends.register(Toy())
    yield
    backends.unregister("toy")


SETTINGS = {  # the setting that asks for each capability
    "packs": ["cluster.pack=true"],
    "elastic": ["cluster.elastic.enabled=true", "cluster.nodes=2", "train.checkpoint.every=2"],
    "pauses": ["sweep=asha", "sweep.rungs=[2,4]", "train.steps=4"],
}


def test_the_table_names_a_setting_for_every_capability():
    assert {c.flag for c in CAPABILITIES} == set(SETTINGS)
    assert all(hasattr(Backend, c.flag) and getattr(Backend, c.flag) is False for c in CAPABILITIES)


@pytest.mark.usefixtures("toy")
def test_a_registered_backend_without_a_capability_refuses_its_setting_naming_the_key():
    assert "toy" in backends.names() and backends.get("toy").name == "toy"
    assert len(validate([Point(compose_cfg(["cluster.backend=toy"]))])) == 1  # what it can do passes
    for cap in CAPABILITIES:
        text = _refused(["cluster.backend=toy", *SETTINGS[cap.flag]], cap.key)
        assert f"the toy backend cannot do this: it needs {cap.needs}" in text, text
        assert f"fix: {cap.fix}" in text, text
    backends.unregister("toy")
    _refused(["cluster.backend=toy"], "cluster.backend")  # gone: no longer a backend


@pytest.mark.parametrize("name", ["local", "slurm"])
def test_a_declared_capability_is_implemented(name):
    """A backend that says it packs, loses nodes or queues after a job has the methods that do it."""
    needs = {"packs": ("pack_executor", "pack_preview", "pack_node_limit"),
             "elastic": ("elastic_after_job", "usable_nodes"), "dependencies": ("after",)}
    backend = backends.get(name)
    for flag, methods in needs.items():
        if getattr(backend, flag):
            for m in methods:
                assert inspect.getattr_static(type(backend), m) is not inspect.getattr_static(Backend, m), (name, m)
    assert backends.get("slurm").packs and backends.get("slurm").dependencies and backends.get("local").pauses
    assert not backends.get("local").packs and not backends.get("local").elastic
