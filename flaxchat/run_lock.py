"""One writer per run folder, local or `gs://`: a lock file that names its holder.

    lock = RunLock.acquire(run_dir, log=print0)   # UserError naming the holder if it is alive
    ...train...
    lock.release()                                # also at process exit; a dead holder's is taken over

`<run>/run.lock` holds JSON: host, boot id, pid (and the pid's start time, so a reused pid is not
mistaken for the holder), start time, heartbeat (refreshed every `HEARTBEAT_S` by a daemon thread)
and a token. Who holds it:
  - local disk: an `flock` on the file, which the kernel drops when the holder dies (kill -9
    included), so a dead holder is never waited on; the JSON only names the holder in the refusal.
  - an object store (no locks there): the file itself. Its holder is dead when it ran on this host
    and its pid is gone (or this host booted since), or when its heartbeat is older than `STALE_S`
    (another host, a preempted VM). A new writer writes its own record, waits `SETTLE_S`, and reads
    it back: of two racing writers the object store keeps one, and the other sees that and stops.
Readers (chat, eval, export, a later stage's --base) never take it. In a multi-process job only
process 0 does (`flaxchat.stage.open_checkpoints`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Callable

from flaxchat import paths
from flaxchat.errors import UserError

HEARTBEAT_S = 30.0
STALE_S = 300.0  # ten missed heartbeats: a holder this quiet on another host is gone
SETTLE_S = 2.0  # between writing a remote lock and reading it back (two writers racing)

_held: dict[str, "RunLock"] = {}  # lock path -> the lock this process holds (a stage re-opening its folder)
_held_guard = threading.Lock()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> str:
    """The start time of process `pid` in clock ticks since boot ('' where /proc is not there)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def _pid_alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, under another user
    return not start or not _pid_start(pid) or _pid_start(pid) == start


def describe(record: dict, now: float) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(record.get("started", 0)))
    beat = now - record.get("heartbeat", 0)
    return (f"pid {record.get('pid')} on host {record.get('host')} (started {started}, last heartbeat "
            f"{beat:.0f} s ago)")


def holder_is_dead(record: dict, now: float, host: str, boot: str) -> str | None:
    """Why the holder of `record` is gone (a phrase), or None when it may be alive."""
    if record.get("released"):
        return "it finished"
    if record.get("host") == host:
        if record.get("boot") and boot and record["boot"] != boot:
            return "this host has restarted since"
        if not _pid_alive(int(record.get("pid", -1)), record.get("pid_start", "")):
            return "its process is gone"
        return None
    if now - float(record.get("heartbeat", 0)) > STALE_S:
        return f"its heartbeat stopped over {STALE_S:.0f} s ago"
    return None


class RunLock:
    """The lock of one run folder, held by this process (see the module docstring)."""

    def __init__(self, run_dir: str, now: Callable[[], float] = time.time):
        self.run_dir, self.path, self.now = run_dir, paths.RunFolder(run_dir).lock, now
        self.host, self.boot, self.pid = socket.gethostname(), _boot_id(), os.getpid()
        self.token = uuid.uuid4().hex
        self.started = now()
        self._fd: int | None = None
        self._stop = threading.Event()
        self._io = threading.Lock()  # a heartbeat never writes through a descriptor release() closed
        self._thread: threading.Thread | None = None

    def record(self) -> dict:
        return {"host": self.host, "boot": self.boot, "pid": self.pid, "pid_start": _pid_start(self.pid),
                "started": self.started, "heartbeat": self.now(), "token": self.token}

    def refusal(self, record: dict) -> UserError:
        return UserError(f"the run folder {self.run_dir} is in use by another run: {describe(record, self.now())}; "
                         "wait for it to finish, stop it, or give this run another --run-dir.")

    @classmethod
    def acquire(cls, run_dir: str, log: Callable[[str], None] | None = print,
                now: Callable[[], float] = time.time, heartbeat: bool = True) -> "RunLock":
        """Take the lock of `run_dir` for this process, or raise the UserError naming its holder."""
        lock = cls(run_dir, now)
        with _held_guard:
            if lock.path in _held:
                return _held[lock.path]
            previous = lock._take_local() if not paths.is_remote(lock.path) else lock._take_remote()
            _held[lock.path] = lock
        if previous and log:
            log(f"run folder: took over the lock of {describe(previous[0], now())}: {previous[1]}")
        if heartbeat:
            lock._thread = threading.Thread(target=lock._beat, name="run-lock-heartbeat", daemon=True)
            lock._thread.start()
        return lock

    # --- local disk: flock --------------------------------------------------------------------------

    def _take_local(self) -> tuple[dict, str] | None:
        import fcntl
        path = os.path.abspath(self.path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        for _ in range(10):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                record = _parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                raise self.refusal(record) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file between our open and our flock: open anew
                os.close(fd)
                continue
            previous = _parse(os.pread(fd, 1 << 16, 0))
            self._fd = fd
            self._write_local()
            if previous and not previous.get("released"):
                return previous, "its process is gone"
            return None
        raise UserError(f"cannot take the lock {path}: it keeps being replaced; is another run starting there?")

    def _write_local(self) -> None:
        data = json.dumps(self.record()).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    # --- object store: a lease with a heartbeat -----------------------------------------------------

    def _read_remote(self) -> dict | None:
        try:
            return _parse(paths.read_bytes(self.path))
        except FileNotFoundError:
            return None

    def _take_remote(self) -> tuple[dict, str] | None:
        record = self._read_remote()
        why = None
        if record:
            why = holder_is_dead(record, self.now(), self.host, self.boot)
            if why is None:
                raise self.refusal(record)
        paths.write_json(self.path, self.record())
        time.sleep(SETTLE_S)
        landed = self._read_remote()
        if not landed or landed.get("token") != self.token:
            raise self.refusal(landed or {})
        return (record, why) if record and not record.get("released") else None

    # --- heartbeat and release ------------------------------------------------------------------------

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(Exception):  # a missed beat is retried; STALE_S allows ten
                self.beat()

    def beat(self) -> None:
        """Refresh the heartbeat. On an object store a record that is no longer ours means another
        writer took the folder over: this run stops writing (KeyboardInterrupt in the main thread)."""
        with self._io:  # release() waits for a beat in flight, so a released lock is never written back
            if self._stop.is_set():
                return
            if self._fd is not None:
                self._write_local()
                return
            record = self._read_remote()
            if record is not None and record.get("token") == self.token:
                paths.write_json(self.path, self.record())
                return
            self._stop.set()
        import _thread
        print(f"run folder {self.run_dir}: another run took it over ({describe(record or {}, self.now())}); "
              "this run stops writing there", flush=True)
        _thread.interrupt_main()

    def release(self) -> None:
        """Give the folder up (idempotent): the lock file is removed while still held."""
        with _held_guard:
            if _held.get(self.path) is not self:
                return
            del _held[self.path]
        self._stop.set()
        with self._io:
            fd, self._fd = self._fd, None
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.remove(os.path.abspath(self.path))
                os.close(fd)
                return
            with contextlib.suppress(Exception):
                record = self._read_remote()
                if record and record.get("token") == self.token:
                    paths.remove(self.path)


def _parse(data: bytes) -> dict:
    try:
        record = json.loads(data.decode("utf-8", errors="replace") or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


@atexit.register
def _release_all() -> None:
    for lock in list(_held.values()):
        with contextlib.suppress(Exception):
            lock.release()
