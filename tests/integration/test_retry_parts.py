"""retry and resume check every change before anything changes (their path runs pip freeze, so
they are not pure); resume takes key=value changes as retry does."""

import pytest
from hydra import compose, initialize_config_dir

from launcher.app import CONF_DIR, normalize_overrides
from launcher.run.status import Status


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=normalize_overrides(["cluster=local_slurm", *overrides]))


def _ended_run(tmp_path, *overrides):
    """A staged, never submitted run (local backend), recorded failed and sealed."""
    from launcher.submit import pipeline

    cfg = _cfg("cluster=local", "model=gpt_tiny", "train.steps=3", *overrides)
    checked = pipeline.validate([pipeline.Point(cfg, list(overrides))])
    code = tmp_path / "code"
    code.mkdir(exist_ok=True)
    sweep = pipeline.create(checked, tmp_path / "runs", ["launch"], code, None)
    (rd,) = pipeline.stage(sweep, checked)
    rd.finish(Status.failed, exit_code=1, error="boom")
    return rd


def test_retry_checks_every_change_before_anything_changes(tmp_path):
    from launcher.config.errors import ConfigErrors
    from launcher.submit import resume

    rd = _ended_run(tmp_path, "train.fail_at_step=2")
    n = resume.prepare(rd.path, changes=["train.fail_at_step=null", "optim.lr=0.01"])
    assert n.changed == {"optim.lr": (0.001, 0.01), "train.fail_at_step": (2, None)}
    assert n.plain["train"]["fail_at_step"] is None and rd.config()["train"]["fail_at_step"] == 2
    # a layout change that moves state is checked (launcher.submit.reshard); one it cannot make is refused
    lay = rd.run()["layout"]
    assert lay["dp"] == 2  # cluster=local: 2 processes
    moved = resume.prepare(rd.path, changes=["cluster.gpus_per_node=1"]).layout
    assert moved["from"]["dp"] == 2 and moved["to"]["dp"] == 1
    assert resume.prepare(rd.path, changes=["parallelism.engine=megatron", "parallelism.tp=2",
                                            f"cluster.gpus_per_node={2 * lay['world_size']}"]).layout["to"]["tp"] == 2
    with pytest.raises(ConfigErrors, match="DeepSpeed ZeRO-0 in bf16"):  # its own master copy: not resharded
        resume.prepare(rd.path, changes=["parallelism.engine=deepspeed", "zero.stage=0", "precision.dtype=bf16"])
    # a new layout that does not divide the batch, or would not fit: refused by the rule table, naming the key
    with pytest.raises(ConfigErrors, match="train.global_batch_size: 16 is not a multiple of dp") as e:
        resume.prepare(rd.path, changes=["cluster.gpus_per_node=3"])
    print(e.value)
    with pytest.raises(ConfigErrors, match="memory") as e:
        resume.prepare(rd.path, changes=["cluster.gpus_per_node=1", "cluster.gpu.memory_gb=0.0001"])
    print(e.value)
    with pytest.raises(ConfigErrors, match="no_such_key"):
        resume.prepare(rd.path, changes=["train.no_such_key=1"])
    with pytest.raises(ConfigErrors, match="optim.lr"):
        resume.prepare(rd.path, changes=["optim.lr=-1"])
    assert rd.is_sealed() and not rd.restarts() and rd.verify() == []  # nothing was touched
    (rd.path / "config.yaml").chmod(0o644)
    (rd.path / "config.yaml").write_text((rd.path / "config.yaml").read_text() + "\n# edited\n")
    with pytest.raises(ConfigErrors, match="changed after it was sealed"):
        resume.prepare(rd.path)


def test_resume_steps_is_a_change_of_the_config(tmp_path):
    from launcher.submit import resume

    rd = _ended_run(tmp_path)
    n = resume.prepare(rd.path, steps=5)
    assert n.changed == {"train.steps": (3, 5)} and n.plain["train"]["steps"] == 5
    assert rd.config()["train"]["steps"] == 3


def test_resume_takes_key_value_changes_as_retry_does(tmp_path, capsys):
    """`launcher resume RUN key=value` checks a change as retry does (launcher.submit.resume.prepare):
    a bad value is refused naming the key, before anything changes."""
    from launcher.cli import main as cli

    rd = _ended_run(tmp_path)
    code = cli.main(["resume", str(rd.path), "optim.lr=-1", "--root", str(tmp_path / "runs")])
    assert code == 2 and "optim.lr" in capsys.readouterr().err
    assert rd.is_sealed() and not rd.restarts() and rd.verify() == []  # nothing was touched


def test_resume_refuses_a_run_whose_checkpoints_fail_their_manifest_before_submitting(tmp_path):
    """`launcher resume`'s check (names and sizes, against each checkpoint.json): a truncated latest
    resumes from the intact checkpoint before it; with none left the resume is refused, naming the
    file, before anything is written (the job itself checks every byte: tests/unit/test_training_api.py)."""
    from launcher.config.errors import ConfigErrors
    from launcher.run import checkpoint_manifest
    from launcher.submit import resume

    rd = _ended_run(tmp_path)
    for step in (2, 3):
        d = rd.checkpoint_dir(step)
        d.mkdir(parents=True)
        (d / "state.pt").write_bytes(b"s" * 100)
        (d / "meta.json").write_text(f'{{"step": {step}, "metrics": []}}')
        checkpoint_manifest.write(d, step, [])
        rd.set_latest(d)
    assert resume.prepare(rd.path, steps=5).done == 3
    (rd.checkpoint_dir(3) / "state.pt").write_bytes(b"s" * 10)
    assert resume.prepare(rd.path, steps=5).done == 2  # the job falls back the same way
    (rd.checkpoint_dir(2) / "extra.pt").write_bytes(b"planted")
    with pytest.raises(ConfigErrors, match=r"step_00000003/state.pt is 10 bytes, checkpoint.json says 100 "
                                           r"\(truncated\).*step_00000002/extra.pt added"):
        resume.prepare(rd.path, steps=5)
    assert not rd.restarts() and rd.checkpoint_dir(3).is_dir()  # nothing was touched


def test_resume_leaves_checkpoints_to_their_manifests_and_refuses_any_other_change(tmp_path, capsys):
    """A sealed run's checkpoints changed after the seal (here: one added) are named in a warning and
    judged by their checkpoint.json (the resume goes on from the intact one); any other change to the
    sealed archive still refuses the resume, naming it."""
    from launcher.config.errors import ConfigErrors
    from launcher.run import checkpoint_manifest
    from launcher.submit import resume

    rd = _ended_run(tmp_path)
    d = rd.checkpoint_dir(2)
    d.mkdir(parents=True)
    (d / "state.pt").write_bytes(b"s" * 100)
    (d / "meta.json").write_text('{"step": 2, "metrics": []}')
    checkpoint_manifest.write(d, 2, [])
    rd.set_latest(d)
    assert resume.prepare(rd.path, steps=5).done == 2
    err = capsys.readouterr().err
    assert "checkpoints changed after the seal" in err and "step_00000002 added after the seal" in err, err
    (rd.path / "notes.txt").write_text("planted")
    with pytest.raises(ConfigErrors, match=r"changed after it was sealed: notes.txt added after the seal"):
        resume.prepare(rd.path, steps=5)
