"""scripts.chat_web for real: a uvicorn server on 127.0.0.1, streamed replies, multi-turn, bad
requests as 400 with a reason, the queue, a tool call that never ends, a client that leaves; then
(slow) headless Chromium typing into the page, and 20 concurrent conversations.

The browser is driven over the Chrome DevTools protocol with websocket-client (already a
dependency), so nothing is downloaded: Debian's chromium is enough.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from flaxchat.engine import Engine
from flaxchat.loading import save_run
from scripts import chat_web
from support import ENGINE_TINY as TINY
from support import nonzero_model, scripted_model, tool_chain

pytestmark = pytest.mark.slow  # a real uvicorn server: CI runs it; `-m "not slow"` skips it


REPO = Path(__file__).resolve().parent.parent


class Server:
    """uvicorn in a thread of this process, on a socket bound to a free port."""

    def __init__(self, app):
        import uvicorn
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)
        self.thread.start()
        wait_healthy(self.url)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def wait_healthy(url, timeout=60.0, warm=False):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            h = requests.get(url + "/health", timeout=2).json()
            if not warm or h.get("warm"):
                return h
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} never became healthy")


def chat(url, messages, **kw):
    """POST a conversation; returns (status, reply text, events) reading the event stream."""
    r = requests.post(url + "/chat/completions", data=json.dumps(dict(messages=messages, **kw)), stream=True, timeout=120)
    if r.status_code != 200:
        return r.status_code, None, r.json()
    events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    return 200, "".join(e.get("token", "") for e in events), events


@pytest.fixture(scope="module")
def server(tokenizer):
    app = chat_web.create_app(Engine(nonzero_model(seed=5), tokenizer), tokenizer, slots=2,
                              limits=chat_web.Limits(max_messages=6, max_message_chars=200, max_tokens=40))
    srv = Server(app)
    yield srv
    srv.stop()


# --- in-process server ----------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_health_and_page(server):
    h = requests.get(server.url + "/health", timeout=5).json()
    assert h["status"] == "ok" and h["slots"] == 2 and h["context"] == 64
    page = requests.get(server.url + "/", timeout=5)
    assert page.status_code == 200 and 'id="input"' in page.text and "/chat/completions" in page.text


@pytest.mark.timeout(120)
def test_a_base_model_continues_the_last_message_and_health_says_so(tokenizer, monkeypatch):
    seen, generate = [], Engine.generate

    def recording(self, tokens, *args, **kwargs):  # the token ids the real engine is handed
        seen.append(list(tokens))
        return generate(self, tokens, *args, **kwargs)
    monkeypatch.setattr(Engine, "generate", recording)
    srv = Server(chat_web.create_app(Engine(nonzero_model(seed=5), tokenizer), tokenizer, mode="complete"))
    try:
        assert requests.get(srv.url + "/health", timeout=5).json()["mode"] == "complete"
        status, text, events = chat(srv.url, [{"role": "user", "content": "Once upon a time"}], max_tokens=6,
                                    temperature=0.0)
        assert status == 200 and events[-1] == {"done": True}
        assert seen[-1] == tokenizer.encode("Once upon a time", prepend=tokenizer.bos_token_id)  # no template
    finally:
        srv.stop()


@pytest.mark.parametrize("meta,asked,mode", [({"stage": "sft"}, "auto", "chat"), ({"stage": "rl"}, "auto", "chat"),
                                             ({}, "auto", "complete"), ({"train_config": {}}, "chat", "chat"),
                                             ({"stage": "sft"}, "complete", "complete")])
def test_the_mode_comes_from_the_stage_that_made_the_checkpoint_unless_the_flag_says(meta, asked, mode):
    from flaxchat.chat_mode import resolve
    got, why = resolve(meta, asked)
    assert got == mode and why.startswith(f"mode: {mode}")


@pytest.mark.timeout(120)
def test_streamed_reply_and_multi_turn(server):
    status, text, events = chat(server.url, [{"role": "user", "content": "Hello!"}], max_tokens=12, temperature=0.0)
    assert status == 200 and events[-1] == {"done": True}
    assert sum("token" in e for e in events) >= 2 and text  # several pieces, in order
    again = chat(server.url, [{"role": "user", "content": "Hello!"}], max_tokens=12, temperature=0.0)[1]
    assert again == text  # greedy is deterministic across requests
    history = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": text[:40]},
               {"role": "user", "content": "And then?"}]
    status, text2, events = chat(server.url, history, max_tokens=8)
    assert status == 200 and events[-1] == {"done": True}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("body,words", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ("{}", "'messages'"),
    ('{"messages": []}', "'messages'"),
    ('{"messages": [{"role": "system", "content": "x"}]}', "role"),
    ('{"messages": [{"role": "user", "content": 5}]}', "string content"),
    ('{"messages": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]}', "alternate"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}', "last message"),
    ('{"messages": [{"role": "user", "content": "   "}]}', "empty"),
    ('{"messages": [{"role": "user", "content": "' + "x" * 201 + '"}]}', "limit is 200"),
    (json.dumps({"messages": [{"role": r, "content": "hi"} for r in ["user", "assistant"] * 3 + ["user"]]}), "at most 6"),
    ('{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "'temperature'"),
    ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}', "'max_tokens'"),
    ('{"messages": [{"role": "user", "content": "hi"}], "top_k": -3}', "'top_k'"),
    ('{"messages": [{"role": "user", "content": "' + "a1 " * 66 + '"}]}', "context"),  # >64 tokens
])
def test_bad_requests_get_400_with_a_reason_and_the_server_stays_up(server, body, words):
    r = requests.post(server.url + "/chat/completions", data=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"], r.text
    assert requests.get(server.url + "/health", timeout=5).json()["status"] == "ok"


@pytest.mark.timeout(120)
def test_a_client_that_leaves_frees_its_slot(server):
    r = requests.post(server.url + "/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40},
                      stream=True, timeout=30)
    next(r.iter_lines())
    r.close()
    deadline = time.monotonic() + 20
    while requests.get(server.url + "/health", timeout=5).json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert requests.get(server.url + "/health", timeout=5).json()["busy"] == 0
    assert chat(server.url, [{"role": "user", "content": "Still there?"}], max_tokens=4)[0] == 200


@pytest.mark.timeout(180)
def test_a_tool_call_that_never_ends_is_cut_and_requests_queue(tokenizer):
    """The scripted model writes <|python_start|>while 1:0<|python_end|>: the sandbox times out and
    the reply says so. One slot, one queue place: a second request waits, a third gets 503."""
    call, after = tool_chain(tokenizer, "while 1:0")
    engine = Engine(scripted_model(call + after), tokenizer, tool_timeout=1.5)
    srv = Server(chat_web.create_app(engine, tokenizer, slots=1, limits=chat_web.Limits(max_queue=1)))
    try:
        msgs = [{"role": "user", "content": "loop"}]
        first = {}
        t = threading.Thread(target=lambda: first.update(r=chat(srv.url, msgs, temperature=0.0)))
        t.start()
        wait_for(srv.url, busy=1)
        second = {}
        t2 = threading.Thread(target=lambda: second.update(r=chat(srv.url, msgs, temperature=0.0)))
        t2.start()
        wait_for(srv.url, queued=1)
        status, _, body = chat(srv.url, msgs)
        assert status == 503 and "busy" in body["error"]
        t.join(60)
        t2.join(60)
        for r in (first["r"], second["r"]):
            assert r[0] == 200 and "timed out" in r[1] and r[2][-1] == {"done": True}, r
        assert any("queued" in e for e in second["r"][2])  # the waiting client was told
        assert requests.get(srv.url + "/health", timeout=5).json()["served"] == 2
    finally:
        srv.stop()


def wait_for(url, timeout=30, **want):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = requests.get(url + "/health", timeout=5).json()
        if all(h[k] == v for k, v in want.items()):
            return
        time.sleep(0.05)
    raise TimeoutError(f"health never showed {want}")


# --- the real command, a browser, many users (slow) -----------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer):
    """`python -m scripts.chat_web` in its own process, on a random run (or FLAXCHAT_WEB_RUN_DIR)."""
    model = nonzero_model(dataclasses.replace(TINY, sequence_len=256), seed=9)  # room for a few turns
    run_dir = os.environ.get("FLAXCHAT_WEB_RUN_DIR") or str(save_run(tmp_path_factory.mktemp("web") / "run", model, tokenizer))
    port = free_port()
    log = open(tmp_path_factory.mktemp("weblog") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "scripts.chat_web", "--run-dir", run_dir, "--port", str(port),
                             "--slots", "2", "--default-max-tokens", "24"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=150, warm=True)
        yield url, port
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.seek(0)
        print(log.read()[-3000:])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_twenty_concurrent_conversations_all_complete(served):
    url, _ = served
    done = {}

    def conversation(i):
        messages = [{"role": "user", "content": f"Hello, I am user {i}."}]
        for turn in range(2):
            status, text, events = chat(url, messages, max_tokens=10, temperature=0.8)
            assert status == 200 and events[-1] == {"done": True}, (i, turn, status, events)
            messages += [{"role": "assistant", "content": text[:30]}, {"role": "user", "content": "Go on."}]
        done[i] = True

    errors = []
    threads = [threading.Thread(target=lambda i=i: _catch(errors, conversation, i)) for i in range(20)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors, errors[:3]
    assert sorted(done) == list(range(20))
    h = requests.get(url + "/health", timeout=5).json()
    assert h["served"] >= 40 and h["busy"] == 0 and h["queued"] == 0
    print(f"20 conversations x 2 turns in {time.monotonic() - t0:.1f} s")


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # collected and reported by the test, not lost in a thread
        errors.append(repr(e))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_taken_port_is_one_sentence(served):
    _, port = served
    out = subprocess.run([sys.executable, "-m", "scripts.chat_web", "--run-dir", "unused", "--port", str(port)],
                         cwd=REPO, capture_output=True, text=True, timeout=110)
    assert out.returncode == 2 and "cannot listen" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("argv,words", [
    (["--slots", "0"], "--slots must be at least 1"),
    (["--port", "99999"], "--port must be between 1 and 65535"),
    # These used to start a server that refused every request leaving the field to its default:
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--default-max-tokens", "600"], "--default-max-tokens must lie between 1 and 512"),
    (["--temperature", "-2"], "--temperature must lie between 0.0 and 2.0"),
    (["--top-k", "-1"], "--top-k must lie between 0 and 1000"),
    (["--max-queue", "-1"], "--max-queue must be at least 0"),
])
def test_bad_flags_are_one_sentence_before_the_model_loads(argv, words, capsys):
    from flaxchat.errors import cli_main
    assert cli_main(chat_web.main, ["--run-dir", "/nonexistent/run", *argv]) == 2  # the model is never read
    err = capsys.readouterr().err.strip()
    assert words in err and err.count("\n") == 0, err


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class DevTools:
    """The few Chrome DevTools protocol calls the test needs, over one page's websocket."""

    def __init__(self, ws_url):
        import websocket
        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.n = 0

    def __call__(self, method, **params):
        self.n += 1
        self.ws.send(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def js(self, expr):
        res = self("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        return res["result"].get("value")

    def until(self, expr, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.js(expr):
                return
            time.sleep(0.05)
        raise TimeoutError(f"{expr}; the page shows: {self.js('document.body.innerText')!r}")

    def press_enter(self):
        key = dict(key="Enter", code="Enter", windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)
        self("Input.dispatchKeyEvent", type="keyDown", text="\r", **key)
        self("Input.dispatchKeyEvent", type="keyUp", **key)


class PacedProxy:
    """A TCP relay on 127.0.0.1 that passes the browser's bytes on at once and the server's one
    server-sent event at a time, `gap` seconds apart: tokens at a real model's pace. The tiny test
    model writes a whole 24-token reply in a few milliseconds, and a browser on a loaded machine
    then reads it in one piece (the page drew 0 then all 37 characters, both turns); through a
    network and from a model of a useful size the events come one by one, as they do here."""

    def __init__(self, upstream_port, gap=0.02):
        self.upstream, self.gap = upstream_port, gap
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.open, self.conns = True, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while self.open:
            try:
                client, _ = self.sock.accept()
            except OSError:  # the 0.5 s timeout, or closed
                continue
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=60)
            self.conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src, dst, paced):
        pending = b""
        try:
            while data := src.recv(65536):
                pending += data
                while paced and b"\n\n" in pending:  # one event (or blank-line-ended piece) per send
                    cut = pending.index(b"\n\n") + 2
                    dst.sendall(pending[:cut])
                    pending = pending[cut:]
                    time.sleep(self.gap)
                dst.sendall(pending)
                pending = b""
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.open = False
        for s in [self.sock, *self.conns]:
            s.close()


@pytest.fixture
def browser(tmp_path):
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (Debian: apt-get install -y chromium chromium-driver)")
    profile = tmp_path / "profile"
    proc = subprocess.Popen([CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
                             "--window-size=900,640", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        pages = [t for t in requests.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        yield DevTools(pages[0]["webSocketDebuggerUrl"])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_page_in_headless_chromium_streams_a_reply(served, browser, tmp_path, request):
    proxy = PacedProxy(served[1])
    request.addfinalizer(proxy.close)
    url = f"http://127.0.0.1:{proxy.port}"
    browser("Page.enable")
    browser("Page.navigate", url=url + "/")
    browser.until("document.readyState === 'complete' && !!document.getElementById('input')")
    browser.js("document.getElementById('max_tokens').value = 24; true")
    # Record every change of the reply bubble while it is being written.
    browser.js("""window.updates = [];
      new MutationObserver(() => { const all = [...document.querySelectorAll('.assistant')], b = all[all.length - 1];
        if (b) window.updates.push([all.length - 1, b.textContent, b.classList.contains('streaming')]); })
        .observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true}); true""")
    for turn, message in enumerate(["Hello! Tell me a story.", "What happened next?"]):
        browser.js("document.getElementById('input').focus()")
        browser("Input.insertText", text=message)  # typed like a user, then Enter
        browser.press_enter()
        browser.until(f"document.querySelectorAll('.assistant').length === {turn + 1} && "
                      "!document.querySelector('.assistant.streaming') && !document.getElementById('send').disabled")
    users = browser.js("[...document.querySelectorAll('.user')].map(e => e.textContent)")
    replies = browser.js("[...document.querySelectorAll('.assistant')].map(e => e.textContent)")
    assert users == ["Hello! Tell me a story.", "What happened next?"]
    assert all(r and not r.startswith("(waiting") for r in replies), replies
    assert not browser.js("document.querySelector('.error')")
    # Each reply was on the page in part (a prefix of it) while still being written: piece by piece,
    # as the paced events arrived, not all at once at the end.
    updates = browser.js("window.updates")
    partial = {turn for turn, text, streaming in updates
               if streaming and 0 < len(text) < len(replies[turn]) and replies[turn].startswith(text)}
    assert partial == {0, 1}, updates
    shot = base64.b64decode(browser("Page.captureScreenshot", format="png")["data"])
    (tmp_path / "chat_web.png").write_bytes(shot)
    if os.environ.get("FLAXCHAT_SAVE_SCREENSHOT"):
        (REPO / "docs" / "chat_web.png").write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 5000
