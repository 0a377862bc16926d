"""The engine: cached = uncached (logits and greedy tokens, GQA + sliding windows, non-zero output
projections), sampling, samples per prompt, stop tokens, streaming, no recompiles, tool use through
a scripted model, speculative decoding = greedy, bad input, the calculator.

Compiles cost 3-10 s each on a 2-core CPU, so every test shares one architecture (TINY) and the
engine's process-wide cache of compiled functions; shapes stay within one cache bucket (64).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import engine as E
from flaxchat.config import GPTConfig
from flaxchat.errors import UserError
from flaxchat.tools import calculate, run_tool
from support import ENGINE_TINY as TINY
from support import nonzero_model, scripted_model, tool_chain

@pytest.fixture(scope="module")
def model():
    return nonzero_model()


@pytest.fixture(scope="module")
def engine(model):
    return E.Engine(model)


@pytest.fixture(scope="module")
def full_forward():
    """The training forward on a fixed (1, 64) buffer (causal, so padding never matters)."""
    fn = nnx.jit(lambda m, x: m(x))

    def run(m, seq):
        buf = np.zeros((1, TINY.sequence_len), np.int32)
        buf[0, :len(seq)] = seq
        return np.asarray(fn(m, jnp.asarray(buf)))[0, :len(seq)]
    return run


def prompt_of(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, TINY.vocab_size, n)]


# --- cached = uncached ----------------------------------------------------------------------------


def test_cached_logits_equal_the_full_forward(model, full_forward):
    """Prefill 10 tokens, then feed 48 more one at a time through the cache (past the 16-token
    window), and 4 at a time (the speculative verifier's path): logits within 1e-5 at every step.
    The prefill holds 16 real tokens: decode must ignore the stale keys after its position."""
    seq = prompt_of(60, seed=1)
    want = full_forward(model, seq)
    graphdef, params = nnx.split(model)

    @jax.jit
    def cached(params, idx):
        m = nnx.merge(graphdef, params)
        logits0, cache = E.prefill(m, idx[:, :16], 64)  # prompt bucket 16, real prompt 10

        def feed(n):  # n tokens per step from position 10 on
            def step(cache, t):
                lg, cache = E.forward_cached(m, cache, jax.lax.dynamic_slice_in_dim(idx, t, n, 1), idx[:, t - 1], t)
                return cache, lg[0]
            return jax.lax.scan(step, cache, jnp.arange(10, 58, n))[1].reshape(-1, lg_dim)
        return logits0[0, :10], feed(1), feed(4)

    lg_dim = TINY.vocab_size
    idx = np.zeros((1, 64), np.int32)
    idx[0, :60] = seq
    prompt_logits, step_logits, multi_logits = (np.asarray(a) for a in cached(params, jnp.asarray(idx)))
    np.testing.assert_allclose(prompt_logits, want[:10], atol=1e-5, rtol=0)
    np.testing.assert_allclose(step_logits, want[10:58], atol=1e-5, rtol=0)
    np.testing.assert_allclose(multi_logits, want[10:58], atol=1e-5, rtol=0)
    assert np.abs(want[10:] - want[10:].mean()).max() > 1e-2  # the model really computes something


def test_prefill_runs_the_kernel_of_the_models_record(model):
    """Prefill takes its attention from the model's kernels record (splash on a TPU), not a kernel
    of its own: the splash kernel itself (Pallas interpret mode here) fills a cache whose prompt
    logits equal the blockwise kernel's. The prompt is 128 tokens, splash's tile."""
    from flaxchat import kernels
    cfg = GPTConfig(sequence_len=128, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                    window_pattern="SL", attn_block=32)
    graphdef, params = nnx.split(nonzero_model(cfg))
    idx = jnp.asarray(np.random.default_rng(3).integers(0, 512, (1, 128)), jnp.int32)
    out, seen = {}, []
    for name in ("splash", "blockwise"):
        record = kernels.choose("cpu", name).model
        traced = lambda q, k, v, w, b, record=record: seen.append(record.attention_name) or record.attention(q, k, v, w, b)
        spy = dataclasses.replace(record, attention=traced)

        @jax.jit
        def prefill(params, idx):
            m = nnx.merge(graphdef, params)
            m.kernels = spy
            return E.prefill(m, idx, 128)

        logits, cache = prefill(params, idx)
        out[name] = (np.asarray(logits), np.asarray(cache.k[0]))
    assert seen == ["splash"] * 2 + ["blockwise"] * 2  # once per layer, each record's own kernel
    np.testing.assert_allclose(out["splash"][0], out["blockwise"][0], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(out["splash"][1], out["blockwise"][1])  # keys come before attention


def test_greedy_generation_equals_uncached_greedy(model, engine, full_forward):
    prompt = prompt_of(10, seed=2)
    got, masks = engine.generate_batch(prompt, 1, 50, temperature=0.0, stop_tokens=())
    seq = list(prompt)
    for _ in range(50):
        seq.append(int(np.argmax(full_forward(model, seq)[-1])))
    assert got[0] == seq[len(prompt):]
    assert masks[0] == [1] * 50


def test_compiled_once_and_shared_no_retrace_between_calls(model, engine):
    engine.generate_batch(prompt_of(5), 1, 30, temperature=0.0)  # compiled (or reused) here
    before = len(E.compile_log)
    for seed, (temp, k, p) in enumerate([(0.0, None, None), (1.0, 5, None), (0.7, None, 0.9), (1.3, 40, 0.5)]):
        engine.generate_batch(prompt_of(3 + seed, seed), 1, 20 + seed, temperature=temp, top_k=k, top_p=p, seed=seed)
    other = E.Engine(nonzero_model(seed=7))  # another checkpoint of the same architecture
    other.generate_batch(prompt_of(7), 1, 40, temperature=0.5)
    assert len(E.compile_log) == before, [k[1:] for k, _ in E.compile_log[before:]]


# --- sampling -------------------------------------------------------------------------------------


def test_sampling_filters_and_temperature():
    V = 300  # > TOP_K_FAST: top-k above it takes the sorting path, below it lax.top_k
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(1, V)) * 2, jnp.float32)
    rows = jnp.repeat(logits, 4000, axis=0)
    fn = jax.jit(E.sample_token)  # one compile: the settings are traced
    order = np.argsort(-np.asarray(logits[0]))
    probs = np.asarray(jax.nn.softmax(logits[0]))

    def draw(**kw):
        return np.asarray(fn(rows, jax.random.key(3), E.make_sampling(**kw)))

    def nucleus(p, among=V):
        q = probs[order[:among]] / probs[order[:among]].sum()
        return set(order[:np.searchsorted(np.cumsum(q), p) + 1])

    assert set(draw(temperature=0.0)) == {order[0]}
    assert set(draw(temperature=1.0, top_k=1)) == {order[0]}
    assert set(draw(temperature=1.0, top_k=3)) == set(order[:3])
    assert set(draw(temperature=1.0, top_p=0.6)) == nucleus(0.6)
    assert set(draw(temperature=1.0, top_k=20, top_p=0.5)) == nucleus(0.5, 20)
    big = draw(temperature=1.0, top_k=200)
    assert set(big) <= set(order[:200]) and len(set(big)) > 50
    freq = np.bincount(draw(temperature=1.0), minlength=V) / 4000
    assert np.abs(freq - probs).max() < 0.03  # temperature 1 samples the model's distribution
    top10 = np.bincount(draw(temperature=1.0, top_k=10), minlength=V)[order[:10]] / 4000
    assert np.abs(top10 - probs[order[:10]] / probs[order[:10]].sum()).max() < 0.03
    hot = np.bincount(draw(temperature=5.0), minlength=V)
    assert (hot > 0).sum() > (freq > 0).sum()  # a hotter temperature spreads the choice


def test_several_samples_per_prompt_and_seeds(model, engine):
    prompt = prompt_of(8, seed=3)
    greedy1, _ = engine.generate_batch(prompt, 1, 20, temperature=0.0, stop_tokens=())
    greedy3, _ = engine.generate_batch(prompt, 3, 20, temperature=0.0, stop_tokens=())
    assert greedy3 == [greedy1[0]] * 3
    a, _ = engine.generate_batch(prompt, 3, 20, temperature=1.0, seed=1, stop_tokens=())
    b, _ = engine.generate_batch(prompt, 3, 20, temperature=1.0, seed=1, stop_tokens=())
    c, _ = engine.generate_batch(prompt, 3, 20, temperature=1.0, seed=2, stop_tokens=())
    assert a == b and a != c
    assert len({tuple(r) for r in a}) == 3  # the samples differ from one another
    streamed = [col for col, _ in engine.generate(prompt, 3, 20, temperature=1.0, seed=1, stop_tokens=(), chunk=3)]
    assert [[col[r] for col in streamed] for r in range(3)] == a  # the draws depend on the seed, not on chunking


def test_stop_tokens_end_each_sample(model, engine):
    prompt = prompt_of(6, seed=4)
    free, _ = engine.generate_batch(prompt, 1, 30, temperature=0.0, stop_tokens=())
    stop = free[0][7]
    first = free[0].index(stop)
    cut, _ = engine.generate_batch(prompt, 1, 30, temperature=0.0, stop_tokens=[stop])
    assert cut[0] == free[0][:first]
    columns = list(engine.generate(prompt, 1, 30, temperature=0.0, stop_tokens=[stop]))
    assert [c[0][0] for c in columns] == free[0][:first + 1]  # the stop token is streamed, then it ends


def test_streaming_yields_before_the_end_and_cancels(model, engine):
    gen = engine.generate(prompt_of(9, seed=5), 1, 54, temperature=0.0, stop_tokens=(), chunk=4)
    tokens, forced = next(gen)  # the first token, straight from the prefill
    assert len(tokens) == 1 and isinstance(tokens[0], int) and forced == [False]
    rest = [next(gen) for _ in range(10)]
    gen.close()  # the caller stops listening: nothing more is generated
    assert len(rest) == 10


# --- tool use -------------------------------------------------------------------------------------


@pytest.mark.parametrize("expr,result", [("6*7", "42"), ("abs(-9)", "9")])  # calculator, then sandbox
def test_tool_call_output_is_forced_into_each_sample(tokenizer, expr, result):
    call, after = tool_chain(tokenizer, expr)
    eng = E.Engine(scripted_model(call + after), tokenizer)
    s = tokenizer.special_tokens
    prompt = [tokenizer.bos_token_id, call[0]]
    rows, masks = eng.generate_batch(prompt, 3, 40, temperature=0.0)
    output = [s["<|output_start|>"]] + tokenizer.encode(result) + [s["<|output_end|>"]]
    want = call[1:] + output  # then <|assistant_end|> stops the sample
    for row, mask in zip(rows, masks):
        assert row == want, tokenizer.decode(row)
        assert mask == [1] * (len(call) - 1) + [0] * len(output)  # forced tokens are marked


def test_tools_off_means_no_forced_output(tokenizer):
    call, after = tool_chain(tokenizer, "6*7")
    eng = E.Engine(scripted_model(call + after), tokenizer, tools=False)
    rows, masks = eng.generate_batch([tokenizer.bos_token_id, call[0]], 1, 12, temperature=0.0)
    assert tokenizer.special_tokens["<|output_start|>"] not in rows[0] and set(masks[0]) == {1}


def test_calculator_is_safe_and_exact():
    assert calculate("6*7") == "42"
    assert calculate("1,234 + 1") == "1235"
    assert calculate("(2 + 3) * 4 / 5") == "4.0"
    assert calculate("-2**10 // 3 % 7") == str(-2**10 // 3 % 7)
    assert calculate('"strawberry".count("r")') == "3"
    for unsafe in ("__import__('os').system('true')", "open('x')", "(1).__class__", "9**9**9", "[1]*10**9",
                   "x", "lambda: 1", '"a,b".upper()', "1/0", ""):
        assert calculate(unsafe) is None, unsafe


def test_tool_falls_back_to_the_sandbox_and_a_call_that_never_ends_is_cut():
    assert run_tool("sum(range(10))") == "45"
    t0 = time.monotonic()
    out = run_tool("while True: pass", timeout=1.0)
    assert "timed out" in out and time.monotonic() - t0 < 4


# --- speculative decoding -------------------------------------------------------------------------


def test_speculative_decoding_equals_greedy(model, engine):
    prompt = prompt_of(10, seed=6)
    greedy, _ = engine.generate_batch(prompt, 1, 50, temperature=0.0, stop_tokens=())
    same, stats = engine.generate_speculative(prompt, engine, 50, k=4, stop_tokens=())
    assert same == greedy[0] and stats["acceptance"] == 1.0 and stats["rounds"] <= 50 // 5 + 1
    noisy = E.Engine(nonzero_model(seed=11, base=model, noise=0.3))  # a draft that sometimes disagrees
    spec, stats = engine.generate_speculative(prompt, noisy, 50, k=4, stop_tokens=())
    assert spec == greedy[0]
    assert 0.0 < stats["acceptance"] < 1.0, stats


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs,words", [
    (dict(tokens=[]), "empty"),
    (dict(tokens=list(range(64))), "context"),
    (dict(tokens=[1, 2, 9999]), "vocabulary"),
    (dict(tokens=[1], max_tokens=0), "max_tokens"),
    (dict(tokens=[1], temperature=-1.0), "temperature"),
    (dict(tokens=[1], top_p=1.5), "top_p"),
    (dict(tokens=[1], num_samples=0), "num_samples"),
])
def test_bad_input_is_one_clear_sentence(engine, kwargs, words):
    tokens = kwargs.pop("tokens")
    with pytest.raises(UserError, match=words):
        next(engine.generate(tokens, **kwargs))


def test_generation_stops_at_the_context(engine):
    rows, _ = engine.generate_batch(prompt_of(10), 1, None, temperature=0.0, stop_tokens=())
    assert len(rows[0]) == 54  # 10 prompt tokens + 54 = the 64-token context
