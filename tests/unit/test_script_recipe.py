"""recipe=script's pure parts: the launch-time checks, the command, the environment a rank's script
gets, what its exit means for the run, and how the ranks agree on their attempt."""
import threading
from types import SimpleNamespace

import pytest

from launcher import script_recipe
from launcher.rundir import RunDir
from launcher.runtime import script
from launcher.runtime.script import MetricsTail, outcome, summary, torchrun_env

TARGET = script_recipe.SCRIPT_TARGET


def tree(**recipe):
    return {"recipe": {"_target_": TARGET, "script": None, "module": None, "args": [], **recipe}}


def problem(t):
    found = script_recipe.problems(t)
    return (found[0][0], found[0][1], script_recipe.fix(t)) if found else None


# ---- launch-time checks ---------------------------------------------------------------------------


def test_a_script_in_the_launch_dir_passes(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    assert problem(tree(script="train.py", args=["--lr", "0.1"])) is None


@pytest.mark.parametrize("recipe,key,says,fix", [
    ({}, "recipe.script", "neither recipe.script", "recipe.script=train.py or recipe.module="),
    ({"script": "train.py", "module": "pkg.train"}, "recipe.module", "both", "set only one"),
    ({"script": "missing.py"}, "recipe.script", "no file missing.py in the launch dir", "relative to"),
    ({"module": "no_such_module_xyz"}, "recipe.module", "'no_such_module_xyz' is not importable", "name a module"),
    ({"module": "json"}, "recipe.module", "without a __main__", "name a module"),
])
def test_a_bad_script_recipe_names_the_key_and_the_fix(tmp_path, monkeypatch, recipe, key, says, fix):
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    found = problem(tree(**recipe))
    assert found is not None and found[0] == key, found
    assert says in found[1] and fix in found[2], found


def test_a_module_in_the_launch_dir_passes(tmp_path, monkeypatch):
    pkg = tmp_path / "mypkg_script_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    assert problem(tree(module="mypkg_script_test.train")) is None
    assert "no submodule 'nope'" in problem(tree(module="mypkg_script_test.nope"))[1]


def test_script_keys_without_the_script_recipe_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = problem({"recipe": {"_target_": "recipes.gpt.train.main", "script": "train.py"}})
    assert found[0] == "recipe.script" and "recipe=script" in found[2]
    assert problem({"recipe": {"_target_": "recipes.gpt.train.main", "script": None, "args": []}}) is None


def test_the_command_of_each_form(tmp_path):
    assert script_recipe.command({"script": "a/train.py", "args": ["--lr", 1]}, tmp_path, "py") == \
        ["py", str(tmp_path / "a" / "train.py"), "--lr", "1"]
    assert script_recipe.command({"module": "pkg.train", "args": []}, tmp_path, "py") == ["py", "-m", "pkg.train"]


# ---- the node side --------------------------------------------------------------------------------


def test_the_environment_is_torchruns_and_the_launchers(tmp_path):
    rd = RunDir(tmp_path / "run")
    denv = SimpleNamespace(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
                           master_addr="node1", master_port=21234)
    env = torchrun_env(denv, attempt=3, max_restarts=5, rd=rd)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "MASTER_ADDR": "node1", "MASTER_PORT": "21234", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert env["LAUNCHER_ATTEMPT"] == "3" and env["LAUNCHER_RUN_DIR"] == str(rd.path)
    assert env["LAUNCHER_CHECKPOINT_DIR"] == str(rd.path / "checkpoints" / "script")
    assert env["LAUNCHER_METRICS_FILE"] == str(rd.metrics_path)
    assert all(isinstance(v, str) for v in env.values())


@pytest.mark.parametrize("rc,stopped,kind,error", [
    (0, None, "completed", ""),
    (3, None, "failed", "script exited 3"),
    (-9, None, "killed", "script killed by SIGKILL"),
    (0, "time_limit", "interrupted", "script exited 0 after the time_limit signal"),
    (-12, "time_limit", "interrupted", "script killed by SIGUSR2 after the time_limit signal"),
    (1, "preempted", "interrupted", "script exited 1 after the preempted signal"),
])
def test_what_the_scripts_exit_means(rc, stopped, kind, error):
    out = outcome(rc, stopped)
    assert (out.kind, out.exit_code, out.reason, out.error) == (kind, rc, stopped, error)


def test_the_summary_is_the_last_metrics_row():
    assert summary([]) == {"exit_code": 0}
    assert summary([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]) == \
        {"exit_code": 0, "steps": 2, "final_loss": 1.5}


def test_the_metrics_tail_reads_whole_rows_as_they_come(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 4, "loss": 1}\n')
    tail = MetricsTail(path)
    assert tail.step == 4 and not tail.poll()  # an earlier attempt's rows: the step, not progress
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')
    assert not tail.poll() and tail.step == 4
    with open(path, "a") as f:
        f.write('ss": 0.5}\nnot json\n')
    assert tail.poll() and tail.step == 5
    assert MetricsTail(tmp_path / "none.jsonl").step is None


def test_ranks_learn_the_attempt_rank_0_began(tmp_path):
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    for r in (0, 1, 2):
        rd.write_rank(r, {"rank": r, "hostname": "h", "pid": 100 + r, "started": "t"})
    rd.write_rank_attempts({"attempt": 1, "starts": {"1": ["h", 99, "t0"]}})  # an earlier start of rank 1
    stop = threading.Event()
    threading.Thread(target=script.announce, args=(rd, 2, stop, 0.05), daemon=True).start()
    try:
        assert script.learn_attempt(rd, 1, timeout_s=20, interval_s=0.05) == 2
        assert script.learn_attempt(rd, 2, timeout_s=20, interval_s=0.05) == 2
    finally:
        stop.set()
    rd.write_rank(3, {"rank": 3, "hostname": "h", "pid": 103, "started": "t"})  # nobody announces it
    with pytest.raises(RuntimeError, match="rank 0 did not start"):
        script.learn_attempt(rd, 3, timeout_s=0.3, interval_s=0.05)


def test_a_resume_or_reproduction_looks_in_its_snapshot_whatever_the_cwd(tmp_path, monkeypatch):
    from launcher.recipe_target import searched_in

    snap = tmp_path / "code"
    snap.mkdir()
    (snap / "train.py").write_text("print('hi')\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    with searched_in(snap):
        assert problem(tree(script="train.py")) is None
        found = problem(tree(script="other.py"))
    assert found[0] == "recipe.script" and f"the code snapshot {snap}" in found[1], found
    assert problem(tree(script="train.py")) is not None  # a launch from elsewhere: not there
