"""Serve a trained model as a chat web page: FastAPI + uvicorn, replies streamed as they are written.

    python -m scripts.chat_web --run-dir runs/tinystories --port 8000   # then open http://127.0.0.1:8000

Endpoints: `GET /` the page; `GET /health` status, slots and queue; `POST /chat/completions` with
{"messages": [{"role": "user", "content": "..."}, ...], "temperature"?, "top_k"?, "max_tokens"?}
answers a stream of server-sent events `data: {"token": "..."}` ending with `data: {"done": true}`.
Several users at once: `--slots` replies are generated concurrently (one compiled engine shared by
all), further requests wait in a queue (they get `{"queued": n}` events meanwhile) and are refused
with 503 only past `--max-queue`. Bad requests get HTTP 400 with one sentence in {"error": ...};
a body larger than `--max-body-bytes` (1 MiB) gets 413 and is not read further.
A model finetuned by scripts.sft or scripts.rl chats; a base model (pretraining only) continues the
last message's text instead (`--mode` overrides; `/health` and the page say which).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import socket
import sys
import threading
import time
from pathlib import Path

from fastapi import Request  # at module level: FastAPI resolves the handler's annotation by name

import flaxchat
from flaxchat.chat_mode import MODE_HELP, MODES
from flaxchat.config import ArgumentParser, flag, flag_help
from flaxchat.errors import UserError, cli_main
from flaxchat.execution import SANDBOX_CHOICES, SANDBOX_HELP

PAGE = Path(flaxchat.__file__).resolve().parent / "web" / "index.html"


@dataclasses.dataclass(frozen=True)
class Limits:
    max_message_chars: int = flag(4000, "longest message a request may carry, in characters")
    max_messages: int = flag(40, "most messages in one conversation (user and assistant)")
    max_tokens: int = flag(512, "the longest reply a request may ask for, in tokens")
    default_max_tokens: int = flag(256, "reply length for a request that names none (at most --max-tokens)")
    max_queue: int = flag(256, "requests that may wait beyond the busy slots; more get HTTP 503")
    temperature: float = flag(0.6, "sampling temperature for a request that names none (0: greedy; at most 2)")
    top_k: int = flag(50, "sample among the k likeliest tokens for a request that names none (0: all)")
    # The largest valid body is --max-messages x --max-message-chars characters, up to 6 bytes each
    # as JSON escapes (160,000 characters: 960 KB) plus the keys.
    max_body_bytes: int = flag(1_048_576, "largest request body the server reads, in bytes; a larger one gets "
                                          "HTTP 413")

    def check(self) -> None:
        """The server's own limits and defaults, as flags: one sentence at start-up, not a 400 on
        every request that leaves a field to its default."""
        for name, lo in (("max_message_chars", 1), ("max_messages", 1), ("max_tokens", 1), ("max_queue", 0),
                         ("max_body_bytes", 64)):
            if getattr(self, name) < lo:
                raise UserError(f"--{name.replace('_', '-')} must be at least {lo} (got {getattr(self, name)}).")
        for name, lo, hi in (("default_max_tokens", 1, self.max_tokens), ("temperature", *RANGES["temperature"]),
                             ("top_k", *RANGES["top_k"])):
            if not lo <= getattr(self, name) <= hi:
                raise UserError(f"--{name.replace('_', '-')} must lie between {lo} and {hi} (got {getattr(self, name)}).")


RANGES = {"temperature": (0.0, 2.0), "top_k": (0, 1000)}  # what a request (and the server's default) may ask


class BadRequest(Exception):
    """One sentence for the client, sent as HTTP 400 (or `status`)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ClientGone(Exception):
    """The client disconnected before its request was read whole: there is no one to answer."""


async def read_body(request, limit: int) -> bytes:
    """The request body, read only up to `limit` bytes: a larger one is refused (413) without
    holding it in memory (a 200 MB body used to be read whole). A client that leaves mid-body is
    `ClientGone` (Starlette's ClientDisconnect used to end in a traceback in the server's log)."""
    from starlette.requests import ClientDisconnect
    too_big = f"the request body is larger than the server's limit of {limit:,} bytes (--max-body-bytes)."
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BadRequest(too_big, 413)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BadRequest(too_big, 413)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def parse_request(body: bytes, limits: Limits) -> dict:
    """Check a /chat/completions body; returns messages and sampling settings or raises BadRequest."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e}).") from None
    except RecursionError:  # json nests one Python call per level: 100,000 levels overflow the stack
        raise BadRequest("the request body is JSON nested too deeply to read; send a flat "
                         "{\"messages\": [...]} object.") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object with a 'messages' list.")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects.")
    if len(messages) > limits.max_messages:
        raise BadRequest(f"the conversation has {len(messages)} messages; at most {limits.max_messages} are "
                         "allowed, start a new chat.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ("user", "assistant"):
            raise BadRequest(f"message {i} must be an object with role 'user' or 'assistant' and a string content.")
        if len(m["content"]) > limits.max_message_chars:
            raise BadRequest(f"message {i} has {len(m['content'])} characters; the limit is {limits.max_message_chars}.")
        if i % 2 != (0 if m["role"] == "user" else 1):
            raise BadRequest("roles must alternate user, assistant, user, ... starting with user.")
    if messages[-1]["role"] != "user":
        raise BadRequest("the last message must come from the user.")
    if not messages[-1]["content"].strip():
        raise BadRequest("the last message is empty; write something.")
    out = dict(messages=[{"role": m["role"], "content": m["content"]} for m in messages])
    for name, kind, lo, hi, default in (("temperature", (int, float), *RANGES["temperature"], limits.temperature),
                                        ("top_k", int, *RANGES["top_k"], limits.top_k),
                                        ("max_tokens", int, 1, limits.max_tokens,
                                         min(limits.default_max_tokens, limits.max_tokens))):
        value = data.get(name, default)
        if value is None:
            value = default
        if isinstance(value, bool) or not isinstance(value, kind) or not lo <= value <= hi:
            raise BadRequest(f"'{name}' must be a number from {lo} to {hi} (got {value!r}).")
        out[name] = value
    return out


class SlotPool:
    """At most `slots` replies generate at once; the rest wait in order. Waiting is counted so
    /health can report it and the queue can be bounded."""

    def __init__(self, slots: int, max_queue: int):
        self.slots, self.max_queue = slots, max_queue
        self.sem = asyncio.Semaphore(slots)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=slots, thread_name_prefix="chat-slot")
        self.waiting = 0
        self.busy = 0
        self.served = 0

    def full(self) -> bool:
        """Every slot busy and `max_queue` requests already waiting."""
        return self.busy + self.waiting >= self.slots + self.max_queue

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def create_app(engine, tokenizer, *, slots: int = 2, limits: Limits = Limits(), name: str = "flaxchat",
               mode: str = "chat"):
    """The FastAPI app around one engine. Generation runs in `slots` worker threads (JAX releases the
    GIL while it computes), tokens travel to the event loop through a queue per request. `mode`:
    "chat" renders the conversation with the chat template, "complete" continues the last message."""
    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.requests import ClientDisconnect

    class Stream(StreamingResponse):
        """A reply stream whose client may leave: under ASGI spec 2.4 Starlette raises
        ClientDisconnect from the send; the generator's `finally` has freed the slot by then."""

        async def __call__(self, scope, receive, send):
            with contextlib.suppress(ClientDisconnect):
                await super().__call__(scope, receive, send)

    from flaxchat.chat_mode import completion_prompt
    from flaxchat.loading import chat_prompt, stream_text

    state = dict(pool=None, started=time.time(), warm=False)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if state["pool"] is not None:
            state["pool"].shutdown()

    app = FastAPI(title="flaxchat", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.flaxchat = state
    page = PAGE.read_text(encoding="utf-8") if PAGE.is_file() else "<h1>flaxchat</h1><p>page missing</p>"
    context = engine.config.sequence_len

    def pool() -> SlotPool:  # created inside the running loop (asyncio objects belong to one loop)
        if state["pool"] is None:
            state["pool"] = SlotPool(slots, limits.max_queue)
        return state["pool"]

    def error(status: int, message: str):
        return JSONResponse({"error": message}, status_code=status)

    @app.get("/", response_class=HTMLResponse)
    async def index():
        return page

    @app.get("/health")
    async def health():
        p = pool()
        return dict(status="ok", model=name, mode=mode, context=context, warm=state["warm"], slots=p.slots, busy=p.busy, queued=p.waiting,
                    served=p.served, uptime_s=round(time.time() - state["started"], 1))

    @app.post("/chat/completions")
    async def chat(request: Request):
        try:
            req = parse_request(await read_body(request, limits.max_body_bytes), limits)
            if mode == "chat":
                prompt = chat_prompt(tokenizer, req["messages"])
            else:
                prompt = completion_prompt(tokenizer, req["messages"][-1]["content"])
        except ClientGone:
            return Response(status_code=400)  # nobody reads it; uvicorn drops it quietly
        except BadRequest as e:
            return error(e.status, str(e))
        except UserError as e:
            return error(400, str(e))
        if len(prompt) >= context:
            return error(400, f"the conversation is {len(prompt)} tokens long but the model's context holds "
                              f"{context}; start a new chat or shorten it.")
        p = pool()
        if p.full():
            return error(503, f"the server is busy ({p.waiting} requests waiting); try again in a moment.")
        sampling = dict(max_tokens=req["max_tokens"], temperature=float(req["temperature"]), top_k=req["top_k"])
        return Stream(_reply_events(p, engine, tokenizer, prompt, sampling, stream_text),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app


def _event(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _reply_events(pool: SlotPool, engine, tokenizer, prompt, sampling, stream_text):
    """Wait for a slot (reporting the queue), then stream the reply's text pieces as events."""
    loop = asyncio.get_running_loop()
    pool.waiting += 1
    # One acquire for the whole wait, left pending across the queued events (asyncio.wait), rather
    # than one cancelled and asked again every second (wait_for): a slot is only ever won or given
    # back here, in one place.
    acquire = asyncio.ensure_future(pool.sem.acquire())
    try:
        while not (await asyncio.wait({acquire}, timeout=1.0))[0]:
            yield _event({"queued": pool.waiting})
    except BaseException:  # the client left while waiting: give back a slot it may just have got
        if acquire.done() and not acquire.cancelled():
            pool.sem.release()
        else:
            acquire.cancel()
        raise
    finally:
        pool.waiting -= 1
    pool.busy += 1
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()

    def work():  # in a slot thread: generation never blocks the event loop
        try:
            for piece in stream_text(engine, tokenizer, prompt, seed=time.time_ns() % (1 << 31), **sampling):
                if cancel.is_set():  # the client went away: closing the generator stops the engine
                    break
                loop.call_soon_threadsafe(queue.put_nowait, ("token", piece))
        except UserError as e:
            loop.call_soon_threadsafe(queue.put_nowait, ("error", str(e)))
        except Exception as e:  # a bug: report it to this client, keep serving the others
            loop.call_soon_threadsafe(queue.put_nowait, ("error", f"internal error: {type(e).__name__}: {e}"))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, ("end", None))

    def release(_):  # the slot frees when the thread really stops, not when the client leaves
        pool.busy -= 1
        pool.served += 1
        pool.sem.release()

    future = loop.run_in_executor(pool.executor, work)
    future.add_done_callback(release)
    try:
        while True:
            kind, value = await queue.get()
            if kind == "end":
                yield _event({"done": True})
                return
            yield _event({kind: value})
    finally:
        cancel.set()


# --- command line ---------------------------------------------------------------------------------


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m scripts.chat_web", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", "-i", required=True, help="run folder (local or gs://), its checkpoints/ folder, or a checkpoints/<step> folder")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=2, help="replies generated at once (default: 2)")
    p.add_argument("--no-tools", action="store_true", help="do not run the model's Python tool calls")
    p.add_argument("--sandbox", default="strict", choices=SANDBOX_CHOICES, help=SANDBOX_HELP + " (default: strict)")
    p.add_argument("--mode", default="auto", choices=MODES, help=MODE_HELP + " (default: auto)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile for a short chat at start-up (default: on)")
    d = Limits()
    for f in dataclasses.fields(Limits):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(d, f.name)), default=getattr(d, f.name),
                       help=f"{flag_help(Limits, f.name)} (default: {getattr(d, f.name)})")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.slots < 1:
        raise UserError(f"--slots must be at least 1 (got {args.slots}).")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be between 1 and 65535 (got {args.port}).")
    limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    limits.check()
    import uvicorn

    from flaxchat.chat_mode import resolve
    from flaxchat.engine import Engine
    from flaxchat.loading import load_model

    sock = listen(args.host, args.port)  # a taken port fails before the model loads
    model, tokenizer, meta = load_model(args.run_dir, args.step)
    engine = Engine(model, tokenizer, tools=not args.no_tools, sandbox=args.sandbox)
    mode, why = resolve(meta, args.mode)
    print(why, flush=True)
    app = create_app(engine, tokenizer, slots=args.slots, limits=limits, name=f"{args.run_dir} step {meta.get('step')}",
                     mode=mode)
    if args.warmup:  # compile the common shapes now, in the background, so /health answers at once
        threading.Thread(target=warm_up, args=(engine, tokenizer, app, limits.default_max_tokens), daemon=True).start()
    print(f"serving {args.run_dir} (step {meta.get('step')}) on http://{args.host}:{sock.getsockname()[1]} "
          f"with {args.slots} slot(s)", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, so a taken port is one clear sentence (uvicorn would just exit)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another --port.") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def warm_up(engine, tokenizer, app, max_tokens: int) -> None:
    """Compile prefill and decode for a reply to a short chat message (two steps are enough)."""
    from flaxchat.loading import chat_prompt
    prompt = chat_prompt(tokenizer, [{"role": "user", "content": "Hello!"}])
    for i, _ in enumerate(engine.generate(prompt, 1, max_tokens, temperature=0.0, stop_tokens=(), chunk=1)):
        if i >= 2:
            break
    app.state.flaxchat["warm"] = True


if __name__ == "__main__":
    sys.exit(cli_main(main))
