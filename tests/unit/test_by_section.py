"""Walks of a config done section by section, each distinct section once (launcher.by_section), give what
the whole-config walk gave: the YAML text, the secrets found, the redaction, the lifted secrets."""
import yaml

from launcher import by_section
from launcher.archive import env_lift, secrets, yamlio

CFG = {
    "name": "run", "seed": 3, "tags": ["a", "https://u:pw1234567890@host/x"],
    "cluster": {"env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstu", "OK": "1"},
                "setup": ["export WANDB_API_KEY=abcdef0123456789"]},
    "wandb": {"api_key": "${oc.env:WANDB_KEY}", "mode": "offline"}, "empty": {}, "nested": {"a": [1, 2.0, True, None]},
}
RAW = {**CFG, "wandb": {"api_key": "${oc.env:WANDB_KEY}", "mode": "offline"}}


def test_yaml_text_is_the_whole_dump():
    for seed in range(3):
        cfg = {**CFG, "seed": seed}
        assert yamlio.dump(cfg) == yaml.dump(cfg, Dumper=yaml.SafeDumper, sort_keys=False, allow_unicode=False)
        assert yamlio.load(yamlio.dump(cfg)) == cfg


def _whole_known(cfgs):
    out = {}
    for i, c in enumerate(cfgs):
        secrets._config_secrets(c, f"config[{i}]", out)
        secrets._string_secrets(c, f"config[{i}]", out)
    return out


def test_secrets_found_section_by_section_are_the_whole_walks_named_once():
    cfgs = [{**CFG, "seed": s} for s in range(3)]
    got = {k: v for k, v in secrets.known_secrets(cfgs, env={}).items() if ":" not in k or "url" in k}
    whole = _whole_known(cfgs)
    assert set(got.values()) == set(whole.values())
    assert {k for k in got if k.startswith("config[0]")} == {k for k in whole if k.startswith("config[0]")}
    assert not any(k.startswith("config[1]") for k in got)  # the same secret of the next points: named once


def test_redaction_and_lifting_match_the_whole_config():
    known = secrets.known_secrets([CFG], env={})
    for _ in range(2):  # the second time from the memo
        got = env_lift.redact_config(CFG, known, raw=RAW)
        assert got == env_lift._redacted(CFG, RAW, known)
        got["cluster"]["env"]["OK"] = "changed"  # the caller's to change: the memo keeps its own
    assert env_lift.redact_config(CFG, known, raw=RAW)["cluster"]["env"]["OK"] == "1"
    assert env_lift.lifted_secrets(CFG, RAW) == {**env_lift._lifted(CFG, RAW),
                                                 **env_lift.lift_shell(env_lift.shell_lines_of(CFG))[1]}


def test_the_memo_is_bounded_and_keys_by_content():
    calls = []

    def fn(k, v):
        calls.append(k)
        return len(str(v))

    assert by_section.once("t", fn, "a", [1]) == by_section.once("t", fn, "a", [1]) == 3
    assert by_section.once("t", fn, "a", [1.0]) == 5  # 1 and 1.0 are different contents
    assert calls == ["a", "a"]
    for i in range(by_section.MAX_KEPT + 1):
        by_section.once("fill", fn, i, i)
    assert len(by_section._kept) <= by_section.MAX_KEPT
