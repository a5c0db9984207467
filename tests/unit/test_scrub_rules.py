"""The scrub rules on text (launcher.archive.secrets.scrub): which values are replaced, whole
token or inside other text; the end-to-end secret drills are in tests/integration/test_secrets.py."""
import secrets as _random

import pytest

from launcher import backends
from launcher.archive import secrets


def _value(tag):  # made at test time: a literal would sit in the code snapshot of this very file
    return f"s3cr3t-{tag}-{_random.token_hex(12)}"


CLI = _value("cli")        # +cluster.env.HF_TOKEN=... on the command line


DOTENV = _value("dotenv")  # HF_TOKEN=... in the repo's (untracked, not ignored) .env


LEAKY = _value("leaky")    # env: {HF_TOKEN: ...} in conf/cluster/leaky.yaml


@pytest.mark.timeout(60)
def test_scrub_rules():
    known = secrets.known_secrets([{"cluster": {"env": {"HF_TOKEN": CLI, "OMP_NUM_THREADS": "1"}},
                                    "wandb": {"api_key": LEAKY}}],
                                   env={"MY_SECRET": DOTENV, "TOKENIZERS_PARALLELISM": "false", "PIN_KEY": "123",
                                        "PATH": "/usr/bin"})
    assert sorted(known.values()) == sorted([CLI, LEAKY, DOTENV])  # no short or settings-like value
    tree = {"tags": [CLI, f"a-{LEAKY}-b", 3, True, None], "setup": [f"export X={DOTENV}"], CLI: "key too"}
    assert secrets.scrub_tree(tree, known) == {
        "tags": [secrets.REDACTED, f"a-{secrets.REDACTED}-b", 3, True, None],
        "setup": [f"export X={secrets.REDACTED}"], secrets.REDACTED: "key too"}
    assert secrets.scrub("use false and 123 freely", {"TOKENIZERS_PARALLELISM": "false", "PIN_KEY": "123"}) == \
        "use false and 123 freely"
    assert secrets.redact_config({"cluster": {"env": {"HF_TOKEN": "abc"}}, "tags": [CLI]}, known) == \
        {"cluster": {"env": {"HF_TOKEN": secrets.REDACTED}}, "tags": [secrets.REDACTED]}
    for name in (".env", "a/.env.local", "x.pem", "k.key", "id_rsa", "id_ed25519.pub", "aws/credentials",
                 ".netrc", ".pypirc", "c.p12", ".ssh/config"):
        assert secrets.is_secret_file(name), name
    for name in ("launcher/archive/secrets.py", "conf/cluster/local.yaml", "keys.py", "README.md"):
        assert not secrets.is_secret_file(name), name
    assert secrets.training_env({"NCCL_DEBUG": "INFO", "WANDB_NOTES": f"x{CLI}", "HF_TOKEN": CLI}) == \
        {"NCCL_DEBUG": "INFO", "WANDB_NOTES": f"x{secrets.REDACTED}"}
    # a scheduler's own variables come from its backend (Slurm's env_prefixes); names without _ are whole
    env = {"SLURM_JOB_ID": "7", "RANK": "1", "RANKS": "x", "WORLD_SIZE": "2", "HOME": "/h"}
    assert secrets.training_env(env, backends.get("slurm").env_prefixes) == \
        {"RANK": "1", "SLURM_JOB_ID": "7", "WORLD_SIZE": "2"}
    assert "SLURM_JOB_ID" not in secrets.training_env(env, backends.get("local").env_prefixes)
    assert secrets.is_redacted(secrets.REDACTED) and not secrets.is_redacted("1")
