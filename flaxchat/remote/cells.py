"""Executing code on a Jupyter kernel so that a lost message can never pass for a finished cell.

One `execute_request` is answered on two channels (messaging spec 5.3): iopub carries `status:
busy`, `execute_input`, the outputs and `status: idle`; shell carries `execute_reply`. The reply
can overtake the last outputs, so a cell is finished only when both the reply and the idle for its
msg_id have arrived. Messages from other clients' cells share iopub; we filter on parent msg_id.

The messages alone are not enough on a shared kernel (a Kaggle notebook has its own tab attached):
- with another client connected the server keeps no replay buffer for a dropped socket, so output
  sent while we were away is gone, and so is the shell reply;
- the server's IOPub data-rate limit (1 MB/s) drops a big print, leaving one stderr notice.
So each cell of ours starts with one line that calls a helper installed in the kernel (`on_kernel.install_helper`,
sent silently just before): it tees the cell's stdout/stderr into files on the server and writes
the outcome (ok or the error) to `<id>.json` when the cell ends. Whenever the messages may have
missed something, the result is rebuilt from those files through the REST API; when they cannot be
read, the result says `incomplete` and is never ok. The same files let `reattach(request_id)`
recover a run whose connection was gone for longer than the reconnect window, and a request that
waited past its timeout in the queue (behind the notebook's own cell) is cancelled with a marker
file instead of an interrupt, which would hit the other cell.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

from flaxchat.runner.base import OutputCallback, RemoteConnectionError, RemoteError, RunResult
from flaxchat.remote import on_kernel
from flaxchat.remote.jupyter import (KernelConnection, KernelGone, JupyterREST, _ConnectionLost, new_message)
# A display_data bundle of RESULT_MIME carries a value back to the runner (see kaggle.py): not
# the execute_result, because IPython's displayhook of a store_history=False cell tokenizes the
# last *stored* cell and fails when that one had a syntax error.
from flaxchat.remote.on_kernel import CANCELLED_MIME, MODULE, RESULT_MIME

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_RATE_NOTICE = ("IOPub data rate exceeded", "IOPub message rate exceeded")
_GONE_STATES = ("restarting", "dead", "autorestarting", "starting")



@dataclasses.dataclass(frozen=True)
class CellFiles:
    """Where the helper keeps each request's files, relative to the server's root (REST paths);
    `marker`/`nonce`: a file the runner uploaded, by which the kernel finds that root."""

    folder: str
    marker: str
    nonce: str

    def path(self, rid: str, kind: str) -> str:
        return f"{self.folder}/{rid}.{kind}"


def kernel_module_code() -> str:
    """A cell's lines that make flaxchat/remote/on_kernel.py the module `flaxchat_on_kernel` in the
    kernel (its source travels in the cell: it also finds where uploads land, so it comes first)."""
    source = Path(on_kernel.__file__).read_text(encoding="utf-8")
    return (f"__import__('sys').modules[{MODULE!r}] = __import__('types').ModuleType({MODULE!r})\n"
            f"exec(compile({source!r}, {MODULE + '.py'!r}, 'exec'), __import__('sys').modules[{MODULE!r}].__dict__)\n")


def kernel_call(function: str, params: dict) -> str:
    """A cell that runs `on_kernel.<function>(params)` and displays its JSON value as RESULT_MIME."""
    value = (f"__import__('json').dumps(__import__('sys').modules[{MODULE!r}].{function}"
             f"(__import__('json').loads({json.dumps(json.dumps(params))})))")
    return kernel_module_code() + f"__import__('IPython.display').display.display({{{RESULT_MIME!r}: {value}}}, raw=True)"


def helper_code(files: CellFiles) -> str:
    """The silent cell that installs the tee-and-outcome helper (`on_kernel.install_helper`)."""
    return kernel_module_code() + (f"__import__('sys').modules[{MODULE!r}].install_helper("
                                   f"{files.marker!r}, {files.nonce!r}, {files.folder!r})\n")


def print_output(stream: str, text: str) -> None:
    """The default on_output: the remote stdout/stderr appear on ours as they arrive."""
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()


@dataclasses.dataclass
class _Execution:
    """What one execute_request has produced so far (messages filtered on its msg_id)."""

    msg_id: str
    on_output: OutputCallback
    echo_result: bool = True
    stdout: list[str] = dataclasses.field(default_factory=list)
    stderr: list[str] = dataclasses.field(default_factory=list)
    result: str | None = None
    error: tuple[str, str, list[str]] | None = None
    reply: dict | None = None
    idle_at: float | None = None
    seen_at: float | None = None  # when the last message of ours arrived
    started: bool = False  # the kernel began executing it (our busy / execute_input arrived)
    died: str | None = None  # the kernel restarted or died under the cell
    rate_limited: bool = False  # the server dropped some of its output (IOPub rate limit)
    reattached: bool = False  # the socket was replaced while it ran: messages may be missing
    interrupted_by_us: bool = False  # runner.stop() interrupted it (from another thread)
    cancelled: bool = False  # it reached the kernel after a cancel: nothing of it ran

    @property
    def done(self) -> bool:
        return self.reply is not None and self.idle_at is not None

    def handle(self, msg: dict) -> None:
        mtype, content = msg.get("msg_type") or msg["header"]["msg_type"], msg.get("content") or {}
        if (msg.get("parent_header") or {}).get("msg_id") != self.msg_id:
            # The server itself announces a restart or death with a parentless status message, a
            # freshly started kernel process with a parentless `starting`. It counts before our busy
            # arrived too: a killed kernel loses the messages it had not yet sent (busy included).
            if mtype == "status" and not msg.get("parent_header") and \
                    content.get("execution_state") in _GONE_STATES:
                self.died = content["execution_state"]
            return
        self.seen_at = time.monotonic()
        if mtype == "stream":
            name, text = content.get("name", "stdout"), content.get("text", "")
            if name == "stderr" and text.startswith(_RATE_NOTICE):
                self.rate_limited = True
                self.on_output("stderr", "[flaxchat] the server's IOPub rate limit dropped output; the full output "
                               "is fetched from the server when the cell ends\n")
                return
            (self.stderr if name == "stderr" else self.stdout).append(text)
            self.on_output(name, text)
        elif mtype == "execute_result":
            self.result = content.get("data", {}).get("text/plain")
            if self.result is not None and self.echo_result:
                self.on_output("stdout", self.result + "\n")
        elif mtype == "display_data" and RESULT_MIME in content.get("data", {}):
            self.result = content["data"][RESULT_MIME]
        elif mtype == "display_data" and CANCELLED_MIME in content.get("data", {}):
            self.cancelled = True
        elif mtype == "display_data":
            text = content.get("data", {}).get("text/plain")
            if text is not None:
                self.stdout.append(text + "\n")
                self.on_output("stdout", text + "\n")
        elif mtype == "error":
            tb = [_ANSI.sub("", line) for line in content.get("traceback", [])]
            self.error = (content.get("ename", "Error"), content.get("evalue", ""), tb)
            self.on_output("stderr", "\n".join(tb) + "\n")
        elif mtype == "execute_reply":
            self.reply = content
        elif mtype == "execute_input":
            self.started = True
        elif mtype == "status":
            state = content.get("execution_state")
            self.started = self.started or state == "busy"
            if state == "idle":
                self.idle_at = time.monotonic()

    def to_result(self, elapsed: float, failure: tuple[str, str] | None = None) -> RunResult:
        name = value = None
        tb: list[str] = []
        if self.error:
            name, value, tb = self.error
        elif self.reply is not None and self.reply.get("status") not in (None, "ok"):
            name = self.reply.get("ename") or self.reply["status"].capitalize()
            value = self.reply.get("evalue", "")
        if failure:
            name, value = failure
        elif self.cancelled:
            name, value = "Queued", "it was cancelled while it waited behind another cell, and did not run"
        ok = failure is None and name is None and self.reply is not None
        state = "done" if ok else "unknown" if name == "ConnectionLost" else "queued" if name == "Queued" else "failed"
        return RunResult(state=state, ok=ok, stdout="".join(self.stdout), stderr="".join(self.stderr),
                         result=self.result, error_name=name, error_value=value, traceback=tb, elapsed=elapsed,
                         request_id=self.msg_id)


@dataclasses.dataclass
class Follow:
    """How long to keep at a connection: `window` s of reconnecting when the caller set no deadline;
    a ping after `quiet_s` of silence, and a socket that answers nothing `pong_timeout_s` later is
    taken for frozen and replaced."""

    window: float = 300.0
    quiet_s: float = 20.0
    pong_timeout_s: float = 15.0


def execute(conn: KernelConnection, rest: JupyterREST, code: str, *, timeout: float | None = None,
            on_output: OutputCallback | None = None, interrupt_on_timeout: bool = True,
            store_history: bool = True, echo_result: bool = True, files: CellFiles | None = None,
            env_file: str | None = None, follow: Follow | None = None) -> RunResult:
    """Run `code` on the kernel; stream its output; return when it has finished (or failed).

    A timeout is a failure: a cell the kernel is running is interrupted (unless told otherwise), one
    still waiting behind another client's cell is cancelled (with `files`) and reported as queued.
    A dropped connection is reattached with the same session id until the deadline (or
    `follow.window`); the code is never sent twice. With `files` (the runner always passes them) the
    output and outcome are checked against the helper's files whenever a message may be missing.
    """
    follow = follow or Follow()
    t0 = time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    rid = uuid.uuid4().hex
    tracked = files is not None and not code.lstrip().startswith("%%")  # a cell magic must stay the first line
    if tracked:
        code = f"__import__('builtins').__dict__.get('_flaxchat_begin', lambda *a: None)({rid!r}, {env_file or ''!r})\n" + code
    # stop_on_error=False: an error of ours must not abort the cells queued after it (the notebook's)
    content = {"code": code, "silent": False, "store_history": store_history, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": False}
    msg = new_message("execute_request", content, conn.session_id)
    msg["header"]["msg_id"] = msg["msg_id"] = rid
    ex = _Execution(rid, on_output or print_output, echo_result)
    conn.current = ex  # what stop() from another thread looks at: interrupt only a cell of ours that runs
    try:
        _drain(conn)
        if conn.ws is None:  # nothing was sent yet, so a plain reconnect is safe
            conn.reconnect(rest, deadline, follow.window)
        if conn.restarted:
            _wait_ready(conn, rest, deadline, follow.window)
        try:
            if tracked:  # silent: no execute_input for other clients, no execution count
                conn.send(new_message("execute_request", {"code": helper_code(files), "silent": True,
                                                          "store_history": False, "allow_stdin": False,
                                                          "stop_on_error": False, "user_expressions": {}},
                                      conn.session_id))
            conn.send(msg)
        except _ConnectionLost:  # it may or may not have reached the server: follow, do not resend
            conn.reconnect(rest, deadline, follow.window)
            ex.reattached = True
        failure = _follow(conn, rest, ex, deadline, follow, files if tracked else None)
    except KernelGone as e:
        failure = ("DeadKernel", f"the kernel died while running the code ({e})")
    except RemoteConnectionError as e:
        failure = _lost(e, rid)
    except KeyboardInterrupt:  # a local Ctrl-C also stops the remote cell (when it is ours), then propagates
        if ex.started and ex.idle_at is None:
            _quiet(rest.interrupt, conn.kernel_id)
        raise
    if failure and failure[0] == "RemoteTimeout":
        failure = _after_timeout(conn, rest, ex, timeout, interrupt_on_timeout, files if tracked else None)
        if failure[0] == "Queued" and env_file and "cancelled" in failure[1]:
            _quiet(rest.delete, env_file)  # the cell that would have read (and removed) it will not run
    elif failure is None and tracked and ex.error and ex.error[0] == "KeyboardInterrupt" and not ex.interrupted_by_us:
        failure = _why_interrupted(conn, rest, ex, files, deadline)  # not by us: a restart, or another client
    conn.current = None
    return _settle(ex.to_result(time.monotonic() - t0, failure), ex, rest, files if tracked else None, deadline)


def _why_interrupted(conn: KernelConnection, rest: JupyterREST, ex: _Execution, files: CellFiles,
                     deadline: float | None) -> tuple[str, str] | None:
    """Our cell ended with KeyboardInterrupt and we sent no interrupt. A restart from the notebook does
    that (jupyter_client interrupts before it shuts the kernel down), and the new kernel process says
    nothing we could hear. So compare the process id in the cell's outcome file with the kernel's
    now (asked after a moment, so that the old process is gone if it is going)."""
    try:
        then = (_read_json(rest, files.path(ex.msg_id, "json"), deadline) or {}).get("pid")
        time.sleep(1.0)
        for _ in range(3):
            left = 10.0 if deadline is None else min(10.0, deadline - time.monotonic())
            if left < 1:
                break
            probe = execute(conn, rest, "print(__import__('os').getpid())", timeout=left, store_history=False,
                            on_output=lambda s, t: None, interrupt_on_timeout=False)
            if probe.ok and probe.stdout.strip().isdigit():
                if then is not None and int(probe.stdout) != then:
                    return ("KernelRestarted", "the kernel was restarted while running the code (by the notebook "
                            "or another client); everything in its memory (variables, imports, models) is lost")
                break
    except RemoteError:
        pass
    ex.error = ("KeyboardInterrupt", "the kernel was interrupted by another client (the notebook?)", ex.error[2])
    return None


def reattach(conn: KernelConnection, rest: JupyterREST, rid: str, files: CellFiles, *, timeout: float | None = None,
             on_output: OutputCallback | None = None, follow: Follow | None = None) -> RunResult:
    """Follow request `rid` again (after run() returned it as ConnectionLost or queued): its outcome
    and full output from the helper's files once it has finished, its live output until then."""
    follow = follow or Follow()
    t0 = time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    ex = _Execution(rid, on_output or print_output)
    ex.reattached = True
    failure = None
    try:
        if _retrying(lambda: _read_json(rest, files.path(rid, "json"), deadline), deadline, follow.window) is None:
            if conn.ws is None:
                conn.reconnect(rest, deadline, follow.window)
            failure = _follow(conn, rest, ex, deadline, follow, files)
    except KernelGone as e:
        failure = ("DeadKernel", f"the kernel died ({e})")
    except RemoteConnectionError as e:
        failure = _lost(e, rid)
    if failure and failure[0] == "RemoteTimeout":
        failure = ("RemoteTimeout", f"request {rid} is still running after {timeout:g} s; reattach again to keep following it")
    res = ex.to_result(time.monotonic() - t0, failure)
    if failure is None and not ex.done:
        res.ok, res.state = False, "failed"
    return _settle(res, ex, rest, files, deadline)


def _retrying(fn, deadline: float | None, window: float):
    """fn() again and again while the server cannot be reached, until the deadline (or `window` s)."""
    end = deadline if deadline is not None else time.monotonic() + window
    delay = 0.2
    while True:
        try:
            return fn()
        except RemoteConnectionError:
            if time.monotonic() + delay >= end:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _lost(e: Exception, rid: str) -> tuple[str, str]:
    return ("ConnectionLost", f"{str(e).rstrip('.')}; the code may still be running on the kernel: "
            f"runner.reattach({rid!r}) follows it")


def _settle(res: RunResult, ex: _Execution, rest: JupyterREST, files: CellFiles | None,
            deadline: float | None) -> RunResult:
    """Make the result tell the truth about its output: rebuild it from the helper's files when a
    message may be missing; say `incomplete` (and never ok) when that is impossible."""
    doubtful = ex.rate_limited or ex.reattached or res.error_name in ("OutputLost", "ConnectionLost")
    if not doubtful or res.error_name in ("DeadKernel", "KernelRestarted", "Queued"):
        return res
    outcome = None
    if files is not None:
        try:
            outcome = _read_json(rest, files.path(ex.msg_id, "json"), deadline)
            if outcome is not None:
                out = rest.read_bytes(files.path(ex.msg_id, "stdout"), timeout=_left(deadline))
                err = rest.read_bytes(files.path(ex.msg_id, "stderr"), timeout=_left(deadline))
                if out is None or err is None:
                    outcome = None
        except RemoteError:
            outcome = None
    if outcome is None:
        if res.error_name == "ConnectionLost":
            res.incomplete = True
            return res
        res.ok, res.incomplete = False, True
        res.state = "failed" if res.state == "done" else res.state
        where = f" (what was kept is in {files.folder}/{ex.msg_id}.stdout on the server)" if files else ""
        res.error_name = res.error_name or "OutputIncomplete"
        res.error_value = (res.error_value + "; " if res.error_value else "") + \
            "some of the output never arrived (a dropped connection or the server's rate limit)" + where
        if files is not None:
            res.output_file = files.path(ex.msg_id, "stdout")
        return res
    res.stdout, res.stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    res.output_file = files.path(ex.msg_id, "stdout")
    res.result = outcome.get("result") if outcome.get("result") is not None else res.result
    ok = outcome.get("status") == "ok"
    res.ok, res.state, res.incomplete = ok, "done" if ok else "failed", False
    res.error_name, res.error_value = (None, None) if ok else (outcome.get("ename"), outcome.get("evalue"))
    return res


def _left(deadline: float | None, cap: float = 30.0) -> float:
    return cap if deadline is None else max(1.0, min(cap, deadline - time.monotonic()))


def _read_json(rest: JupyterREST, path: str, deadline: float | None):
    data = rest.read_bytes(path, timeout=_left(deadline))
    try:
        return None if data is None else json.loads(data)
    except ValueError:
        return None


def _drain(conn: KernelConnection, limit: int = 10_000) -> None:
    """Read what arrived between requests (other clients' output, the server's notices), so that a
    restart announced while we were idle is not blamed on the next request."""
    for _ in range(limit):
        try:
            msg = conn.recv(0)
        except _ConnectionLost:
            conn.close()
            return
        if msg is None:
            return
        if msg.get("msg_type") == "status" and not msg.get("parent_header") and \
                msg.get("content", {}).get("execution_state") in _GONE_STATES:
            _notice("the kernel restarted since the last request: its memory (variables, imports) is gone")
            conn.restarted = True


def _wait_ready(conn: KernelConnection, rest: JupyterREST, deadline: float | None, window: float,
                limit: float = 60.0) -> None:
    """A restarted kernel answers on its request channel before the server has re-subscribed to its
    output channel (IOPub), and output sent in that gap is lost. Nudge it with kernel_info requests
    until one's status message comes back on IOPub: from then on, output arrives."""
    end = time.monotonic() + limit if deadline is None else min(deadline, time.monotonic() + limit)
    while time.monotonic() < end:
        nudge = new_message("kernel_info_request", {}, conn.session_id)
        try:
            conn.send(nudge)
            sent = time.monotonic()
            while time.monotonic() - sent < 0.5:
                msg = conn.recv(0.1)
                if msg is not None and (msg.get("parent_header") or {}).get("msg_id") == nudge["msg_id"] and \
                        (msg.get("msg_type") or msg["header"]["msg_type"]) == "status":
                    conn.restarted = False
                    return
        except _ConnectionLost:  # nothing of the user's was sent yet: reconnecting is safe
            conn.reconnect(rest, deadline, window)
    raise RemoteConnectionError(f"the kernel restarted and did not become ready within {limit:.0f} s.")


def _follow(conn: KernelConnection, rest: JupyterREST, ex: _Execution, deadline: float | None, follow: Follow,
            files: CellFiles | None) -> tuple[str, str] | None:
    """Read messages until the cell is finished; return a (name, value) failure or None."""
    ex.seen_at = time.monotonic()
    while not ex.done:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return ("RemoteTimeout", "")
        # After a reattach without a server-side buffer (another client was connected), the shell
        # reply went to the dropped socket while iopub (a broadcast) still reached us: idle suffices.
        if ex.reattached and ex.idle_at is not None and now - ex.idle_at > 2:
            ex.reply = {"status": "error" if ex.error else "ok"}
            break
        try:
            msg = conn.recv(1.0 if deadline is None else min(1.0, deadline - now))
            if msg is None:
                conn.check_alive(follow.quiet_s, follow.pong_timeout_s)
        except _ConnectionLost as e:
            _notice(f"the connection to the kernel dropped ({e}); reattaching to the running code")
            conn.reconnect(rest, deadline, follow.window)
            _notice("reattached")
            ex.reattached, ex.seen_at = True, time.monotonic()
            continue
        if msg is not None:
            ex.handle(msg)
            if ex.died:
                conn.restarted = True
                began = ex.started or _began(rest, ex, files, deadline)
                when = "while running the code" if began else \
                    "before the code began, so nothing of it ran" if began is False else \
                    "before or while running the code (which one is unknown)"
                if ex.died == "starting":  # a new kernel process announced itself: someone restarted it
                    return ("KernelRestarted", f"the kernel restarted {when}; everything in its memory "
                            "(variables, imports, loaded models) is lost")
                return ("DeadKernel", f"the kernel died {when} (server status: {ex.died}); everything in its "
                        "memory (variables, imports, loaded models) is lost")
            continue
        if _kernel_idle_without_us(rest, conn, ex, quiet=5 if ex.reattached or files else 30, deadline=deadline):
            outcome = _read_json(rest, files.path(ex.msg_id, "json"), deadline) if files else None
            if outcome is not None:  # the helper's record of the end: the files have the rest
                ex.reattached, ex.reply, ex.idle_at = True, {"status": outcome["status"]}, now
                continue
            if files is not None:  # idle, and no record of our cell's end: the kernel process was replaced
                conn.restarted = True
                began = ex.started or _began(rest, ex, files, deadline)
                if began is not False:
                    when = "while running the code" if began else "before or while running the code"
                    return ("DeadKernel", f"the kernel died (or was killed and restarted) {when}: it is idle "
                            "again and the cell never ended; everything in its memory is lost")
                return ("DeadKernel", "the kernel died (or was restarted) before it ran the code, so nothing of it "
                        "ran; everything in its memory is lost")
            if ex.error is None and ex.result is None:
                return ("OutputLost", "the kernel is idle again but the end of this code's output never arrived "
                        "(the connection dropped, or the server lost it), so its outcome is unknown")
            # An error, or the last expression's value, is the cell's last word: the outcome is known.
            ex.reply, ex.idle_at = {"status": "error" if ex.error else "ok"}, now
    return None


def _began(rest: JupyterREST, ex: _Execution, files: CellFiles | None, deadline: float | None) -> bool | None:
    """The kernel went away before our busy arrived, which a killed kernel's lost messages allow: did
    the cell begin? The helper's output files, opened by the cell's first line, say so. A cancel
    marker goes first, so that a request still in the server's queue never runs on the new kernel."""
    if files is None:
        return None
    try:
        rest.upload(files.path(ex.msg_id, "cancel"), b"", timeout=_left(deadline, 10.0))
        return rest.read_bytes(files.path(ex.msg_id, "stdout"), timeout=_left(deadline, 10.0)) is not None
    except RemoteError as e:
        if isinstance(e, KernelGone):
            raise
        return None


def _kernel_idle_without_us(rest: JupyterREST, conn: KernelConnection, ex: _Execution, quiet: float,
                            deadline: float | None) -> bool:
    """Has nothing of ours come for `quiet` seconds while the kernel (per REST) is idle? This bounds
    the wait for messages that can no longer come, without ever sending the code again."""
    if time.monotonic() - (ex.seen_at or 0.0) < quiet:
        return False
    try:
        state = rest.kernel(conn.kernel_id, timeout=_left(deadline, 10.0)).get("execution_state")
    except RemoteError as e:
        if isinstance(e, KernelGone):
            raise
        return False
    if state in ("idle", "starting"):
        return True
    ex.seen_at = time.monotonic()  # busy (our code, or a queue before it): look again later
    return False


def _after_timeout(conn: KernelConnection, rest: JupyterREST, ex: _Execution, timeout: float | None,
                   interrupt: bool, files: CellFiles | None) -> tuple[str, str]:
    _drain_ours(conn, ex)
    if not ex.started:  # still waiting behind another client's cell: an interrupt would hit that one
        if files is None:
            return ("Queued", f"the code did not start within {timeout:g} s: the kernel is busy with another "
                    "client's cell; it is still queued and will run when the kernel is free")
        try:
            rest.upload(files.path(ex.msg_id, "cancel"), b"", timeout=10)
        except RemoteError:
            return ("Queued", f"the code did not start within {timeout:g} s (the kernel is busy with another cell) "
                    "and could not be cancelled; it is still queued and will run when the kernel is free")
        _drain_ours(conn, ex)
        if not ex.started:
            return ("Queued", f"the code did not start within {timeout:g} s: the kernel is busy with another "
                    "client's cell (the notebook's?), which was left alone; the request was cancelled and will not run")
    if ex.idle_at is not None:
        return ("RemoteTimeout", f"the code did not finish within {timeout:g} s")
    if not interrupt:
        return ("RemoteTimeout", f"the code did not finish within {timeout:g} s; it is still running on the kernel")
    _quiet(rest.interrupt, conn.kernel_id)
    try:  # collect the interrupted cell's end, so the next request does not queue behind it
        _follow(conn, rest, ex, time.monotonic() + 10, Follow(window=10), None)
    except RemoteError:
        pass
    return ("RemoteTimeout", f"the code did not finish within {timeout:g} s and was interrupted")


def _drain_ours(conn: KernelConnection, ex: _Execution, wait: float = 0.2) -> None:
    end = time.monotonic() + wait
    while time.monotonic() < end:
        try:
            msg = conn.recv(max(0.01, end - time.monotonic()))
        except _ConnectionLost:
            return
        if msg is not None:
            ex.handle(msg)


def _notice(text: str) -> None:
    print(f"[flaxchat] {text}", file=sys.stderr, flush=True)


def _quiet(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except RemoteError:
        pass
