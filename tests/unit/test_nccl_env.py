"""What a rank on NCCL adds to its environment (launcher.runtime.task.nccl_env): error handling that raises
in Python unless the user chose, and the flight recorder's dumps (the GPU templates turn it on) in the run
dir's stacks/, beside the hang watchdog's stacks, instead of each node's /tmp."""
from pathlib import Path

from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR
from launcher.runtime.task import nccl_env

RUN = Path("/runs/s/0")


def test_error_handling_raises_in_python_unless_the_user_chose():
    assert nccl_env({}, RUN) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert nccl_env({"NCCL_ASYNC_ERROR_HANDLING": "1"}, RUN) == {}  # the old name, the user's value


def test_the_flight_recorder_dumps_into_the_run_dir():
    on = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
    assert nccl_env(on, RUN) == {"TORCH_FR_DUMP_TEMP_FILE": "/runs/s/0/stacks/nccl_trace_rank_",
                                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/s/0/stacks/nccl_trace_rank_"}
    assert nccl_env({**on, "TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr_"}, RUN) == {
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/runs/s/0/stacks/nccl_trace_rank_"}  # a path of the user's stays
    assert nccl_env({**on, "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, RUN) == {}  # off


def test_the_gpu_templates_turn_the_flight_recorder_on():
    for template in ("h100_80g", "a100_80g"):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            env = dict(compose(config_name="config", overrides=[f"cluster={template}"]).cluster.env)
        assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1", template
