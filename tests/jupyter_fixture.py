"""A real Jupyter server on 127.0.0.1 for the remote-runner tests (the Kaggle stand-in), made unkind.

- It serves under a Kaggle-shaped base URL (`/k/123/<signed>/proxy/`), with the default IOPub rate
  limit (1 MB/s: a big print is dropped but for one notice).
- `NotebookTab` is a second client on the same kernel, as the notebook's browser tab is on Kaggle:
  it runs its own (long) cells while the runner works, and keeps every message it receives. With it
  attached the server keeps no replay buffer for a dropped connection of ours.
- The kernel runs in a venv of its own (never the test interpreter: setup() runs pip there) that
  holds what a Kaggle GPU image has: a jax of another version than flaxchat's pin and a CUDA plugin
  (`fake_accelerator_dists`: dist-info folders only, so `import jax` still gets the real one).
- Its package index is unreachable (the notebook's Internet is off) unless a test says otherwise.
- `Proxy` stands between the runner and the server: it can cut every connection (and refuse new
  ones) or freeze them (the socket stays open, nothing passes), like Kaggle's proxy at its worst.

Everything it writes (runtime files, kernelspecs, IPython profile, even what goes to $HOME) lands
in a temp folder, never in the home folder. Stop it with SIGTERM, which shuts its kernels down cleanly.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import site
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import requests
import websocket

from flaxchat.uploads import repo_files

KAGGLE_BASE = "/k/123/eyJhbGciOi.signed-part_x/proxy/"
FAKE_JAX = "0.10.1"  # flaxchat pins jax 0.10.2; Kaggle's image brings its own
# name, version, Requires-Dist: what `pip install` would replace if setup() let it
FAKE_DISTS = (("jax", FAKE_JAX, ["jaxlib<=0.10.2,>=0.10.1"]),
              ("jax_cuda12_plugin", FAKE_JAX, [f"jax-cuda12-pjrt=={FAKE_JAX}"]),
              ("jax_cuda12_pjrt", FAKE_JAX, []))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_kernel_venv(folder: Path) -> tuple[Path, bool]:
    """A venv that sees this Python's packages but installs into itself, so a test's `pip install`
    on the kernel never touches the shared environment. Returns (python, can_build): can_build
    says whether an offline `pip install --no-build-isolation -e` can work (setuptools < 70.1
    needs the `wheel` package for that, fetched here from the configured package index if any)."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(folder)],
                   check=True, timeout=120)
    python = folder / "bin" / "python"
    if sys.prefix != sys.base_prefix:  # we run in a venv: the new one is built on the base Python, so
        # it must be shown this venv's packages too (ipykernel, jax), after its own ones
        site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True, timeout=60).stdout.strip()
        outer = [d for d in site.getsitepackages() if d.startswith(sys.prefix)]
        (Path(site_dir) / "zz_outer_venv.pth").write_text(
            "".join(f"import site; site.addsitedir({d!r})\n" for d in outer))
    write_fake_accelerator_dists(python)
    check = "import setuptools, sys; v = tuple(int(x) for x in setuptools.__version__.split('.')[:2]); " \
            "import importlib.util as u; sys.exit(0 if v >= (70, 1) or u.find_spec('wheel') else 1)"
    if subprocess.run([str(python), "-c", check], timeout=60).returncode != 0:
        env = dict(os.environ, PIP_RETRIES="0", PIP_TIMEOUT="5", PIP_DISABLE_PIP_VERSION_CHECK="1")
        try:
            subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "wheel"], env=env,
                           timeout=90, capture_output=True)
        except subprocess.TimeoutExpired:
            pass
    return python, subprocess.run([str(python), "-c", check], timeout=60).returncode == 0


def site_packages(python: Path) -> Path:
    return Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip())


def write_fake_accelerator_dists(python: Path) -> None:
    """dist-info folders of a jax and a CUDA plugin of another version than the pin, in the venv's own
    site-packages (ahead of the outer ones): importlib.metadata and pip see them; `import jax` still
    finds the real package further down sys.path. Each has a RECORD, so pip could uninstall it."""
    site_dir = site_packages(python)
    for name, version, requires in FAKE_DISTS:
        info = site_dir / f"{name}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        meta = ["Metadata-Version: 2.1", f"Name: {name.replace('_', '-')}", f"Version: {version}",
                *(f"Requires-Dist: {r}" for r in requires)]
        (info / "METADATA").write_text("\n".join(meta) + "\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n" for f in ("METADATA", "INSTALLER", "RECORD")))


def fake_accelerator_dists(python: Path) -> dict[str, str]:
    """{dist-info folder: digest of its files}: what must survive setup() untouched."""
    site_dir = site_packages(python)
    out = {}
    for name, version, _ in FAKE_DISTS:
        info = site_dir / f"{name}-{version}.dist-info"
        h = hashlib.sha256()
        for f in sorted(info.iterdir()) if info.is_dir() else []:
            h.update(f.name.encode() + f.read_bytes())
        out[info.name] = h.hexdigest() if info.is_dir() else "missing"
    return out


class JupyterServer:
    def __init__(self, base: Path, token: str = "", extra_args: tuple[str, ...] = (),
                 kernel_python: Path | None = None, env: dict[str, str] | None = None, base_url: str = "/",
                 offline: bool = True):
        self.base, self.token, self.extra_args = Path(base), token, tuple(extra_args)
        self.root = self.base / "root"
        self.kernel_python = kernel_python
        self.extra_env = env or {}
        if offline:  # the notebook's Internet is off: pip's index does not answer (a closed port)
            self.extra_env.setdefault("PIP_INDEX_URL", f"http://127.0.0.1:{free_port()}/simple/")
        self.port = free_port()
        self.base_url = "/" + base_url.strip("/") + "/" if base_url.strip("/") else "/"
        self.origin = f"http://127.0.0.1:{self.port}"
        self.url = self.origin + self.base_url.rstrip("/")
        self.proc: subprocess.Popen | None = None
        self.log_path = self.base / "server.log"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(JUPYTER_RUNTIME_DIR=str(self.base / "runtime"), JUPYTER_CONFIG_DIR=str(self.base / "config"),
                   JUPYTER_DATA_DIR=str(self.base / "data"), IPYTHONDIR=str(self.base / "ipython"),
                   JUPYTER_PLATFORM_DIRS="1", PYTHONUNBUFFERED="1", HOME=str(self.base / "home"),
                   JUPYTER_PREFER_ENV_PATH="0",  # in a venv, our kernelspec must still beat the venv's own
                   **self.extra_env)
        env.pop("JUPYTER_PATH", None)
        return env

    def start(self, ready_timeout: float = 90.0) -> "JupyterServer":
        self.root.mkdir(parents=True, exist_ok=True)
        if self.kernel_python is not None:  # our python3 kernelspec wins over the built-in one
            spec = self.base / "data" / "kernels" / "python3"
            spec.mkdir(parents=True, exist_ok=True)
            (spec / "kernel.json").write_text(json.dumps({
                "argv": [str(self.kernel_python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (test venv)", "language": "python"}))
        cmd = [sys.executable, "-m", "jupyter_server", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
               "--port-retries=0", "--allow-root", f"--IdentityProvider.token={self.token}",
               f"--ServerApp.root_dir={self.root}", f"--ServerApp.base_url={self.base_url}", *self.extra_args]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < ready_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/api", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"jupyter server not ready after {ready_timeout} s:\n{self.log_tail()}")

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"} if self.token else {}

    def kernels(self) -> list[dict]:
        return requests.get(f"{self.url}/api/kernels", headers=self.headers(), timeout=10).json()

    def shutdown_kernel(self, kernel_id: str, timeout: float = 20.0) -> None:
        # jupyter_server answers 500 to a DELETE while it is still restarting a kernel: try again.
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            resp = requests.delete(f"{self.url}/api/kernels/{kernel_id}", headers=self.headers(), timeout=30)
            if resp.status_code in (204, 404):
                return
            time.sleep(0.5)
        raise RuntimeError(f"kernel {kernel_id} did not shut down: HTTP {resp.status_code}")

    def child_pids(self) -> list[int]:
        """Processes whose parent is the server: its kernels."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    pids.append(int(entry.name))
        return pids

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM the server; return the kernel pids still alive afterwards (should be none)."""
        if self.proc is None or self.proc.poll() is not None:
            return []
        kernels = self.child_pids()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()
        t0 = time.monotonic()
        alive = kernels
        while alive and time.monotonic() - t0 < 10:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.1)
        return alive

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# A training script's stand-in for run_pipeline(command=...): steps, a checkpoint, an exit code.
STAND_IN = '''
import argparse, os, sys, time
p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=3)
p.add_argument("--run-dir")
p.add_argument("--exit", type=int, default=0)
p.add_argument("--sleep", type=float, default=0.2)
a = p.parse_args()
import flaxchat  # the uploaded package is importable in the job
for step in range(a.steps):
    print(f"step {step} loss {1.0 / (step + 1):.3f}", flush=True)
    time.sleep(a.sleep)
os.makedirs(os.path.join(a.run_dir, "checkpoints", "3"))  # Orbax's layout; "checkpoints" is special to Jupyter
with open(os.path.join(a.run_dir, "checkpoints", "3", "model.ckpt"), "wb") as f:
    f.write(bytes(range(256)) * 40)
print("done", flush=True)  # the outcome comes from the exit code, never from this line
sys.exit(a.exit)
'''


def snapshot_repo(dest: Path, repo: Path) -> Path:
    """A git repository of this repo's tracked files (others edit the working tree while the tests
    run), with an untracked `.env` and `kaggle.json` next to them, as a user's folder has."""
    for name in repo_files(repo):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_bytes((repo / name).read_bytes())
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t", "-C", str(dest)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "snapshot"]):
        subprocess.run(git + args, check=True, timeout=60, capture_output=True)
    (dest / ".env").write_text("HF_TOKEN=hf_not_for_upload\n")
    (dest / "kaggle.json").write_text('{"username": "u", "key": "not-for-upload"}\n')
    return dest


# --------------------------------------------------------------------------------------------
# The notebook's tab: a second client on the same kernel


class NotebookTab:
    """A browser tab attached to the kernel: its own session, its own cells, every message kept."""

    def __init__(self, server: JupyterServer, kernel_id: str):
        self.session = uuid.uuid4().hex
        url = server.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels?session_id={self.session}"
        header = [f"Authorization: token {server.token}"] if server.token else []
        self.ws = websocket.create_connection(url, header=header, timeout=30)
        self.raw: list[str] = []  # every frame received, as text
        self.messages: list[dict] = []
        self._idle: dict[str, threading.Event] = {}
        self._seen: dict[str, set] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        self.ws.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = self.ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except Exception:
                return
            text = data if isinstance(data, str) else data.decode("utf-8", "replace")
            self.raw.append(text)
            try:
                msg = json.loads(text)
            except ValueError:
                continue
            self.messages.append(msg)
            parent = (msg.get("parent_header") or {}).get("msg_id")
            if parent in self._idle:  # finished: its idle (iopub) and its reply (shell), in either order
                kind = msg.get("msg_type")
                if kind == "execute_reply" or (kind == "status" and msg["content"].get("execution_state") == "idle"):
                    self._seen.setdefault(parent, set()).add(kind)
                    if len(self._seen[parent]) == 2:
                        self._idle[parent].set()

    def execute(self, code: str) -> str:
        msg_id = uuid.uuid4().hex
        self._idle[msg_id] = threading.Event()
        header = {"msg_id": msg_id, "msg_type": "execute_request", "username": "tab", "session": self.session,
                  "date": "2026-01-01T00:00:00Z", "version": "5.3"}
        self.ws.send(json.dumps({"header": header, "parent_header": {}, "metadata": {}, "channel": "shell",
                                 "content": {"code": code, "silent": False, "store_history": True,
                                             "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                                 "buffers": []}))
        return msg_id

    def wait_idle(self, msg_id: str, timeout: float = 60) -> bool:
        return self._idle[msg_id].wait(timeout)

    def outputs(self, msg_id: str) -> str:
        return "".join(m["content"].get("text", "") for m in self.messages
                       if (m.get("parent_header") or {}).get("msg_id") == msg_id and m.get("msg_type") == "stream")

    def reply(self, msg_id: str) -> dict | None:
        for m in self.messages:
            if (m.get("parent_header") or {}).get("msg_id") == msg_id and m.get("msg_type") == "execute_reply":
                return m["content"]
        return None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        try:
            self.ws.close(timeout=1)
        except Exception:
            pass

    def __enter__(self) -> "NotebookTab":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# A proxy that can cut or freeze every connection


def _hang_up(s: socket.socket) -> None:
    """Shut both directions (the peer sees EOF, as when a link drops) and close; already gone is fine."""
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


class Proxy:
    """TCP forwarding from 127.0.0.1:<port> to the server; `cut()` closes every connection and refuses
    new ones until `restore()`; `freeze()` keeps the sockets open but passes nothing (and drops what
    comes) until `thaw()`: a frozen connection, as a proxy or a sleeping laptop leaves it."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.refusing = threading.Event()
        self.frozen = threading.Event()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, server: JupyterServer) -> str:
        return f"http://127.0.0.1:{self.port}{server.base_url.rstrip('/')}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.refusing.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=10)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if self.frozen.is_set():
                    continue  # swallowed: the sender believes it was delivered
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            _hang_up(s)

    def cut(self) -> None:
        self.refusing.set()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            _hang_up(s)

    def restore(self) -> None:
        self.refusing.clear()

    def freeze(self) -> None:
        self.frozen.set()

    def thaw(self) -> None:
        self.frozen.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self.listener.close()
