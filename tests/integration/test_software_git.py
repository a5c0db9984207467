"""An editable project in a git checkout is recorded as pip records it (``-e git+REMOTE@COMMIT#egg=NAME``,
its subdirectory too): the package record is read in-process (launcher.archive.software), and this is
the one part of it that asks git. Compared with pip's own `pip freeze` of the same install."""
import subprocess
import sys

import pytest

from launcher.archive import software

pytestmark = pytest.mark.timeout(120)


def git(cwd, *args):
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("remote,expected", [
    ("git@example.com:team/tool.git", "ssh://git@example.com/team/tool.git"),
    ("https://example.com/team/tool.git", "https://example.com/team/tool.git"),
])
def test_an_editable_project_in_a_git_checkout_is_its_remote_and_commit(tmp_path, remote, expected):
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "pyproject.toml").write_text("[project]\nname = 'my-tool'\nversion = '0.1'\n")
    git(tmp_path, "init", "-q", str(repo))
    git(repo, "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x")
    git(repo, "remote", "add", "origin", remote)
    commit = git(repo, "rev-parse", "HEAD")
    line = software._editable(str(repo / "pkg"), "my-tool")
    assert line == f"-e git+{expected}@{commit}#egg=my_tool&subdirectory=pkg"
    git(repo, "remote", "remove", "origin")  # no remote: the path, as pip prints it
    assert software._editable(str(repo / "pkg"), "my-tool") == f"-e {repo / 'pkg'}"


def test_the_record_is_pips_own_listing_of_this_environment():
    pip = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True)
    assert software.pip_freeze().splitlines() == [x for x in pip.stdout.splitlines() if not x.startswith("#")]
