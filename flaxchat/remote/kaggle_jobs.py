"""Following a KaggleRunner job through the Jupyter server's file API, never through the kernel.

The job runs under `flaxchat/runner/worker.py` with its state folder `runs/<name>/job/` inside the
server's root: `output.log` (redacted), `exit_code` (JSON, written when the command ends),
`run.json`, `heartbeat`, and the progress file the training writes (FLAXCHAT_PROGRESS_FILE). The
kernel may be busy with the notebook's own cell for hours; none of this waits for it.
"""

from __future__ import annotations

import dataclasses
import json
import time

from flaxchat.runner.base import OutputCallback, RemoteError, RemoteTimeout, RunResult, RunStatus
from flaxchat.remote.jupyter import JupyterREST


@dataclasses.dataclass
class Job:
    """A training job started by run_pipeline, as recorded on the server."""

    name: str
    remote_dir: str  # the run folder, relative to the server's root: what download() takes
    path: str  # the same folder, absolute, on the kernel's machine
    argv: list[str] = dataclasses.field(default_factory=list)
    pid: int | None = None
    offset: int = 0  # how much of the log wait() has shown

    @property
    def state(self) -> str:  # the supervisor's state folder, relative to the server's root
        return f"{self.remote_dir}/job"

    def record(self) -> dict:
        return {"name": self.name, "remote_dir": self.remote_dir, "path": self.path, "argv": self.argv, "pid": self.pid}

    @classmethod
    def from_record(cls, info: dict) -> "Job":
        return cls(info["name"], info["remote_dir"], info["path"], list(info.get("argv") or []), info.get("pid"))


def _json(data: bytes | None):
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


class JobFollower:
    """The REST side of a job: its exit code, progress, log tail; wait; request a stop."""

    def __init__(self, rest: JupyterREST):
        self.rest = rest

    def exit_code(self, job: Job, timeout: float | None = None) -> int | None:
        info = _json(self.rest.read_bytes(f"{job.state}/exit_code", timeout=timeout))
        return None if not isinstance(info, dict) else info.get("exit_code")

    def status(self, job: Job) -> RunStatus:
        code = self.exit_code(job)
        progress = _json(self.rest.read_bytes(f"{job.state}/progress.json")) or {}
        tail = (self.rest.read_range(f"{job.state}/output.log", 0, 1 << 30, tail=4096) or b"").decode("utf-8", "replace")
        lines = [ln for ln in tail.splitlines() if ln.strip() and not ln.startswith("=== flaxchat run")]
        info = {"job": job.name, "remote_dir": job.remote_dir, "exit_code": code, "progress": progress,
                "last_line": lines[-1] if lines else ""}
        if code is None:
            step = f"step {progress['step']}/{progress.get('steps')}: " if "step" in progress else ""
            return RunStatus("running", f"job {job.name} is running ({step}{info['last_line']})", info)
        if code == 0:
            return RunStatus("done", f"job {job.name} finished", info)
        return RunStatus("failed", f"job {job.name} exited with code {code}: {info['last_line']}", info)

    def request_stop(self, job: Job) -> None:
        self.rest.upload(f"{job.state}/stop_request", b"stop", timeout=30)

    def wait(self, job: Job, *, timeout: float | None, on_output: OutputCallback, poll_interval: float,
             alive=None, stale_s: float = 120.0) -> RunResult:
        """Follow the log (Range reads) until the exit code exists and the log is read to its end.
        `alive()` (asking the kernel, when it is free) is consulted only after `stale_s` of silence:
        a supervisor killed outright (the machine restarted) writes no exit code."""
        t0, log = time.monotonic(), []
        deadline = None if timeout is None else t0 + timeout
        last_news = last_check = t0
        while True:
            now = time.monotonic()
            left = None if deadline is None else max(1.0, min(30.0, deadline - now))
            code = self.exit_code(job, timeout=left)  # first: once it exists, the log is complete
            data = self.rest.read_range(f"{job.state}/output.log", job.offset, 1 << 20, timeout=left) or b""
            if code is None:
                data = data[:data.rfind(b"\n") + 1]  # whole lines only while it still writes
            if data:
                text = data.decode("utf-8", "replace")
                job.offset += len(data)
                on_output("stdout", text)
                log.append(text)
                last_news = now
                if len(data) >= 1 << 19:
                    continue  # catching up with a long log: no pause
            if code is not None:
                break
            if deadline is not None and now >= deadline:
                raise RemoteTimeout(f"job {job.name} is still running after {timeout:g} s; call wait() (--wait) "
                                    "again to keep following it, or stop() (--stop) to end it.")
            if now - last_news > stale_s and now - last_check > stale_s and alive is not None:
                last_check = now
                if alive(job) is False and self.exit_code(job) is None:
                    code = None
                    break
            time.sleep(poll_interval if deadline is None else max(0.0, min(poll_interval, deadline - now)))
        ok = code == 0
        why = None if ok else (f"exit code {code}; see {job.state}/output.log" if code is not None
                               else "it ended without an exit code (killed, or its machine restarted)")
        return RunResult(state="done" if ok else "failed", ok=ok, stdout="".join(log)[-(4 << 20):],
                         error_name=None if ok else "JobFailed", error_value=why,
                         exit_codes={0: code} if code is not None else {}, elapsed=time.monotonic() - t0,
                         output_file=f"{job.state}/output.log")

    def wait_stopped(self, job: Job, limit: float = 30.0) -> int:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            code = self.exit_code(job, timeout=10)
            if code is not None:
                return code
            time.sleep(0.2)
        raise RemoteError(f"job {job.name} is still alive {limit:g} s after the stop request; its supervisor may be "
                          "gone: stop it from the notebook (or runner.stop(restart=True), --stop --restart).")
