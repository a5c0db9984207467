"""`launcher report` as a command: it imports no torch (the pages: tests/unit/test_report.py)."""
import subprocess
import sys

from unit.test_report import EVIL, LAYOUT, PLAN, make_run, sweep  # noqa: F401 (fixtures and helpers shared with the pure tests)


def test_report_imports_no_torch(sweep, tmp_path):
    rd = make_run(sweep, 0)
    make_run(sweep, 1, seed=2)
    for target in (str(rd.path), sweep.sweep_id):
        res = subprocess.run([sys.executable, "-X", "importtime", "-m", "launcher.cli.main", "report", target,
                              "--root", str(sweep.path.parent), "-o", str(tmp_path / "x.html")],
                             capture_output=True, text=True, timeout=120, cwd=tmp_path,
                             env={"PATH": "/usr/bin:/bin", "MPLBACKEND": "Agg"})
        assert res.returncode == 0, res.stderr[-2000:]
        imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
        assert "matplotlib" in imported and "launcher.report" in imported
        assert "torch" not in imported and "deepspeed" not in imported
