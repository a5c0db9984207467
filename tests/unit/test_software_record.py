"""The run's record of installed distributions (env/pip-freeze.txt) is read from their metadata in the
launching interpreter, in `pip freeze --all`'s format: tried on a fabricated site dir holding each kind
of install (tests/integration/test_local_launch.py compares a real environment's with pip's own)."""
import json
from pathlib import Path

from launcher.archive import software


def dist(site: Path, folder: str, name: str, version: str, direct=None) -> None:
    d = site / folder
    d.mkdir(parents=True)
    (d / "METADATA" if folder.endswith(".dist-info") else d / "PKG-INFO").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if direct is not None:
        (d / "direct_url.json").write_text(json.dumps(direct))


def test_each_kind_of_install_in_pips_format_sorted_by_name(tmp_path):
    site = tmp_path / "site"
    dist(site, "Zeta_Pkg-2.0.dist-info", "Zeta_Pkg", "2.0")
    dist(site, "alpha-1.0.dist-info", "alpha", "1.0")
    dist(site, "wheelish-3.1.dist-info", "wheelish", "3.1", {"url": "file:///w/wheelish-3.1-py3-none-any.whl",
                                                             "archive_info": {}})
    dist(site, "tool-0.4.dist-info", "tool", "0.4", {"url": "https://github.com/o/tool",
                                                     "vcs_info": {"vcs": "git", "commit_id": "abc123"}})
    dist(site, "mine-0.1.dist-info", "mine", "0.1", {"url": "file:///home/u/mine", "dir_info": {"editable": True}})
    # a legacy editable install: the egg-info lies in the project, beside its setup.py
    project = tmp_path / "legacy"
    dist(project, "legacy.egg-info", "legacy", "0.2")
    (project / "setup.py").write_text("")
    # the same distribution twice on the path: the first one, as an import would find it
    dist(tmp_path / "later", "alpha-0.9.dist-info", "alpha", "0.9")
    out = software.pip_freeze([str(site), str(project), str(tmp_path / "later")])
    assert out.splitlines() == [
        "alpha==1.0",
        f"-e {project.resolve()}",
        "-e /home/u/mine",
        "tool @ git+https://github.com/o/tool@abc123",
        "wheelish @ file:///w/wheelish-3.1-py3-none-any.whl",
        "Zeta_Pkg==2.0",
    ]


def test_an_unreadable_record_is_said_and_the_launch_goes_on(tmp_path):
    site = tmp_path / "site"
    dist(site, "bad-1.0.dist-info", "bad", "1.0")
    (site / "bad-1.0.dist-info" / "direct_url.json").write_text("{not json")
    assert software.pip_freeze([str(site)]) == "bad==1.0\n"  # a broken direct_url.json: the plain line
    assert software.pip_freeze([str(tmp_path / "none")]) == ""


def test_name_and_version_come_from_the_header_block_alone(tmp_path):
    """The description after the header's blank line may hold header-like lines (a README quoting one);
    a file written with CRLF reads the same."""
    site = tmp_path / "site"
    d = site / "real-1.2.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_bytes(b"Metadata-Version: 2.1\r\nName: Real_Name\r\nVersion: 1.2 \r\nSummary: x\r\n\r\n"
                                 b"Name: impostor\nVersion: 9.9\n" + b"long description\n" * 5000)
    e = site / "noname-1.0.dist-info"
    e.mkdir()
    (e / "METADATA").write_text("Metadata-Version: 2.1\nVersion: 1.0\n\nName: impostor\n")
    assert software.pip_freeze([str(site)]) == "Real_Name==1.2\n"  # (one with no Name is no distribution)
