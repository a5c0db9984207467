"""hydra.launcher.sweep, checked before anything is submitted, each refusal naming its key."""
import pytest

from hydra_plugins.launcher_plugin.generic import _schedule


def test_asha_is_taken_with_its_defaults():
    assert _schedule({"sweep": {"scheduler": "asha", "rungs": [2, 4]}}) == {"scheduler": "asha", "rungs": [2, 4],
                                                                            "reduction": 3}
    assert _schedule({}) == {}


@pytest.mark.parametrize("sweep, key", [
    ({"scheduler": "pbt", "interval": 2}, "hydra.launcher.sweep.scheduler: 'pbt' is not offered to a Hydra app"),
    ({"scheduler": "hyperband"}, "hydra.launcher.sweep.scheduler: 'hyperband' is no scheduler"),
    ({"scheduler": "asha", "rungs": [2, 4], "reduction": 1}, "hydra.launcher.sweep.reduction"),
])
def test_what_a_hydra_app_cannot_have_is_refused_naming_the_key(sweep, key):
    with pytest.raises(ValueError) as e:
        _schedule({"sweep": sweep})
    assert str(e.value).startswith(key) and "(fix: " in str(e.value), str(e.value)
