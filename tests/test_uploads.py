"""flaxchat.uploads: the one file selection the pod launcher and the Kaggle runner upload."""

import subprocess

import pytest

from flaxchat.errors import UserError
from flaxchat.uploads import is_secret, repo_files, skipped_secrets


def _repo(tmp_path):
    (tmp_path / "pyproject.toml").write_text("[project]\nname='x'\n")
    (tmp_path / "flaxchat").mkdir()
    (tmp_path / "flaxchat" / "a.py").write_text("x = 1\n")
    (tmp_path / ".gitignore").write_text("runs/\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "."], check=True)
    (tmp_path / ".env").write_text("HF_TOKEN=hf_secret\n")
    (tmp_path / "kaggle.json").write_text('{"key": "k"}\n')
    (tmp_path / "notes.txt").write_text("untracked work\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "big.bin").write_bytes(b"0" * 10)
    return tmp_path


def test_tracked_files_only_and_never_secrets(tmp_path):
    root = _repo(tmp_path)
    assert repo_files(root) == [".gitignore", "flaxchat/a.py", "pyproject.toml"]
    with_untracked = repo_files(root, untracked=True)
    assert "notes.txt" in with_untracked
    assert ".env" not in with_untracked and "kaggle.json" not in with_untracked
    assert "runs/big.bin" not in with_untracked  # ignored by .gitignore
    assert skipped_secrets(root) == [".env", "kaggle.json"]


def test_a_tracked_secret_is_still_left_out(tmp_path):
    root = _repo(tmp_path)
    subprocess.run(["git", "-C", str(root), "add", "-f", ".env"], check=True)
    assert ".env" not in repo_files(root)


def test_without_git_a_walk_skips_secrets_and_ignored(tmp_path):
    root = _repo(tmp_path)
    subprocess.run(["rm", "-rf", str(root / ".git")], check=True)
    files = repo_files(root)
    assert "flaxchat/a.py" in files and "notes.txt" in files
    assert ".env" not in files and "kaggle.json" not in files and "runs/big.bin" not in files


@pytest.mark.parametrize("name,secret", [(".env", True), ("prod.env", True), ("kaggle.json", True),
                                         ("id_rsa", True), ("sa-credentials.json", True), ("gpt.py", False),
                                         ("environment.yml", False), ("README.md", False)])
def test_secret_names(name, secret):
    assert is_secret(name) is secret


def test_not_the_repo_is_one_sentence(tmp_path):
    with pytest.raises(UserError, match="not the flaxchat repository"):
        repo_files(tmp_path)
