"""The Jupyter protocol, client side: the REST API and a kernel's WebSocket channels (cells.py executes).

What KaggleRunner stands on. A Kaggle notebook is a Jupyter server behind a proxy
(`https://kkb-production.jupyter-proxy.kaggle.net/k/<id>/<signed token>/proxy`), so everything
here is plain Jupyter and is tested against a real `jupyter_server` on 127.0.0.1.

When the WebSocket drops, the server keeps buffering our channels under `kernel_id:session_id` and
replays them to a client that comes back with the same session id, but only while no other client
is attached to the kernel (on Kaggle the notebook's tab usually is). So a connection keeps one
session id for its life, reconnects with it, and never sends the code again by itself; cells.py
checks the output against files on the server wherever a message may be missing. A socket that
stays silent gets a ping; no answer at all within a bound means a frozen connection: replaced.
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
from typing import Any
from urllib.parse import parse_qs, quote, urlsplit, urlunsplit

import requests
import websocket

from flaxchat.errors import UserError
from flaxchat.runner.base import RemoteConnectionError, RemoteError

V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"
MSG_SPEC_VERSION = "5.3"


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
        bounded = kw.get("timeout") not in (None, self.timeout)  # a caller's deadline: no retries past it
        timeout, stream = kw.pop("timeout", None) or self.timeout, kw.pop("stream", False)
        prepared = self.session.prepare_request(requests.Request(method, f"{self.address.http}/{path}", **kw))
        prepared.url = _unshadow(prepared.url)
        # Only GETs are retried: a repeated POST could start a second kernel or append a chunk twice.
        tries = 1 + (self.get_retries if method == "GET" and not bounded else 0)
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

    def kernel(self, kernel_id: str, timeout: float | None = None) -> dict:
        resp = self.request("GET", f"api/kernels/{quote(kernel_id)}", what="the kernel status request", ok=(200, 404),
                            timeout=timeout or self.timeout)
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
    def model(self, path: str, content: bool = False, fmt: str | None = None, timeout: float | None = None) -> dict | None:
        params = {"content": int(content)} | ({"format": fmt} if fmt else {})
        resp = self.request("GET", _contents_path(path), what=f"reading {path}", ok=(200, 404), params=params,
                            timeout=timeout or self.timeout)
        return None if resp.status_code == 404 else resp.json()

    def delete(self, path: str) -> None:
        self.request("DELETE", _contents_path(path), what=f"deleting {path}", ok=(204, 404))

    def mkdir(self, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):  # PUT of an existing directory is a no-op
            sub = "/".join(parts[:i])
            self.request("PUT", _contents_path(sub), what=f"creating {sub}", json={"type": "directory"})

    def upload(self, path: str, data: bytes, chunk_size: int = 4 << 20, timeout: float = 300) -> None:
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
            self.request("PUT", _contents_path(path), what=f"uploading {path}", json=body, timeout=timeout)

    def read_bytes(self, path: str, timeout: float | None = None) -> bytes | None:
        model = self.model(path, content=True, fmt="base64", timeout=timeout)
        return None if model is None else base64.b64decode(model["content"])

    def read_range(self, path: str, start: int, limit: int = 1 << 20, timeout: float | None = None,
                   tail: int | None = None) -> bytes | None:
        """Bytes [start, start+limit) of a file through /files/ with a Range header, or its last `tail`
        bytes (None: no such file). The server answers 416 when `start` is at the end: nothing new."""
        rng = f"bytes=-{tail}" if tail else f"bytes={start}-{start + limit - 1}"
        resp = self.request("GET", f"files/{quote(path)}", what=f"reading {path}", ok=(200, 206, 404, 416),
                            headers={"Range": rng}, timeout=timeout or self.timeout)
        if resp.status_code == 404:
            return None
        if resp.status_code == 416:
            return b""
        data = resp.content
        if resp.status_code == 200:  # the server ignored Range: cut the answer ourselves
            return data[-tail:] if tail else data[start:start + limit]
        return data

    def download_file(self, path: str, target, expected_size: int | None, start: int = 0) -> int:
        """Stream one file to `target` (a binary file object, positioned at `start`) through /files/,
        from byte `start` on (a Range request: a broken download resumes); return the bytes now there."""
        headers = {"Range": f"bytes={start}-"} if start else {}
        resp = self.request("GET", f"files/{quote(path)}", what=f"downloading {path}", ok=(200, 206), stream=True,
                            timeout=300, headers=headers)
        n = start
        with resp:
            if start and resp.status_code == 200:  # no Range support: start over
                target.seek(0)
                target.truncate()
                n = 0
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
        self.heard = 0.0  # when the socket last delivered anything (a message or a pong)
        self.ping_sent: float | None = None  # an unanswered ping went out then
        self.current = None  # the execution in progress (cells.py), for stop() from another thread

    def connect(self, timeout: float | None = None) -> None:
        url = f"{self.address.ws}/api/kernels/{quote(self.kernel_id)}/channels?session_id={self.session_id}"
        header = [f"Authorization: token {self.address.token}"] if self.address.token else []
        offer = [V1_PROTOCOL] if self.protocol in ("auto", "v1") else None
        try:
            ws = websocket.create_connection(
                url, header=header, subprotocols=offer, timeout=min(self.connect_timeout, timeout or self.connect_timeout),
                enable_multithread=True,
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
        self.heard = time.monotonic()
        self.ping_sent = None
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
            opcode, data = self.ws.recv_data(control_frame=True)
        except websocket.WebSocketTimeoutException:
            return None
        except (OSError, websocket.WebSocketException) as e:
            raise _ConnectionLost(str(e)) from None
        _quickack(self.ws.sock)
        self.heard, self.ping_sent = time.monotonic(), None
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            raise _ConnectionLost("the server closed the connection")
        if opcode in (websocket.ABNF.OPCODE_PONG, websocket.ABNF.OPCODE_PING):
            return None  # websocket-client answers pings itself; a pong proves the socket is alive
        if self.subprotocol == V1_PROTOCOL:
            return decode_v1(data)
        return decode_legacy(data.decode() if opcode == websocket.ABNF.OPCODE_TEXT else data)

    def check_alive(self, quiet_s: float, pong_timeout_s: float) -> None:
        """A socket silent for `quiet_s` gets a ping; one that answers nothing (not even the pong) for
        `pong_timeout_s` after it is frozen (a proxy that stopped forwarding, a sleeping laptop):
        raise _ConnectionLost, so that the caller reconnects instead of waiting forever."""
        now = time.monotonic()
        if self.ping_sent is not None and now - self.ping_sent > pong_timeout_s:
            self.close()
            raise _ConnectionLost(f"no answer to a ping within {pong_timeout_s:g} s (a frozen connection)")
        if self.ping_sent is None and now - self.heard > quiet_s:
            self.ping_sent = now
            try:
                if self.ws is not None:
                    self.ws.ping()
            except (OSError, websocket.WebSocketException) as e:
                raise _ConnectionLost(str(e)) from None

    def reconnect(self, rest: JupyterREST, deadline: float | None, window: float = 300.0) -> None:
        """Open a new socket with the same session id, so the server replays what it buffered. Keeps
        trying until `deadline` (the caller's), or for `window` seconds when the caller set none;
        every REST probe and connect attempt ends before that."""
        self.close()
        t0 = time.monotonic()
        end = deadline if deadline is not None else t0 + window
        delay, last = 0.2, ""
        while time.monotonic() + delay < end:
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
            left = end - time.monotonic()
            try:
                state = rest.kernel(self.kernel_id, timeout=max(0.5, min(10.0, left))).get("execution_state")
                if state == "dead":  # KernelGone (404) is final, too
                    raise KernelGone(f"kernel {self.kernel_id} is dead; restart it from the notebook.")
                self.connect(timeout=max(0.5, min(10.0, end - time.monotonic())))
                return
            except KernelGone:
                raise
            except RemoteError as e:  # connection trouble (the REST or the socket); try again
                last = str(e)
        raise RemoteConnectionError(f"lost the connection to the kernel and could not reconnect within "
                                    f"{end - t0:.0f} s ({last.rstrip('.') or 'out of time'}).")
