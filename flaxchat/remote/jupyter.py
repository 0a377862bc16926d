"""The Jupyter protocol, client side: the REST API, a kernel's WebSocket channels, execute with reattach.

What KaggleRunner stands on. A Kaggle notebook is a Jupyter server behind a proxy
(`https://kkb-production.jupyter-proxy.kaggle.net/k/<id>/<signed token>/proxy`), so everything
here is plain Jupyter and is tested against a real `jupyter_server` on 127.0.0.1.

One `execute_request` is answered on two channels (messaging spec 5.3): iopub carries `status:
busy`, `execute_input`, the outputs and `status: idle`; shell carries `execute_reply`. The reply
can overtake the last outputs, so a cell is finished only when both the reply and the idle for its
msg_id have arrived. Messages from other clients' cells share iopub; we filter on parent msg_id.

When the WebSocket drops, the server keeps buffering our channels under `kernel_id:session_id` and
replays them to a client that comes back with the same session id. So a connection keeps one
session id for its life, reconnects with it, and never sends the code again by itself.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import re
import socket
import struct
import time
import uuid
from typing import Any, Callable
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

import requests
import websocket

from flaxchat.errors import UserError
from flaxchat.remote.base import OutputCallback, RemoteConnectionError, RemoteError, RunResult

V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"
# A display_data bundle with this type carries a value back to the runner (see kaggle.py): not
# the execute_result, because IPython's displayhook of a store_history=False cell tokenizes the
# last *stored* cell and fails when that one had a syntax error.
RESULT_MIME = "text/x-flaxchat-result"
MSG_SPEC_VERSION = "5.3"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class KernelGone(RemoteError):
    """The kernel was shut down, died for good, or never existed on this server."""


class _ConnectionLost(Exception):
    """The WebSocket broke; the caller reconnects with the same session id."""


# --------------------------------------------------------------------------------------------
# URLs


@dataclasses.dataclass(frozen=True)
class ServerAddress:
    # repr=False: the path of a Kaggle URL is a signed credential, like the token.
    http: str = dataclasses.field(repr=False)  # REST base, no trailing slash: http(s)://host[:port][/prefix]
    ws: str = dataclasses.field(repr=False)  # the same base as ws(s)://
    token: str | None = dataclasses.field(repr=False)
    kernel_id: str | None  # set when the URL named a kernel (a copied ".../channels" URL)

    @property
    def shown(self) -> str:
        """Scheme and host only: Kaggle puts a signed token in the path, which must never be printed."""
        parts = urlsplit(self.http)
        return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def parse_server_url(url: str, token: str | None = None) -> ServerAddress:
    """Turn what a user pastes (server base, Kaggle proxy URL, a `…/channels` URL) into an address."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    http_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    if http_scheme not in ("http", "https"):
        raise UserError(f"the server URL must start with http://, https://, ws:// or wss:// (got {scheme + '://' if scheme else 'no scheme'}).")
    if not parts.hostname:
        raise UserError("the server URL has no host name; pass the notebook's Jupyter URL (on Kaggle it ends in /proxy).")
    token = token or parse_qs(parts.query).get("token", [None])[0] or None
    path = parts.path.rstrip("/")
    kernel_id = None
    m = re.match(r"^(?P<base>.*?)/api/kernels/(?P<kid>[^/]+)(?:/channels)?$", path)
    if m:  # a channels URL copied from the browser: base and kernel id come from it; its session_id
        # belongs to the browser tab and is not reused (the server would close the tab's socket).
        path, kernel_id = m["base"], m["kid"]
    else:  # a page URL (".../lab", ".../tree/x.ipynb") or the API root: keep the server base
        path = re.sub(r"/(lab|tree|notebooks|api)(/.*)?$", "", path)
    ws_scheme = "wss" if http_scheme == "https" else "ws"
    return ServerAddress(
        http=urlunsplit((http_scheme, parts.netloc, path, "", "")),
        ws=urlunsplit((ws_scheme, parts.netloc, path, "", "")),
        token=token,
        kernel_id=kernel_id,
    )


# --------------------------------------------------------------------------------------------
# Message framing: legacy JSON text frames (what Kaggle's proxy speaks) and v1 binary frames


def new_message(msg_type: str, content: dict, session: str, channel: str = "shell") -> dict:
    header = {"msg_id": uuid.uuid4().hex, "msg_type": msg_type, "username": "flaxchat", "session": session,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "version": MSG_SPEC_VERSION}
    return {"header": header, "msg_id": header["msg_id"], "msg_type": msg_type, "parent_header": {},
            "metadata": {}, "content": content, "buffers": [], "channel": channel}


def encode_legacy(msg: dict) -> str:
    return json.dumps({k: msg[k] for k in ("header", "parent_header", "metadata", "content", "channel")}
                      | {"buffers": []})


def decode_legacy(data: str | bytes) -> dict:
    if isinstance(data, str):
        return json.loads(data)
    # A message with binary buffers: uint32 count, uint32 offsets (big-endian), JSON first.
    n = struct.unpack("!I", data[:4])[0]
    offsets = list(struct.unpack(f"!{n}I", data[4:4 * (n + 1)])) + [len(data)]
    msg = json.loads(data[offsets[0]:offsets[1]])
    msg["buffers"] = [data[a:b] for a, b in zip(offsets[1:-1], offsets[2:])]
    return msg


def encode_v1(msg: dict) -> bytes:
    # uint64 little-endian: number of offsets, then offsets of channel, header, parent, metadata,
    # content (and buffers), then the end; see jupyter_server serialize_msg_to_ws_v1.
    parts = [json.dumps(msg[k]).encode() for k in ("header", "parent_header", "metadata", "content")]
    parts += list(msg.get("buffers") or [])
    channel = msg["channel"].encode()
    offsets = [8 * (len(parts) + 3)]
    for part in [channel, *parts]:
        offsets.append(offsets[-1] + len(part))
    head = b"".join(x.to_bytes(8, "little") for x in [len(offsets), *offsets])
    return head + channel + b"".join(parts)


def decode_v1(data: bytes) -> dict:
    n = int.from_bytes(data[:8], "little")
    offsets = [int.from_bytes(data[8 * (i + 1):8 * (i + 2)], "little") for i in range(n)]
    chunks = [data[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    channel, header, parent, metadata, content, *buffers = chunks
    header = json.loads(header)
    return {"channel": channel.decode(), "header": header, "msg_type": header.get("msg_type"),
            "parent_header": json.loads(parent), "metadata": json.loads(metadata),
            "content": json.loads(content), "buffers": buffers}


# --------------------------------------------------------------------------------------------
# REST


class JupyterREST:
    """The server's REST API (kernels, contents), with every error turned into one sentence."""

    def __init__(self, address: ServerAddress, timeout: float = 30.0, get_retries: int = 2):
        self.address = address
        self.timeout = timeout
        self.get_retries = get_retries
        self.session = requests.Session()
        if address.token:
            self.session.headers["Authorization"] = f"token {address.token}"
        # Without a token the server wants XSRF protection on POST/PUT/DELETE: tornado compares the
        # _xsrf cookie with the X-XSRFToken header, so a random value sent as both passes.
        xsrf = uuid.uuid4().hex
        self.session.cookies.set("_xsrf", xsrf)
        self.session.headers["X-XSRFToken"] = xsrf

    def request(self, method: str, path: str, *, what: str, ok=(200, 201, 204), **kw) -> requests.Response:
        timeout, stream = kw.pop("timeout", self.timeout), kw.pop("stream", False)
        prepared = self.session.prepare_request(requests.Request(method, f"{self.address.http}/{path}", **kw))
        prepared.url = _unshadow(prepared.url)
        # Only GETs are retried: a repeated POST could start a second kernel or append a chunk twice.
        tries = 1 + (self.get_retries if method == "GET" else 0)
        for attempt in range(tries):
            try:
                resp = self.session.send(prepared, timeout=timeout, stream=stream)
                break
            except (requests.ConnectionError, requests.Timeout) as e:
                if attempt + 1 == tries:
                    raise RemoteConnectionError(
                        f"could not reach the Jupyter server at {self.address.shown} ({type(e).__name__}); "
                        "check that the notebook is running and the URL is current.") from None
                time.sleep(0.5 * 2 ** attempt)
        if resp.status_code in (401, 403):
            raise RemoteError(f"the Jupyter server at {self.address.shown} refused {what} (HTTP {resp.status_code}): "
                              "the token is wrong or missing; pass --token or set KAGGLE_JUPYTER_TOKEN.")
        if resp.status_code not in ok:
            raise RemoteError(f"the Jupyter server at {self.address.shown} answered HTTP {resp.status_code} "
                              f"to {what}: {_server_message(resp)}.")
        return resp

    def json(self, method: str, path: str, *, what: str, **kw) -> Any:
        resp = self.request(method, path, what=what, **kw)
        try:
            return resp.json()
        except ValueError:
            raise RemoteError(f"{self.address.shown} does not look like a Jupyter server (no JSON answer to {what}); "
                              "check the URL (on Kaggle it ends in /proxy).") from None

    def check_server(self) -> str:
        """Fail with one sentence unless this is a Jupyter server that accepts our token."""
        try:
            info = self.json("GET", "api", what="the API version request", ok=(200,))
        except RemoteError as e:
            if "HTTP 404" in str(e):
                raise RemoteError(f"{self.address.shown} does not look like a Jupyter server (no /api there); "
                                  "check the URL (on Kaggle it ends in /proxy).") from None
            raise
        if not isinstance(info, dict) or "version" not in info:
            raise RemoteError(f"{self.address.shown} does not look like a Jupyter server (unexpected /api answer).")
        self.kernels()  # /api is public; this one checks the token
        return str(info["version"])

    # kernels ----------------------------------------------------------------------------------
    def kernels(self) -> list[dict]:
        return self.json("GET", "api/kernels", what="the kernel list request", ok=(200,))

    def kernel(self, kernel_id: str) -> dict:
        resp = self.request("GET", f"api/kernels/{quote(kernel_id)}", what="the kernel status request", ok=(200, 404))
        if resp.status_code == 404:
            raise KernelGone(f"kernel {kernel_id} does not exist on the server (it died or was shut down); "
                             "start the notebook again or pass another URL.")
        return resp.json()

    def start_kernel(self, name: str | None = None) -> dict:
        # path "" starts it in the server's root folder (else it inherits the server process's cwd),
        # the folder a notebook at the top level would get: where our uploads land.
        body = {"path": ""} | ({"name": name} if name else {})
        try:
            return self.json("POST", "api/kernels", what="starting a kernel", json=body, ok=(200, 201))
        except RemoteError as e:
            if "HTTP 403" in str(e) or "HTTP 401" in str(e):
                raise RemoteError(f"no kernel is running on {self.address.shown} and the server does not allow "
                                  "starting one; open the notebook (which starts its kernel) and try again.") from None
            raise

    def interrupt(self, kernel_id: str) -> None:
        self.request("POST", f"api/kernels/{quote(kernel_id)}/interrupt", what="the interrupt request")

    def restart(self, kernel_id: str) -> None:
        self.request("POST", f"api/kernels/{quote(kernel_id)}/restart", what="the restart request", timeout=120)

    def shutdown(self, kernel_id: str) -> None:
        self.request("DELETE", f"api/kernels/{quote(kernel_id)}", what="the shutdown request")

    # contents ---------------------------------------------------------------------------------
    def model(self, path: str, content: bool = False, fmt: str | None = None) -> dict | None:
        params = {"content": int(content)} | ({"format": fmt} if fmt else {})
        resp = self.request("GET", _contents_path(path), what=f"reading {path}", ok=(200, 404), params=params)
        return None if resp.status_code == 404 else resp.json()

    def mkdir(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):  # PUT of an existing directory is a no-op
            sub = "/".join(parts[:i])
            self.request("PUT", _contents_path(sub), what=f"creating {sub}", json={"type": "directory"})

    def upload(self, path: str, data: bytes, chunk_size: int = 4 << 20) -> None:
        """Write `data` to `path`; above `chunk_size`, in numbered chunks (1, 2, …, -1 for the last),
        because proxies cap request bodies and one base64 JSON body of a big file is ~1.33x its size."""
        if "/" in path.strip("/"):
            self.mkdir(path.strip("/").rsplit("/", 1)[0])
        if len(data) <= chunk_size:
            pieces = [(None, data)]
        else:
            starts = range(0, len(data), chunk_size)
            pieces = [(-1 if s + chunk_size >= len(data) else i + 1, data[s:s + chunk_size]) for i, s in enumerate(starts)]
        for chunk, piece in pieces:
            body = {"type": "file", "format": "base64", "content": base64.b64encode(piece).decode("ascii")}
            if chunk is not None:
                body["chunk"] = chunk
            self.request("PUT", _contents_path(path), what=f"uploading {path}", json=body, timeout=300)

    def read_bytes(self, path: str) -> bytes | None:
        model = self.model(path, content=True, fmt="base64")
        return None if model is None else base64.b64decode(model["content"])

    def download_file(self, path: str, target, expected_size: int | None) -> int:
        """Stream one file to `target` (a binary file object) through /files/; return the byte count."""
        resp = self.request("GET", f"files/{quote(path)}", what=f"downloading {path}", ok=(200,), stream=True, timeout=300)
        n = 0
        with resp:
            for block in resp.iter_content(1 << 20):
                target.write(block)
                n += len(block)
        if expected_size is not None and n != expected_size:
            raise RemoteError(f"the download of {path} stopped at {n} of {expected_size} bytes; try again.")
        return n


def _contents_path(path: str) -> str:
    return "api/contents/" + quote(path.strip("/"))


# A path segment named `checkpoints` or `trust` routes to Jupyter's notebook-checkpoint and trust
# handlers instead of the Contents API (an Orbax run folder has `checkpoints/5`). Percent-encoding
# its last letter hides it from the router (which matches the raw path) while the handler gets the
# decoded path. requests undoes such escapes while preparing a URL, so this is applied afterwards.
_SHADOWED = re.compile(r"(?<=/)(checkpoints|trust)(?=/|$)")


def _unshadow(url: str) -> str:
    head, sep, rest = url.partition("/api/contents/")
    if not sep:
        return url
    path, q, query = rest.partition("?")
    path = _SHADOWED.sub(lambda m: f"{m[1][:-1]}%{ord(m[1][-1]):02X}", "/" + path)[1:]
    return head + sep + path + q + query


def _server_message(resp: requests.Response) -> str:
    try:
        body = resp.json()
        msg = (body.get("message") if isinstance(body, dict) else None) or resp.reason
    except ValueError:
        msg = resp.reason
    return str(msg).rstrip(".")[:300]


# --------------------------------------------------------------------------------------------
# WebSocket


def _quickack(sock: socket.socket | None) -> None:
    # Without it a tiny execute takes ~48 ms on loopback (Nagle on one side, delayed ACK on the
    # other); Linux clears QUICKACK after a while, so it is set again after every receive.
    if sock is not None and hasattr(socket, "TCP_QUICKACK"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        except OSError:
            pass


class KernelConnection:
    """One WebSocket to one kernel, with one session id for its whole life (reconnects included)."""

    def __init__(self, address: ServerAddress, kernel_id: str, *, protocol: str = "auto", connect_timeout: float = 30.0):
        if protocol not in ("auto", "v1", "legacy"):
            raise UserError(f"protocol must be 'auto', 'v1' or 'legacy' (got {protocol!r}).")
        self.address, self.kernel_id, self.protocol = address, kernel_id, protocol
        self.connect_timeout = connect_timeout
        self.session_id = uuid.uuid4().hex
        self.subprotocol: str | None = None
        self.connects = 0  # how many times a socket was opened (1 + reconnects)
        self.ws: websocket.WebSocket | None = None
        self.restarted = False  # the kernel restarted since our last request: wait until it is ready

    def connect(self) -> None:
        url = f"{self.address.ws}/api/kernels/{quote(self.kernel_id)}/channels?session_id={self.session_id}"
        header = [f"Authorization: token {self.address.token}"] if self.address.token else []
        offer = [V1_PROTOCOL] if self.protocol in ("auto", "v1") else None
        try:
            ws = websocket.create_connection(
                url, header=header, subprotocols=offer, timeout=self.connect_timeout, enable_multithread=True,
                skip_utf8_validation=True, sockopt=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),))
        except websocket.WebSocketBadStatusException as e:
            code = getattr(e, "status_code", None)
            if code in (401, 403):
                raise RemoteError(f"the Jupyter server at {self.address.shown} refused the kernel connection "
                                  f"(HTTP {code}): the token is wrong or missing.") from None
            if code == 404:
                raise KernelGone(f"kernel {self.kernel_id} does not exist on the server (it died or was shut down).") from None
            raise RemoteConnectionError(f"the kernel connection to {self.address.shown} failed (HTTP {code}).") from None
        except (OSError, websocket.WebSocketException) as e:
            raise RemoteConnectionError(f"could not open the kernel connection to {self.address.shown} "
                                        f"({type(e).__name__}).") from None
        self.subprotocol = ws.getsubprotocol() or None
        if self.protocol == "v1" and self.subprotocol != V1_PROTOCOL:
            ws.close()
            raise RemoteError("the server does not offer the v1 binary kernel protocol; use protocol='auto'.")
        self.ws = ws
        self.connects += 1
        _quickack(ws.sock)

    def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            try:
                ws.close(timeout=1)
            except Exception:  # a broken socket cannot be closed politely; it is gone either way
                pass

    def send(self, msg: dict) -> None:
        if self.ws is None:
            raise _ConnectionLost("not connected")
        try:
            if self.subprotocol == V1_PROTOCOL:
                self.ws.send(encode_v1(msg), opcode=websocket.ABNF.OPCODE_BINARY)
            else:
                self.ws.send(encode_legacy(msg))
        except (OSError, websocket.WebSocketException) as e:
            raise _ConnectionLost(str(e)) from None

    def recv(self, timeout: float) -> dict | None:
        """The next message, or None when none came within `timeout` seconds."""
        if self.ws is None:
            raise _ConnectionLost("not connected")
        try:
            self.ws.settimeout(max(timeout, 0.001))
            opcode, data = self.ws.recv_data()
        except websocket.WebSocketTimeoutException:
            return None
        except (OSError, websocket.WebSocketException) as e:
            raise _ConnectionLost(str(e)) from None
        _quickack(self.ws.sock)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            raise _ConnectionLost("the server closed the connection")
        if self.subprotocol == V1_PROTOCOL:
            return decode_v1(data)
        return decode_legacy(data.decode() if opcode == websocket.ABNF.OPCODE_TEXT else data)

    def ping(self) -> None:
        try:
            if self.ws is not None:
                self.ws.ping()
        except (OSError, websocket.WebSocketException):
            pass  # the next recv sees the broken socket and reconnects

    def reconnect(self, rest: JupyterREST, deadline: float | None, tries: int = 6) -> None:
        """Open a new socket with the same session id, so the server replays what it buffered."""
        self.close()
        delay, last, t0 = 0.2, "", time.monotonic()
        for _ in range(tries):
            if deadline is not None and time.monotonic() + delay > deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 8.0)
            try:
                state = rest.kernel(self.kernel_id).get("execution_state")  # KernelGone is final
                if state == "dead":
                    raise KernelGone(f"kernel {self.kernel_id} is dead; restart it from the notebook.")
                self.connect()
                return
            except KernelGone:
                raise
            except RemoteError as e:  # connection trouble (the REST or the socket); try again
                last = str(e)
        raise RemoteConnectionError(f"lost the connection to the kernel and could not reconnect within "
                                    f"{time.monotonic() - t0:.0f} s ({last or 'out of time'}).")


# --------------------------------------------------------------------------------------------
# Execute


def print_output(stream: str, text: str) -> None:
    """The default on_output: the remote stdout/stderr appear on ours as they arrive."""
    import sys
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
    died: str | None = None  # the kernel restarted or died under the cell

    @property
    def done(self) -> bool:
        return self.reply is not None and self.idle_at is not None

    def handle(self, msg: dict) -> None:
        mtype, content = msg.get("msg_type") or msg["header"]["msg_type"], msg.get("content") or {}
        if msg.get("parent_header", {}).get("msg_id") != self.msg_id:
            # The server itself announces a restart or death with a parentless status message.
            if mtype == "status" and content.get("execution_state") in ("restarting", "dead", "autorestarting"):
                self.died = content["execution_state"]
            return
        self.seen_at = time.monotonic()
        if mtype == "stream":
            name, text = content.get("name", "stdout"), content.get("text", "")
            (self.stderr if name == "stderr" else self.stdout).append(text)
            self.on_output(name, text)
        elif mtype == "execute_result":
            self.result = content.get("data", {}).get("text/plain")
            if self.result is not None and self.echo_result:
                self.on_output("stdout", self.result + "\n")
        elif mtype == "display_data" and RESULT_MIME in content.get("data", {}):
            self.result = content["data"][RESULT_MIME]
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
        elif mtype == "status" and content.get("execution_state") == "idle":
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
        ok = failure is None and name is None and self.reply is not None
        return RunResult(state="done" if ok else "failed", ok=ok, stdout="".join(self.stdout),
                         stderr="".join(self.stderr), result=self.result, error_name=name, error_value=value,
                         traceback=tb, elapsed=elapsed)


def execute(conn: KernelConnection, rest: JupyterREST, code: str, *, timeout: float | None = None,
            on_output: OutputCallback | None = None, interrupt_on_timeout: bool = True,
            store_history: bool = True, echo_result: bool = True) -> RunResult:
    """Run `code` on the kernel; stream its output; return when it has finished (or failed).

    A timeout is a failure: the cell is interrupted (unless told otherwise) and the result says so.
    A dropped connection is reattached with the same session id and the same request is followed;
    the code is never sent twice.
    """
    t0 = time.monotonic()
    deadline = None if timeout is None else t0 + timeout
    content = {"code": code, "silent": False, "store_history": store_history, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": True}
    msg = new_message("execute_request", content, conn.session_id)
    ex = _Execution(msg["msg_id"], on_output or print_output, echo_result)
    try:
        _drain(conn)
        if conn.ws is None:  # nothing was sent yet, so a plain reconnect is safe
            conn.reconnect(rest, deadline)
        if conn.restarted:
            _wait_ready(conn, rest, deadline)
        try:
            conn.send(msg)
            reattached = False
        except _ConnectionLost:  # it may or may not have reached the server: follow, do not resend
            conn.reconnect(rest, deadline)
            reattached = True
        failure = _follow(conn, rest, ex, deadline, reattached)
    except KernelGone as e:
        failure = ("DeadKernel", f"the kernel died while running the code ({e})")
    except KeyboardInterrupt:  # a local Ctrl-C also stops the remote cell, then propagates
        _quiet(rest.interrupt, conn.kernel_id)
        raise
    if failure and failure[0] == "RemoteTimeout":
        failure = _after_timeout(conn, rest, ex, timeout, interrupt_on_timeout)
    return ex.to_result(time.monotonic() - t0, failure)


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
                msg.get("content", {}).get("execution_state") in ("restarting", "dead", "autorestarting"):
            _notice("the kernel restarted since the last request: its memory (variables, imports) is gone")
            conn.restarted = True


def _wait_ready(conn: KernelConnection, rest: JupyterREST, deadline: float | None, limit: float = 60.0) -> None:
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
                if msg is not None and msg.get("parent_header", {}).get("msg_id") == nudge["msg_id"] and \
                        (msg.get("msg_type") or msg["header"]["msg_type"]) == "status":
                    conn.restarted = False
                    return
        except _ConnectionLost:  # nothing of the user's was sent yet: reconnecting is safe
            conn.reconnect(rest, deadline)
    raise RemoteConnectionError(f"the kernel restarted and did not become ready within {limit:.0f} s.")


def _follow(conn: KernelConnection, rest: JupyterREST, ex: _Execution, deadline: float | None,
            reattached: bool) -> tuple[str, str] | None:
    """Read messages until the cell is finished; return a (name, value) failure or None."""
    heard = ex.seen_at = time.monotonic()
    while not ex.done:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return ("RemoteTimeout", "")
        # After a reattach without a server-side buffer (another client was connected), the shell
        # reply went to the dropped socket while iopub (a broadcast) still reached us: idle suffices.
        if reattached and ex.idle_at is not None and now - ex.idle_at > 2:
            ex.reply = {"status": "error" if ex.error else "ok"}
            break
        try:
            msg = conn.recv(1.0 if deadline is None else min(1.0, deadline - now))
        except _ConnectionLost:
            _notice("the connection to the kernel dropped; reattaching to the running code")
            conn.reconnect(rest, deadline)
            _notice("reattached (output printed at the moment of the drop may be missing)")
            reattached, heard, ex.seen_at = True, time.monotonic(), time.monotonic()
            continue
        if msg is not None:
            heard = time.monotonic()
            ex.handle(msg)
            if ex.died:
                conn.restarted = True
                return ("DeadKernel", f"the kernel died while running the code (server status: {ex.died}); "
                        "everything in its memory is lost")
            continue
        if now - heard > 30:  # proxies (Kaggle's included) drop WebSockets that stay silent too long
            conn.ping()
            heard = now
        if _kernel_idle_without_us(rest, conn, ex, quiet=5 if reattached else 30):
            if ex.error is None and ex.result is None:
                return ("OutputLost", "the kernel is idle again but the end of this code's output never arrived "
                        "(the connection dropped, or the server lost it), so its outcome is unknown")
            # An error, or the last expression's value, is the cell's last word: the outcome is known.
            ex.reply, ex.idle_at = {"status": "error" if ex.error else "ok"}, now
    return None


def _kernel_idle_without_us(rest: JupyterREST, conn: KernelConnection, ex: _Execution, quiet: float) -> bool:
    """Has nothing of ours come for `quiet` seconds while the kernel (per REST) is idle? This bounds
    the wait for messages that can no longer come, without ever sending the code again."""
    if time.monotonic() - (ex.seen_at or 0.0) < quiet:
        return False
    try:
        state = rest.kernel(conn.kernel_id).get("execution_state")
    except RemoteError as e:
        if isinstance(e, KernelGone):
            raise
        return False
    if state in ("idle", "starting"):
        return True
    ex.seen_at = time.monotonic()  # busy (our code, or a queue before it): look again later
    return False


def _after_timeout(conn: KernelConnection, rest: JupyterREST, ex: _Execution, timeout: float | None,
                   interrupt: bool) -> tuple[str, str]:
    if not interrupt:
        return ("RemoteTimeout", f"the code did not finish within {timeout:g} s; it is still running on the kernel")
    _quiet(rest.interrupt, conn.kernel_id)
    try:  # collect the interrupted cell's end, so the next request does not queue behind it
        _follow(conn, rest, ex, time.monotonic() + 10, reattached=False)
    except RemoteError:
        pass
    return ("RemoteTimeout", f"the code did not finish within {timeout:g} s and was interrupted")


def _notice(text: str) -> None:
    import sys
    print(f"[flaxchat] {text}", file=sys.stderr, flush=True)


def _quiet(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except RemoteError:
        pass
