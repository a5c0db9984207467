"""What of a source tree the code record keeps (launcher.archive.tree, launcher.archive.code): the one
rule for what is not code (any runs root, Hydra's output dirs, the launcher's own dirs and files) and
where a changed file goes (the patch, the list by name, size and sha256, or left out as a secret).
The git side (a real repo, real launches) is in tests/integration/test_code_record_git.py."""
import hashlib
import os
from pathlib import Path

import pytest

from launcher.archive import code, index, tree
from launcher.run.rundir import SweepDir
from launcher.submit import interrupted


def files(root: Path, rels) -> Path:
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x\n")
    return root


@pytest.mark.timeout(60)
def test_every_runs_root_and_output_dir_is_not_code_wherever_it_lies(tmp_path):
    root = files(tmp_path / "repo", [
        "pkg/train.py", "pkg/conf/sweep.json", "README.md",
        "exp/20261205-1-ab/0/checkpoints/step_1/state.pt",      # the configured runs root, named at will
        f"old/{index.DB_NAME}", "old/20261204-1-cd/0/run.json",  # an earlier runs root: its registry
        f"loose/20261203-1-ef/{SweepDir.SEALS}/0.json", "loose/20261203-1-ef/0/metrics.jsonl",  # a sweep dir
        f"inflight/s/{interrupted.JOURNAL}", "inflight/s/code.partial/pkg/train.py",  # a launch under way
        f"copy/code/{tree.INFO_FILE}", "copy/code/pkg/train.py",  # a sweep's code snapshot, copied
        "runs/x/y.pt", "outputs/2026-12-05/10-00-00/.hydra/config.yaml", "multirun/a/0/o.txt",
        "logs/day/.hydra/overrides.yaml", "logs/day/main.log",   # a hydra.run.dir under another name
        ".hydra/config.yaml", "multirun.yaml",                   # hydra.run.dir=. (the tree's top)
        "wandb/run-1/files/x", ".submitit/1/x.pkl", ".slurm-local/x", "pkg/__pycache__/t.pyc"])
    os.symlink(root / "exp" / "20261205-1-ab", root / "pkg" / "last_run")  # a link into the runs root
    left_out = tree.not_code(root, exclude=[root / "exp"])
    code_files = [rel for rel in ["pkg/train.py", "pkg/conf/sweep.json", "README.md"] if not left_out(rel)]
    assert code_files == ["pkg/train.py", "pkg/conf/sweep.json", "README.md"]
    outputs = ["exp/20261205-1-ab/0/checkpoints/step_1/state.pt", f"old/{index.DB_NAME}",
               "old/20261204-1-cd/0/run.json", "loose/20261203-1-ef/0/metrics.jsonl",
               f"inflight/s/{interrupted.JOURNAL}", "inflight/s/code.partial/pkg/train.py",
               "copy/code/pkg/train.py", "runs/x/y.pt", "outputs/2026-12-05/10-00-00/.hydra/config.yaml",
               "multirun/a/0/o.txt", "logs/day/main.log", ".hydra/config.yaml", "multirun.yaml",
               "wandb/run-1/files/x", ".submitit/1/x.pkl", ".slurm-local/x", "pkg/__pycache__/t.pyc",
               "pkg/last_run/0/checkpoints/step_1/state.pt"]
    assert [rel for rel in outputs if not left_out(rel)] == []
    # not named: the configured root is found by nothing but its name (it holds no mark yet)
    assert not tree.not_code(root)("exp/20261205-1-ab/0/checkpoints/step_1/state.pt")


@pytest.mark.timeout(60)
def test_the_trees_top_is_never_an_output_dir(tmp_path):
    """A tree whose top holds a registry (LAUNCHER_RUNS=. at some time) still has code in it."""
    root = files(tmp_path / "repo", [index.DB_NAME, "train.py", "pkg/m.py"])
    left_out = tree.not_code(root)
    assert not left_out("train.py") and not left_out("pkg/m.py")


@pytest.mark.timeout(60)
def test_the_launchers_marks_are_the_names_it_writes():
    assert tree.launcher_marks() == (index.DB_NAME, interrupted.JOURNAL, SweepDir.SEALS,
                                     f"{SweepDir.CODE}/{tree.INFO_FILE}", tree.INFO_FILE)


@pytest.mark.timeout(60)
def test_where_a_changed_file_goes():
    small, big = b"def f():\n    return 1\n", b"x = 1\n" * (code.PATCH_MAX_BYTES // 6 + 1)
    binary = b"\x89PNG\r\n\x1a\n\0\0\0" + bytes(range(256))
    value = "s3cr3t-" + "7" * 20
    known = {"cluster.env.HF_TOKEN": value}
    assert code.classify("pkg/new.py", small, known, tracked=False) == "patch"
    assert code.classify("pkg/t.py", small, known, tracked=True) == "patch"
    assert len(big) > code.PATCH_MAX_BYTES
    assert code.classify("data/big.csv", big, known, tracked=False) == "listed"  # untracked and large
    assert code.classify("data/big.csv", big, known, tracked=True) == "patch"  # a tracked one's diff is its change
    assert code.classify("plot.png", binary, known, tracked=False) == "listed"
    assert code.classify("model.bin", b"abc", known, tracked=True, binary=True) == "listed"  # git says binary
    assert code.classify("gone.bin", None, known, tracked=True, binary=True) == "listed"
    assert code.classify("gone.py", None, known, tracked=True) == "patch"
    assert code.classify("latest", None, known, tracked=False, link=True) == "patch"  # a symlink: its target
    assert code.classify(".env", b"HF_TOKEN=abc\n", known, tracked=False) == "excluded"
    assert code.classify("blob.bin", binary + value.encode(), known, tracked=False) == "excluded"
    # a text file holding a secret stays in the patch: the patch is scrubbed (secrets.scrub)
    assert code.classify("conf/x.yaml", f"token: {value}\n".encode(), known, tracked=False) == "patch"


@pytest.mark.timeout(60)
def test_a_listed_file_is_named_by_size_and_hash():
    data = b"\0" * 1000 + b"tail"
    assert code.listing("ckpt/model.pt", data) == {"path": "ckpt/model.pt", "bytes": 1004,
                                                   "sha256": hashlib.sha256(data).hexdigest()}
    assert code.listing("old.bin", None) == {"path": "old.bin", "deleted": True}
    assert code.is_binary(b"a\0b") and not code.is_binary(b"plain text\n")
    assert not code.is_binary(b"a" * code.BINARY_PROBE + b"\0")  # git's probe: the first 8000 bytes
