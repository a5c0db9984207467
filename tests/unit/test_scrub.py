"""The scrubber finds a long secret anywhere, and a short one (a common word) only as a whole token,
so that scrubbing never rewrites code such as ``launcher.archive.secrets``."""
from launcher.archive.secrets import REDACTED, contains_secret, scrub, scrub_bytes

ENV = {"DB_PASSWORD": "secret", "HF_TOKEN": "hf-0123456789abcdef"}


def test_short_secret_is_scrubbed_only_as_a_whole_token():
    code = 'from launcher.archive.secrets import scrub\npassword = "secret"\n'
    out = scrub(code, ENV)
    assert "launcher.archive.secrets" in out and f'password = "{REDACTED}"' in out
    assert scrub_bytes(code.encode(), ENV).decode() == out
    assert contains_secret(code, ENV) and not contains_secret("import secrets", ENV)


def test_long_secret_is_scrubbed_inside_other_text():
    text = "url=https://u:hf-0123456789abcdef@host tag=xhf-0123456789abcdefx"
    out = scrub(text, ENV)
    assert "hf-0123456789abcdef" not in out and out.count(REDACTED) == 2
    assert contains_secret(text.encode(), ENV)
