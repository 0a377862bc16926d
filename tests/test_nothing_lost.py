"""Nothing a user made is lost, end to end: readers never disturb a run that is training, kill -9 at
several moments (mid-save among them) resumes bit for bit, a damaged latest step falls back, a full
disk stops training with one sentence and resumes, a rerun of a finished run keeps its figures, and
every bad input is one sentence and a non-zero exit before any long work.

The training runs are depth 1 on 32-token rows (seconds per run), started as `scripts.pretrain`
subprocesses the way a user starts them."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import requests
from flax import nnx

from flaxchat.errors import cli_main
from support import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_flags(sample_every=0)


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _pretrain(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "scripts.pretrain", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _start(args):
    return subprocess.Popen([sys.executable, "-m", "scripts.pretrain", *args], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _params(run_dir, step=None):
    from flaxchat.loading import load_model
    model, _, meta = load_model(run_dir, step, with_tokenizer=False)
    return meta["step"], nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _assert_equal(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)  # bitwise


# --- readers while training --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chat_eval_export_and_sft_read_a_run_while_it_trains_and_it_ends_as_if_undisturbed(tmp_path, tokenizer_dir):
    """The run saves every step (keep 2) while chat_cli and sft --base (subprocesses) and the load
    paths of chat/eval, SFT's base and export (in a loop here) read it. The old readers opened the
    run as its owner and deleted the save in flight: the trainer died with NOT_FOUND."""
    from flaxchat.export import read_checkpoint
    from flaxchat.loading import load_model, read_run

    common = [*TINY, "--eval-every=0", f"--tokenizer-dir={tokenizer_dir}", "--steps=80", "--save-every=1"]
    ref = tmp_path / "undisturbed"
    # The reference saves only its last step: saving never changes what trains (the SIGTERM tests
    # compare runs that save every 4 steps with one that never does), and its 79 other saves took
    # about a third of this test's time.
    r = _pretrain([*common[:-1], "--save-every=0", f"--run-dir={ref}"])
    assert r.returncode == 0, r.stderr[-2000:]
    run = tmp_path / "live"
    trainer = _start([*common, f"--run-dir={run}"])
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(trainer.stdout), daemon=True)
    reader.start()
    deadline = time.time() + 300
    while not (run / "checkpoints" / "2").is_dir() and time.time() < deadline and trainer.poll() is None:
        time.sleep(0.05)
    clis = [subprocess.Popen([sys.executable, "-m", "scripts.chat_cli", "-i", str(run), "-p", "hi", "--max-tokens", "2"],
                             cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            subprocess.Popen([sys.executable, "-m", "scripts.sft", "--base", str(run), "--run-dir", str(tmp_path / "sft"),
                              "--mix=chat:0.01", "--val-mix=chat:0.01", "--steps=1", "--device-batch-size=2",
                              "--eval-every=0"],
                             cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    reads = 0
    while trainer.poll() is None and time.time() < deadline:
        load_model(run, with_tokenizer=False)  # chat_cli, chat_web, eval
        read_run(run)  # sft/rl --base, before the weights (the sft subprocess reads those too)
        read_checkpoint(str(run))  # export
        reads += 3
    trainer.wait(timeout=300)
    reader.join(10)
    for p in clis:
        text = p.communicate(timeout=300)[0]
        assert p.returncode == 0, text[-2000:]
    assert trainer.returncode == 0, "".join(out)[-3000:]
    assert reads >= 6, f"only {reads} reads happened while the run trained"
    print(f"{reads} in-process reads and {len(clis)} CLI readers while the run trained 80 steps, saving each")
    step_a, a = _params(ref)
    step_b, b = _params(run)
    assert step_a == step_b == 80
    _assert_equal(a, b)


# --- kill -9 at several moments, and the rerun of a finished run --------------------------------------

MOMENTS = {  # the line after which the run is killed, the step folder that must have landed first
    "after compiling, before any save": ("compiled the train step", None),
    "mid-save, the first write in flight": ("step 00004 | saving checkpoint", None),
    "mid-save of step 8, step 4 landed": ("step 00008 | saving checkpoint", "4"),
    "after the last save, before COMPLETE": ("--- sampled stories ---", "12"),
}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_kill_9_at_several_moments_resumes_bit_for_bit_and_a_finished_rerun_keeps_its_figures(tmp_path, tokenizer_dir):
    common = [*TINY, "--eval-every=1000", "--eval-tokens=256", f"--tokenizer-dir={tokenizer_dir}", "--steps=12",
              "--save-every=4"]
    ref = tmp_path / "uninterrupted"
    r = _pretrain([*common, f"--run-dir={ref}"])
    assert r.returncode == 0, r.stderr[-2000:]
    ref_report = [line for line in (ref / "report.md").read_text().splitlines() if "val bpb" in line or "final loss" in line]
    assert len(ref_report) == 2 and "| - |" not in " ".join(ref_report), ref_report
    _, want = _params(ref)
    for n, (moment, (line_seen, landed)) in enumerate(MOMENTS.items()):
        run = tmp_path / f"killed-{n}"
        proc = _start([*common, f"--run-dir={run}"])
        seen = []
        deadline = time.time() + 300
        for line in proc.stdout:
            seen.append(line)
            if line_seen in line or time.time() > deadline:
                break
        while landed and not (run / "checkpoints" / landed).is_dir() and time.time() < deadline:
            time.sleep(0.01)  # the asynchronous write of that step lands (the loop waits for it at the next save)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert any(line_seen in s for s in seen), (moment, "".join(seen)[-2000:])
        assert not (run / "COMPLETE").exists()
        junk = run / "checkpoints" / "9.orbax-checkpoint-tmp-1234"
        if landed == "4":  # a save a kill cut short leaves a temp folder: plant one for certain, it must be ignored
            junk.mkdir(parents=True)
            (junk / "junk").write_text("half-written")
        again = _pretrain([*common, f"--run-dir={run}"])
        assert again.returncode == 0, (moment, again.stderr[-2000:])
        assert not junk.exists(), moment  # cleaned up
        step, got = _params(run)
        assert step == 12, moment
        _assert_equal(want, got)
        resumed = next((line for line in again.stdout.splitlines() if line.startswith("resumed from")), "started over")
        assert (landed is None) or resumed.startswith("resumed from step "), (moment, resumed)
        print(f"kill -9 {moment}: {resumed.split(' in ')[0]}; the 12-step weights equal the uninterrupted run's")
        if moment.startswith("after the last save"):  # the rerun of a finished run: nothing to train
            assert "resumed from step 12" in again.stdout
            last = again.stdout.strip().splitlines()[-1]
            assert "val bpb" in last and "no validation" not in last, last
            report = [line for line in (run / "report.md").read_text().splitlines()
                      if "val bpb" in line or "final loss" in line]
            assert report == ref_report, (report, ref_report)


# --- a damaged latest step, a full disk ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flipped_bytes_in_the_latest_step_are_caught_before_training_and_the_run_resumes_the_step_before(
        tmp_path, tokenizer_dir):
    common = [*TINY, "--eval-every=0", f"--tokenizer-dir={tokenizer_dir}", "--steps=8", "--save-every=4"]
    run = tmp_path / "run"
    r = _pretrain([*common, f"--run-dir={run}"])
    assert r.returncode == 0, r.stderr[-2000:]
    _, want = _params(run)
    from test_checkpoint_integrity import damage
    damage(str(run / "checkpoints" / "8"), "flipped bytes")
    (run / "COMPLETE").unlink()
    again = _pretrain([*common, f"--run-dir={run}"])
    assert again.returncode == 0, again.stderr[-2000:]
    warn = [line for line in again.stdout.splitlines() if line.startswith("warning: checkpoint step 8")]
    assert len(warn) == 1 and "does not match the checksum" in warn[0] and "using step 4" in warn[0], again.stdout
    assert "resumed from step 4 " in again.stdout
    moved = os.listdir(f"{run}/checkpoints.damaged")
    assert len(moved) == 1 and moved[0].startswith("8-")  # kept, not deleted
    _assert_equal(want, _params(run)[1])  # retrained from step 4 to where it was




@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_full_disk_stops_training_with_one_sentence_and_the_same_command_resumes(tmp_path, tokenizer_dir, small_disk):
    """Steps of ~1 MB on a 3 MB disk: the third save (step 300) cannot be written while two are kept.
    The old loop printed tracebacks and trained on past the failed save until the next one (step
    400, the last); now the step after the failure is known stops it (the write fails ~0.5 s after
    it starts, and these steps take ~10 ms)."""
    common = [*TINY, "--log-every=10", "--eval-every=0", f"--tokenizer-dir={tokenizer_dir}", "--steps=400",
              "--save-every=100"]
    ref = tmp_path / "ref"
    assert _pretrain([*common, f"--run-dir={ref}"]).returncode == 0
    run = small_disk / "run"
    r = _pretrain([*common, f"--run-dir={run}"])
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-2000:])
    err = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    assert err[-1].startswith("error: saving checkpoint step ") and "no space left on the device" in err[-1], err[-5:]
    failed = int(err[-1].split()[4])
    trained = [int(line.split()[1].split("/")[0]) for line in r.stdout.splitlines() if line.startswith("step ") and "/" in line]
    assert failed == 300 and max(trained) < 400, trained  # stopped before the next save
    left = sorted(os.listdir(run / "checkpoints"))
    assert all(name.isdigit() and int(name) < failed for name in left), left  # no half step
    subprocess.run(["mount", "-o", "remount,size=30m", str(small_disk)], check=True)  # the user frees space
    again = _pretrain([*common, f"--run-dir={run}"])
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"resumed from step {max(int(n) for n in left)} " in again.stdout
    _assert_equal(_params(ref)[1], _params(run)[1])


# --- bad input: one sentence, non-zero, before the work --------------------------------------------------


def _cli(main, argv, capsys):
    code = cli_main(main, argv)
    return code, capsys.readouterr()


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf", "1e9", "0"])
def test_sft_mix_weights_must_be_finite_and_bounded(weight, tmp_path, capsys):
    from scripts import sft
    code, cap = _cli(sft.main, ["--base", str(tmp_path), "--run-dir", str(tmp_path / "s"), f"--mix=chat:{weight}"], capsys)
    assert code == 2 and "weight of task 'chat'" in cap.err and "at most 1000" in cap.err, cap.err
    assert len(cap.err.strip().splitlines()) == 1


def test_a_mixture_too_large_for_memory_is_refused_before_it_is_built():
    import tasks
    from flaxchat.errors import UserError
    with pytest.raises(UserError, match="more than 50,000,000"):
        tasks.TaskMixture([tasks.get_task("chat")] * 20, [1000.0] * 20)


@pytest.mark.parametrize("content,words", [
    (b'{"messages": ["hello", "hi"]}\n', "not an object"),
    (b'{"messages": [{"role": "user", "content": "h\xff\xfei"}, {"role": "assistant", "content": "x"}]}\n', "not UTF-8"),
    (b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]}\n', "not a string"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "not valid JSON"),
])
def test_smoltalk_rows_of_the_wrong_shape_are_one_sentence_before_any_model_loads(content, words, tmp_path):
    import tasks
    from flaxchat.errors import UserError
    good = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    f = tmp_path / "smol.jsonl"
    f.write_bytes(good * 3 + content + good)  # the bad row is not the first: every row is checked
    with pytest.raises(UserError, match=words):
        tasks.parse_mix(f"smoltalk@{f}", split="train")


def test_export_and_tok_train_refuse_a_file_as_their_folder_before_the_work(tmp_path, capsys):
    from scripts import export, tok_train
    afile = tmp_path / "a-file"
    afile.write_text("mine")
    code, cap = _cli(export.main, ["--run-dir", str(tmp_path), "--out-dir", str(afile)], capsys)
    assert code == 2 and "is a file, not a folder" in cap.err
    code, cap = _cli(tok_train.main, ["--out", str(afile), "--vocab-size=300", "--max-chars=200000"], capsys)
    assert code == 2 and "is a file, not a folder" in cap.err and "reading" not in cap.out  # before training
    assert afile.read_text() == "mine"


@pytest.mark.parametrize("argv,words", [(["-t", "nan"], "-t/--temperature"), (["-t", "inf"], "-t/--temperature"),
                                        (["--top-p", "nan"], "top_p"), (["--max-tokens", "0"], "--max-tokens")])
def test_chat_cli_sampling_flags_are_checked_before_the_model_loads(argv, words, tmp_path, capsys):
    from scripts import chat_cli
    code, cap = _cli(chat_cli.main, ["-i", str(tmp_path / "no-run"), "-p", "hi", *argv], capsys)
    assert code == 2 and words in cap.err and len(cap.err.strip().splitlines()) == 1, cap.err


@pytest.fixture
def read_only_run(tmp_path):
    """A run folder that cannot be written: a read-only bind mount for root (who ignores permission
    bits), mode 555 for anyone else."""
    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.loading import save_run
    from flaxchat.tokenizer import Tokenizer
    from support import nonzero_model

    run = tmp_path / "ro"
    tok = Tokenizer.train([StoriesCorpus(seed=0).doc(i) for i in range(100)], 512, max_chars=50_000)
    save_run(run, nonzero_model(seed=1), tok, step=3)
    if os.geteuid() == 0:
        if subprocess.run(["mount", "--bind", str(run), str(run)], capture_output=True).returncode != 0:
            pytest.skip("cannot bind-mount a read-only folder here")
        subprocess.run(["mount", "-o", "remount,bind,ro", str(run)], check=True)
        yield run
        subprocess.run(["umount", str(run)], check=True)
    else:
        for d, _, _ in os.walk(run):
            os.chmod(d, 0o555)
        yield run
        for d, _, _ in os.walk(run):
            os.chmod(d, 0o755)


def test_read_only_destinations_are_one_sentence_before_the_work(read_only_run, capsys):
    from scripts import convert_to_tflite, eval as eval_script, export
    before = sorted(os.listdir(read_only_run))
    for main, argv in ((eval_script.main, ["--model", str(read_only_run), "--tasks", "spelling", "--limit", "2"]),
                       (export.main, ["--run-dir", str(read_only_run)]),
                       (convert_to_tflite.main, ["--checkpoint", str(read_only_run), "--no-verify"])):
        code, cap = _cli(main, argv, capsys)
        assert code == 2 and "cannot write to" in cap.err and len(cap.err.strip().splitlines()) == 1, cap.err
        assert "evaluating" not in cap.out and "wrote" not in cap.out  # nothing was computed to be lost
    assert sorted(os.listdir(read_only_run)) == before


# --- the web server's limits ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def web():
    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.engine import Engine
    from flaxchat.tokenizer import Tokenizer
    from scripts import chat_web
    from test_chat_web import Server
    from support import nonzero_model

    tok = Tokenizer.train([StoriesCorpus(seed=0).doc(i) for i in range(100)], 512, max_chars=50_000)
    srv = Server(chat_web.create_app(Engine(nonzero_model(seed=5), tok), tok, slots=1,
                                     limits=chat_web.Limits(max_tokens=4, max_body_bytes=300_000)))
    yield srv
    srv.stop()


def _post(url, body: bytes):
    host, port = url.split("//")[1].split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        c.request("POST", "/chat/completions", body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@pytest.mark.timeout(120)
def test_the_web_server_caps_the_body_refuses_deep_json_with_400_and_stays_healthy(web):
    ok = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    assert _post(web.url, ok)[0] == 200
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 400_000}]}).encode()  # valid JSON, too big
    status, body = _post(web.url, big)
    assert status == 413 and "--max-body-bytes" in json.loads(body)["error"]
    status, body = _post(web.url, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and "nested too deeply" in json.loads(body)["error"]
    assert requests.get(web.url + "/health", timeout=5).json()["status"] == "ok"
    assert _post(web.url, ok)[0] == 200


def test_the_body_limit_is_a_flag_with_help(capsys):
    from scripts import chat_web
    assert chat_web.parse_args(["-i", "x", "--max-body-bytes", "2048"]).max_body_bytes == 2048
    with pytest.raises(SystemExit):
        chat_web.parse_args(["--help"])
    assert "--max-body-bytes" in capsys.readouterr().out
    code, cap = _cli(chat_web.main, ["-i", "x", "--max-body-bytes", "0"], capsys)
    assert code == 2 and "--max-body-bytes" in cap.err


# --- the run remembers its tokenizer -------------------------------------------------------------------


def test_another_tokenizer_of_the_same_size_is_one_sentence(tmp_path):
    # Resuming with another tokenizer of the same vocabulary size used to be accepted (the loss went
    # from 1.09 to 5.91 with no word): the checkpoint records the tokenizer's fingerprint.
    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.tokenizer import Tokenizer, fingerprint_beside
    run, own, other = tmp_path / "run", tmp_path / "own", tmp_path / "other"
    base = [*TINY, "--eval-every=0", f"--run-dir={run}"]
    r = _pretrain([*base, f"--tokenizer-dir={own}", "--steps=2"])
    assert r.returncode == 0, r.stderr[-2000:]
    Tokenizer.train((StoriesCorpus(seed=7).doc(i) for i in range(300)), 300).save(other)
    assert Tokenizer.load(other).vocab_size == Tokenizer.load(own).vocab_size
    assert Tokenizer.load(other).fingerprint() != Tokenizer.load(own).fingerprint()
    r = _pretrain([*base, f"--tokenizer-dir={other}", "--steps=4"])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"the checkpoint in {run} was trained with another tokenizer" in r.stderr
    assert r.stderr.strip().count("\n") == 0
    # --base: a finetuning stage on a run whose tokenizer folder was replaced.
    Tokenizer.load(other).save(run / "tokenizer")
    sft = subprocess.run([sys.executable, "-m", "scripts.sft", f"--base={run}", f"--run-dir={tmp_path / 'sft'}",
                          "--steps=1"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert sft.returncode == 2 and f"the checkpoint of --base {run} was trained with another tokenizer" in sft.stderr, \
        sft.stderr[-2000:]
    # --init-from: the weights of a run whose tokenizer is not this run's.
    assert fingerprint_beside(str(run)) == Tokenizer.load(other).fingerprint()
    r = _pretrain([*TINY, "--eval-every=0", f"--run-dir={tmp_path / 'init'}", f"--tokenizer-dir={own}",
                   f"--init-from={run}", "--steps=1"])
    assert r.returncode == 2 and f"--init-from {run} was trained with another tokenizer" in r.stderr, r.stderr[-2000:]


def test_a_checkpoint_from_before_fingerprints_is_taken_as_it_is():
    from flaxchat.tokenizer import Tokenizer
    tok = Tokenizer.train(["a b c d e f g"] * 10, 270)
    tok.check_matches(None, "an old checkpoint", "")  # no fingerprint recorded: no refusal
    tok.check_matches(tok.fingerprint(), "this checkpoint", "")


# --- out of memory is one sentence ---------------------------------------------------------------------

_CAPPED_PRETRAIN = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))  # XLA's CPU client then fails as a full HBM does
from flaxchat.errors import cli_main
from scripts.pretrain import main
sys.exit(cli_main(main, sys.argv[1:]))
"""


@pytest.mark.slow
def test_out_of_memory_is_one_sentence_and_the_next_run_trains(tmp_path):
    # The case was a raw `JaxRuntimeError: RESOURCE_EXHAUSTED ... 62530539144 bytes`.
    run = tmp_path / "run"
    big = [a for a in TINY if not a.startswith(("--device-batch-size", "--total-batch-size"))]
    r = subprocess.run([sys.executable, "-c", _CAPPED_PRETRAIN, *big, "--device-batch-size=32768",
                        "--total-batch-size=1048576", "--eval-every=0", f"--run-dir={run}", "--steps=2"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    err = r.stderr.strip()
    assert err.count("\n") == 0 and err.startswith("error: out of memory in the train step (an allocation of ")
    for words in ("--device-batch-size 32768 x --sequence-len 32", "lower --device-batch-size", "--grad-checkpoint",
                  "bench.scale --topology"):
        assert words in err
    assert not os.listdir(run / "checkpoints")
    # Nothing left behind trips the next run: a batch that fits trains in the same folder.
    r = _pretrain([*TINY, "--eval-every=0", f"--run-dir={run}", "--steps=1"])
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.timeout(180)
def test_a_client_dropping_mid_stream_leaves_no_traceback_and_the_next_is_served():
    # The case: `starlette.requests.ClientDisconnect` with a traceback in the server's log.
    import logging
    import socket
    import struct

    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.engine import Engine
    from flaxchat.tokenizer import Tokenizer
    from scripts import chat_web
    from test_chat_web import Server, chat
    from support import nonzero_model

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    tok = Tokenizer.train([StoriesCorpus(seed=0).doc(i) for i in range(100)], 512, max_chars=50_000)
    srv = Server(chat_web.create_app(Engine(nonzero_model(seed=5), tok), tok, slots=1,
                                     limits=chat_web.Limits(max_tokens=400)))
    for name in ("uvicorn.error", "uvicorn", ""):
        logging.getLogger(name).addHandler(handler)
    try:
        host, port = srv.url.split("//")[1].split(":")
        for _ in range(3):
            body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}).encode()
            s = socket.create_connection((host, int(port)), timeout=60)
            s.sendall(b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            got, deadline = b"", time.monotonic() + 60
            while b'{"token"' not in got:  # the reply is streaming
                chunk = s.recv(4096)
                assert chunk and time.monotonic() < deadline, f"no token in 60 s; the reply so far: {got[-600:]!r}"
                got += chunk
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, as a dropped tab
            s.close()
            time.sleep(1.0)
        # Dropped while sending its body: the server was reading it (`request.stream()`).
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(b"POST /chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n" + b'{"messages": [' + b" " * 5000)
        time.sleep(0.5)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        time.sleep(1.0)
        status, text, _ = chat(srv.url, [{"role": "user", "content": "hello"}], max_tokens=3)
        assert status == 200 and text is not None
        assert requests.get(srv.url + "/health", timeout=5).json()["status"] == "ok"
    finally:
        for name in ("uvicorn.error", "uvicorn", ""):
            logging.getLogger(name).removeHandler(handler)
        srv.stop()
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() + str(r.exc_info and r.exc_info[1].__class__) for r in errors]


# --- the remaining rows: each one sentence -----------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--matrix-lr=nan", "--embedding-lr=inf", "--scalar-lr=-0.1",
                                  "--param-data-ratio=nan"])
def test_non_finite_or_negative_rates_are_refused_when_the_flags_are_read(flag, tmp_path, capsys):
    # --matrix-lr=nan used to train 5 steps and then say "the loss became nan".
    from scripts import pretrain
    assert cli_main(pretrain.main, [flag, f"--run-dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag.split("=")[0] in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before anything is made


def test_sft_lr_frac_nan_is_refused(tmp_path, capsys):
    from scripts import sft
    assert cli_main(sft.main, ["--base=x", f"--run-dir={tmp_path}", "--lr-frac=nan"]) == 2
    assert "--lr-frac must be positive and finite (got nan)" in capsys.readouterr().err


def test_a_run_folder_that_is_a_symlink_loop_is_named_as_one(tmp_path, capsys):
    # Used to read "File exists".
    from scripts import pretrain
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert cli_main(pretrain.main, [*TINY, f"--run-dir={loop}", "--steps=1"]) == 2
    err = capsys.readouterr().err
    assert f"{loop} is a symbolic link that leads nowhere: a loop, or its target is missing" in err
    assert "File exists" not in err


def test_a_parquet_without_a_text_column_names_a_flag_that_exists(tmp_path, capsys):
    # The hint used to be "pick one with the text field option", an option pretrain did not have.
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flaxchat.data.sources import resolve_source
    from scripts import pretrain
    data = tmp_path / "data.parquet"
    pq.write_table(pa.table({"content": [f"document {i} says hello to the world" for i in range(50)]}), data)
    assert cli_main(pretrain.main, [*TINY, f"--data={data}", f"--run-dir={tmp_path / 'run'}", "--steps=1"]) == 2
    err = capsys.readouterr().err
    assert "has no column 'text' (columns: content)" in err and "--text-field" in err
    assert pretrain.parse_args([f"--data={data}", "--text-field=content"]).text_field == "content"
    assert resolve_source(str(data), field="content").doc(0) == "document 0 says hello to the world"


def test_metrics_jsonl_that_is_a_symlink_is_refused_not_written_through(tmp_path):
    # Used to append through the link into another file.
    from flaxchat.errors import UserError
    from flaxchat.report import MetricsLog
    other = tmp_path / "precious.txt"
    other.write_text("mine\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(other)
    with pytest.raises(UserError, match=r"metrics.jsonl is a symbolic link \(to .*precious.txt\).*remove the link"):
        MetricsLog(str(link))
    link.unlink()
    log = MetricsLog(str(link))
    log.append(step=1, loss=2.0)
    link.unlink()
    link.symlink_to(other)  # put there while the run trains
    with pytest.raises(UserError, match="symbolic link"):
        log.append(step=2, loss=1.0)
    assert other.read_text() == "mine\n"
