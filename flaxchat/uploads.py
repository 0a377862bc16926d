"""Which files of the repository go to a remote machine (a TPU pod's workers, a Kaggle kernel).

One selection for every launcher: the files git tracks (`git ls-files --cached`), never untracked
ones unless asked, and never a name that looks like a secret, tracked or not. On Kaggle the
upload lands in `/kaggle/working`, which Kaggle keeps as the notebook's public output; on a pod it
sits on every worker's disk. A `.env` or `kaggle.json` left in the folder must not travel along.
Without git (an unpacked archive), a walk that skips dot-folders, caches and `.gitignore` patterns.
"""

from __future__ import annotations

import os
import subprocess
from fnmatch import fnmatch
from pathlib import Path

from flaxchat.errors import UserError

# Names that are credentials more often than not; matched against the file name and the whole path.
SECRET_PATTERNS = (
    ".env", ".env.*", "*.env", ".envrc", "kaggle.json", ".netrc", ".pypirc", ".git-credentials",
    "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_ed25519*", "id_ecdsa*", "*credentials*.json",
    "*service-account*.json", "*service_account*.json", "application_default_credentials.json",
    "*secret*", "*.token", "token.json", ".htpasswd",
)
SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", ".pytest_cache", ".pixi", "runs", "node_modules"}


def is_secret(rel: str) -> bool:
    name = os.path.basename(rel).lower()
    return any(fnmatch(name, p) for p in SECRET_PATTERNS)


def repo_files(root: str | os.PathLike, untracked: bool = False) -> list[str]:
    """Relative paths of the files to upload from the repository at `root`, sorted.

    `untracked=True` adds files git does not track but does not ignore either (work in progress).
    Secret-looking names are always left out; `skipped_secrets(root)` names them for the user.
    """
    return [f for f in _candidates(root, untracked) if not is_secret(f)]


def skipped_secrets(root: str | os.PathLike, untracked: bool = True) -> list[str]:
    """The secret-looking files in the folder that an upload leaves behind (for the message)."""
    return [f for f in _candidates(root, untracked) if is_secret(f)]


def _candidates(root: str | os.PathLike, untracked: bool) -> list[str]:
    base = Path(root).expanduser().resolve()
    if not base.is_dir():
        raise UserError(f"{root} is not a folder; pass the flaxchat repository's root folder.")
    if not (base / "pyproject.toml").is_file():
        raise UserError(f"{root} is not the flaxchat repository (no pyproject.toml there); pass its root folder.")
    files = _git_files(base, untracked)
    if files is None:
        files = _walk(base)
    return sorted(f for f in set(files) if (base / f).is_file())


def _git_files(base: Path, untracked: bool) -> list[str] | None:
    if not (base / ".git").exists():
        return None
    args = ["git", "-C", str(base), "ls-files", "-z", "--cached"]
    if untracked:
        args += ["--others", "--exclude-standard"]
    try:
        r = subprocess.run(args, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return [n for n in r.stdout.decode().split("\0") if n]


def _walk(base: Path) -> list[str]:
    gitignore = base / ".gitignore"
    patterns = [line.strip().rstrip("/") for line in (gitignore.read_text().splitlines() if gitignore.is_file() else [])
                if line.strip() and not line.startswith(("#", "!"))]

    def ignored(rel: Path) -> bool:
        return any(fnmatch(rel.name, p) or fnmatch(str(rel), p.lstrip("/")) for p in patterns)

    files = []
    for dirpath, dirnames, filenames in os.walk(base):
        rel = Path(dirpath).relative_to(base)
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
                             and not ignored(rel / d))
        files += [str(rel / f) if str(rel) != "." else f for f in filenames if not ignored(rel / f)]
    return files
