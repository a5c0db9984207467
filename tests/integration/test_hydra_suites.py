"""Hydra's own launcher test suites (hydra.test_utils.launcher_common_tests) against both of this
project's launchers, with the parametrisations hydra-submitit-launcher's own tests use
(LauncherTestSuite: ``timeout_min=2``; IntegrationTestSuite: logging disabled, ``gpus_per_node=0``,
``timeout_min=1``, on launcher_local), and ``timeout_min=2`` with Hydra's logging on for the
IntegrationTestSuite on Slurm. The Slurm ones need the local cluster (marked slurm)."""
import pytest
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

pytestmark = [pytest.mark.timeout(420)]

SLURM = ["hydra.launcher.partition=debug"]
SUBMITIT_INTEGRATION_FLAGS = ["hydra/hydra_logging=disabled", "hydra/job_logging=disabled",
                              "hydra.launcher.gpus_per_node=0", "hydra.launcher.timeout_min=1"]


@pytest.fixture(autouse=True)
def _runs_under_tmp(request, tmp_path, monkeypatch):
    """Every run of these tests goes to a runs root of its own (the suites' subprocesses inherit it).
    The suites' task functions live in Hydra's package: the code snapshot is then of the launch
    directory, a scratch dir here (not this repo, whose every copy would carry the suites' config
    secret `db.password: secret` redacted out of its code)."""
    monkeypatch.setenv("LAUNCHER_RUNS", str(tmp_path / "suite-runs"))
    monkeypatch.chdir(tmp_path)
    if "launcher_slurm" in request.node.name:
        env = request.getfixturevalue("slurm")
        for k, v in env.items():
            monkeypatch.setenv(k, v)


@pytest.fixture
def _fresh_version_base():
    """Hydra keeps the app's version_base in a process-wide singleton, set by the first app or compose
    call of the process, and a launcher hands it to its jobs (with the rest of Hydra's state). Hydra's
    suites are written for an app that names none (Hydra 1.1 defaults: hydra.job.chdir=True, so the
    job's log lies in its working dir); an earlier test of this process that named version_base="1.3"
    would change that. Each suite test starts as in a process of its own."""
    from hydra.core.singleton import Singleton
    from hydra.version import VersionBase

    saved = Singleton._instances.pop(VersionBase, None)
    yield
    Singleton._instances.pop(VersionBase, None)
    if saved is not None:
        VersionBase.set_instance(saved)


@pytest.mark.usefixtures("_fresh_version_base")
@pytest.mark.parametrize("launcher_name, overrides", [
    ("launcher_local", ["hydra.launcher.timeout_min=2"]),
    pytest.param("launcher_slurm", ["hydra.launcher.timeout_min=2", *SLURM], marks=pytest.mark.slurm),
])
class TestHydraLauncherSuite(LauncherTestSuite):
    """Hydra's LauncherTestSuite: 1 and 2 job sweeps, strict mode, bad keys, config groups,
    not sweeping Hydra's own config, custom resolvers, overriding the sweep."""


@pytest.mark.parametrize("task_launcher_cfg, extra_flags", [
    pytest.param({}, ["-m", "hydra/launcher=launcher_local", *SUBMITIT_INTEGRATION_FLAGS],
                 id="launcher_local-submitit"),
    # (with Hydra's logging on, locally: test_hydra_app.py's apps; here on Slurm, launcher_slurm-2min.
    # No 1-minute job on Slurm: Slurm sends its time-limit signal up to a minute early, so a 1-minute
    # job may be told "time limit" the moment its task starts; the 2-minute one has 30 s at least)
    pytest.param({}, ["-m", "hydra/launcher=launcher_slurm", "hydra.launcher.timeout_min=2", *SLURM],
                 id="launcher_slurm-2min", marks=pytest.mark.slurm),
])
class TestHydraIntegrationSuite(IntegrationTestSuite):
    """Hydra's IntegrationTestSuite: task names, hydra.sweep.dir/subdir (config and command line,
    override_dirname), hydra.job.chdir, get_original_cwd and to_absolute_path in multirun."""
