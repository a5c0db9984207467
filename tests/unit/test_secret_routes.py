"""Secrets by every route (issue 27): what `launch` and `launcher` print on an error or for --cfg,
and the shell lines of cluster.setup, name a key but never hold its value; redaction never changes
what runs. Each route: the attack the issue lists, then one more of the same class it did not list
(marked "not listed"). Everything runs in this process: the Hydra app's main with sys.argv set,
the `launcher` CLI's main, the secret rules as functions; nothing is submitted.
"""
from __future__ import annotations

import secrets as _random
import sys

import pytest

from launcher import app
from launcher.archive import secrets
from launcher.backends.slurm import SlurmBackend, setup_lines
from launcher.cli import main as cli
from launcher.cli.scrubbed import errors_scrubbed, report


def _value(tag):  # made at test time: a literal would sit in the code snapshot of this very file
    return f"s3cr3t-{tag}-{_random.token_hex(8)}"


TINY = ["model=gpt_tiny", "train.steps=2", "optim.warmup_steps=0", "submit.dry_run=true"]


def _launch(monkeypatch, capsys, tmp_path, *args, multirun=False):
    """(exit code, stdout + stderr) of `launch ARGS` run in this process (a dry run: nothing written)."""
    monkeypatch.setattr(sys, "argv", ["launch", *(["-m"] if multirun else []), *TINY, f"submit.runs_root={tmp_path}",
                                      *args])
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    try:
        app.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out = capsys.readouterr()
    return code, out.out + out.err


# ---- route 1: an interpolation that does not resolve -------------------------------------------


def test_an_unresolved_interpolation_names_its_key_and_echoes_no_secret(monkeypatch, capsys, tmp_path):
    token = _value("interp")
    code, out = _launch(monkeypatch, capsys, tmp_path, f"+cluster.env.HF_TOKEN={token}", "name='x${nope}'")
    assert code == 2, out
    assert "name: cannot be resolved" in out and "Traceback" not in out, out
    assert token not in out


def test_a_sweep_whose_secret_itself_does_not_resolve_names_the_secret_key(monkeypatch, capsys, tmp_path):
    """Not listed: the interpolation that fails is inside the secret's own value, in a sweep (-m),
    where each point is named by its overrides as Hydra writes them back, `$\\{nope\\}<value>`."""
    token = _value("interp-sweep")
    code, out = _launch(monkeypatch, capsys, tmp_path, f"+cluster.env.HF_TOKEN=${{nope}}{token}", "seed=1,2",
                        multirun=True)
    assert code == 2, out
    assert "cluster.env.HF_TOKEN: cannot be resolved" in out and "Traceback" not in out, out
    assert token not in out


def test_any_other_error_is_printed_scrubbed_with_its_key():
    """An OmegaConf error that reaches the top: its key and why, never the overrides' values."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    token = _value("report")
    try:
        print(OmegaConf.create({"a": {"b": "${nope}"}}).a.b)
    except OmegaConfBaseException as e:
        text = report(e, secrets.override_secrets([f"+x.api_key={token}"]), "launch")
    assert text.startswith("launch: a.b: Interpolation key 'nope' not found"), text
    text = report(RuntimeError(f"failed with +x.api_key={token}"), secrets.override_secrets([f"+x.api_key={token}"]),
                  "launch")
    assert "RuntimeError: failed with +x.api_key=<redacted>" in text and token not in text


# ---- route 2: Hydra's override errors -----------------------------------------------------------


@pytest.mark.parametrize("args,says", [
    (lambda t: [f"cluster.env.HF_TOKEN={t}"], "+cluster.env.HF_TOKEN=<redacted>"),  # a forgotten +
    (lambda t: [f"+cluster.env.HF_TOKEN={t},x"], "Ambiguous value for argument '+cluster.env.HF_TOKEN=<redacted>'"),
    (lambda t: [f"+cluster.env.HF_TOKEN={t}", f"+cluster.env.HF_TOKEN={t}"],
     "Either remove + prefix: 'cluster.env.HF_TOKEN=<redacted>'"),  # a duplicate +
], ids=["forgotten-plus", "a,b", "duplicate-plus"])
def test_hydras_override_errors_name_the_key_never_the_value(monkeypatch, capsys, tmp_path, args, says):
    token = _value("hydra")
    code, out = _launch(monkeypatch, capsys, tmp_path, *args(token))
    assert code == 1 and says in out, out
    assert token not in out


def test_a_setup_line_override_that_does_not_parse_echoes_no_secret(monkeypatch, capsys, tmp_path):
    """Not listed: Hydra's grammar error quotes the override, here a setup line whose secret is
    under no secret-named key (the assignment in the line makes it one)."""
    token = _value("parse")
    code, out = _launch(monkeypatch, capsys, tmp_path, f"cluster.setup=['export HF_TOKEN2={token}'")
    assert code == 1 and "export HF_TOKEN2=<redacted>" in out, out
    assert token not in out


def test_the_launcher_cli_scrubs_the_same_errors(capsys):
    """Not listed: `launcher plan` composes the same overrides through Hydra's compose API."""
    token = _value("plan")
    assert cli.main(["plan", "model=gpt_tiny", f"cluster.env.HF_TOKEN={token}"]) == 2
    out = capsys.readouterr().err
    assert "+cluster.env.HF_TOKEN=<redacted>" in out and token not in out, out
    with pytest.raises(SystemExit) as e:  # a SystemExit message is scrubbed too
        with errors_scrubbed([f"+a.api_key={token}"], "launcher"):
            sys.exit(f"launcher: bad +a.api_key={token}")
    assert e.value.code == "launcher: bad +a.api_key=<redacted>"


# ---- route 3: --cfg (and every other way Hydra shows a config) ---------------------------------


def test_cfg_job_prints_no_secret(monkeypatch, capsys, tmp_path):
    token = _value("cfg")
    code, out = _launch(monkeypatch, capsys, tmp_path, f"+cluster.env.HF_TOKEN={token}", "--cfg", "job")
    assert code == 0 and "HF_TOKEN: <redacted>" in out, out
    assert token not in out


@pytest.mark.parametrize("flags", [["--cfg", "hydra"], ["--cfg", "all", "--resolve"], ["--info", "config"],
                                   ["--help"]])
def test_cfg_hydra_resolve_info_and_help_print_no_secret(monkeypatch, capsys, tmp_path, flags):
    """Not listed: the hydra node lists every override (overrides.task, override_dirname); --resolve
    resolves a reference to the environment; --info and --help print the config too."""
    token, env_token = _value("cfg-hydra"), _value("cfg-env")
    monkeypatch.setenv("MY_PLAIN_VAR", env_token)  # not secret-named: known through the key that reads it
    code, out = _launch(monkeypatch, capsys, tmp_path, f"+cluster.env.HF_TOKEN={token}",
                        "+recipe.params.api_key=${oc.env:MY_PLAIN_VAR}", *flags)
    assert code == 0 and "HF_TOKEN" in out, out
    assert token not in out and env_token not in out


# ---- route 4: shell lines of cluster.setup ------------------------------------------------------


def test_a_setup_line_secret_is_lifted_and_the_archive_and_script_reference_it():
    token = _value("setup")
    resolved = {"cluster": {"setup": [f"export HF_TOKEN2={token}", "echo ok"], "env": {}}}
    lifted = secrets.lifted_secrets(resolved, resolved)
    assert lifted == {"LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2": token}  # what the launch exports
    known = secrets.known_secrets([resolved], env={})
    assert token in known.values()  # so every other archived text is scrubbed of it
    archived = secrets.redact_config(resolved, known, raw=resolved)
    assert archived["cluster"]["setup"] == ['export HF_TOKEN2="$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2"', "echo ok"]
    assert secrets.env_references(archived) == ["LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2"]  # reproduce asks for it
    assert secrets.missing_references(archived, env={}) is not None
    # the batch script runs the lines the archive holds (tests/integration/test_secrets.py runs them in bash)
    assert setup_lines(resolved["cluster"]["setup"]) == archived["cluster"]["setup"]
    assert secrets.lift_shell(archived["cluster"]["setup"]) == (archived["cluster"]["setup"], {})  # idempotent


def test_every_quoting_of_a_setup_secret_is_lifted_and_other_forms_run_as_written():
    """Not listed: several assignments in one line, single and double quotes, a URL password in a
    command (unquoted and single-quoted); a value the shell would expand (`$A`, a backslash) is no
    literal and stays as written, and so do settings under secret-looking names."""
    pw, quoted, dq = _value("url"), _value("sq") + " x", _value("dq")
    new, lifted = secrets.lift_shell(_setup_lines(pw, quoted, dq))
    assert not any(v in line for line in new for v in (pw, quoted, dq)), new
    assert new[0] == 'export A=1 HF_TOKEN="$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN" B=2; ' \
                     'export WANDB_API_KEY="$LAUNCHER_SECRET_CLUSTER_SETUP_WANDB_API_KEY"'
    assert new[1] == 'git_url=https://bob:"$LAUNCHER_SECRET_CLUSTER_SETUP_URL_PASSWORD"@git.example/x'
    assert new[2] == 'single=\'https://bob:\'"$LAUNCHER_SECRET_CLUSTER_SETUP_URL_PASSWORD"\'@h\''
    assert new[3:] == _setup_lines(pw, quoted, dq)[3:]
    assert sorted(lifted.values()) == sorted([quoted, dq, pw])
    assert secrets.lift_shell(["export MY_KEY=abc\\def"])[1] == {}  # the shell reads abcdef: left as written


def _setup_lines(pw, quoted, dq):
    return [f"export A=1 HF_TOKEN='{quoted}' B=2; export WANDB_API_KEY=\"{dq}\"",
            f"git_url=https://bob:{pw}@git.example/x", f"single='https://bob:{pw}@h'",
            "export MY_TOKEN=$A", "export X_TOKEN=false"]


def test_the_backend_script_and_the_sbatch_preview_hold_the_reference(tmp_path):
    from omegaconf import OmegaConf

    token = _value("preview")
    cfg = OmegaConf.create({"submit": {"job_name": "x"}, "cluster": {
        "time_min": 5, "nodes": 1, "gpus_per_node": 1, "cpus_per_task": 1, "array_parallelism": 1,
        "setup": [f"export HF_TOKEN2={token}"], "env": {}, "signal_delay_s": 60, "use_gpus": False,
        "mem_gb": None, "sbatch_extra": {}}})
    params = SlurmBackend().parameters(cfg)
    assert params["setup"][0] == 'export HF_TOKEN2="$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2"'
    assert token not in str(params)


def test_a_setup_line_in_a_yaml_list_of_the_tree_is_a_known_secret():
    """The issue's M5: `- export HF_TOKEN=...` in a list of an unused cluster yaml (the snapshot
    leaves out a file holding a known value: tests/integration/test_secrets.py)."""
    token, pw = _value("yaml-list"), _value("yaml-url")
    text = f"name: prod\nsetup:\n  - export HF_TOKEN={token}\n  - pip install git+https://u:{pw}@h/x\n"
    assert secrets.secrets_in_text("conf/cluster/prod.yaml", text) == {
        "conf/cluster/prod.yaml:HF_TOKEN": token, "conf/cluster/prod.yaml:url_password": pw}
    assert secrets.secrets_in_text("run.sh", f"cd x && export HF_TOKEN={token}\n") == {"run.sh:HF_TOKEN": token}


# ---- route 5: credentials in URLs ---------------------------------------------------------------


def test_a_url_password_in_any_config_value_is_a_secret():
    pw = _value("tag")
    cfg = {"tags": [f"https://bob:{pw}@git.example/x"], "name": "run"}
    known = secrets.known_secrets([cfg], env={})
    assert secrets.scrub_tree(cfg, known) == {"tags": ["https://bob:<redacted>@git.example/x"], "name": "run"}
    assert secrets.secrets_in_text("conf/x.yaml", f"data:\n  url: s3://k:{pw}@bucket/x\n") == \
        {"conf/x.yaml:url_password": pw}
    for plain in ("https://host:8080/x", "ssh://git@github.com/x", "https://u:${oc.env:PW}@h", "a://u:abc@h"):
        assert secrets.url_passwords(plain) == [], plain


def test_a_url_password_in_the_environment_is_a_secret():
    """Not listed: the submitting environment's URL (PIP_INDEX_URL, WANDB_BASE_URL): scrubbed from
    every text, and from the job's training-env.json."""
    pw = _value("env-url")
    env = {"PIP_INDEX_URL": f"https://u:{pw}@pypi.example/simple", "WANDB_BASE_URL": f"https://u:{pw}@wandb.example"}
    assert pw in secrets.known_secrets(env=env).values()
    assert secrets.training_env(env) == {"WANDB_BASE_URL": "https://u:<redacted>@wandb.example"}


def test_numbered_secret_names_are_secret():
    for name in ("HF_TOKEN2", "API_KEY_1", "db.password2"):
        assert secrets.is_secret(name), name
    for name in ("max_tokens2", "key_order_1", "TOKENIZERS_PARALLELISM"):
        assert not secrets.is_secret(name), name
