"""recipe._target_ is checked before anything is queued: the function exists AND can be called as the
job calls it, fn(cfg, ctx) (read with ast from the source; nothing imported)."""
import textwrap

import pytest

from launcher.config.recipe_target import _target_problem

SOURCES = {
    "def main(cfg, ctx):\n    pass\n": True,
    "def main(cfg, ctx, extra=1):\n    pass\n": True,
    "def main(*args):\n    pass\n": True,
    "def main(cfg, *rest, **kw):\n    pass\n": True,
    "def main():\n    pass\n": False,
    "def main(cfg):\n    pass\n": False,
    "def main(cfg, ctx, data):\n    pass\n": False,
    "def main(cfg, ctx, *, required):\n    pass\n": False,
    "main = make_recipe()\n": True,  # not a def: the job will tell
}


@pytest.mark.parametrize("source,fine", SOURCES.items(), ids=[s.splitlines()[0] for s in SOURCES])
def test_the_recipe_function_takes_cfg_and_ctx(tmp_path, source, fine):
    pkg = tmp_path / "arity_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent(source))
    problem = _target_problem("arity_pkg.train.main", str(tmp_path))
    assert (problem is None) is fine, problem
    if not fine:
        assert "def main(cfg, ctx)" in problem  # the fix, named


def test_a_snapshot_is_searched_instead_of_the_working_dir(tmp_path, monkeypatch):
    """`launcher resume` / `reproduce` look for the target in the run's snapshot, whatever the cwd."""
    from launcher.config.recipe_target import searched_in, target_problem

    snap = tmp_path / "snap"
    (snap / "snap_only_pkg").mkdir(parents=True)
    (snap / "snap_only_pkg" / "__init__.py").write_text("")
    (snap / "snap_only_pkg" / "t.py").write_text("def main(cfg, ctx):\n    pass\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert "not importable here" in target_problem("snap_only_pkg.t.main")
    with searched_in(snap):
        assert target_problem("snap_only_pkg.t.main") is None
    assert "not importable here" in target_problem("snap_only_pkg.t.main")
    with searched_in(None):  # no snapshot (a launch): the working dir
        monkeypatch.chdir(snap)
        assert target_problem("snap_only_pkg.t.main") is None
