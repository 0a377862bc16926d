"""Pretraining end to end: the main job, the stop helper, and bad input (exact resume after Ctrl-C and
SIGTERM: tests/test_preemption.py; after kill -9: tests/test_nothing_lost.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

from flaxchat.checkpoint import Checkpointer
from flaxchat.config import GPTConfig
from flaxchat.errors import cli_main
from flaxchat.gpt import GPT
from support import tiny_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = tiny_flags(eval_every=0, sample_every=0)


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _pretrain(args, timeout=300):
    return subprocess.run([sys.executable, "-m", "scripts.pretrain", *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _final_params(run_dir):
    ck = Checkpointer(os.path.join(run_dir, "checkpoints"), async_save=False)
    meta = ck.read_meta()
    model = GPT(GPTConfig.from_dict(meta["model_config"]), rngs=nnx.Rngs(0))
    meta = ck.restore(model)
    ck.close()
    return meta["step"], nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.mark.timeout(30)
def test_stop_on_ctrl_c_as_sft_and_rl_use_it():
    """The helper all three loops use: the first Ctrl-C only asks; the loop's next boundary saves that
    step (not one already saved, not step 0) and raises; a second Ctrl-C interrupts at once; the
    previous handler comes back. Disabled (several processes), the process's own handler is left alone."""
    from flaxchat.stage import StopOnSignal

    class Checkpoints:  # what stop_here reads of a Checkpointer
        def __init__(self, latest):
            self.latest, self.closed = latest, False

        def latest_step(self):
            return self.latest

        def raise_if_failed(self):  # no save failed
            pass

        def close(self):
            self.closed = True

    before = signal.getsignal(signal.SIGINT)
    saved, said = [], []
    with StopOnSignal(said.append) as stop:
        stop.stop_here(3, Checkpoints(None), saved.append)  # nothing asked: goes on
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert stop.requested and "stopping after this step" in said[-1]
        ck = Checkpoints(4)
        with pytest.raises(KeyboardInterrupt):
            stop.stop_here(7, ck, saved.append)
        assert saved == [7] and ck.closed and said[-1].startswith("stopped at step 7; run the same command")
        with pytest.raises(KeyboardInterrupt):
            stop.stop_here(7, Checkpoints(7), saved.append)  # already saved: not again
        with pytest.raises(KeyboardInterrupt):
            stop.stop_here(0, Checkpoints(None), saved.append)  # nothing trained: nothing to save
        assert saved == [7] and said[-1] == "stopped at step 0; nothing was trained yet."
        with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is before
    with StopOnSignal(said.append, processes=2, sync_point=lambda step: False):
        assert signal.getsignal(signal.SIGINT) is before  # disabled: whatever handled Ctrl-C still does


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_tinystories_loss_falls_and_writes_the_run_folder(tmp_path):
    run = tmp_path / "stories"
    r = subprocess.run([sys.executable, "-m", "scripts.run_tinystories", "--depth=2", "--steps=80",
                        "--sequence-len=64", "--vocab-size=512", "--device-batch-size=4", "--total-batch-size=512",
                        "--eval-every=40", "--eval-tokens=4096", "--sample-every=0", "--save-every=40", "--log-every=10",
                        "--max-chars-tokenizer=2000000", f"--run-dir={run}"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=550)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for word in ("data: built-in procedural stories", "tok/s", "mfu", "eta", "val bpb", "sampled stories"):
        assert word in out, word
    entries = [json.loads(l) for l in open(run / "metrics.jsonl")]
    losses = [e["loss"] for e in entries if e["kind"] == "train"]
    assert losses[-1] < losses[0] - 1.5, losses
    bpb = [e["val_bpb"] for e in entries if e["kind"] == "val"]
    assert len(bpb) == 2 and bpb[1] < bpb[0]
    for name in ("report.md", "loss.png", "samples.txt", "config.json", "COMPLETE"):
        assert (run / name).exists(), name
    assert open(run / "loss.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "![loss](loss.png)" in (run / "report.md").read_text()
    assert len((run / "samples.txt").read_text().split()) > 20
    for name in ("model.pkl", "weights.npz", "model.stablehlo", "model.mlir", "tokenizer"):
        assert (run / "export" / name).exists(), name  # exported by default


def _main(argv, capsys):
    from scripts import pretrain
    code = cli_main(pretrain.main, argv)
    return code, capsys.readouterr()


@pytest.mark.parametrize("argv,words", [
    (["--no-such-flag"], "unrecognized arguments"),
    (["--depth=0", "--steps=1"], "--depth must be at least 1"),
    (["--window-pattern=SXL", "--steps=1"], "window pattern"),
    (["--optimizer=sgd"], "--optimizer must be"),
    (["--ns-dtype=fp8"], "--ns-dtype must be one of auto, float32, bfloat16, bf16-products, bf16-operands"),
    (["--data=/no/such/place/*.txt", "--steps=1"], "/no/such/place"),
    # Values that used to run as something else, or end in a traceback after minutes of work:
    (["--steps=0"], "--steps must be positive, or -1"),  # ran the derived horizon
    (["--steps=-5"], "--steps must be positive, or -1"),
    (["--total-batch-size=0", "--steps=1"], "--total-batch-size must be positive, or -1"),
    (["--param-data-ratio=0"], "--param-data-ratio must be positive"),  # ZeroDivisionError
    (["--log-every=0", "--steps=1"], "--log-every must be at least 1"),  # ZeroDivisionError
    (["--num-samples=-1", "--steps=1"], "--num-samples 0 or more"),  # sampled 2 of the 3 prompts
    (["--keep-checkpoints=0", "--steps=1"], "--keep-checkpoints must be at least 1"),  # kept none, the last too
    (["--save-every=-3", "--steps=1"], "--save-every must be 0 (never) or more"),
    (["--matrix-lr=-1", "--steps=1"], "--matrix-lr must be 0 or more"),  # trained, climbing the loss
    (["--weight-decay=-0.1", "--steps=1"], "--weight-decay must be 0 or more"),
    (["--adam-beta1=1.5", "--steps=1"], "--adam-beta1 and --adam-beta2 must lie in [0, 1)"),
])
def test_bad_input_is_one_sentence_and_nonzero(argv, words, capsys, tmp_path):
    code, cap = _main([*argv, f"--run-dir={tmp_path / 'r'}"], capsys)
    assert code == 2
    assert words in cap.err
    assert "Traceback" not in cap.err and len(cap.err.strip().splitlines()) == 1


def test_every_flag_says_what_it_does(capsys):
    import argparse
    import dataclasses
    from flaxchat.config import TrainConfig, add_dataclass_args
    from scripts import pretrain
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, TrainConfig)  # as pretrain's parse_args builds it
    helps = {a.dest: a.help for a in parser._actions}
    for f in dataclasses.fields(TrainConfig):
        words = helps[f.name].rsplit(" (default:", 1)[0].strip()
        assert len(words.split()) >= 3, f"--{f.name.replace('_', '-')} has no help: {helps[f.name]!r}"
    with pytest.raises(SystemExit):
        pretrain.parse_args(["--help"])
    assert "Polar Express" in capsys.readouterr().out  # the texts reach --help


@pytest.mark.parametrize("argv", [["--window-pattern=SXL"], ["--depth=3", "--sequence-len=1"], ["--warmdown-ratio=2"]])
def test_config_errors_come_before_any_work(argv, capsys, tmp_path):
    """A bad --window-pattern once surfaced only after the tokenizer had trained, as a 'cannot
    schedule new futures after shutdown' traceback: config errors are found before anything runs."""
    code, cap = _main([*argv, "--steps=1", f"--run-dir={tmp_path / 'r'}"], capsys)
    assert code == 2 and "Traceback" not in cap.err and len(cap.err.strip().splitlines()) == 1
    assert cap.out == "" and not (tmp_path / "r").exists()  # no device set up, no tokenizer, no folder


def test_empty_corpus_is_refused(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    code, cap = _main([f"--data={tmp_path / 'empty.txt'}", "--steps=1", f"--run-dir={tmp_path / 'r'}"], capsys)
    assert code == 2 and "empty" in cap.err


def test_corrupt_checkpoint_is_reported_and_kept(capsys, tmp_path, tokenizer_dir):
    run = tmp_path / "r"
    step_dir = run / "checkpoints" / "5"
    (step_dir / "meta").mkdir(parents=True)
    (step_dir / "meta" / "metadata").write_text("{not json")
    (step_dir / "_CHECKPOINT_METADATA").write_text("{also broken")
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    code, cap = _main([*TINY, f"--tokenizer-dir={tokenizer_dir}", "--steps=2", f"--run-dir={run}"], capsys)
    assert code == 2, cap.err
    assert "checkpoint" in cap.err and "--fresh" in cap.err
    after = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    assert set(before) <= set(after)  # nothing the user had was removed
    assert (step_dir / "meta" / "metadata").read_text() == "{not json"


def test_side_by_side_micro_batches_are_chosen_by_the_backend_and_cpu():
    from flaxchat import kernels
    from flaxchat.kernels.cpu import halves_a_lone_micro_batch
    intel, amd = "vendor_id\t: GenuineIntel\nflags\t\t: avx512f amx_bf16\n", "vendor_id\t: AuthenticAMD\nflags\t\t: avx512f\n"
    assert kernels.choose("cpu").plan.scan_unroll == 2 and kernels.choose("cpu").plan.flat_gradient_reduce
    for backend in ("tpu", "gpu"):  # memory binds there; XLA's all-reduce combiner merges the arrays
        plan = kernels.choose(backend).plan
        assert (plan.scan_unroll, plan.halve_lone_micro_batch, plan.flat_gradient_reduce) == (1, False, False)
    assert halves_a_lone_micro_batch(amd)
    assert not halves_a_lone_micro_batch(intel)  # measured no faster there
    assert not halves_a_lone_micro_batch("")


@pytest.mark.parametrize("count,rows,halves", [(1, 4, False), (1, 4, True), (1, 3, True), (4, 2, True), (3, 2, False)])
def test_gradient_sums_are_the_same_side_by_side(monkeypatch, count, rows, halves):
    """Micro-batches two at a time, and a lone one in halves, give the sums one whole micro-batch at
    a time gives, to float rounding; an odd count, and an odd number of rows (kept whole), work."""
    import flaxchat.train as train
    from flaxchat import kernels
    cfg = GPTConfig(sequence_len=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    graphdef, params, rest = nnx.split(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    x = np.random.default_rng(0).integers(0, 300, (count, rows, 32)).astype(np.int32)
    y = np.roll(x, -1, -1)
    y[..., :5] = -1  # masked targets are not counted
    scanned = []
    real_scan = jax.lax.scan
    monkeypatch.setattr(jax.lax, "scan", lambda f, init, xs, **kw: scanned.append(xs[0].shape) or real_scan(f, init, xs, **kw))
    out = {}
    for side in (1, 2):
        plan = kernels.StepPlan(scan_unroll=side, halve_lone_micro_batch=side > 1 and halves)
        out[side] = jax.jit(lambda p, r, b: train._gradient_sums(graphdef, plan, p, r, b))(params, rest, (x, y))
    split = halves and count == 1 and rows % 2 == 0
    assert scanned == [(count, rows, 32), (2, rows // 2, 32) if split else (count, rows, 32)]
    (g1, l1, n1), (g2, l2, n2) = out[1], out[2]
    assert int(n1) == int(n2) == count * rows * 27
    assert float(l2) == pytest.approx(float(l1), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_the_step_holds_the_plan_and_the_model_only_its_kernels(monkeypatch):
    """The step's plan reaches the scan from StepLoop (this backend's when none is given); the model
    carries neither the plan nor Muon's settings, so neither can reach it."""
    import dataclasses

    from flaxchat import kernels
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import StepLoop
    fields = lambda record: {f.name for f in dataclasses.fields(record)}
    assert not fields(kernels.Kernels) & (fields(kernels.StepPlan) | fields(kernels.PolarExpress))
    cfg = GPTConfig(sequence_len=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    model = GPT(cfg, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, build_optimizer(OptimConfig(n_embd=64), Schedule(10)), wrt=nnx.Param)
    assert StepLoop(model, opt).plan is kernels.choose().plan
    x = np.zeros((1, 4, 32), np.int32)
    scanned = []
    real_scan = jax.lax.scan
    monkeypatch.setattr(jax.lax, "scan", lambda f, init, xs, **kw: scanned.append((xs[0].shape, kw.get("unroll")))
                        or real_scan(f, init, xs, **kw))
    for plan in (kernels.StepPlan(), kernels.StepPlan(scan_unroll=2, halve_lone_micro_batch=True)):
        StepLoop(model, opt, plan=plan).lower(x, x)
    assert scanned == [((1, 4, 32), 1), ((2, 2, 32), 2)]


def test_step_loop_trains_exactly_as_train_step_and_hands_back_its_arrays_on_sync():
    """StepLoop is train_step with a faster call: the same losses and parameters bit for bit. Until
    sync() the model holds donated arrays, so using it fails loudly instead of reading stale ones."""
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import StepLoop, train_step
    cfg = GPTConfig(sequence_len=32, vocab_size=300, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)

    def build():
        model = GPT(cfg, rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, build_optimizer(OptimConfig(n_embd=64), Schedule(10)), wrt=nnx.Param)

    x = np.random.default_rng(0).integers(0, 300, (2, 2, 32)).astype(np.int32)
    y = np.roll(x, -1, -1)
    (m1, o1), (m2, o2) = build(), build()
    loop = StepLoop(m2, o2)
    plain = [float(train_step(m1, o1, x, y)) for _ in range(3)]
    looped = [float(loop(x, y)) for _ in range(3)]
    assert looped == plain and plain[2] < plain[0]
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(m2.lm_head.kernel[...])  # donated to the loop's first step
    loop.sync()
    for a, b in zip(jax.tree.leaves(nnx.state((m1, o1))), jax.tree.leaves(nnx.state((m2, o2)))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(loop(x, y)) == float(train_step(m1, o1, x, y))  # and it goes on from there


def test_lr_batch_rule_follows_how_often_the_run_reads_its_text():
    """`--lr-batch-scaling auto`: nanochat's sqrt(B/2^19) rule with the automatic batch, and with a
    batch you give once the run reads its text REPEAT_PASSES times or more (bench.quality: on a text
    read ~5 times the LRs as given climbed 0.64 bpb above nanochat by step 600)."""
    from flaxchat.recipe import REPEAT_PASSES, batch_scaling_applies
    assert batch_scaling_applies("auto", -1, None) and batch_scaling_applies("auto", -1, 0.1)
    assert batch_scaling_applies("auto", 2048, REPEAT_PASSES) and batch_scaling_applies("auto", 2048, 5.0)
    assert not batch_scaling_applies("auto", 2048, 0.3) and not batch_scaling_applies("auto", 2048, None)
    assert batch_scaling_applies("on", 2048, 0.0) and not batch_scaling_applies("off", -1, 9.0)


def test_estimated_passes_counts_documents_as_the_loader_packs_them(tmp_path):
    from flaxchat.data.sources import resolve_source
    from flaxchat.tokenizer import Tokenizer
    from flaxchat.recipe import estimated_passes
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    docs = [" ".join(words[i % 8:] + words[:i % 8]) * (1 + i % 3) for i in range(400)]
    (tmp_path / "t.txt").write_text("\n\n".join(docs) + "\n")
    src = resolve_source(str(tmp_path / "t.txt"), split="train")
    tok = Tokenizer.train(iter(docs), 300)
    exact = sum(len(tok.encode(src.doc(i))) + 1 for i in range(len(src)))  # + BOS, no document cut at 256
    assert estimated_passes(src, tok, 3 * exact, 256) == pytest.approx(3.0, rel=0.05)
    cut = sum(min(len(tok.encode(src.doc(i))) + 1, 9) for i in range(len(src)))  # rows of 8 cut every document
    assert estimated_passes(src, tok, cut, 8) == pytest.approx(1.0, rel=0.05)
