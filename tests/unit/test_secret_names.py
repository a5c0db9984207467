"""Which key and variable names count as secret: the last word of the name, never a substring, so that
settings whose names merely contain "key" or "token" are archived and run as given."""
import pytest

from launcher.archive import secrets
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


def test_a_secret_literal_becomes_a_reference_to_the_variable_that_carries_it():
    resolved = {"recipe": {"params": {"api_key": "abcdef123", "key_order": "ascending"}},
                "cluster": {"env": {"HF_TOKEN": "hf_value_1", "X_TOKEN": "true", "NO_KEY": ""}}}
    written = {"recipe": {"params": {"api_key": "abcdef123", "key_order": "ascending"}},
               "cluster": {"env": {"HF_TOKEN": "${oc.env:MY_HF}", "X_TOKEN": "true", "NO_KEY": ""}}}
    assert secrets.lifted_secrets(resolved, written) == {"LAUNCHER_SECRET_RECIPE_PARAMS_API_KEY": "abcdef123"}
    archived = secrets.redact_config(resolved, None, raw=written)
    assert archived == {"recipe": {"params": {"api_key": "${oc.env:LAUNCHER_SECRET_RECIPE_PARAMS_API_KEY}",
                                              "key_order": "ascending"}},
                        "cluster": {"env": {"HF_TOKEN": "${oc.env:MY_HF}", "X_TOKEN": "true", "NO_KEY": ""}}}
    assert secrets.env_references(archived) == ["LAUNCHER_SECRET_RECIPE_PARAMS_API_KEY", "MY_HF"]
    # a record that is only read (no config as written): the value is redacted
    assert secrets.redact_config(resolved)["recipe"]["params"]["api_key"] == secrets.REDACTED


def test_a_reference_whose_default_is_a_secret_is_a_literal():
    assert secrets.env_reference("${oc.env:MY_HF}") == "MY_HF"
    assert secrets.env_reference("${oc.env:MY_HF,null}") == "MY_HF"
    assert secrets.env_reference("${oc.env:MY_HF,hf_real_value}") is None
    assert secrets.lifted_secrets({"k": {"api_key": "hf_real_value"}}, {"k": {"api_key": "${oc.env:X,hf_real_value}"}})


def test_the_node_resolves_references_and_a_new_job_needs_their_variables():
    assert secrets.from_env_reference("${oc.env:MY_HF}", {"MY_HF": "v1"}) == "v1"
    assert secrets.from_env_reference("${oc.env:MY_HF,fallback}", {}) == "fallback"
    assert secrets.from_env_reference("${oc.env:MY_HF}", {}) is None
    assert secrets.from_env_reference("plain", {}) == "plain"
    archived = {"a": {"api_key": "${oc.env:LAUNCHER_SECRET_A_API_KEY}"}, "b": "${oc.env:OTHER,x}"}
    assert secrets.missing_references(archived, {"LAUNCHER_SECRET_A_API_KEY": "v"}) is None
    why = secrets.missing_references(archived, {})
    assert "LAUNCHER_SECRET_A_API_KEY" in why and "OTHER" not in why and "export" in why
