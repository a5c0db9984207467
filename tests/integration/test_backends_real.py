"""The Slurm backend against sbatch and the controller themselves: its sbatch text with hostile values as sbatch
parses it, and the state of a job requeued held then cancelled (the pure parts: tests/unit/test_backends.py)."""
import os
import shlex
import subprocess
import time

import pytest

from launcher.run.status import Status
from unit.test_backends import SLURM, _cfg  # noqa: F401 (fixtures and helpers shared with the pure tests)


def test_hostile_values_stay_text(tmp_path):
    evil = "a;touch pwned$(touch pwned2)`touch pwned3`"
    cfg = _cfg(f"submit.job_name='{evil}'", f"+cluster.env.EVIL='{evil}'")
    text = SLURM.script_text(cfg, tmp_path, 1)
    assert f"#SBATCH --job-name={shlex.quote(evil)}" in text
    assert f"export EVIL={shlex.quote(evil)}" in text
    # run the setup lines through a real shell: the value arrives verbatim and nothing executes
    setup = [line for line in text.splitlines() if line.startswith("export ")]
    out = subprocess.run(["bash", "-c", "\n".join(setup) + '\nprintf %s "$EVIL"'], capture_output=True,
                         text=True, cwd=tmp_path)
    assert out.stdout == evil
    assert not list(tmp_path.glob("pwned*"))


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_job_requeued_held_then_cancelled_has_ended(slurm, tmp_path):
    # an ASHA point pruned while its pause (scontrol requeuehold) is still completing: accounting keeps
    # REQUEUED for it; the controller says CANCELLED, and the backend must say ended (else it is never sealed)
    from launcher.backends.slurm import SlurmBackend

    script = tmp_path / "job.sh"
    # a job that ends only when it is ended (its 2-minute limit bounds it, should the test die first)
    script.write_text("#!/bin/bash\ntrap '' TERM\nsleep infinity\n")
    env = dict(os.environ, **slurm)
    jid = subprocess.run(["sbatch", "--parsable", "-p", "debug", "-t", "2", "-o", "/dev/null", str(script)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout.strip().split(";")[0]
    backend = SlurmBackend()
    deadline = time.time() + 60
    while backend.job_state_now(jid) != "RUNNING":
        assert time.time() < deadline, "the job never started"
        time.sleep(0.5)
    backend.pause(jid)
    backend.drop_paused(jid)
    deadline = time.time() + 60
    while not (state := backend.states([{"job_id": jid}]).get(jid)) or not state.ended:
        assert time.time() < deadline, f"job {jid} never reported ended: {state}"
        time.sleep(1.0)
    assert state.status is Status.cancelled, state
