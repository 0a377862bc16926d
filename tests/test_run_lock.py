"""One writer per run folder: a second writer is refused in one sentence naming the first, and the
lock of a dead writer (kill -9, a preempted VM) is taken over, never waited on.

Every writer here is a real process; gs:// is the rehearsal's bucket stand-in (a folder reached
through fsspec, as tests/test_run_folder.py uses it), which has no file locks, so there the lock is
the file and its heartbeat."""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flaxchat import run_lock
from flaxchat.paths import RunFolder

sys.path.insert(0, str(Path(__file__).parent))
from test_run_folder import TINY, Gcs  # noqa: E402

pytestmark = pytest.mark.slow  # end to end: two training processes on one run folder: CI runs it; `-m "not slow"` skips it

# Takes the lock of argv[1] as a stage does (`open_checkpoints`), says so, then holds it.
HOLD = """
import sys, time
from flaxchat.errors import cli_main
from flaxchat.run_lock import RunLock

def main(argv):
    RunLock.acquire(sys.argv[1], log=lambda s: print(s, flush=True))
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    return 0
sys.exit(cli_main(main))
"""


class Writers:
    """Lock holders as processes, on a local folder or on gs:// (the stand-in on their path)."""

    def __init__(self, tmp_path: Path, remote: bool):
        self.gcs = Gcs(tmp_path / "gcs") if remote else None
        self.run_dir = "gs://bk/run" if remote else str(tmp_path / "run")
        self.procs: list[subprocess.Popen] = []

    def env(self) -> dict:
        if self.gcs:
            return self.gcs.env()
        return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    def start(self, hold_s: float = 120) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", HOLD, self.run_dir, str(hold_s)], env=self.env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        lines = []
        deadline = time.time() + 60
        while time.time() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.strip() == "held":
                return p
        p.kill()
        raise AssertionError(f"the writer did not take the lock: {''.join(lines)} {p.stderr.read()[-2000:]}")

    def second(self) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", HOLD, self.run_dir, "0"], env=self.env(), capture_output=True,
                              text=True, timeout=60)

    def lock_record(self) -> dict:
        path = self.gcs.local(RunFolder(self.run_dir).lock) if self.gcs else Path(RunFolder(self.run_dir).lock)
        return json.loads(path.read_text())

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


@pytest.fixture(params=["local", "gs"])
def writers(tmp_path, request):
    w = Writers(tmp_path, remote=request.param == "gs")
    yield w
    w.close()


def test_second_writer_refused_then_dead_writer_taken_over(writers):
    first = writers.start()
    record = writers.lock_record()
    assert record["pid"] == first.pid and record["host"] == socket.gethostname()
    refused = writers.second()
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    err = refused.stderr.strip()
    assert err.count("\n") == 0 and f"in use by another run: pid {first.pid} on host {socket.gethostname()}" in err
    assert "another --run-dir" in err
    assert first.poll() is None  # the first writer is untouched
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    # The lock file is still there, naming a process that is gone: the next writer takes it at once.
    assert writers.lock_record()["pid"] == first.pid
    t0 = time.time()
    taken = writers.second()
    assert taken.returncode == 0, taken.stderr
    assert f"took over the lock of pid {first.pid}" in taken.stdout and "its process is gone" in taken.stdout
    assert time.time() - t0 < 30
    assert not os.path.exists(writers.gcs.local(RunFolder(writers.run_dir).lock) if writers.gcs
                              else RunFolder(writers.run_dir).lock)  # released at exit


def _remote_lock(tmp_path, monkeypatch, record: dict):
    """gs://bk/run in this process, through the stand-in, with `record` as its lock."""
    gcs = Gcs(tmp_path / "gcs")
    for k, v in gcs.env().items():
        monkeypatch.setenv(k, v)
    # The stand-in is this process's gs:// for this test only: fsspec's registry, the import hooks
    # and sys.path are put back at teardown (a later test in this worker sees gs:// as it was).
    registry = importlib.import_module("fsspec.registry")._registry  # fsspec.registry is the mapping's name too
    monkeypatch.syspath_prepend(str(gcs.site))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for protocol in ("gs", "gcs"):
        monkeypatch.setitem(registry, protocol, registry.get(protocol))
    import flaxchat_rehearsal_bucket as bucket
    bucket.install()
    from flaxchat import paths
    monkeypatch.setattr(paths, "_filesystems", {})
    monkeypatch.setattr(run_lock, "SETTLE_S", 0.1)
    lock_path = gcs.local(RunFolder("gs://bk/run").lock)
    lock_path.parent.mkdir(parents=True)
    lock_path.write_text(json.dumps(record))
    return gcs, lock_path


def test_a_preempted_vm_is_recognised_by_its_heartbeat(tmp_path, monkeypatch):
    now = time.time()
    gone = {"host": "vm-preempted", "boot": "x", "pid": 4242, "started": now - 3600, "heartbeat": now - 400,
            "token": "a"}
    gcs, lock_path = _remote_lock(tmp_path, monkeypatch, gone)
    said = []
    lock = run_lock.RunLock.acquire("gs://bk/run", log=said.append, heartbeat=False)
    assert "took over the lock of pid 4242 on host vm-preempted" in said[0] and "heartbeat stopped" in said[0]
    assert json.loads(lock_path.read_text())["token"] == lock.token
    lock.release()
    assert not lock_path.exists()
    # A writer on another host that beat 20 s ago is alive as far as anyone can tell: refused.
    lock_path.write_text(json.dumps({**gone, "heartbeat": time.time() - 20}))
    with pytest.raises(run_lock.UserError, match=r"in use by another run: pid 4242 on host vm-preempted .*last "
                                                 r"heartbeat 2\d s ago"):
        run_lock.RunLock.acquire("gs://bk/run", log=said.append, heartbeat=False)


def test_a_lock_taken_over_stops_the_old_writer_writing(tmp_path, monkeypatch):
    now = time.time()
    gcs, lock_path = _remote_lock(tmp_path, monkeypatch, {})
    lock_path.unlink()
    lock = run_lock.RunLock.acquire("gs://bk/run", log=None, heartbeat=False)
    lock.beat()
    assert json.loads(lock_path.read_text())["heartbeat"] >= now
    lock_path.write_text(json.dumps({"host": "other", "pid": 1, "heartbeat": time.time(), "token": "theirs"}))
    with pytest.raises(KeyboardInterrupt):
        lock.beat()
        time.sleep(5)  # interrupt_main lands here
    lock.release()
    assert json.loads(lock_path.read_text())["token"] == "theirs"  # the new writer's lock is left alone


def test_two_pretrains_on_one_run_dir(tmp_path):
    # The case: both used to exit 0 with "done", each deleting the other's checkpoints.
    run_dir, env = tmp_path / "run", {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                      "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "scripts.pretrain", *TINY, f"--run-dir={run_dir}", "--save-every=1"]
    first = subprocess.Popen([*cmd, "--steps=100000"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        lock = Path(RunFolder(str(run_dir)).lock)
        deadline = time.time() + 240
        while not lock.exists() and first.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        assert lock.exists(), first.stderr.read()[-3000:] if first.poll() is not None else "no lock after 240 s"
        second = subprocess.run([*cmd, "--steps=2", "--fresh"], env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"in use by another run: pid {first.pid} on host" in second.stderr
        assert first.poll() is None
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        third = subprocess.run([*cmd, "--steps=2"], env=env, capture_output=True, text=True, timeout=300)
        assert third.returncode == 0, third.stderr[-3000:]
        assert f"took over the lock of pid {first.pid}" in third.stdout + third.stderr
        assert not lock.exists()
    finally:
        if first.poll() is None:
            first.kill()
        first.wait(timeout=30)
