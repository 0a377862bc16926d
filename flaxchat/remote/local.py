"""LocalRunner: the RemoteRunner verbs on this machine, with the work in a detached process.

The same wrapper that runs on every TPU worker (`flaxchat/runner/worker.py`) starts the command in
its own session, so it outlives this Python process (close the notebook, the training goes on);
`status()`, `wait()` and `stop()` find it again through its state folder:

    runner = LocalRunner(workdir=".")
    runner.run("python -m scripts.pretrain --depth=4 --run-dir=runs/d4", env={"WANDB_MODE": "offline"})
    runner.wait(on_output=lambda stream, text: print(text, end=""))
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from typing import Any, Mapping

from flaxchat.runner import worker
from flaxchat.errors import UserError
from flaxchat.runner.base import OutputCallback, RemoteError, RemoteRunner, RemoteTimeout, RunResult, RunStatus

_PROBE = ("import json, jax; print(json.dumps({'backend': jax.default_backend(), "
          "'device_count': jax.device_count(), 'process_count': jax.process_count()}))")


class LocalRunner(RemoteRunner):
    def __init__(self, workdir: str = ".", state_dir: str | None = None, python: str = sys.executable,
                 poll_s: float = 0.5):
        self.workdir = os.path.abspath(workdir)
        self.state_dir = os.path.abspath(os.path.expanduser(state_dir or os.path.join("~", ".flaxchat", "local-run")))
        self.python = python
        self.poll_s = poll_s

    def _env(self, extra: Mapping[str, str] | None = None) -> dict:
        # FLAXCHAT_WORKER_ID: this machine is worker 0 (and worker.py skips the metadata server).
        return {**os.environ, **(extra or {}), "FLAXCHAT_WORKER_ID": "0"}

    def setup(self, local_repo_path: str = ".") -> None:
        """Nothing to install here; check that flaxchat imports from the work folder (idempotent)."""
        proc = subprocess.run([self.python, "-c", "import flaxchat"], cwd=os.path.abspath(local_repo_path),
                              capture_output=True, text=True, env=self._env())
        if proc.returncode != 0:
            raise RemoteError(f"flaxchat does not import in {local_repo_path}: "
                              f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")

    def check_devices(self) -> dict[str, Any]:
        proc = subprocess.run([self.python, "-c", _PROBE], cwd=self.workdir, capture_output=True, text=True,
                              env=self._env(), timeout=300)
        if proc.returncode != 0:
            raise RemoteError(f"JAX did not start: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def run(self, what: str, *, env: Mapping[str, str] | None = None, timeout: float | None = None,
            on_output: OutputCallback | None = None, secrets: Mapping[str, str] | None = None,
            marker: str | None = None) -> RunResult:
        """Start `what` (a shell command) detached; return at once with state 'running'.

        env and secrets reach the command through a 0600 file, never its command line; secret
        values are replaced by *** in the log.
        """
        current = self.status()
        if current.state == "running":
            raise UserError(f"a run is already going here ({current.info.get('command')!r}); stop it first.")
        os.makedirs(self.state_dir, exist_ok=True)
        env_file = os.path.join(self.state_dir, "run.env")
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"env": {**(env or {}), **(secrets or {})}, "secret_keys": sorted(secrets or {})}, f)
        self._log_offset = self._log_size()
        run_id = f"local-{uuid.uuid4().hex[:8]}"
        args = [self.python, worker.__file__, "start", "--state-dir", self.state_dir, "--run-id", run_id,
                "--env-file", env_file, "--cwd", self.workdir, *(["--marker", marker] if marker else []), "--", what]
        proc = subprocess.run(args, capture_output=True, text=True, env=self._env(), timeout=60)
        if proc.returncode != 0:
            raise RemoteError(f"the command did not start: {proc.stdout.strip() or proc.stderr.strip()}")
        return RunResult(state="running", ok=True)

    def _log_size(self) -> int:
        try:
            return os.path.getsize(os.path.join(self.state_dir, "output.log"))
        except OSError:
            return 0

    def status(self) -> RunStatus:
        s = worker.status(self.state_dir)
        if s["state"] == "none":
            return RunStatus("idle", "nothing has run yet", s)
        if s["alive"]:
            return RunStatus("running", s["last_line"], s)
        if s["state"] == "exited" and s["exit_code"] == 0 and s["complete"] is not False:
            return RunStatus("done", "finished", s)
        why = (f"exited with code {s['exit_code']}" if s["state"] == "exited" and s["exit_code"] else
               "was killed" if s["state"] == "killed" else "exited without its completion marker")
        return RunStatus("failed", f"the command {why}: {s['last_line']}", s)

    def _read_new(self) -> str:
        path = os.path.join(self.state_dir, "output.log")
        offset = getattr(self, "_log_offset", 0)
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return ""
        cut = data.rfind(b"\n") + 1  # hand over whole lines only
        self._log_offset = offset + cut
        return data[:cut].decode("utf-8", "replace")

    def wait(self, timeout: float | None = None, on_output: OutputCallback | None = None) -> RunResult:
        """Block until the command ends; stream its new output to on_output('stdout', text)."""
        t0 = time.monotonic()
        out = []
        while True:
            st = self.status()
            text = self._read_new()
            if text:
                out.append(text)
                if on_output:
                    on_output("stdout", text)
            if st.state != "running":
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise RemoteTimeout(f"the local run did not finish within {timeout:.0f} s (it is still running).")
            time.sleep(self.poll_s)
        info = st.info
        ok = st.state == "done"
        return RunResult(state="done" if ok else "failed", ok=ok, stdout="".join(out),
                         exit_codes={0: info["exit_code"]} if info.get("exit_code") is not None else {},
                         error_name=None if ok else "RunFailed", error_value=None if ok else st.detail,
                         elapsed=time.monotonic() - t0)

    def stop(self) -> None:
        worker.stop(self.state_dir)
