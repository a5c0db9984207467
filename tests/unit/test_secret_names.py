"""Which key and variable names count as secret: the last word of the name, never a substring, so that
settings whose names merely contain "key" or "token" are archived and run as given."""
import pytest

from launcher.archive.secrets import is_secret, redact_config

SECRET = ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD", "MY_SECRET", "SECRET", "token",
          "api_key", "apiKey", "githubToken", "cluster.env.HF_TOKEN", "wandb.api_key", "db.passwd",
          "GOOGLE_APPLICATION_CREDENTIALS", "AUTHTOKEN", "private-key"]
SETTINGS = ["tokenizer", "tokens", "max_tokens", "key_order", "num_keys", "TOKENIZERS_PARALLELISM", "keyboard",
            "monkey", "tokens_per_step", "secret_santa_count", "password_file", "recipe.params.key_order",
            "token_dropout", "data.tokenizer", "sort_key_fn"]


@pytest.mark.parametrize("name", SECRET)
def test_secret_names(name):
    assert is_secret(name)


@pytest.mark.parametrize("name", SETTINGS)
def test_names_that_only_contain_a_secret_word_are_settings(name):
    assert not is_secret(name)


def test_a_setting_named_like_key_order_reaches_the_job_unchanged():
    cfg = {"recipe": {"params": {"key_order": "ascending", "tokenizer": "gpt2", "api_key": "sk-live-1234567890"}}}
    out = redact_config(cfg)
    assert out["recipe"]["params"]["key_order"] == "ascending" and out["recipe"]["params"]["tokenizer"] == "gpt2"
    assert out["recipe"]["params"]["api_key"] == "<redacted>"
