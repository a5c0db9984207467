"""recipe=script's pure parts: the launch-time checks, the command, the environment a rank's script
gets, what its exit means for the run, and how the ranks agree on their attempt."""
import os
import threading
from types import SimpleNamespace

import pytest

from launcher import script_recipe
from launcher.config.recipe_target import SCRIPT_TARGET
from launcher.run.rundir import RunDir
from launcher.runtime import script
from launcher.runtime.script import MetricsTail, outcome, summary, torchrun_env

TARGET = SCRIPT_TARGET


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


def test_resume_args_come_after_args_from_the_second_attempt_on(tmp_path):
    recipe = {"script": "train.py", "args": ["--device=cpu"], "resume_args": ["--init_from=resume"]}
    assert script_recipe.command(recipe, tmp_path, "py", attempt=1)[2:] == ["--device=cpu"]
    assert script_recipe.command(recipe, tmp_path, "py", attempt=2)[2:] == ["--device=cpu", "--init_from=resume"]
    assert script_recipe.command({**recipe, "script": None, "module": "m"}, tmp_path, "py", attempt=3) == \
        ["py", "-m", "m", "--device=cpu", "--init_from=resume"]


def test_the_script_is_found_from_the_launch_dir_as_torchrun_takes_it(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("")
    (tmp_path / "tools.py").write_text("")
    assert script_recipe.script_in(tmp_path, "sub", "train.py") == "sub/train.py"
    assert script_recipe.script_in(tmp_path, "sub", "../tools.py") == "tools.py"
    assert script_recipe.script_in(tmp_path, "sub", "sub/train.py") == "sub/train.py"  # from the root: as before
    assert script_recipe.script_in(tmp_path, ".", "sub/train.py") == "sub/train.py"
    assert script_recipe.script_in(tmp_path, None, "train.py") == "train.py"  # nowhere: the job says so


def test_a_script_from_a_subdir_of_the_repo_passes_as_typed_there(tmp_path, monkeypatch):
    import subprocess

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "train.py").write_text("print('hi')\n")
    (tmp_path / "tool.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path / "proj")
    assert problem(tree(script="train.py")) is None
    assert problem(tree(script="../tool.py")) is None
    assert problem(tree(script="proj/train.py")) is None  # the repo-root form still finds it
    found = problem(tree(script=str(tmp_path / "proj" / "train.py")))
    assert "absolute" in found[1] and "recipe.script=train.py" in found[2], found


def test_resume_args_without_the_script_recipe_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = problem({"recipe": {"_target_": "recipes.gpt.train.main", "resume_args": ["--resume"]}})
    assert found[0] == "recipe.resume_args" and "recipe=script" in found[2], found


@pytest.mark.parametrize("typed,value", [
    ("recipe.args=[--device=cpu,--compile=False]", ["--device=cpu", "--compile=False"]),
    ("recipe.resume_args=[--init_from=resume]", ["--init_from=resume"]),
    ("recipe.args=[--lr,3e-4,--epochs,2]", ["--lr", 3e-4, "--epochs", 2]),  # Hydra's own, as before
    ("recipe.args=[--a=1, --flag,'--b=x,y',\"--c=1\"]", ["--a=1", "--flag", "--b=x,y", "--c=1"]),
    ("recipe.args=[--tags=[a,b],--home=${oc.env:HOME}]", ["--tags=[a,b]", "--home=${oc.env:HOME}"]),
    ("++recipe.args=[--path=C:\\dir\\,--q=say \"hi\"]", ["--path=C:\\dir\\", '--q=say "hi"']),
    ("recipe.args=[]", []),
])
def test_k_equals_v_elements_are_taken_as_typed(typed, value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (line,) = script_recipe.quote_args([typed])
    assert OverridesParser.create().parse_override(line).value() == value, line


def test_lines_quote_args_cannot_fix_are_left_to_hydras_error():
    for line in ("recipe.args=[--a=1", "train.steps=3", "recipe.args=[--x='open]", "other.args=[--a=1]",
                 "recipe.args=[--a=1],[--a=2]"):  # (a sweep over lists: quoted by hand)
        assert script_recipe.quote_args([line]) == [line]


def test_the_archive_says_what_a_script_never_used():
    layout = {"engine": "ddp", "dp": 2, "tp": 1, "pp": 1, "grad_accum": 2, "world_size": 2, "procs_per_node": 1}
    got = script_recipe.archived({"recipe": {"_target_": TARGET}}, layout)
    assert got["seed"] == "not used by this recipe"
    assert {"seed", "layout.engine", "layout.dp", "layout.grad_accum"} <= set(got["not_used_by_recipe"])
    assert "layout.world_size" not in got["not_used_by_recipe"]  # the processes it ran as: the job's shape
    assert script_recipe.archived({"recipe": {"_target_": "recipes.gpt.train.main"}}, layout) == {}


def test_no_checkpoint_every_advice_for_a_script():
    from launcher.config import rules

    cfg = {"cluster": {"nodes": 2}, "train": {"checkpoint": {"every": 0}}}
    assert rules.advice({**cfg, "recipe": {"_target_": "recipes.gpt.train.main"}})
    assert rules.advice({**cfg, "recipe": {"_target_": TARGET}}) == []


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
    assert env["LOCAL_SIZE"] == "2"  # DeepSpeed's launcher's name for the processes per node
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
    announcer = threading.Thread(target=script.announce, args=(rd, 2, stop, 0.05), daemon=True)
    announcer.start()
    try:
        assert script.learn_attempt(rd, 1, timeout_s=20, interval_s=0.05) == 2
        assert script.learn_attempt(rd, 2, timeout_s=20, interval_s=0.05) == 2
    finally:
        stop.set()
        announcer.join(20)  # (a pass of its loop under way would name rank 3's start below)
    rd.write_rank(3, {"rank": 3, "hostname": "h", "pid": 103, "started": "t"})  # nobody announces it
    with pytest.raises(RuntimeError, match="rank 0 did not start"):
        script.learn_attempt(rd, 3, timeout_s=0.3, interval_s=0.05)


def test_a_resume_or_reproduction_looks_in_its_snapshot_whatever_the_cwd(tmp_path, monkeypatch):
    from launcher.config.recipe_target import searched_in

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


# ---- the script's working dir: the run's mirror of the snapshot ----------------------------------


def _snapshot(tmp_path):
    from launcher.archive.snapshot import make_read_only

    code = tmp_path / "code"
    for rel, text in {"train.py": "", "configurator.py": "x = 1\n", "data/vocab.txt": "a b\n",
                      "data/deep/more.txt": "", "proj/train.py": "", "proj/cfg.txt": "1\n", "top.txt": "top\n",
                      ".snapshot.json": "{}", ".patch.diff": ""}.items():
        (code / rel).parent.mkdir(parents=True, exist_ok=True)
        (code / rel).write_text(text)
    make_read_only(code)
    return code


def test_the_work_dir_mirrors_the_launch_dir_reads_go_to_the_snapshot_writes_to_the_run(tmp_path):
    code = _snapshot(tmp_path)
    rd = RunDir(tmp_path / "run")
    cwd = script.work_dir(rd, code, ".")
    assert cwd == rd.work_dir
    assert (cwd / "configurator.py").read_text() == "x = 1\n" and (cwd / "data" / "vocab.txt").read_text() == "a b\n"
    assert (cwd / "data").is_dir() and not (cwd / "data").is_symlink()  # a dir of the run: writes land here
    assert not (cwd / ".snapshot.json").exists() and not (cwd / ".patch.diff").exists()  # the launcher's own
    (cwd / "out").mkdir()
    (cwd / "out" / "ckpt.pt").write_text("w")
    (cwd / "data" / "train.bin").write_text("w")
    assert not (code / "out").exists() and not (code / "data" / "train.bin").exists()
    (cwd / "data" / "vocab.txt").write_text("rewritten")  # a copy of the run's: rewritten there
    assert (code / "data" / "vocab.txt").read_text() == "a b\n"
    assert (cwd / "configurator.py").is_symlink() and (cwd / "train.py").is_symlink()  # code: the snapshot's
    again = script.work_dir(rd, code, ".")  # the next attempt: made already, the run's files kept
    assert again == cwd and (cwd / "out" / "ckpt.pt").read_text() == "w"
    assert (cwd / "data" / "vocab.txt").read_text() == "rewritten"


def test_the_work_dir_of_a_launch_from_a_subdir_starts_there_and_sees_its_parent(tmp_path):
    code = _snapshot(tmp_path)
    rd = RunDir(tmp_path / "run")
    cwd = script.work_dir(rd, code, "proj")
    assert cwd == rd.work_dir / "proj"
    assert (cwd / "cfg.txt").read_text() == "1\n" and (cwd / ".." / "top.txt").read_text() == "top\n"
    assert (cwd / ".." / "data" / "vocab.txt").read_text() == "a b\n"  # above the launch dir: mirrored too
    (cwd / ".." / "data" / "new.txt").write_text("w")
    assert not (code / "data" / "new.txt").exists()
    assert os.path.realpath(cwd / "train.py") == str(os.path.realpath(code / "proj" / "train.py"))


def test_past_its_budget_the_mirror_links_a_directory_whole(tmp_path):
    code = _snapshot(tmp_path)
    rd = RunDir(tmp_path / "run")
    cwd = script.work_dir(rd, code, ".", entries=0, copy_bytes=0)
    assert (cwd / "data").is_symlink() and (cwd / "data" / "vocab.txt").read_text() == "a b\n"
    assert (cwd / "top.txt").is_symlink() and (cwd / "top.txt").read_text() == "top\n"


def test_a_snapshot_without_a_launch_dir_runs_in_the_empty_work_dir(tmp_path):
    code = _snapshot(tmp_path)
    rd = RunDir(tmp_path / "run")
    assert script.work_dir(rd, code, None) == rd.work_dir and list(rd.work_dir.iterdir()) == []


def test_a_stop_of_a_script_claims_no_checkpoint_of_the_launchers():
    assert script.stop_detail("preempted", None) == \
        "preempted signal, forwarded to the script (its own checkpoint, if it saved one)"
    assert "its metrics' last step 7" in script.stop_detail("time_limit", 7)
    assert "checkpoint saved after step" not in script.stop_detail("preempted", 7)
