"""KaggleRunner: train flaxchat on a Kaggle notebook's accelerators from your own machine.

    from flaxchat.remote import KaggleRunner
    runner = KaggleRunner("https://kkb-production.jupyter-proxy.kaggle.net/k/.../proxy")
    runner.setup()                             # upload this repo, pip install it on the kernel
    runner.check_devices()                     # {'backend': 'gpu', 'device_count': 2, ...}
    runner.run("print(1 + 1)")                 # Python on the kernel, output streamed back
    runner.run_pipeline(depth=8, steps=5000)   # training starts detached on the kernel
    runner.wait()                              # follow its log until it exits
    runner.download(local_path="run")          # fetch the run folder (checkpoint, log)

Any Jupyter server works (the tests use a local one). The work on the kernel is done by small
snippets below (`_K_*`): each is a function `_flaxchat_main(params)` whose JSON return value
comes back in a display_data bundle of its own type, so the runner never parses printed text. Files live under
`flaxchat_remote/` in the server's root folder (`/kaggle/working` on Kaggle): `src/` (the
uploaded repo), `setup.json` (what is installed), `runs/<name>/` (log.txt, exit_code, the run).

Command line: `python -m flaxchat.remote.kaggle URL --run CODE` (see --help).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Mapping, Sequence

from flaxchat.errors import UserError, cli_main
from flaxchat.remote.base import (OutputCallback, RemoteConnectionError, RemoteError, RemoteRunner, RemoteTimeout,
                                  RunResult, RunStatus)
from flaxchat.remote.jupyter import (RESULT_MIME, JupyterREST, KernelConnection, execute,
                                     parse_server_url, print_output)

TOKEN_ENV = "KAGGLE_JUPYTER_TOKEN"

# --------------------------------------------------------------------------------------------
# Kernel-side snippets. They run inside the notebook's Python; keep them self-contained.

_K_ALIVE = '''
def _flaxchat_alive(pid):
    import os
    proc = globals().get("_flaxchat_jobs", {}).get(pid)
    if proc is not None:
        return proc.poll() is None  # poll() also reaps it, so it never lingers as a zombie
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # exited but not reaped (its parent kernel restarted): state Z
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True
'''

_K_FIND_ROOT = '''
def _flaxchat_main(p):
    import os
    d = os.getcwd()
    for _ in range(16):
        f = os.path.join(d, p["marker"])
        if os.path.isfile(f) and open(f).read().strip() == p["nonce"]:
            os.remove(f)
            return {"root": d}
        if os.path.dirname(d) == d:
            break
        d = os.path.dirname(d)
    raise RuntimeError(f"the kernel does not see its server's files from its folder {os.getcwd()} (it may run "
                       "on another machine), so setup() and run_pipeline() cannot work with this kernel")
'''

_K_SETUP = '''
def _flaxchat_main(p):
    import hashlib, importlib, json, os, site, subprocess, sys, sysconfig, tarfile
    tar, src = os.path.join(p["root"], p["tar"]), os.path.join(p["root"], p["src"])
    with open(tar, "rb") as f:
        if hashlib.sha256(f.read()).hexdigest() != p["sha256"]:
            raise RuntimeError("the uploaded archive arrived damaged (checksum mismatch); run setup() again")
    os.makedirs(src, exist_ok=True)
    with tarfile.open(tar) as t:
        t.extractall(src, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    os.remove(tar)
    if p["install"] == "pip":
        cmd = [sys.executable, "-m", "pip", "install", "--no-input", "--disable-pip-version-check", "-e", src]
        cmd += ([] if p["deps"] else ["--no-deps"]) + p["pip_args"]
        print("$ pip install " + " ".join(cmd[6:]), flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            print(line, end="", flush=True)
        if proc.wait() != 0:
            raise RuntimeError(f"pip install failed with exit code {proc.returncode} (its output is above)")
    else:  # "path": what an editable install amounts to, for kernels that already have the dependencies
        site_dir = sysconfig.get_paths()["purelib"]
        if not os.access(site_dir, os.W_OK):
            site_dir = site.getusersitepackages()
            os.makedirs(site_dir, exist_ok=True)
        with open(os.path.join(site_dir, "flaxchat-src.pth"), "w") as f:
            f.write(src + "\\n")
    # The running kernel read its .pth files at start: make the new code importable here too.
    if src not in sys.path:
        sys.path.insert(0, src)
    for name in [m for m in sys.modules if m == "flaxchat" or m.startswith("flaxchat.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    marker = dict(p["want"], src=src, python=sys.executable)
    with open(os.path.join(p["root"], p["marker"]) + ".tmp", "w") as f:
        json.dump(marker, f)
    os.replace(os.path.join(p["root"], p["marker"]) + ".tmp", os.path.join(p["root"], p["marker"]))
    return marker
'''

_K_IMPORT_CHECK = '''
def _flaxchat_main(p):
    import os, subprocess, sys, tempfile
    if not os.path.isdir(p["src"]):
        return {"ok": False}
    code = "import os, flaxchat; print(os.path.realpath(flaxchat.__file__))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())
    ok = r.returncode == 0 and r.stdout.strip().startswith(os.path.realpath(p["src"]))
    if ok and p["src"] not in sys.path:
        sys.path.insert(0, p["src"])
    return {"ok": ok}
'''

# JAX runs in a child process: imported in the kernel itself it would keep the accelerator (and
# 75% of GPU memory) for the kernel's lifetime, and the training process could not get it.
_K_PROBE = '''
def _flaxchat_main(p):
    import json, subprocess, sys
    code = ("import json, jax; d = jax.devices(); print(json.dumps({'backend': jax.default_backend(), "
            "'device_count': jax.device_count(), 'process_count': jax.process_count(), "
            "'device_kind': d[0].device_kind}))")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=p["probe_timeout"])
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the JAX probe did not finish within {p['probe_timeout']} s") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the JAX probe failed ({last}); is JAX installed there (runner.setup())?")
    return json.loads(r.stdout.strip().splitlines()[-1])
'''

# The wrapper owns the exit code: wait() reads it from a file, never guesses from the log.
_WRAPPER = '''
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda *a: None)  # stop() signals the group: let the child go first, then record
rc = subprocess.call(sys.argv[2:])
print(f"[flaxchat] the job exited with code {rc}", flush=True)
with open(os.path.join(sys.argv[1], "exit_code.tmp"), "w") as f:
    f.write(str(rc))
os.replace(os.path.join(sys.argv[1], "exit_code.tmp"), os.path.join(sys.argv[1], "exit_code"))
'''

_K_LAUNCH = _K_ALIVE + '''
def _flaxchat_main(p):
    import json, os, subprocess, sys, time
    if os.path.exists(p["latest"]):
        with open(p["latest"]) as f:
            prev = json.load(f)
        if not os.path.exists(os.path.join(prev["path"], "exit_code")) and _flaxchat_alive(prev["pid"]):
            raise RuntimeError(f"job {prev['name']} (pid {prev['pid']}) is still running on the kernel; "
                               "wait() for it or stop() it first")
    if p["need_src"] and not os.path.isdir(p["cwd"]):
        raise RuntimeError("flaxchat is not set up on this kernel; run runner.setup() first")
    if os.path.exists(p["path"]):
        raise RuntimeError(f"a run named {p['name']} exists already on the kernel; pick another name")
    os.makedirs(p["path"])
    cwd = p["cwd"] if os.path.isdir(p["cwd"]) else p["root"]
    with open(os.path.join(p["path"], "log.txt"), "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", p["wrapper"], p["path"], sys.executable, *p["argv"]],
                                cwd=cwd, env=dict(os.environ, **p["env"]), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    globals().setdefault("_flaxchat_jobs", {})[proc.pid] = proc
    job = {"name": p["name"], "remote_dir": p["remote_dir"], "path": p["path"], "pid": proc.pid,
           "argv": p["argv"], "started": time.time()}
    for target in (os.path.join(p["path"], "job.json"), p["latest"]):
        with open(target + ".tmp", "w") as f:
            json.dump(job, f)
        os.replace(target + ".tmp", target)
    return job
'''

_K_POLL = _K_ALIVE + '''
def _flaxchat_main(p):
    import os
    def exit_code():
        try:
            with open(os.path.join(p["path"], "exit_code")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None
    code = exit_code()  # first: once it exists, the log is complete
    with open(os.path.join(p["path"], "log.txt"), "rb") as f:
        f.seek(p["offset"])
        data = f.read(p["max_bytes"])
    more = len(data) == p["max_bytes"]
    alive = code is None and _flaxchat_alive(p["pid"])
    if code is None and not alive:  # it ended after the log was read: read again for the tail
        code, more = exit_code(), more or len(data) > 0
    if alive and not more:
        data = data[:data.rfind(b"\\n") + 1]  # whole lines only while it still writes
    return {"text": data.decode("utf-8", "replace"), "offset": p["offset"] + len(data), "exit_code": code,
            "alive": alive, "more": more}
'''

_K_KILL = _K_ALIVE + '''
def _flaxchat_main(p):
    import os, signal, time
    done = os.path.join(p["path"], "exit_code")
    if os.path.exists(done) or not _flaxchat_alive(p["pid"]):
        return {"stopped": False}
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(p["pid"], sig)  # the job is its own session: this reaches the trainer too
        except ProcessLookupError:
            break
        t0 = time.time()
        while time.time() - t0 < grace and _flaxchat_alive(p["pid"]):
            time.sleep(0.1)
        if not _flaxchat_alive(p["pid"]):
            break
    if not os.path.exists(done):
        with open(done, "w") as f:
            f.write(str(-int(sig)))
    return {"stopped": True}
'''


def _kernel_code(snippet: str, params: Mapping[str, Any]) -> str:
    value = f"__import__('json').dumps(_flaxchat_main(__import__('json').loads({json.dumps(json.dumps(params))})))"
    return snippet + f"\n__import__('IPython.display').display.display({{{RESULT_MIME!r}: {value}}}, raw=True)"


# --------------------------------------------------------------------------------------------
# Pure helpers: what to upload, what to run


def repo_files(path: str | os.PathLike) -> list[str]:
    """The repository's files to upload: git's tracked and untracked-but-not-ignored files, or a
    walk that skips dot-folders, __pycache__ and simple .gitignore patterns when it is no git repo."""
    root = Path(path).resolve()
    if not (root / "pyproject.toml").is_file():
        raise UserError(f"{path} is not the flaxchat repository (no pyproject.toml there); pass its root folder.")
    if (root / ".git").exists():
        r = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, timeout=60)
        if r.returncode == 0:
            return sorted({n for n in r.stdout.decode().split("\0") if n and (root / n).is_file()})
    ignore = [line.strip().rstrip("/") for line in _read_lines(root / ".gitignore") if line.strip()
              and not line.startswith(("#", "!"))]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__"
                             and not _ignored(rel / d, ignore))
        files += [str(rel / f) if str(rel) != "." else f for f in filenames if not _ignored(rel / f, ignore)]
    return sorted(files)


def _read_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def _ignored(rel: Path, patterns: list[str]) -> bool:
    return any(fnmatch(rel.name, p) or fnmatch(str(rel), p.lstrip("/")) for p in patterns)


def build_archive(root: str | os.PathLike, files: Sequence[str]) -> tuple[bytes, str]:
    """A .tar.gz of `files` and a digest of their names and contents (not their times), so an
    unchanged repo is recognised. Real mtimes go in the archive: Python's .pyc cache trusts them."""
    root, digest, buf = Path(root), hashlib.sha256(), io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name in files:
            path = root / name
            data = path.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode() + data)
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), digest.hexdigest()


def pipeline_argv(depth: int, steps: int, run_dir: str, flags: Mapping[str, Any]) -> list[str]:
    """Arguments for the kernel's Python: `-m scripts.run_tinystories --depth=.. --steps=.. ...`.
    Flags are written --kebab-case=value; True gives --flag, False --no-flag, None is left out."""
    argv = ["-m", "scripts.run_tinystories", f"--depth={depth}", f"--steps={steps}", f"--run-dir={run_dir}"]
    for key, value in flags.items():
        flag = key.replace("_", "-")
        if value is True:
            argv.append(f"--{flag}")
        elif value is False:
            argv.append(f"--no-{flag}")
        elif value is not None:
            argv.append(f"--{flag}={value}")
    return argv


@dataclasses.dataclass
class Job:
    """A training job started by run_pipeline, as recorded on the kernel."""

    name: str
    remote_dir: str  # relative to the server's root folder: what download() takes
    path: str  # the same folder, absolute, on the kernel's machine
    pid: int
    argv: list[str]
    offset: int = 0  # how much of log.txt wait() has shown


def _discard(stream: str, text: str) -> None:
    pass


# --------------------------------------------------------------------------------------------
# The runner


class KaggleRunner(RemoteRunner):
    """Runs flaxchat on the kernel of a Jupyter server (a Kaggle notebook, or any other).

    url: the server base (Kaggle's proxy URL ending in /proxy), http(s) or ws(s), or a copied
      `…/api/kernels/<id>/channels` URL; token: optional (else `?token=` in the URL, else the
      KAGGLE_JUPYTER_TOKEN variable). The kernel is the URL's, `kernel_id`'s, a new one
      (`new_kernel=True`), or else the most recently active one, started if none runs.
    protocol: 'auto' (v1 binary framing when the server offers it, else legacy JSON), 'v1', 'legacy'.
    Nothing touches the network until the first call.
    """

    def __init__(self, url: str, token: str | None = None, *, kernel_id: str | None = None,
                 kernel_name: str | None = None, new_kernel: bool = False, protocol: str = "auto",
                 workdir: str = "flaxchat_remote", request_timeout: float = 30.0):
        self.address = parse_server_url(url, token or os.environ.get(TOKEN_ENV) or None)
        self.rest = JupyterREST(self.address, timeout=request_timeout)
        self._kernel_id = kernel_id or self.address.kernel_id
        self._chosen = False
        self.kernel_name, self.new_kernel, self.protocol = kernel_name, new_kernel, protocol
        self.workdir = workdir.strip("/")
        self.connection: KernelConnection | None = None
        self.job: Job | None = None
        self._root: str | None = None  # the server's root folder as the kernel sees it
        self._lock = threading.Lock()  # one request on the socket at a time; stop() may come from another thread

    # kernel and connection --------------------------------------------------------------------
    @property
    def kernel_id(self) -> str:
        """The kernel's id; the first use checks the server and token and picks (or starts) the kernel."""
        if not self._chosen:
            self._kernel_id = self._choose_kernel()
            self._chosen = True
        return self._kernel_id

    def _choose_kernel(self) -> str:
        self.rest.check_server()
        if self._kernel_id:
            model = self.rest.kernel(self._kernel_id)
        elif self.new_kernel:
            model = self.rest.start_kernel(self.kernel_name)
        else:
            kernels = self.rest.kernels()
            live = [k for k in kernels if k.get("execution_state") != "dead"]
            if kernels and not live:
                raise RemoteError(f"the only kernel on {self.address.shown} is dead; restart it from the notebook.")
            model = max(live, key=lambda k: k.get("last_activity") or "") if live else \
                self.rest.start_kernel(self.kernel_name)
        if model.get("execution_state") == "dead":
            raise RemoteError(f"kernel {model['id']} is dead; restart it from the notebook "
                              "(or runner.stop(restart=True)).")
        return model["id"]

    def _connect(self) -> KernelConnection:
        if self.connection is None or self.connection.ws is None:
            conn = self.connection or KernelConnection(self.address, self.kernel_id, protocol=self.protocol)
            conn.connect()
            self.connection = conn
        return self.connection

    def close(self) -> None:
        if self.connection is not None:
            self.connection.close()

    def __enter__(self) -> "KaggleRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # running code ----------------------------------------------------------------------------
    def run(self, what: str, *, env: Mapping[str, str] | None = None, timeout: float | None = None,
            on_output: OutputCallback | None = None) -> RunResult:
        """Execute Python code on the kernel; output is streamed to `on_output(stream, text)` (default:
        printed here). Returns the finished RunResult: 'done', or 'failed' with the error (a timeout
        interrupts the cell and is a failure). `env` is set in the kernel's os.environ first (it stays).
        The code runs inside the kernel process: JAX imported there holds the accelerator until the
        kernel restarts, which is why check_devices() and run_pipeline() use child processes."""
        with self._lock:
            conn = self._connect()
            if env:
                prelude = f"import os as _os; _os.environ.update({ {str(k): str(v) for k, v in env.items()}!r})"
                execute(conn, self.rest, prelude, timeout=60, on_output=_discard, store_history=False).raise_for_error()
            return execute(conn, self.rest, what, timeout=timeout, on_output=on_output)

    def _call(self, snippet: str, what: str, *, timeout: float, on_output: OutputCallback = _discard,
              interrupt_on_timeout: bool = True, lock: bool = True, **params) -> Any:
        """Run a kernel-side snippet and return its JSON result; a failure is one RemoteError sentence."""
        if lock:
            self._lock.acquire()
        try:
            res = execute(self._connect(), self.rest, _kernel_code(snippet, params), timeout=timeout,
                          on_output=on_output, interrupt_on_timeout=interrupt_on_timeout, store_history=False,
                          echo_result=False)
        finally:
            if lock:
                self._lock.release()
        if not res.ok:
            raise RemoteError(f"{what} failed on the kernel: {res.error_value or res.error_name}.")
        return json.loads(res.result)

    def _kernel_root(self) -> str:
        if self._root is None:
            nonce = uuid.uuid4().hex
            marker = f"{self.workdir}/where-{nonce}.txt"
            self.rest.upload(marker, nonce.encode())
            self._root = self._call(_K_FIND_ROOT, "finding the server's folder", timeout=60, marker=marker,
                                    nonce=nonce)["root"]
        return self._root

    # RemoteRunner verbs -----------------------------------------------------------------------
    def setup(self, local_repo_path: str = ".", *, install: str = "pip", deps: bool = True,
              pip_args: Sequence[str] = (), chunk_size: int = 4 << 20, timeout: float = 1800,
              on_output: OutputCallback | None = None) -> dict[str, Any]:
        """Upload the repo (one chunked .tar.gz through the Contents API) and install it on the kernel
        (`pip install -e`, with its dependencies unless deps=False; install='path' only puts the
        source on sys.path). Idempotent: when the same content is installed already, nothing happens.
        Files deleted locally are not deleted on the kernel."""
        if install not in ("pip", "path"):
            raise UserError(f"install must be 'pip' or 'path' (got {install!r}).")
        files = repo_files(local_repo_path)
        data, digest = build_archive(local_repo_path, files)
        want = {"hash": digest, "install": install, "deps": deps, "pip_args": list(pip_args)}
        marker_rel = f"{self.workdir}/setup.json"
        marker = _json_or_none(self.rest.read_bytes(marker_rel))
        if marker and all(marker.get(k) == v for k, v in want.items()) and \
                self._call(_K_IMPORT_CHECK, "checking the installed flaxchat", timeout=180, src=marker["src"])["ok"]:
            return {"changed": False, "files": len(files), "hash": digest}
        root = self._kernel_root()
        tar_rel = f"{self.workdir}/upload-{digest[:12]}.tar.gz"
        self.rest.upload(tar_rel, data, chunk_size=chunk_size)
        info = self._call(_K_SETUP, "setup", timeout=timeout, on_output=on_output or print_output, root=root,
                          tar=tar_rel, sha256=hashlib.sha256(data).hexdigest(), src=f"{self.workdir}/src",
                          install=install, deps=deps, pip_args=list(pip_args), marker=marker_rel, want=want)
        return {"changed": True, "files": len(files), "hash": digest, "bytes": len(data), **info}

    def check_devices(self, timeout: float = 300) -> dict[str, Any]:
        """What JAX sees on the kernel's machine, probed in a child process."""
        return self._call(_K_PROBE, "the device check", timeout=timeout + 30, probe_timeout=timeout)

    def status(self) -> RunStatus:
        """The kernel's execution state, from the REST API (never queued behind a running cell)."""
        model = self.rest.kernel(self.kernel_id)
        state = model.get("execution_state", "unknown")
        mapped = {"idle": "idle", "starting": "idle", "busy": "running", "dead": "failed"}.get(state, "unknown")
        return RunStatus(mapped, detail=f"kernel {self.kernel_id} is {state}", info=model)

    def stop(self, *, restart: bool = False, shutdown: bool = False) -> None:
        """Interrupt the running cell and end the job run_pipeline started (if it still runs);
        then restart the kernel (its memory is lost) or shut it down, when asked."""
        kid = self.kernel_id
        self.rest.interrupt(kid)
        job = self.job or self._latest_job()
        # The interrupted cell (if run() is in another thread) ends within moments and frees the socket.
        if job is not None and self._lock.acquire(timeout=15):
            try:
                self._call(_K_KILL, "stopping the job", timeout=30, interrupt_on_timeout=False, lock=False,
                           path=job.path, pid=job.pid)
            finally:
                self._lock.release()
        if shutdown:
            self.rest.shutdown(kid)
            self.close()
        elif restart:
            self.rest.restart(kid)
            self.close()  # a fresh socket next time, without the restart notices of this one
            if self.connection is not None:
                self.connection.restarted = True  # and the next request first waits until it is ready

    # background training -------------------------------------------------------------------
    def run_pipeline(self, depth: int = 8, steps: int = 5000, *, command: Sequence[str] | None = None,
                     env: Mapping[str, str] | None = None, name: str | None = None, follow: bool = False,
                     **flags) -> RunResult:
        """Start `python -m scripts.run_tinystories --depth=.. --steps=.. --run-dir=.. [--flags]` on the
        kernel as a detached process (a dropped connection or an interrupted cell does not stop it)
        and return at once (state 'running'); wait() follows it. `command` replaces the arguments
        given to the kernel's Python ('{run_dir}' in them is filled in); FLAXCHAT_RUN_DIR is set."""
        root = self._kernel_root()
        name = name or time.strftime("%Y%m%d-%H%M%S") + f"-d{depth}"
        remote_dir = f"{self.workdir}/runs/{name}"
        path = f"{root}/{remote_dir}"
        argv = pipeline_argv(depth, steps, path, flags) if command is None else \
            [str(a).replace("{run_dir}", path) for a in command]
        t0 = time.monotonic()
        info = self._call(_K_LAUNCH, "starting the job", timeout=120, root=root, name=name, remote_dir=remote_dir,
                          path=path, argv=argv, cwd=f"{root}/{self.workdir}/src", need_src=command is None,
                          env={"PYTHONUNBUFFERED": "1", "FLAXCHAT_RUN_DIR": path, **dict(env or {})},
                          latest=f"{root}/{self.workdir}/runs/latest.json", wrapper=_WRAPPER)
        self.job = Job(info["name"], info["remote_dir"], info["path"], info["pid"], info["argv"])
        print(f"started job {name} on the kernel (pid {self.job.pid}); runner.wait() follows its log", flush=True)
        started = RunResult(state="running", ok=True, elapsed=time.monotonic() - t0)
        return self.wait() if follow else started

    def _latest_job(self) -> Job | None:
        info = _json_or_none(self.rest.read_bytes(f"{self.workdir}/runs/latest.json"))
        return None if info is None else Job(info["name"], info["remote_dir"], info["path"], info["pid"], info["argv"])

    def wait(self, timeout: float | None = None, on_output: OutputCallback | None = None,
             poll_interval: float = 2.0) -> RunResult:
        """Follow the job's log until it exits; 'done' only for exit code 0 (read from the file the
        wrapper writes). Raises RemoteTimeout after `timeout` s (the job keeps running; wait again)."""
        job = self.job = self.job or self._latest_job()
        if job is None:
            raise RemoteError("there is no job to wait for; start one with run_pipeline() first.")
        out, t0, log = on_output or print_output, time.monotonic(), []
        last_news = t0
        while True:
            try:
                st = self._call(_K_POLL, "reading the job's log", timeout=60, interrupt_on_timeout=False,
                                path=job.path, pid=job.pid, offset=job.offset, max_bytes=1 << 20)
            except RemoteConnectionError as e:
                raise RemoteConnectionError(f"{e} The job keeps running on the kernel; call wait() again.") from None
            job.offset, now = st["offset"], time.monotonic()
            if st["text"]:
                out("stdout", st["text"])
                log.append(st["text"])
                last_news = now
            if st["more"]:  # catching up with a long log: no pause
                continue
            if st["exit_code"] is not None or not st["alive"]:
                break
            if timeout is not None and now - t0 >= timeout:
                raise RemoteTimeout(f"job {job.name} is still running after {timeout:g} s; call wait() again to "
                                    "keep following it, or stop() to end it.")
            if now - last_news > 60:  # a quiet job still shows it is alive
                out("stderr", f"[flaxchat] {job.name} still running ({now - t0:.0f} s)\n")
                last_news = now
            time.sleep(poll_interval if timeout is None else max(0.0, min(poll_interval, t0 + timeout - now)))
        code = st["exit_code"]
        ok = code == 0
        why = None if ok else (f"exit code {code}; see {job.remote_dir}/log.txt" if code is not None
                               else "it ended without an exit code (killed, or its machine restarted)")
        return RunResult(state="done" if ok else "failed", ok=ok, stdout="".join(log)[-(4 << 20):],
                         error_name=None if ok else "JobFailed", error_value=why,
                         exit_codes={0: code} if code is not None else {}, elapsed=time.monotonic() - t0)

    def download(self, remote_path: str | None = None, local_path: str | os.PathLike = ".", *,
                 overwrite: bool = False) -> list[str]:
        """Fetch a file or a folder (recursively; its contents go into `local_path`) from the server.
        `remote_path` is relative to the server's root; None means the last job's run folder.
        Existing local files are kept unless overwrite=True. Returns the local paths written."""
        if remote_path is None:
            job = self.job or self._latest_job()
            if job is None:
                raise UserError("there is no job whose folder to download; pass remote_path.")
            remote_path = job.remote_dir
        model = self.rest.model(remote_path.strip("/"))
        if model is None:
            raise RemoteError(f"{remote_path} does not exist on the server.")
        local = Path(local_path)
        if model["type"] != "directory":
            target = local / model["name"] if local.is_dir() else local
            return [self._fetch(model, target, overwrite)]
        written, stack = [], [(model["path"], local, 0)]
        while stack:
            rpath, lpath, depth = stack.pop()
            if depth > 64:
                raise RemoteError(f"{remote_path} is nested more than 64 folders deep; download a subfolder.")
            for entry in self.rest.model(rpath, content=True)["content"]:
                if entry["type"] == "directory":
                    stack.append((entry["path"], lpath / entry["name"], depth + 1))
                else:
                    written.append(self._fetch(entry, lpath / entry["name"], overwrite))
        return sorted(written)

    def _fetch(self, model: dict, target: Path, overwrite: bool) -> str:
        if target.exists() and not overwrite:
            raise UserError(f"{target} exists already; move it away or pass overwrite=True.")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".part")
        try:  # streamed through /files/; a proxy that passes only /api/ gets the Contents API's base64
            with open(tmp, "wb") as f:
                self.rest.download_file(model["path"], f, model.get("size"))
        except RemoteError:
            data = self.rest.read_bytes(model["path"])
            if data is None:
                raise RemoteError(f"{model['path']} vanished from the server during the download.") from None
            tmp.write_bytes(data)
        os.replace(tmp, target)  # no half-written file under the real name
        return str(target)


def _json_or_none(data: bytes | None) -> Any:
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


if __name__ == "__main__":  # python -m flaxchat.remote.kaggle URL ...; the CLI lives in flaxchat/remote/__main__.py
    from flaxchat.remote.__main__ import main
    sys.exit(cli_main(main))
