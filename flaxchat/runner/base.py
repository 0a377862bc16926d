"""The one interface every place flaxchat runs on implements: this machine, a Kaggle kernel, a TPU pod.

Same verbs, same result types, same errors:

    runner.setup()            make flaxchat runnable there (idempotent)
    runner.check_devices()    {'backend': 'tpu', 'device_count': 8, 'process_count': 1}
    runner.run(what)          start work: a shell command (local, TPU) or Python code (Kaggle)
    runner.status()           RunStatus of the current work
    runner.wait()             block until it finishes, return its RunResult
    runner.stop()             stop the current work

`run` on a runner whose work is detached (LocalRunner, TPULauncher) returns as soon as the work has
started (a RunResult with state 'running'); `wait` returns the final one. `run` on a runner whose
work is a request/response (KaggleRunner) returns the finished RunResult.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Literal, Mapping

from flaxchat.errors import UserError

State = Literal["idle", "queued", "running", "done", "failed", "unknown"]
OutputCallback = Callable[[str, str], None]  # (stream name: 'stdout' | 'stderr', text)


class RemoteError(UserError):
    """Something went wrong on the remote side; the message is one sentence for the user."""


class RemoteTimeout(RemoteError):
    """The work did not finish within the time the caller allowed: a failure, never a success."""


class RemoteConnectionError(RemoteError):
    """The remote could not be reached (or stayed unreachable after bounded retries)."""


@dataclasses.dataclass
class RunResult:
    """What one piece of work produced. `ok` is True only for a clean finish (or a clean start)."""

    state: State
    ok: bool
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # the value of the last expression (Jupyter execute_result)
    error_name: str | None = None
    error_value: str | None = None
    traceback: list[str] = dataclasses.field(default_factory=list)
    exit_codes: dict[int, int] = dataclasses.field(default_factory=dict)  # worker/process -> exit code
    elapsed: float = 0.0
    # Kaggle: the execute request's id (runner.reattach(request_id) follows it after a lost connection)
    request_id: str | None = None
    # True when some of the output is known to be missing (never together with ok=True); the
    # message says where the full output is (`output_file`, on the server, for runner.download)
    incomplete: bool = False
    output_file: str | None = None

    def raise_for_error(self) -> "RunResult":
        if not self.ok:
            what = f"{self.error_name}: {self.error_value}" if self.error_name else f"state {self.state}"
            raise RemoteError(f"the remote run failed ({what}).")
        return self


@dataclasses.dataclass
class RunStatus:
    state: State
    detail: str = ""
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class RemoteRunner(abc.ABC):
    """Base class of LocalRunner, KaggleRunner and TPULauncher."""

    @abc.abstractmethod
    def setup(self, local_repo_path: str = ".") -> None: ...

    @abc.abstractmethod
    def check_devices(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    def run(
        self,
        what: str,
        *,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        on_output: OutputCallback | None = None,
    ) -> RunResult: ...

    @abc.abstractmethod
    def status(self) -> RunStatus: ...

    @abc.abstractmethod
    def wait(self, timeout: float | None = None, on_output: OutputCallback | None = None) -> RunResult: ...

    @abc.abstractmethod
    def stop(self) -> None: ...
