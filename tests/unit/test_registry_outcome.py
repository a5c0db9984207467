"""A job that died without recording its outcome gets the one its scheduler state implies, sealed."""
import json

import pytest

from launcher.archive import bundle
from launcher.archive.registry import record_lost_outcome


@pytest.mark.parametrize("state,want", [("CANCELLED by 0", "cancelled"), ("TIMEOUT", "timeout"),
                                        ("COMPLETED", "failed"), ("NODE_FAIL", "failed"), ("", "failed")])
def test_lost_outcome_is_recorded_and_sealed(tmp_path, state, want):
    bundle.set_status(tmp_path, "running")
    assert record_lost_outcome(tmp_path, state) == want
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == want and "without recording an outcome" in status["error"]
    assert bundle.verify(tmp_path) == []
