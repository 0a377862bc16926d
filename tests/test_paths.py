"""The filesystem layer: local paths, gs:// errors that say what to do, remote paths through fsspec."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from flaxchat import paths
from flaxchat.errors import UserError
from support import tiny_flags


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


# --- the run folder's writers go through the layer ----------------------------------------------


@pytest.fixture
def memory_run(monkeypatch):
    """A fresh `memory://` run folder: fsspec's in-process filesystem, a non-local scheme that
    needs no network, so a writer that bypassed the layer would write a local 'memory:' folder."""
    monkeypatch.setattr(paths, "_filesystems", {})
    fs = MemoryFileSystem()
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    yield "memory://bucket/run", fs
    fs.store.clear()


@pytest.mark.timeout(60)
def test_run_folder_writers_through_memory_fs(memory_run, tmp_path, monkeypatch):
    from flaxchat.report import MetricsLog, plot_losses, write_json, write_report
    run, fs = memory_run
    monkeypatch.chdir(tmp_path)
    paths.check_writable(run)
    write_json(paths.join(run, "config.json"), {"depth": 4, "train": {"steps": 2}})
    paths.write_text(paths.join(run, "samples.txt"), "Once upon a time\n")
    clock = [0.0]
    log = MetricsLog(paths.join(run, "metrics.jsonl"), flush_every_s=10, clock=lambda: clock[0])
    log.append(kind="train", step=1, loss=3.0)  # the first line is uploaded at once
    assert fs.cat_file("/bucket/run/metrics.jsonl").count(b"\n") == 1
    log.append(kind="train", step=2, loss=2.5)  # then at most every 10 s: an object is rewritten whole
    assert fs.cat_file("/bucket/run/metrics.jsonl").count(b"\n") == 1
    clock[0] = 11.0
    log.append(kind="val", step=2, val_bpb=1.9)
    assert fs.cat_file("/bucket/run/metrics.jsonl").count(b"\n") == 3
    log.append(kind="train", step=3, loss=2.0)
    entries = log.read()  # flushes first
    assert [e["step"] for e in entries] == [1, 2, 2, 3]
    resumed = MetricsLog(paths.join(run, "metrics.jsonl"))  # a resumed run keeps what was there
    resumed.append(kind="train", step=4, loss=1.8)
    assert [e["step"] for e in resumed.read()] == [1, 2, 2, 3, 4]
    assert plot_losses(entries, paths.join(run, "loss.png"), "t") == "memory://bucket/run/loss.png"
    write_report(paths.join(run, "report.md"), title="r", sections=[("Run", {"steps": 2}), ("Samples", ["a"])])

    assert json.loads(fs.cat_file("/bucket/run/config.json")) == {"depth": 4, "train": {"steps": 2}}
    assert fs.cat_file("/bucket/run/samples.txt") == b"Once upon a time\n"
    assert fs.cat_file("/bucket/run/loss.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"| steps | 2 |" in fs.cat_file("/bucket/run/report.md")
    assert paths.read_text(paths.join(run, "report.md")).startswith("# r\n")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.find("/bucket/run")) == [
        "config.json", "loss.png", "metrics.jsonl", "report.md", "samples.txt"]  # no probe, no temp file left
    assert list(tmp_path.iterdir()) == []  # nothing written locally


@pytest.mark.timeout(30)
def test_local_writers_are_atomic_and_unchanged(tmp_path):
    from flaxchat.report import MetricsLog, write_json
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    log.append(kind="train", step=1, loss=3.0)
    log.append(kind="train", step=2, loss=2.0)
    log.append(kind="train", step=2, loss=1.9)  # a resumed run logs a step again: the last one counts
    assert [(e["step"], e["loss"]) for e in log.read()] == [(1, 3.0), (2, 1.9)]
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3  # appended locally, not rewritten
    write_json(str(tmp_path / "COMPLETE"), {"step": 2})
    assert json.loads((tmp_path / "COMPLETE").read_text()) == {"step": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["COMPLETE", "metrics.jsonl"]
    paths.remove(str(tmp_path / "COMPLETE"))
    paths.remove(str(tmp_path / "COMPLETE"))  # a missing file is fine
    assert paths.absolute("runs/x") == os.path.abspath("runs/x") and paths.absolute("gs://b/x") == "gs://b/x"


@pytest.mark.timeout(30)
def test_local_copy_mirrors_a_remote_folder(memory_run):
    run, fs = memory_run
    tok = paths.join(run, "tokenizer")
    with paths.local_copy(tok) as local:  # empty remote folder: an empty local one
        assert os.listdir(local) == []
        with open(os.path.join(local, "tokenizer.json"), "w") as f:
            f.write("{}")
    assert not os.path.exists(local)  # the temporary copy is gone
    assert fs.cat_file("/bucket/run/tokenizer/tokenizer.json") == b"{}"
    with paths.local_copy(tok, upload=False) as local:
        assert open(os.path.join(local, "tokenizer.json")).read() == "{}"
        with open(os.path.join(local, "tokenizer.json"), "w") as f:
            f.write("changed")
    assert fs.cat_file("/bucket/run/tokenizer/tokenizer.json") == b"{}"  # upload=False: nothing goes back
    with pytest.raises(RuntimeError):
        with paths.local_copy(tok) as local:
            open(os.path.join(local, "half.json"), "w").write("{")
            raise RuntimeError("training the tokenizer failed")
    assert not fs.exists("/bucket/run/tokenizer/half.json")  # a failed block uploads nothing


@pytest.mark.timeout(30)
def test_fresh_sets_remote_checkpoints_aside(memory_run):
    from flaxchat.checkpoint import set_aside
    run, fs = memory_run
    assert set_aside(paths.join(run, "checkpoints")) is None
    fs.pipe_file("/bucket/run/checkpoints/5/meta/metadata", b"{}")
    moved = set_aside(paths.join(run, "checkpoints"))
    assert moved.startswith("memory://bucket/run/checkpoints.old-")
    assert fs.cat_file(moved.split("://")[1] + "/5/meta/metadata") == b"{}"
    assert not fs.exists("/bucket/run/checkpoints/5/meta/metadata")


@pytest.mark.timeout(30)
def test_check_writable_says_why(tmp_path, monkeypatch):
    paths.check_writable(str(tmp_path / "new" / "run"))
    assert os.listdir(tmp_path / "new" / "run") == []  # the probe is removed
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match=r"cannot write to the run folder .*afile/run \(.*\); pick a folder"):
        paths.check_writable(str(tmp_path / "afile" / "run"))
    _register(monkeypatch, AnonGCS)
    with pytest.raises(UserError, match="gcsfs found no Google Cloud credentials"):
        paths.check_writable("gs://bucket/run")

    class ReadOnlyGCS(MemoryFileSystem):
        protocol = ("gs",)
        cachable = False

        def pipe_file(self, path, value, **kwargs):
            raise PermissionError("403 caller does not have storage.objects.create access")

    _register(monkeypatch, ReadOnlyGCS)
    with pytest.raises(UserError, match=r"cannot write gs://bucket/run/.flaxchat-probe-\w+ \(PermissionError: 403 .*\); "
                                        r"check the path and that your credentials may write there"):
        paths.check_writable("gs://bucket/run")


# --- through scripts.pretrain --------------------------------------------------------------------

TINY = tiny_flags(total_batch_size=64, max_chars_tokenizer=100_000, eval_every=0, sample_every=0)


def _pretrain(argv, capsys):
    from flaxchat.errors import cli_main
    from scripts import pretrain
    code = cli_main(pretrain.main, argv)
    return code, capsys.readouterr()


def _one_sentence(cap):
    assert "Traceback" not in cap.err and len(cap.err.strip().splitlines()) == 1, cap.err
    return cap.err


@pytest.mark.timeout(300)
def test_pretrain_writes_its_run_folder_through_the_layer(memory_run, tmp_path, monkeypatch, capsys):
    """Everything but the checkpoints (Orbax's own gs:// support; it knows no memory://, so they
    go to a local folder here) lands in the memory:// run folder; nothing is written locally."""
    from flaxchat import checkpoint
    run, fs = memory_run
    local_ckpt = tmp_path / "ckpt"

    class LocalCheckpointer(checkpoint.Checkpointer):
        def __init__(self, directory, **kwargs):
            assert directory == run + "/checkpoints"
            super().__init__(str(local_ckpt), **kwargs)

    monkeypatch.setattr(checkpoint, "Checkpointer", LocalCheckpointer)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    code, cap = _pretrain([*TINY, f"--run-dir={run}", "--steps=2"], capsys)
    assert code == 0, cap.err
    assert jax.sharding.get_mesh().empty  # the run's mesh is undone: the next stage in this process starts clean
    names = sorted(p[len("/bucket/run/"):] for p in fs.find("/bucket/run"))
    assert names == ["COMPLETE", "config.json", "loss.png", "metrics.jsonl", "report.md", "samples.txt",
                     "tokenizer/tokenizer.json"], names
    assert json.loads(fs.cat_file("/bucket/run/COMPLETE"))["run_dir"] == run
    assert json.loads(fs.cat_file("/bucket/run/config.json"))["steps"] == 2
    assert [json.loads(l)["step"] for l in fs.cat_file("/bucket/run/metrics.jsonl").splitlines()] == [1, 2]
    assert "![loss](loss.png)" in fs.cat_file("/bucket/run/report.md").decode()
    assert list(work.iterdir()) == []  # no local 'memory:' folder: every writer went through the layer
    assert (local_ckpt / "2").is_dir()
    # A second run loads the tokenizer the first one uploaded, and resumes from its checkpoint.
    code, cap = _pretrain([*TINY, f"--run-dir={run}", "--steps=3"], capsys)
    assert code == 0, cap.err
    assert "training a 300-token tokenizer" not in cap.out and "resumed from step 2" in cap.out
    assert [json.loads(l)["step"] for l in fs.cat_file("/bucket/run/metrics.jsonl").splitlines()] == [1, 2, 3]


@pytest.mark.timeout(60)
def test_pretrain_gs_run_dir_without_gcsfs_or_credentials_stops_first(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(paths, "_filesystems", {})
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if not installed
    code, cap = _pretrain(["--run-dir=gs://bucket/run", "--steps=1"], capsys)
    assert code == 2 and "pip install gcsfs" in _one_sentence(cap)
    assert cap.out == ""  # before anything else: no device set up, no tokenizer trained
    _register(monkeypatch, AnonGCS)
    code, cap = _pretrain(["--run-dir=gs://bucket/run", "--steps=1"], capsys)
    assert code == 2 and "no Google Cloud credentials" in _one_sentence(cap) and cap.out == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(120)
def test_pretrain_empty_shard_folder_is_one_sentence(memory_run, capsys, tmp_path):
    (tmp_path / "shards").mkdir()
    code, cap = _pretrain([f"--data={tmp_path / 'shards'}", "--steps=1", f"--run-dir={tmp_path / 'r'}"], capsys)
    assert code == 2 and "no .txt/.jsonl/.parquet files match" in _one_sentence(cap)
    code, cap = _pretrain(["--data=memory://bucket/shards/", "--steps=1", f"--run-dir={tmp_path / 'r'}"], capsys)
    assert code == 2 and "no parquet shards in memory://bucket/shards/" in _one_sentence(cap)
