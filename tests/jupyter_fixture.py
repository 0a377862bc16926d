"""A real Jupyter server on 127.0.0.1 for the remote-runner tests (the Kaggle stand-in).

Everything it writes (runtime files, kernelspecs, IPython profile, even what goes to $HOME) lands
in a temp folder, never in the home folder. Stop it with SIGTERM, which shuts its kernels down cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import site
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


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


class JupyterServer:
    def __init__(self, base: Path, token: str = "", extra_args: tuple[str, ...] = (),
                 kernel_python: Path | None = None, env: dict[str, str] | None = None):
        self.base, self.token, self.extra_args = Path(base), token, tuple(extra_args)
        self.root = self.base / "root"
        self.kernel_python = kernel_python
        self.extra_env = env or {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
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
               f"--ServerApp.root_dir={self.root}", *self.extra_args]
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
