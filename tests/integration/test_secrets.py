"""Nothing secret is ever written anywhere under runs_root, or printed.

Secret values are planted every way a user can hand one to `launch`: the submitting environment
(HF_TOKEN, WANDB_API_KEY, MY_SECRET), `+cluster.env.HF_TOKEN=...` on the command line, a `.env` file
and a cluster yaml with `env: {HF_TOKEN: ...}` in the source tree launched from, and the same values
under non-secret keys (cluster.setup, tags, so argv and overrides too). Then every byte of every file
under runs_root (.hydra, .submitit, code/, registry.sqlite, wandb/ ... binary files too) and the
command's output is searched for each value.
"""
import hashlib
import json
import secrets as _random
import subprocess
from pathlib import Path

import pytest

from helpers import BIN, clone_worktree, launch, run_cmd, runs_json, wait_final
from launcher.archive import secrets, snapshot


def _value(tag):  # made at test time: a literal would sit in the code snapshot of this very file
    return f"s3cr3t-{tag}-{_random.token_hex(12)}"


ENV = {"HF_TOKEN": _value("env-hf"), "WANDB_API_KEY": _value("env-wandb"), "MY_SECRET": _value("env-my")}
CLI = _value("cli")        # +cluster.env.HF_TOKEN=... on the command line
DOTENV = _value("dotenv")  # HF_TOKEN=... in the repo's (untracked, not ignored) .env
LEAKY = _value("leaky")    # env: {HF_TOKEN: ...} in conf/cluster/leaky.yaml
PEM = _value("pem")        # a tracked, secret-looking file (deploy/server.pem)
IGNORED = _value("ignored")  # a file git ignores (build/notes.txt): never copied, never read
SETUP = _value("setup")    # cluster.setup=['export HF_TOKEN2=...']: no secret-named key holds it
URL_PW = _value("url")     # a URL password in a setup line: git_url=https://bob:...@git.example/x
TREE_SETUP = _value("tree-setup")  # `- export HF_TOKEN=...` in a YAML list of the tree (conf/cluster/prod.yaml)
PLANTED = [*ENV.values(), CLI, DOTENV, LEAKY, PEM, IGNORED, SETUP, URL_PW, TREE_SETUP]

FAST = ["train.steps=6", "optim.warmup_steps=0", "train.log_interval=0"]
# the values again, under keys that are not secret-named: the scrubber must find them by value
SETUP_LINES = [f"export MY_SECRET={ENV['MY_SECRET']}", f"true {LEAKY}", f"export HF_TOKEN2={SETUP}",
               f"git_url=https://bob:{URL_PW}@git.example/x"]
LEAKS = [f"cluster.setup=[{','.join(repr(line) for line in SETUP_LINES)}]",
         f"tags=[{ENV['MY_SECRET']},x{DOTENV}x,{LEAKY},{ENV['HF_TOKEN']},plain]"]


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, timeout=120)


@pytest.fixture
def leaky_repo(tmp_path):
    """A scratch clone of this repo with the working tree's current files, plus secrets lying around
    as they do in real checkouts. `launch` runs from it (so it is the tree the snapshot copies)."""
    dest = tmp_path / "work"
    clone_worktree(dest)
    (dest / ".env").write_text(f"HF_TOKEN={DOTENV}\n")
    local = (dest / "conf" / "cluster" / "local.yaml").read_text()
    (dest / "conf" / "cluster" / "leaky.yaml").write_text(
        local.replace("name: local\n", "name: leaky\n") + f"  HF_TOKEN: {LEAKY}\n")
    (dest / "conf" / "cluster" / "prod.yaml").write_text(f"name: prod\nsetup:\n  - export HF_TOKEN={TREE_SETUP}\n")
    (dest / "conf" / "notes.yaml").write_text(f"copied: {SETUP}\n")  # a value only a setup line names
    (dest / "deploy").mkdir()
    (dest / "deploy" / "server.pem").write_text(f"-----BEGIN PRIVATE KEY-----\n{PEM}\n")
    (dest / "build").mkdir(exist_ok=True)  # build/ is in .gitignore
    (dest / "build" / "notes.txt").write_text(IGNORED)
    _git(dest, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-f", "deploy/server.pem")
    _git(dest, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "-m", "add a key")
    return dest


def _env(repo, **extra):
    return {**ENV, "LAUNCHER_CONF_DIR": str(repo / "conf"), **extra}


def _leaks(root, text=""):
    """(where, value) for every planted value found in any file under root, or in text."""
    found = []
    for p in sorted(Path(root).rglob("*")) if Path(root).exists() else []:
        if p.is_file() and not p.is_symlink():
            data = p.read_bytes()
            found += [(str(p), v) for v in PLANTED if v.encode() in data]
    found += [("output", v) for v in PLANTED if v in text]
    return found


def _check_snapshot(code_dir):
    info = json.loads((code_dir / ".snapshot.json").read_text())
    assert not (code_dir / ".env").exists() and ".env" in info["refused"], info
    assert not (code_dir / "deploy" / "server.pem").exists() and "deploy/server.pem" in info["refused"], info
    assert not (code_dir / "build").exists()  # ignored: never copied
    assert "build/notes.txt" not in info["refused"]
    # the code is never rewritten: a file holding a secret value is left out whole, and named
    assert not (code_dir / "conf" / "cluster" / "leaky.yaml").exists()
    assert "conf/cluster/leaky.yaml:HF_TOKEN" in info["held_secret"]["conf/cluster/leaky.yaml"], info
    assert not (code_dir / "conf" / "cluster" / "prod.yaml").exists()  # a setup line in a YAML list
    assert info["held_secret"]["conf/cluster/prod.yaml"] == ["conf/cluster/prod.yaml:HF_TOKEN"], info
    assert not (code_dir / "conf" / "notes.yaml").exists() and "conf/notes.yaml" in info["held_secret"], info
    assert (code_dir / "launcher" / "archive" / "secrets.py").is_file()  # the code itself is all there
    patch = (code_dir / snapshot.PATCH_FILE).read_text()
    heads = [line for line in patch.splitlines() if line.startswith("diff --git ")]
    assert "diff --git a/conf/cluster/leaky.yaml b/conf/cluster/leaky.yaml" in heads
    assert not [h for h in heads if "/.env" in h or ".pem" in h], heads


@pytest.mark.timeout(300)
def test_dry_run_sweep_prints_and_writes_no_secret(runs_root, leaky_repo, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = launch(["-m", "submit.dry_run=true", "cluster=leaky", f"+cluster.env.API_TOKEN={CLI}", *LEAKS, "seed=1,2"],
                 runs_root, extra_env=_env(leaky_repo, TMPDIR=str(tmp)), cwd=leaky_repo)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "# dry run: nothing submitted (2 point(s))" in out
    # a setup line's secret literal: read from the variable the launch exports it in (config and script)
    assert 'export MY_SECRET="$LAUNCHER_SECRET_CLUSTER_SETUP_MY_SECRET"' in out
    assert f"HF_TOKEN: {secrets.REDACTED}" in out
    assert 'export HF_TOKEN2="$LAUNCHER_SECRET_CLUSTER_SETUP_HF_TOKEN2"' in out
    assert not _leaks(runs_root, out), _leaks(runs_root, out)
    # Hydra's multirun.yaml (the config with every override) went to a private temp dir, now gone
    assert not (runs_root / ".hydra").exists()
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())


@pytest.mark.timeout(600)
def test_local_run_archives_no_secret(runs_root, leaky_repo):
    # WANDB_NOTES: a non-secret name holding a secret: archived redacted, so the job must not export it
    res = launch(["cluster=leaky", f"+cluster.env.API_TOKEN={CLI}", f"+cluster.env.WANDB_NOTES=x{DOTENV}", *LEAKS,
                  *FAST, "wandb.enabled=true", "wandb.mode=offline"], runs_root, extra_env=_env(leaky_repo),
                 cwd=leaky_repo, timeout=500)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    (run,) = runs_json(runs_root)
    assert run["status"] == "completed", run
    rdir = Path(run["dir"])
    assert list((rdir / "wandb").rglob("*")), "wandb wrote no files"
    assert (runs_root / "registry.sqlite").is_file()
    _check_snapshot(rdir.parent / "code")
    cfg = (rdir / "config.yaml").read_text()
    # secret literals of the config travel to the job in the environment; the archive references them
    assert "API_TOKEN: ${oc.env:LAUNCHER_SECRET_CLUSTER_ENV_API_TOKEN}" in cfg
    assert "HF_TOKEN: ${oc.env:LAUNCHER_SECRET_CLUSTER_ENV_HF_TOKEN}" in cfg
    assert 'export MY_SECRET="$LAUNCHER_SECRET_CLUSTER_SETUP_MY_SECRET"' in cfg
    assert f"WANDB_NOTES: x{secrets.REDACTED}" in cfg
    assert 'git_url=https://bob:"$LAUNCHER_SECRET_CLUSTER_SETUP_URL_PASSWORD"@git.example/x' in cfg
    job_env = json.loads((rdir / "env" / "training-env.json").read_text())
    assert "WANDB_NOTES" not in job_env, "the job exported a redacted value from config.yaml"
    assert job_env.get("OMP_NUM_THREADS") == "1"  # plain cluster.env values still reach the job
    meta = json.loads((rdir / "run.json").read_text())
    assert meta["tags"] == [secrets.REDACTED, f"x{secrets.REDACTED}x", secrets.REDACTED, secrets.REDACTED, "plain"]
    assert not _leaks(runs_root, out), _leaks(runs_root, out)


USER_RECIPE = """import hashlib, os

ORDER = "ascending"  # a constant: the snapshot the job runs holds it as written


def digest(value):
    return hashlib.sha256(str(value).encode()).hexdigest()


def main(cfg, ctx):
    p = cfg.recipe.params
    return {"key_order": p.key_order, "tokenizer": p.tokenizer, "max_tokens": p.max_tokens, "order": ORDER,
            "api_key": digest(p.api_key), "hf_token": digest(os.environ.get("HF_TOKEN"))}
"""


@pytest.mark.timeout(300)
def test_the_job_reads_every_value_it_was_given_and_no_archived_file_holds_a_secret(runs_root, tmp_path):
    """Settings under key-like names run as written; a secret literal and an ${oc.env:...} reference
    reach the job unchanged through its environment, never through the archive; reproducing without
    those variables is refused, naming them."""
    user = tmp_path / "user"
    (user / "kp").mkdir(parents=True)
    (user / "kp" / "__init__.py").write_text("")
    (user / "kp" / "train.py").write_text(USER_RECIPE)
    overrides = ["recipe._target_=kp.train.main", "+recipe.params.key_order=ascending",
                 "+recipe.params.tokenizer=gpt2", "+recipe.params.max_tokens=128", f"+recipe.params.api_key={CLI}",
                 "+cluster.env.HF_TOKEN=${oc.env:MY_HF}", "cluster.gpus_per_node=1"]
    res = launch(overrides, runs_root, cwd=user, extra_env={"MY_HF": ENV["HF_TOKEN"]}, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    (run,) = runs_json(runs_root)
    rdir = Path(run["dir"])
    summary = json.loads((rdir / "status.json").read_text())["summary"]
    digest = lambda v: __import__("hashlib").sha256(v.encode()).hexdigest()  # noqa: E731
    assert summary == {"key_order": "ascending", "tokenizer": "gpt2", "max_tokens": 128, "order": "ascending",
                       "api_key": digest(CLI), "hf_token": digest(ENV["HF_TOKEN"])}, summary
    assert (rdir.parent / "code" / "kp" / "train.py").read_text() == USER_RECIPE
    cfg = (rdir / "config.yaml").read_text()
    assert "api_key: ${oc.env:LAUNCHER_SECRET_RECIPE_PARAMS_API_KEY}" in cfg and "HF_TOKEN: ${oc.env:MY_HF}" in cfg
    assert not _leaks(runs_root, out), _leaks(runs_root, out)
    again = run_cmd([str(BIN / "launcher"), "reproduce", str(rdir)], runs_root, cwd=user, timeout=120)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "LAUNCHER_SECRET_RECIPE_PARAMS_API_KEY, MY_HF" in again.stderr and "export" in again.stderr, again.stderr
    assert len(runs_json(runs_root)) == 1  # nothing was submitted


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_slurm_sweep_archives_no_secret(slurm, runs_root, leaky_repo):
    # leaky.yaml is not used here: its value (in tags) is known because it is written in the tree
    # the batch script runs the setup lines with their secrets read from variables: the values it got
    digests = [f'printf %s "$HF_TOKEN2" "$git_url" | sha256sum > {runs_root}/setup.sha256']
    setup = [arg for arg in LEAKS if arg.startswith("cluster.setup=")][0][:-1] + "," + repr(digests[0]) + "]"
    res = launch(["-m", "cluster=local_slurm", "cluster.nodes=1", f"+cluster.env.HF_TOKEN={CLI}",
                  *[a for a in LEAKS if not a.startswith("cluster.setup=")], setup, *FAST,
                  "wandb.enabled=true", "wandb.mode=offline", "seed=1,2"],
                 runs_root, extra_env=_env(leaky_repo, **slurm), cwd=leaky_repo, timeout=400)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    runs = wait_final(runs_root, 2, timeout=600)
    assert [r["status"] for r in runs] == ["completed", "completed"], runs
    assert len({r["job_id"].split("_")[0] for r in runs}) == 1  # one array
    rdir = Path(runs[0]["dir"])
    assert list((rdir / "wandb").rglob("*")), "wandb wrote no files"
    assert (rdir / "sbatch.sh").is_file() and list((rdir.parent / ".submitit").glob("*_submission.sh"))
    given = f"{SETUP}https://bob:{URL_PW}@git.example/x".encode()
    assert (runs_root / "setup.sha256").read_text().split()[0] == hashlib.sha256(given).hexdigest()
    _check_snapshot(rdir.parent / "code")
    job_env = json.loads((rdir / "env" / "training-env.json").read_text())
    assert job_env.get("SLURM_JOB_ID") and job_env.get("OMP_NUM_THREADS") == "1"  # the backend's variables too
    assert not _leaks(runs_root, out), _leaks(runs_root, out)


@pytest.mark.timeout(120)
def test_invalid_sweep_error_prints_no_secret(runs_root):
    """An invalid sweep's error names each point by its overrides: a secret among them is redacted."""
    res = launch(["-m", f"+cluster.env.HF_TOKEN={CLI}", f"tags=[{ENV['MY_SECRET']}]", "seed=1,2",
                  "train.micro_batch_size=3"], runs_root, extra_env=ENV)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "2 of 2 point(s) invalid" in out, out
    assert f"tags=[{secrets.REDACTED}]" in out
    assert not _leaks(runs_root, out), _leaks(runs_root, out)


@pytest.mark.timeout(120)
def test_snapshot_outside_git_refuses_secret_files_and_leaves_out_files_holding_one(tmp_path, monkeypatch):
    """Outside a git repo: today's choice of files (.py/.yaml/...), the same secret rules; a file
    holding a secret value is left out and named, never rewritten."""
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "train.py").write_text(f"TOKEN_HINT = '{ENV['HF_TOKEN']}'\n")
    (src / "cluster.yaml").write_text(f"env:\n  HF_TOKEN: {LEAKY}\n")
    (src / "aws_credentials.yaml").write_text("x: 1\n")
    (src / ".env").write_text(f"HF_TOKEN={DOTENV}\n")
    monkeypatch.setenv("HF_TOKEN", ENV["HF_TOKEN"])
    monkeypatch.setattr(snapshot.subprocess, "run", _no_git(snapshot.subprocess.run))
    info = snapshot.take(src, tmp_path / "out" / "s" / "code")
    dest = tmp_path / "out" / "s" / "code"
    assert sorted(info["refused"]) == ["aws_credentials.yaml"]  # .env is not a .py/.yaml file: never listed
    assert not (dest / "pkg" / "train.py").exists() and not (dest / "cluster.yaml").exists()
    assert info["held_secret"] == {"pkg/train.py": ["HF_TOKEN"], "cluster.yaml": ["cluster.yaml:HF_TOKEN"]}, info
    (warning,) = [w for w in snapshot.left_out_warnings(info) if "pkg/train.py" in w]
    assert "HF_TOKEN" in warning and "os.environ" in warning and ENV["HF_TOKEN"] not in warning
    assert not (dest / ".env").exists()
    assert not _leaks(tmp_path / "out")


def _no_git(run):
    def fake(args, *a, **kw):  # snapshot.source_files as if root were no git repo
        if list(args[:2]) == ["git", "-C"] and "ls-files" in args:
            return subprocess.CompletedProcess(args, 128, "", "not a git repository")
        return run(args, *a, **kw)

    return fake




@pytest.mark.timeout(60)
def test_lifted_setup_lines_give_the_shell_the_same_values():
    """Redaction never changes what runs: bash reads the same values from the lines a job's script
    runs (each secret literal replaced by its variable, the variables exported) as from the lines
    as written, whatever their quoting."""
    pw, quoted, dq = _value("url"), _value("sq") + " x  y", _value("dq")
    lines = [f"export A=1 HF_TOKEN='{quoted}' B=2; export WANDB_API_KEY=\"{dq}\"",
             f"git_url=https://bob:{pw}@git.example/x", f"single='https://bob:{pw}@h'", f'double="https://bob:{pw}@h"',
             f"export HF_TOKEN2={SETUP}", "export MY_TOKEN=$A"]
    new, lifted = secrets.lift_shell(lines)
    assert not [v for v in (pw, quoted, dq, SETUP) if v in "\n".join(new)], new
    read = 'printf "%s|" "$A" "$HF_TOKEN" "$B" "$WANDB_API_KEY" "$git_url" "$single" "$double" "$HF_TOKEN2" "$MY_TOKEN"'

    def bash(lines, env):
        return subprocess.run(["bash", "-c", "\n".join([*lines, read])], env={"PATH": "/usr/bin:/bin", **env},
                              capture_output=True, text=True, check=True, timeout=30).stdout

    assert bash(new, lifted) == bash(lines, {}) == \
        f"1|{quoted}|2|{dq}|https://bob:{pw}@git.example/x|https://bob:{pw}@h|https://bob:{pw}@h|{SETUP}|1|"
