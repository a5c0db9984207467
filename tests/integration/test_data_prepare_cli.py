"""`launcher data prepare | show | verify` as commands: a small corpus (big enough for the pool of
encoding processes), no torch imported, and one flipped shard byte makes `verify` exit 1 naming the
shard. Everything pure (formats, bad inputs, splits) is in tests/unit/test_data_{manifest,prepare}.py."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from launcher.data.manifest import Manifest


def _cli(*args, cwd, importtime=False):
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-m", "launcher.cli.main", "data", *args], capture_output=True,
                          text=True, timeout=100, cwd=cwd)


@pytest.mark.timeout(180)
def test_prepare_show_verify_and_a_flipped_byte(tmp_path):
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "import", "class", "self", "value", "\n"]
    (tmp_path / "corpus" / "sub").mkdir(parents=True)
    for i in range(40):  # ~2.6 MB: more than two batches per worker, so the process pool encodes it
        text = " ".join(rng.choice(words) for _ in range(12_000))
        (tmp_path / "corpus" / ("sub" if i % 2 else "") / f"f{i:02}.txt").write_text(text)
    rows = [json.dumps({"text": f"row {i} " + " ".join(rng.choice(words) for _ in range(20))}) for i in range(300)]
    (tmp_path / "rows.jsonl").write_text("\n".join(rows) + "\n")

    res = _cli("prepare", "corpus", "rows.jsonl", "--glob", "*.txt", "-o", "ds", "--vocab-size", "400",
               "--workers", "2", "--val-fraction", "0.1", cwd=tmp_path, importtime=True)
    assert res.returncode == 0, res.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "tokenizers" in imported and "torch" not in imported
    m = Manifest.load(tmp_path / "ds")
    # as readable as any directory the user makes (the test's umask, 022 as most): teammates can train on it
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "ds").stat().st_mode & 0o777 == 0o777 & ~umask
    assert len(m.inputs) == 41 and sum(s.documents for s in m.splits.values()) == 340
    assert m.split("val").documents > 0 and m.prepare.workers == 2
    total = sum(s.tokens for s in m.splits.values())
    assert f"{total:,} tokens" in res.stdout and "tokens/s, 2 worker(s)" in res.stdout

    show = _cli("show", "ds", cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "byte-level-bpe" in show.stdout and f"{m.split('train').tokens:,}" in show.stdout
    assert m.split("train").shards[0].bin in show.stdout
    ok = _cli("verify", "ds", cwd=tmp_path)
    assert ok.returncode == 0 and "intact" in ok.stdout, ok.stderr

    shard = tmp_path / "ds" / m.split("train").shards[0].bin
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    bad = _cli("verify", "ds", cwd=tmp_path)
    assert bad.returncode == 1
    assert f"{shard}: sha256" in bad.stderr and "1 problem(s)" in bad.stderr, bad.stderr
