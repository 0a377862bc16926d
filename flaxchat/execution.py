"""Run untrusted Python (the model's tool calls) in a separate, fenced-in process.

Layers, outermost first (each one catches what slips past the next):
1. Operating-system isolation where the kernel allows it (`flaxchat.isolation`, probed once per
   process by `isolation()`): mount, pid, network, IPC and UTS namespaces (plus a user namespace when
   not root), a private root holding only the Python install and system libraries read-only, a
   size-capped tmpfs as working folder and another as /tmp, a uid of its own per call as root, and a
   child that dies with its caller. No call sees, writes or signals another or the host's files.
2. A fresh interpreter, started with exec (`subprocess`, never a fork of this threaded JAX
   process), `python -I -S` (no user site, no PYTHON* variables, no site-packages), an empty
   environment (the caller's secrets stay here), its own session/process group so a wall-clock
   timeout kills it and anything it started.
3. Resource limits set in the child before any user code: address space (memory), CPU seconds,
   file size, open files, and no new processes or threads (RLIMIT_NPROC = 0).
4. Without namespaces (`sandbox="best-effort"` only): a throw-away folder on the host, and as root
   the child drops to `nobody` after loading an allow-list of modules (RLIMIT_NPROC is not enforced
   for root); it dies with its caller (PR_SET_PDEATHSIG), but its folder stays if the caller is
   killed -9. `sandbox="strict"` runs no code there, `"off"` never does.
5. Python-level guards (after OpenAI human-eval's `reliability_guard`): dangerous os/shutil
   functions removed, ctypes/socket/subprocess/multiprocessing/... imports refused, `open` confined
   to the working folder (and the private /tmp). These stop honest mistakes and casual attempts; a
   determined program can undo them (e.g. via object introspection), which is why layers 1-4 exist.

Not protected against (docs/inference.md states the threat model): kernel exploits; CPU contention
while it runs (the CPU limit bounds it); without namespaces, an escape from layer 5 reading
world-readable files and writing world-writable folders as the child's user.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from flaxchat import isolation as isolation_launcher

NOBODY = 65534

# Imported before the child drops to `nobody` (who may not be able to read the Python installation,
# e.g. a pyenv under /root): the modules a calculator-style tool call reasonably needs.
PRELOAD = ("math", "cmath", "json", "re", "random", "string", "itertools", "functools", "collections",
           "statistics", "fractions", "decimal", "datetime", "time", "heapq", "bisect", "operator",
           "textwrap", "unicodedata", "ast", "traceback", "io", "typing", "hashlib", "copy")

BLOCKED_MODULES = ("ctypes", "_ctypes", "socket", "_socket", "ssl", "_ssl", "select", "selectors",
                   "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing",
                   "concurrent", "asyncio", "threading", "_thread", "signal", "_signal", "resource",
                   "pty", "fcntl", "mmap", "posix", "pwd", "grp", "shutil", "http", "urllib",
                   "ftplib", "smtplib", "telnetlib", "webbrowser", "importlib", "_imp", "marshal",
                   "pickle", "_pickle", "gc", "sysconfig", "code", "codeop", "pdb")

BLOCKED_OS = ("system", "popen", "fork", "forkpty", "vfork", "kill", "killpg", "abort", "_exit",
              "execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe",
              "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
              "posix_spawn", "posix_spawnp", "remove", "unlink", "rmdir", "removedirs", "rename",
              "renames", "replace", "truncate", "ftruncate", "link", "symlink", "chmod", "fchmod",
              "lchmod", "chown", "fchown", "lchown", "chroot", "chdir", "fchdir", "setuid", "setgid",
              "setsid", "setpgid", "setpgrp", "putenv", "unsetenv", "open", "openpty", "mkfifo",
              "mknod", "plock", "nice", "register_at_fork", "startfile", "fdopen", "dup", "dup2",
              "pipe", "pipe2", "memfd_create", "eventfd", "sched_setaffinity")

# The child's side: runs with `python -I -S -c`, config as argv[1], the user's code on stdin.
_RUNNER = r'''
import ast, json, os, resource, sys
cfg = json.loads(sys.argv[1])
code = sys.stdin.read()
sys.stdin.close()
for name in cfg["preload"]:
    try:
        __import__(name)
    except Exception:
        pass
if cfg["parent"]:
    import ctypes
mem = cfg["memory_bytes"]
for lim, val in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem), (resource.RLIMIT_CORE, 0),
                 (resource.RLIMIT_FSIZE, cfg["file_bytes"]), (resource.RLIMIT_NOFILE, cfg["max_files"]),
                 (resource.RLIMIT_CPU, cfg["cpu_seconds"]), (resource.RLIMIT_NPROC, 0)):
    resource.setrlimit(lim, (val, val))
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])
if cfg["parent"]:  # no namespaces: at least die with the caller (after setuid, which would clear it)
    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    if os.getppid() != cfg["parent"]:
        os._exit(1)
    del ctypes
roots = [os.path.realpath(os.getcwd())] + cfg["open_roots"]
import builtins, io
_real_open = builtins.open
def _open(file, mode="r", *args, **kwargs):
    path = os.path.realpath(os.fspath(file)) if not isinstance(file, int) else None
    if path is None or not any(path == r or path.startswith(r + os.sep) for r in roots):
        raise PermissionError(f"sandbox: only files inside the working folder may be opened, not {file!r}")
    return _real_open(file, mode, *args, **kwargs)
builtins.open = io.open = _open
io.FileIO = None
os.environ.clear()
_exit = os._exit  # kept: the interpreter's own shutdown would trip over the blocked modules
for name in cfg["blocked_os"]:
    if hasattr(os, name):
        setattr(os, name, None)
for name in cfg["blocked_modules"]:
    sys.modules[name] = None
del resource
def _run(code):
    tree = ast.parse(code, "<tool>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    env = {"__name__": "__main__", "__builtins__": builtins}
    exec(compile(tree, "<tool>", "exec"), env)
    if last is not None:  # like a REPL: show the value of a final expression
        value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), env)
        if value is not None:
            print(repr(value))
status = 0
try:
    _run(code)
except BaseException:
    import traceback
    traceback.print_exc(limit=-3)
    status = 1
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except BaseException:
        status = 1
_exit(status)
'''


@dataclasses.dataclass
class ExecutionResult:
    status: str  # ok | error | timeout | memory | output_limit | killed | off
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def summary(self, limit: int = 300) -> str:
        """One short text for a tool's output: stdout when it worked, else what went wrong."""
        if self.status == "ok":
            text = self.stdout.strip()
        elif self.status == "timeout":
            text = f"Error: timed out after {self.seconds:.1f} s"
        elif self.status == "output_limit":
            text = self.stdout.strip() + "\nError: too much output"
        else:
            lines = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
            text = lines[-1] if lines else f"Error: {self.status} (exit code {self.returncode})"
        return text if len(text) <= limit else text[:limit] + "..."


SANDBOX_CHOICES = ("strict", "best-effort", "off")
SANDBOX_HELP = ("the code tool's sandbox: strict (run code only inside OS namespaces; without them only "
                "the calculator), best-effort (without namespaces, run it behind rlimits and Python guards), "
                "off (never run code)")


@dataclasses.dataclass(frozen=True)
class Isolation:
    mode: str | None  # "root" (namespaces, a uid of its own per call) | "user" (a user namespace) | None
    reason: str = ""  # when mode is None: what the kernel refused, one clause per mode tried


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
    """What OS isolation this process can give its calls, learned once by running `print(1)` through
    the launcher in each mode the kernel might allow (~0.1 s): "root" needs CAP_SYS_ADMIN, "user"
    needs unprivileged user namespaces (off in some containers, notebooks and seccomp profiles)."""
    tried = []
    for mode in (["root"] if os.geteuid() == 0 else []) + ["user"]:
        r = _run(_command(mode, _runner_config(mode, 64, 1, 8)), "print(1)", 10.0, 4096, False)
        if r.ok and r.stdout.strip() == "1":
            return Isolation(mode)
        lines = (r.stderr or r.stdout).strip().splitlines()
        why = lines[-1].replace(isolation_launcher.SETUP_FAILED, "").strip() if lines else r.status
        tried.append(f"{mode} mode: {why}")
    return Isolation(None, "; ".join(tried))


def sandbox_command(argv: list[str], mode: str, disk_mb: int = 16, inodes: int = 1024) -> list[str]:
    """The command that runs `argv` (argv[0] an interpreter inside the Python install) in the OS
    sandbox of `flaxchat.isolation`; pure, so tests can run a bare interpreter under it too."""
    return isolation_launcher.command(_EXE, argv, mode, os.getpid(), disk_mb, inodes,
                                      isolation_launcher.bind_sources(sys.base_prefix))


def _runner_config(mode, memory_mb, file_mb, max_files, timeout=5.0) -> dict:
    return dict(preload=PRELOAD, blocked_modules=BLOCKED_MODULES, blocked_os=BLOCKED_OS, uid=NOBODY,
                memory_bytes=memory_mb << 20, file_bytes=file_mb << 20, max_files=max_files,
                cpu_seconds=int(timeout) + 1, parent=0 if mode else os.getpid(),
                open_roots=["/tmp"] if mode else [], disk_mb=2 * file_mb)


def _command(mode: str | None, cfg: dict) -> list[str]:
    if mode is None:
        return [sys.executable, "-I", "-S", "-c", _RUNNER, json.dumps(cfg)]
    return sandbox_command([_EXE, "-I", "-S", "-c", _RUNNER, json.dumps(cfg)], mode, cfg["disk_mb"])


_EXE = os.path.realpath(sys.executable)  # inside the new root only the install is there, not a venv
_told: set[str] = set()
_told_lock = threading.Lock()


def _say_once(text: str) -> None:
    with _told_lock:
        if text in _told:
            return
        _told.add(text)
    print(f"flaxchat: {text}", file=sys.stderr, flush=True)


def execute_code(code: str, *, timeout: float = 5.0, memory_mb: int = 256, max_output: int = 65536,
                 file_mb: int = 16, max_files: int = 64, sandbox: str = "best-effort") -> ExecutionResult:
    """Run `code` in the sandbox; never raises for anything the code does (a `sandbox` not in
    SANDBOX_CHOICES is the caller's mistake: ValueError). "off", and "strict" without namespaces,
    answer status "off" without starting a process; without namespaces the process says once on
    stderr what it lacks. `file_mb` caps each file, and twice that each of /sandbox and /tmp."""
    if sandbox not in SANDBOX_CHOICES:
        raise ValueError(f"sandbox={sandbox!r} is not one of {', '.join(SANDBOX_CHOICES)}")
    if sandbox == "off":
        return ExecutionResult("off", "", "Error: the code tool is off (sandbox off)", None, 0.0)
    iso = isolation()
    if iso.mode is None:
        if sandbox == "strict":
            _say_once(f"the code tool is off: this machine gives no namespaces to contain it ({iso.reason}); "
                      "only the calculator runs (--sandbox=best-effort, or sandbox='best-effort', runs code without "
                      "them, behind rlimits and Python guards only)")
            return ExecutionResult("off", "", "Error: the code tool is off on this machine (no namespaces)",
                                   None, 0.0)
        _say_once(f"the code tool runs without namespaces ({iso.reason}): behind rlimits and Python "
                  "guards only, so code that undoes them can read world-readable files (docs/inference.md)")
    cfg = _runner_config(iso.mode, memory_mb, file_mb, max_files, timeout)
    return _run(_command(iso.mode, cfg), code, timeout, max_output, host_folder=iso.mode is None)


def _run(cmd: list[str], code: str, timeout: float, max_output: int, host_folder: bool) -> ExecutionResult:
    workdir = None
    if host_folder:  # no namespaces: a folder on the host, thrown away after
        workdir = tempfile.mkdtemp(prefix="flaxchat-sandbox-")
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)  # the child runs as nobody and owns only this folder
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, cwd=workdir or "/", env={"LC_ALL": "C.UTF-8"}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as e:
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return ExecutionResult("error", "", f"sandbox could not start: {e}", None, 0.0)
    try:
        try:
            proc.stdin.write(code.encode("utf-8", "replace"))
            proc.stdin.close()
        except BrokenPipeError:
            pass
        out, err, why = _collect(proc, t0 + timeout, max_output)
    finally:
        _kill_group(proc)
        if workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    seconds = time.monotonic() - t0
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    rc = proc.returncode
    if why is None:
        if rc == 0:
            why = "ok"
        elif "MemoryError" in stderr:
            why = "memory"
        elif rc == -signal.SIGXCPU:
            why = "timeout"
        else:
            why = "error" if rc in (1, isolation_launcher.SETUP_EXIT) else "killed"
    return ExecutionResult(why, stdout, stderr, rc, seconds)


def _collect(proc: subprocess.Popen, deadline: float, max_output: int) -> tuple[bytes, bytes, str | None]:
    """Read stdout/stderr until both close, the deadline passes or the output grows too large."""
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    sel = selectors.DefaultSelector()
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ)
    why = None
    try:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                bufs[key.fd] += chunk
            if sum(len(b) for b in bufs.values()) > max_output:
                why = "output_limit"
                break
    finally:
        sel.close()
    out, err = (bytes(bufs[f.fileno()][:max_output]) for f in (proc.stdout, proc.stderr))
    return out, err, why


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (anything it managed to start goes too), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for f in (proc.stdout, proc.stderr):
        try:
            f.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
