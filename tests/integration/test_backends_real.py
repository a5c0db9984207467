"""The Slurm backend's sbatch text with hostile values, as sbatch itself parses it (the pure
parts: tests/unit/test_backends.py)."""
import shlex
import subprocess

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
