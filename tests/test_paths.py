"""The filesystem layer: local paths, gs:// errors that say what to do, remote paths through fsspec."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from flaxchat import paths
from flaxchat.errors import UserError


@pytest.mark.timeout(10)
def test_schemes():
    assert paths.scheme("gs://b/x") == "gs" and paths.is_remote("gs://b/x") and paths.is_remote("S3://b")
    for local in ("/tmp/x", "runs/a", "file:///tmp/x", "C:/x", "weird/a://b", "~/data"):
        assert not paths.is_remote(local), local
    assert paths.join("gs://b/runs/", "/ckpt", "meta.json") == "gs://b/runs/ckpt/meta.json"
    assert paths.join("runs", "ckpt") == "runs/ckpt"


@pytest.mark.timeout(10)
def test_local_operations(tmp_path):
    base = str(tmp_path / "run")
    paths.makedirs(paths.join(base, "a", "b"))
    paths.makedirs(paths.join(base, "a", "b"))  # twice is fine
    with paths.open_file(paths.join(base, "a", "b", "x.json"), "w") as f:
        f.write("{}")
    with paths.open_file(paths.join(base, "top.bin"), "wb") as f:
        f.write(b"\x00\x01")
    with paths.open_file("file://" + paths.join(base, "top.bin")) as f:
        assert f.read() == b"\x00\x01"
    assert paths.exists(base) and paths.isdir(base) and not paths.isdir(paths.join(base, "top.bin"))
    assert not paths.exists(paths.join(base, "nope"))
    assert paths.listdir(base) == [paths.join(base, "top.bin")]  # files only
    assert paths.listdir(base, recursive=True) == [paths.join(base, "a", "b", "x.json"), paths.join(base, "top.bin")]
    assert paths.glob(paths.join(base, "**", "*.json")) == [paths.join(base, "a", "b", "x.json")]


@pytest.mark.timeout(20)
def test_gs_without_gcsfs_says_what_to_install(monkeypatch):
    monkeypatch.setattr(paths, "_filesystems", {})
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed, even where it is
    for call in (lambda: paths.exists("gs://bucket/run"), lambda: paths.open_file("gs://bucket/x.json", "w"),
                 lambda: paths.makedirs("gs://bucket/run")):
        with pytest.raises(UserError, match=r"gs:// paths needs an extra package \(pip install gcsfs\) "
                                            r"and Google Cloud credentials \(run `gcloud auth"):
            call()
    with pytest.raises(UserError, match="'nosuchscheme://' is not a storage scheme"):
        paths.exists("nosuchscheme://x/y")


@pytest.mark.timeout(60)
def test_gs_error_is_one_line_and_a_nonzero_exit(tmp_path):
    """Through a real entry point: no traceback, exit status 2 (what `cli_main` gives a UserError)."""
    code = ("import sys; sys.modules['gcsfs'] = None\n"
            "from flaxchat.errors import cli_main\n"
            "from flaxchat.data.sources import resolve_source\n"
            "sys.exit(cli_main(lambda argv: resolve_source('gs://bucket/fineweb/')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, cwd=tmp_path,
                         env={"PYTHONPATH": str(Path(__file__).parents[1]), "PATH": ""})
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and "gcsfs" in out.stderr


class _Creds:
    method = "anon"


class AnonGCS(MemoryFileSystem):
    """Like gcsfs when it finds no credentials: it falls back to anonymous access."""

    protocol = ("gs",)
    cachable = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.credentials = _Creds()


class HangingGCS(MemoryFileSystem):
    """Like google-auth probing a metadata server that never answers."""

    protocol = ("gs",)
    cachable = False
    release = threading.Event()

    def __init__(self, *args, **kwargs):
        self.release.wait(30)
        super().__init__(*args, **kwargs)


class DeniedGCS(MemoryFileSystem):
    protocol = ("gs",)
    cachable = False
    store: dict = {}

    def ls(self, path, detail=True, **kwargs):
        raise PermissionError("403 caller does not have storage.objects.list access\nmore detail")


def _register(monkeypatch, cls):
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", cls)
    monkeypatch.setattr(paths, "_filesystems", {})


@pytest.mark.timeout(20)
def test_gs_without_credentials_or_answer(monkeypatch):
    _register(monkeypatch, AnonGCS)
    with pytest.raises(UserError, match="gcsfs found no Google Cloud credentials.*GOOGLE_APPLICATION_CREDENTIALS"):
        paths.listdir("gs://bucket/shards")
    _register(monkeypatch, HangingGCS)
    monkeypatch.setattr(paths, "REMOTE_TIMEOUT_S", 0.5)
    t0 = time.perf_counter()
    try:
        with pytest.raises(UserError, match=r"connecting to gs:// got no answer within 0.5 s; check the network"):
            paths.exists("gs://bucket/x")
        assert time.perf_counter() - t0 < 5
    finally:
        HangingGCS.release.set()
    _register(monkeypatch, DeniedGCS)
    with pytest.raises(UserError, match=r"cannot list gs://bucket/private \(PermissionError: 403 caller does "
                                        r"not have storage.objects.list access\); check the path"):
        paths.listdir("gs://bucket/private")


@pytest.mark.timeout(20)
def test_remote_operations_through_fsspec(monkeypatch):
    class FakeGCS(MemoryFileSystem):
        protocol = ("gs",)
        cachable = False
        store: dict = {}
        pseudo_dirs = [""]

    _register(monkeypatch, FakeGCS)
    paths.makedirs("gs://bucket/run")  # nothing to create on an object store
    for name in ("run/config.json", "run/ckpt/meta.json", "run/ckpt/data.bin"):
        with paths.open_file(f"gs://bucket/{name}", "w") as f:
            f.write(name)
    with paths.open_file("gs://bucket/run/config.json") as f:
        assert f.read() == b"run/config.json"
    assert paths.exists("gs://bucket/run/config.json") and not paths.exists("gs://bucket/run/none.json")
    assert paths.isdir("gs://bucket/run/ckpt")
    assert paths.listdir("gs://bucket/run") == ["gs://bucket/run/config.json"]
    assert paths.listdir("gs://bucket/run", recursive=True) == [
        "gs://bucket/run/ckpt/data.bin", "gs://bucket/run/ckpt/meta.json", "gs://bucket/run/config.json"]
    assert paths.glob("gs://bucket/**/*.json") == ["gs://bucket/run/ckpt/meta.json", "gs://bucket/run/config.json"]
    assert paths.listdir("gs://bucket/missing", recursive=True) == []
