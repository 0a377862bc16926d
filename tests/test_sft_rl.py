"""SFT and RL: loss masks, packing and its resume state, the policy-gradient step, both scripts end
to end on a tiny base model (exact SFT resume included), and every bad input as one sentence."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tasks
from flaxchat.chat_data import ConversationLoader
from flaxchat.config import GPTConfig
from flaxchat.errors import UserError, cli_main
from flaxchat.gpt import GPT
from flaxchat.loading import load_model, save_run
from flaxchat.optim import OptimConfig, Schedule, build_optimizer
from flaxchat.train import StepLoop, train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = GPTConfig(sequence_len=128, vocab_size=512, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
CONVERSATION = {"messages": [
    {"role": "user", "content": "What is 3 plus 4?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me add. "},
                                      {"type": "python", "text": "3+4"},
                                      {"type": "python_output", "text": "7"},
                                      {"type": "text", "text": " #### 7"}]},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "You are welcome."},
]}


@pytest.fixture(scope="module")
def tokenizer():
    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.tokenizer import Tokenizer
    texts = [StoriesCorpus(seed=0).doc(i) for i in range(150)]
    texts += [str(c["messages"]) for c in list(tasks.parse_mix("chat,arithmetic,spelling", split="train"))[:600]]
    return Tokenizer.train(texts, 512, max_chars=400_000)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    model = GPT(TINY, rngs=nnx.Rngs(0))
    return save_run(tmp_path_factory.mktemp("base") / "run", model, tokenizer, step=5)


def _run(script, *args, timeout=420):
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", f"scripts.{script}", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


# --- masks and packing -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_only_assistant_tokens_train(tokenizer):
    ids, mask = tokenizer.render_conversation(CONVERSATION)
    s = tokenizer.special_tokens
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert trained == ("Let me add. <|python_start|>3+4<|python_end|> #### 7<|assistant_end|>"
                       "You are welcome.<|assistant_end|>")
    untrained = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "What is 3 plus 4?" in untrained and "<|output_start|>7<|output_end|>" in untrained
    assert mask[ids.index(s["<|assistant_start|>"])] == 0
    # In a packed row, a target is the next token exactly where that token is trained, else -1.
    loader = ConversationLoader([CONVERSATION], tokenizer, rows=1, seq_len=len(ids) + 5)
    x, y = loader.next_batch()
    n = len(ids)
    assert x[0, :n].tolist() == ids and (x[0, n:] == tokenizer.bos_token_id).all()
    want = [ids[i + 1] if mask[i + 1] else -1 for i in range(n - 1)]
    assert y[0, :n - 1].tolist() == want and (y[0, n - 1:] == -1).all()


@pytest.mark.timeout(60)
def test_packing_keeps_conversations_whole_and_resumes_exactly(tokenizer):
    data = tasks.parse_mix("chat,arithmetic", split="val")
    loader = ConversationLoader(data, tokenizer, rows=4, seq_len=128, seed=3)
    rendered = {tuple(tokenizer.render_conversation(data[i], 129)[0]) for i in range(len(data))}
    x, _ = loader.next_batch()
    bos = tokenizer.bos_token_id
    for row in x:
        starts = [i for i, t in enumerate(row) if t == bos] + [len(row) + 1]
        pieces = [tuple(row[a:b]) for a, b in zip(starts, starts[1:]) if len(row[a:b]) > 1]
        # The inputs drop the row's last token, so a conversation that ends exactly there shows one short.
        whole = [p for p in pieces if p in rendered or any(len(r) == len(p) + 1 and r[:-1] == p for r in rendered)]
        assert whole and len(whole) == len(pieces)  # best-fit with padding: no conversation is cut
    loader.next_batch()
    state = loader.state_dict()
    after = [loader.next_batch() for _ in range(3)]
    again = ConversationLoader(data, tokenizer, rows=4, seq_len=128, seed=3)
    again.load_state_dict(state)
    for (a, b), (c, d) in zip(after, [again.next_batch() for _ in range(3)]):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    # Two streams split the conversations between them: nothing shared, nothing left out.
    s0 = ConversationLoader(data, tokenizer, 1, 128, seed=3, stream=0, streams=2)._epoch_order()
    s1 = ConversationLoader(data, tokenizer, 1, 128, seed=3, stream=1, streams=2)._epoch_order()
    assert not set(s0) & set(s1) and len(s0) + len(s1) == len(data)


@pytest.mark.timeout(120)
def test_policy_step_is_train_step_with_weights():
    """RL's step (StepLoop with per-token weights, nothing divided): weights of 1/count give the SFT
    update; a negative advantage pushes the other way."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(0, 512, (1, 2, 16)), jnp.int32)
    y = jnp.asarray(np.where(rng.random((1, 2, 16)) < 0.5, rng.integers(0, 512, (1, 2, 16)), -1), jnp.int32)

    def fresh():
        model = GPT(TINY, rngs=nnx.Rngs(1))
        cfg = OptimConfig(optimizer="adamw", matrix_lr=0.01, embedding_lr=0.01, unembedding_lr=0.01, scalar_lr=0.01,
                          smear_lr=0.01, weight_decay=0.0, adam_beta1=0.9, n_embd=TINY.n_embd)
        return model, nnx.Optimizer(model, build_optimizer(cfg, Schedule(10)), wrt=nnx.Param)

    def policy_step(model, optimizer, *batches):
        step = StepLoop(model, optimizer, normalise=False)
        step(*batches)
        step.sync()

    m1, o1 = fresh()
    m2, o2 = fresh()
    train_step(m1, o1, x, y)
    count = float(jnp.sum(y >= 0))  # the policy step divides nothing: the weights carry the mean
    policy_step(m2, o2, x, y, jnp.full(y.shape, 1.0 / count, jnp.float32))
    for a, b in zip(jax.tree.leaves(nnx.state(m1, nnx.Param)), jax.tree.leaves(nnx.state(m2, nnx.Param))):
        # atol: a scalar whose gradient is ~0 at init takes Adam's eps-regime step, where the
        # rounding of (sum w g) versus (sum g)/count shows (3e-4 of a 0.01 step).
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=5e-4)

    def nll(model):
        from flaxchat.train import token_losses
        return float(jnp.sum(token_losses(model, x[0], y[0])))

    m3, o3 = fresh()
    start = nll(m3)
    policy_step(m3, o3, x, y, jnp.full(y.shape, -1.0, jnp.float32))
    assert nll(m3) > start  # penalised tokens became less likely
    m4, o4 = fresh()
    policy_step(m4, o4, x, y, jnp.full(y.shape, 1.0, jnp.float32))
    assert nll(m4) < start


@pytest.mark.timeout(300)
def test_sft_starts_from_the_pretraining_optimizer_state_with_its_lrs(tokenizer, tmp_path):
    """chat_sft: momenta and Adam moments come from the pretraining checkpoint, the schedules start
    again at 0 (Adam's own count stays, matching its moments), the LRs are the pretraining run's."""
    import dataclasses as dc
    from flaxchat.checkpoint import Checkpointer
    from flaxchat.common import mesh_scope
    from flaxchat.finetune import StageOptim, open_stage
    model = GPT(TINY, rngs=nnx.Rngs(0))
    pre = OptimConfig(n_embd=TINY.n_embd, matrix_lr=0.03, batch_lr_scale=0.5)
    opt = nnx.Optimizer(model, build_optimizer(pre, Schedule(10, warmup_steps=0)), wrt=nnx.Param)
    rng = np.random.default_rng(0)
    for _ in range(2):
        opt.update(model, jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), nnx.state(model, nnx.Param)))
    base = tmp_path / "pre"
    ck = Checkpointer(str(base / "checkpoints"), async_save=False)
    ck.save(2, model, opt, dict(model_config=TINY.to_dict(), optim_config=dc.asdict(pre)))
    ck.close()
    tokenizer.save(base / "tokenizer")
    flat = lambda o: {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(o, nnx.optimizer.OptState))}
    want = flat(opt)
    lines = []
    with mesh_scope():
        stage = open_stage(str(base), str(tmp_path / "sft"), name="sft", steps=10, log=lines.append,
                           optim=StageOptim(lr_frac=0.8, warmdown_ratio=0.5, from_base_optimizer=True))
        got = flat(stage.optimizer)
        stage.checkpointer.close()
    assert any("optimizer state" in l for l in lines) and any("matrix_lr 0.03" in l for l in lines), lines
    assert stage.base_lrs["matrix_lr"] == 0.03 and stage.base_lrs["batch_lr_scale"] == 0.5  # saved for RL
    momentum = [p for p in want if "momentum" in p or "mu" in p or "nu" in p]  # Muon's and Adam's moments
    assert momentum and all(np.array_equal(np.asarray(got[p]), np.asarray(want[p])) for p in momentum)
    for p in want:
        if p[-1] == "count":
            assert int(got[p]) == (2 if p[-2] == 0 else 0), p  # Adam's count stays, schedules restart
    assert stage.step == 0 and all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                   zip(jax.tree.leaves(nnx.state(stage.model, nnx.Param)),
                                       jax.tree.leaves(nnx.state(model, nnx.Param))))


def test_conversation_loader_states_reshard_to_another_device_count(tokenizer):
    """A checkpoint of 2 streams resumed by 4: every new stream starts past everything the old
    ones trained (nothing twice), in the same epoch."""
    from flaxchat.finetune import reshard_conversation_states
    data = tasks.parse_mix("chat,arithmetic", split="val")
    old = [ConversationLoader(data, tokenizer, 2, 128, seed=3, stream=s, streams=2) for s in range(2)]
    trained = set()
    for loader in old:
        for _ in range(3):
            before = set(loader.buffer)
            loader.next_batch()
            trained |= (before | set(loader._epoch_order()[:loader.cursor])) - set(loader.buffer)
    states = reshard_conversation_states([l.state_dict() for l in old], 4)
    assert len(states) == 4 and all(s["epoch"] == 0 and s["buffer"] == [] for s in states)
    new = [ConversationLoader(data, tokenizer, 2, 128, seed=3, stream=s, streams=4) for s in range(4)]
    for loader, state in zip(new, states):
        loader.load_state_dict(state)
        loader.next_batch()
        upcoming = set(loader._epoch_order()[state["cursor"]:loader.cursor])
        assert upcoming and not upcoming & trained


# --- RL rollouts: what trains and how much -----------------------------------------------------------

def test_rl_loss_weighs_each_problem_equally_however_long_its_answers():
    """One problem with long answers (40 tokens), one with short ones (4): each problem's weights
    add up to the same mass; per-token weights (the old normalisation over all tokens of the step)
    would give the long problem ten times the short one's."""
    from scripts.rl import policy_weights
    T = 64
    targets = np.full((2, 2, T), -1, np.int32)
    targets[0, :, 10:50] = 7  # problem 0: two 40-token answers
    targets[1, :, 10:14] = 7  # problem 1: two 4-token answers
    adv = np.array([[0.5, -0.5], [0.5, -0.5]], np.float32)
    w = policy_weights(targets, adv)
    mass = np.abs(w).sum(axis=(1, 2))
    np.testing.assert_allclose(mass[0], mass[1], rtol=1e-6)
    np.testing.assert_allclose(mass.sum(), 0.5, rtol=1e-6)  # the mean |advantage|
    assert np.all(w[targets < 0] == 0)
    # The gradient of sum(-w log p) is the mean over problems of each problem's token mean.
    rng = np.random.default_rng(0)
    logp = rng.normal(size=targets.shape)
    want = np.mean([np.sum(adv[j][:, None] * logp[j] * (targets[j] >= 0)) / np.sum(targets[j] >= 0) for j in range(2)])
    np.testing.assert_allclose(np.sum(w * logp), want, rtol=1e-5)


def test_rl_rows_train_only_sampled_end_tokens_and_follow_the_context():
    from scripts.rl import fit_prompt, policy_rows
    T, END, BOS = 32, 9, 1
    prompt = [BOS, 20, 21, 22, 5]  # 5 plays <|assistant_start|>
    outs = [[30, 31, 32], [40, 41], list(range(100, 100 + T - len(prompt)))]
    masks = [[1, 1, 1], [1, 0], [1] * (T - len(prompt))]
    stops = [END, BOS, None]  # <|assistant_end|> sampled; a <|bos|> stop; out of context
    x, y = policy_rows(prompt, outs, masks, stops, END, T, BOS)
    assert x.shape == y.shape == (3, T)
    assert list(y[0][y[0] >= 0]) == [30, 31, 32, END]  # the sampled end token trains
    assert list(y[1][y[1] >= 0]) == [40]  # the forced token does not, nor an end token never sampled
    assert END not in y[1] and END not in y[2]
    assert list(y[2][y[2] >= 0]) == outs[2]  # an answer as long as the context allows is trained whole
    long = [BOS] + list(range(200, 260)) + [5]
    cut = fit_prompt(long, T)
    assert cut[:3] == long[:3] and cut[-1] == 5 and len(cut) == T - 8  # keeps its start and its last token


# --- the scripts ---------------------------------------------------------------------------------------

SFT_ARGS = ["--mix", "chat,arithmetic", "--steps", "4", "--device-batch-size", "2", "--eval-every", "2",
            "--eval-batches", "1", "--save-every", "2", "--log-every", "1"]


def _params(run_dir, step=None):
    model, _, meta = load_model(run_dir, step)
    return meta, [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_trains_resumes_exactly_and_reports(base, tmp_path):
    run = tmp_path / "sft"
    p = _run("sft", "--base", str(base), "--run-dir", str(run), *SFT_ARGS)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "val loss" in p.stdout and (run / "COMPLETE").exists() and (run / "report.md").exists()
    meta, final = _params(run)
    assert meta["step"] == 4 and meta["stage"] == "sft" and meta["loader_states"][0]["cursor"] > 0
    _, start = _params(base)
    assert any(not np.array_equal(a, b) for a, b in zip(final, start))  # it trained
    _, base_again = _params(base)
    assert all(np.array_equal(a, b) for a, b in zip(start, base_again))  # the base was only read
    # Resume: drop the last checkpoint, run again; it continues from step 2 to the same weights.
    shutil.rmtree(run / "checkpoints" / "4")
    p = _run("sft", "--base", str(base), "--run-dir", str(run), *SFT_ARGS)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from step 2" in p.stdout
    _, resumed = _params(run)
    for a, b in zip(final, resumed):
        np.testing.assert_array_equal(a, b)
    # The result opens like any run (tokenizer copied next to the checkpoints).
    model, tok, _ = load_model(run)
    assert tok.vocab_size == model.config.vocab_size
    # Run again once finished: it says so and rewrites nothing of the run's record.
    record = {f: (run / f).read_bytes() for f in ("report.md", "COMPLETE", "metrics.jsonl")}
    p = _run("sft", "--base", str(base), "--run-dir", str(run), *SFT_ARGS)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "complete: " in p.stdout and "nothing rewritten" in p.stdout and "val loss" not in p.stdout
    assert {f: (run / f).read_bytes() for f in record} == record


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rl_runs_measures_pass_at_1_and_resumes(base, tmp_path):
    run = tmp_path / "rl"
    args = ["--base", str(base), "--run-dir", str(run), "--steps", "2", "--prompts", "2", "--samples", "2",
            "--max-new-tokens", "8", "--eval-every", "1", "--eval-examples", "3",
            "--save-every", "1", "--log-every", "1"]
    p = _run("rl", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pass@1" in p.stdout and "mean reward" in p.stdout
    meta, final = _params(run)
    assert meta["stage"] == "rl" and sorted(meta["evals"], key=int) == ["0", "1", "2"]
    assert all(0.0 <= v <= 1.0 for v in meta["evals"].values())
    report = (run / "report.md").read_text()
    assert "pass@1 before" in report and "pass@1 after" in report
    _, start = _params(base)
    assert any(not np.array_equal(a, b) for a, b in zip(final, start))
    p = _run("rl", *args[:-6], "--steps", "3", "--eval-every", "1", "--eval-examples", "3", "--log-every", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from step 2" in p.stdout and "step 00003" in p.stdout


# One process with 8 fake CPU devices runs SFT and then RL with --sharding fsdp into memory:// run
# folders (fsspec's in-process filesystem, so it must all happen inside that process). Orbax knows
# no memory://, so the checkpoints go to a local folder, as in tests/test_paths.py.
FSDP_DRIVER = r"""
import json, os, sys
import jax
from flax import nnx
from fsspec.implementations.memory import MemoryFileSystem
from flaxchat import checkpoint, finetune
from flaxchat.errors import cli_main
base, local, out = sys.argv[1:4]
fs = MemoryFileSystem()
class LocalCheckpointer(checkpoint.Checkpointer):
    def __init__(self, directory, **kw):
        if directory.startswith("memory://"):
            directory = os.path.join(local, directory.split("/")[-2])
        super().__init__(directory, **kw)
checkpoint.Checkpointer = LocalCheckpointer
seen, open_stage = {}, finetune.open_stage
def spy(*a, **kw):
    stage = open_stage(*a, **kw)
    emb = stage.model.wte.embedding[...]
    mom = [x for x in jax.tree.leaves(nnx.state(stage.optimizer, nnx.optimizer.OptState)) if x.ndim == 2][0]
    seen[kw["name"]] = dict(devices=len(emb.sharding.device_set), split=not emb.sharding.is_fully_replicated,
                            opt_split=not mom.sharding.is_fully_replicated, layout=stage.compute.sharding)
    return stage
finetune.open_stage = spy
from scripts import rl, sft
codes = [cli_main(sft.main, ["--base", base, "--run-dir", "memory://bucket/sft", "--sharding", "fsdp",
                             "--mix", "chat,arithmetic", "--steps", "2", "--device-batch-size", "1",
                             "--eval-every", "0", "--log-every", "1"]),
         cli_main(rl.main, ["--base", base, "--run-dir", "memory://bucket/rl", "--sharding", "fsdp", "--steps", "1",
                            "--prompts", "1", "--samples", "8", "--max-new-tokens", "6", "--eval-every", "0",
                            "--eval-examples", "2", "--log-every", "1"])]
json.dump(dict(codes=codes, seen=seen, files=sorted(fs.find("/bucket"))), open(out, "w"))
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sft_and_rl_run_fsdp_on_8_devices_into_a_memory_run_folder(base, tmp_path):
    import json
    out, progress = tmp_path / "out.json", tmp_path / "progress.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT, FLAXCHAT_PROGRESS_FILE=str(progress),
               XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    p = subprocess.run([sys.executable, "-c", FSDP_DRIVER, str(base), str(tmp_path / "ckpt"), str(out)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["codes"] == [0, 0], p.stderr[-3000:]
    for name in ("sft", "rl"):
        assert got["seen"][name] == dict(devices=8, split=True, opt_split=True, layout="fsdp"), got["seen"]
        for f in ("COMPLETE", "report.md", "metrics.jsonl", "loss.png", "tokenizer/tokenizer.json"):
            assert f"/bucket/{name}/{f}" in got["files"], (name, f, got["files"])
    assert (tmp_path / "ckpt" / "sft" / "2").is_dir() and (tmp_path / "ckpt" / "rl" / "1").is_dir()
    assert list(p for p in tmp_path.iterdir() if p.name.startswith("memory")) == []  # nothing bypassed the layer
    record = json.loads(progress.read_text())
    assert (record["stage"], record["step"]) == ("rl", 1)


# --- bad input ---------------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script,argv,words", [
    ("sft", [], "--base is required"),
    ("sft", ["--base", "/nonexistent/run"], "no run folder"),
    ("sft", ["--base", "BASE", "--mix", "nosuchtask"], "known tasks: arc, arithmetic"),
    ("sft", ["--base", "BASE", "--mix", ","], "mixture is empty"),
    ("sft", ["--base", "BASE", "--run-dir", "BASE"], "base model's own folder"),
    ("sft", ["--base", "BASE", "--mix", "chat:heavy"], "bad weight"),
    ("rl", ["--base", "BASE", "--samples", "1"], "at least 2"),
    ("sft", ["--base", "BASE", "--log-every", "0"], "--log-every must be at least 1"),
    ("rl", ["--base", "BASE", "--log-every", "0"], "--log-every must be at least 1"),
    ("sft", ["--base", "BASE", "--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    ("rl", ["--base", "BASE", "--keep-checkpoints", "0"], "--keep-checkpoints must be at least 1"),
    ("rl", ["--base", "BASE", "--eval-every", "-1"], "--eval-every must be 0 (never) or more"),
    ("sft", ["--base", "BASE", "--eval-batches", "0"], "--grad-accum and --eval-batches must be at least 1"),  # read val loss 0.0000
    ("rl", ["--base", "BASE", "--temperature", "-1"], "temperature must be 0 (greedy) or positive"),  # after an eval
    ("rl", ["--base", "BASE", "--top-k", "-3"], "top_k must be positive, or 0 for no limit"),
    ("rl", ["--base", "BASE", "--lr-frac", "-0.01"], "--lr-frac must be positive"),  # trained towards wrong answers
    ("sft", ["--base", "BASE", "--weight-decay", "-1"], "--weight-decay be 0 or more"),
    ("rl", ["--base", "/nonexistent/run"], "no run folder"),
    ("rl", ["--base", "BASE", "--task", "mmlu@/nonexistent/mmlu.parquet"], "mmlu"),
])
def test_bad_input_is_one_sentence(script, argv, words, base, tmp_path, capsys):
    from scripts import rl, sft
    argv = [str(base) if a == "BASE" else a for a in argv]
    if "--run-dir" not in argv:
        argv += ["--run-dir", str(tmp_path / "out")]
    before = sorted(os.listdir(base / "checkpoints"))
    assert cli_main({"sft": sft.main, "rl": rl.main}[script], argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and err.count("\n") == 0, err
    assert sorted(os.listdir(base / "checkpoints")) == before and not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,words", [
    (["--sft-steps", "0"], "--steps must be positive (or -1 for --epochs passes)"),
    (["--rl-steps", "0"], "--steps, --prompts, --samples"),
    (["--eval-limit", "0"], "--eval-examples"),
    (["--depth", "0"], "--depth must be at least 1"),
])
def test_run_chat_checks_every_stage_before_the_first(argv, words, tmp_path, capsys):
    """The chain's later stages' flags used to be read only when their turn came: after the
    pretraining's minutes. Now a bad one is one sentence before anything runs or is written."""
    from scripts import run_chat
    assert cli_main(run_chat.main, ["--run-dir", str(tmp_path / "chain"), *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert words in err and err.count("\n") == 0, err
    assert "--- 1/4" not in captured.out and not (tmp_path / "chain").exists()


@pytest.mark.timeout(30)
def test_roles_out_of_order_are_refused(tokenizer):
    bad = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "?"}]}
    with pytest.raises(UserError, match="roles must alternate"):
        ConversationLoader([bad], tokenizer, 1, 64).next_batch()


@pytest.mark.timeout(120)
def test_check_replies_skips_a_prompt_longer_than_the_context(base):
    """SFT's closing look at the model asks only what fits: a base trained at a short --sequence-len
    used to fail the stage there, after its training and last save."""
    from scripts.sft import check_replies
    model, tok, _ = load_model(base)
    long = "one two three " * 60
    out = check_replies(model, tok, ["Hi", long], max_tokens=4)
    assert out[long].startswith("(not asked: ") and "context holds 128" in out[long], out
    assert isinstance(out["Hi"], str) and not out["Hi"].startswith("(not asked"), out


@pytest.mark.timeout(60)
def test_load_model_after_a_stage_set_a_mesh(base):
    """Loading under a mesh set in the process (jax.set_mesh, as the training stages do while they run)."""
    from flaxchat.common import compute_init
    mesh = compute_init("float32").with_sharding("dp").mesh
    try:
        jax.set_mesh(mesh)
        model, tok, meta = load_model(base)
    finally:
        jax.set_mesh(None)
    assert meta["step"] == 5 and model.config == TINY
