"""Inference: a KV cache, prefill + a jitted decode loop, sampling, tool use, speculative decoding.

Design (measured on a 2-core CPU; the figures are in docs/inference.md):
* The cache is one array per layer for keys, (batch*kv_heads, head_dim, time), and one for values,
  (batch*kv_heads, time, head_dim): exactly the operands of the two attention matmuls, so a step
  writes its column in place and the matmuls read the cache as it lies. A stacked
  (layers, batch, heads, time, dim) cache made XLA copy every layer's slice every step (~12% of
  the step), and a reshape between write and read made it copy the whole array.
* Generation runs inside ONE jitted `while_loop` that stops early when every row is done or a row
  wrote `<|python_end|>` (the host must run the tool). Streaming callers ask for a few tokens per
  call; the loop's state is donated, so the cache is updated in place across calls. A Python loop
  over a jitted one-token step is ~35% slower (dispatch per token).
* Every compiled function is compiled ahead of time once per (batch, cache bucket, prompt bucket)
  and kept: later calls never retrace (a per-call closure recompiled for 1-2 s in an earlier port).
* The model's own forward is used, through its `attend` hook, so the cached path cannot drift from
  the training model; sliding-window layers attend over the whole cache with a window mask
  (decode is memory-bound, skipping masked keys saves nothing at these sizes).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat import ops
from flaxchat.errors import UserError
from flaxchat.gpt import GPT

log = logging.getLogger(__name__)

FORCED_MAX = 64  # tokens of tool output the device can hold per row; longer outputs are cut
MAX_STOP = 8  # stop-token slots (padded with -1)
MIN_BUCKET = 64  # smallest cache length; buckets are powers of two up to the model's context


# --- cache and cached attention -------------------------------------------------------------------


class KVCache(NamedTuple):
    k: tuple[jax.Array, ...]  # per layer (batch * kv_heads, head_dim, time): keys transposed
    v: tuple[jax.Array, ...]  # per layer (batch * kv_heads, time, head_dim)


def init_cache(cfg, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    kshape = (batch * cfg.n_kv_head, cfg.head_dim, length)
    vshape = (batch * cfg.n_kv_head, length, cfg.head_dim)
    return KVCache(tuple(jnp.zeros(kshape, dtype) for _ in range(cfg.n_layer)),
                   tuple(jnp.zeros(vshape, dtype) for _ in range(cfg.n_layer)))


def _write(cache: KVCache, layer: int, k, v, pos) -> KVCache:
    """Write k/v (B,Tn,Hkv,D) of positions pos.. into one layer of the cache."""
    B, Tn, Hkv, D = k.shape
    ks, vs = list(cache.k), list(cache.v)
    k = k.transpose(0, 2, 3, 1).reshape(B * Hkv, D, Tn).astype(ks[layer].dtype)
    v = v.transpose(0, 2, 1, 3).reshape(B * Hkv, Tn, D).astype(vs[layer].dtype)
    ks[layer] = jax.lax.dynamic_update_slice(ks[layer], k, (0, 0, pos))
    vs[layer] = jax.lax.dynamic_update_slice(vs[layer], v, (0, pos, 0))
    return KVCache(tuple(ks), tuple(vs))


def _cached_attention(q, k_all, v_all, pos, window):
    """q (B,Tn,H,D) at positions pos..pos+Tn-1 against one layer's keys (B*Hkv,D,T) and values
    (B*Hkv,T,D); returns (B,Tn,H,D).

    A key at t is visible to a query at s when s-window < t <= s: the same rule as training, so
    keys not yet written (t > s) and stale ones never count.
    """
    B, Tn, H, D = q.shape
    Hkv, T = k_all.shape[0] // B, k_all.shape[2]
    G = H // Hkv
    # (B, Tn, Hkv, G, D) -> (B*Hkv, G*Tn, D): one plain batched matmul per kv head, in the cache's
    # own shape (a reshape of the cache between write and read made XLA copy it every step).
    qg = q.reshape(B, Tn, Hkv, G, D).transpose(0, 2, 3, 1, 4).reshape(B * Hkv, G * Tn, D)
    s = jnp.einsum("hqd,hdt->hqt", qg, k_all, preferred_element_type=jnp.float32) * D ** -0.5
    qpos = pos + jnp.tile(jnp.arange(Tn), G)[:, None]
    kpos = jnp.arange(T)[None, :]
    s = jnp.where((kpos <= qpos) & (kpos > qpos - window), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v_all.dtype)
    y = jnp.einsum("hqt,htd->hqd", p, v_all)
    return y.reshape(B, Hkv, G, Tn, D).transpose(0, 3, 1, 2, 4).reshape(B, Tn, H, D)


def forward_cached(model: GPT, cache: KVCache, idx: jax.Array, prev: jax.Array, pos) -> tuple[jax.Array, KVCache]:
    """Logits for tokens idx (B,Tn) at positions pos.. given the cache; writes their keys/values.

    `prev` (B,) is the token just before idx[:, 0] (for smear). Returns (logits (B,Tn,V), cache).
    """
    box = [cache]

    def attend(layer, q, k, v, window):
        box[0] = c = _write(box[0], layer, k, v, pos)
        return _cached_attention(q, c.k[layer], c.v[layer], pos, window).astype(q.dtype)

    prev_emb = ops.rms_norm(model.wte(prev[:, None]).astype(model.dtype))
    positions = pos + jnp.arange(idx.shape[1], dtype=jnp.int32)
    logits = model(idx, positions, attend=attend, prev_embedding=prev_emb)
    return logits, box[0]


def prefill(model: GPT, idx: jax.Array, cache_len: int) -> tuple[jax.Array, KVCache]:
    """Run the prompt idx (B,P) through the model with the attention kernel of its kernels record
    (splash on TPU, cuDNN on GPU, blockwise on CPU), filling a fresh cache of `cache_len`
    positions. Returns (logits (B,P,V), cache). Padding after the real prompt is harmless: causal
    attention keeps it out of the real positions, and decode overwrites it."""
    cfg = model.config
    box = [init_cache(cfg, idx.shape[0], cache_len, model.dtype)]

    def attend(layer, q, k, v, window):
        box[0] = _write(box[0], layer, k, v, 0)
        return model.kernels.attention(q, k, v, window, cfg.attn_block)

    logits = model(idx, attend=attend)
    return logits, box[0]


# --- sampling -------------------------------------------------------------------------------------


class Sampling(NamedTuple):
    """Traced sampling settings: changing them never recompiles. temperature 0 is greedy."""
    temperature: jax.Array  # () f32
    top_k: jax.Array  # () i32, 0 = off
    top_p: jax.Array  # () f32, 1 = off


def make_sampling(temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None) -> Sampling:
    if temperature < 0:
        raise UserError(f"temperature must be 0 (greedy) or positive (got {temperature}).")
    if top_k is not None and top_k < 0:
        raise UserError(f"top_k must be positive, or 0 for no limit (got {top_k}).")
    if top_p is not None and not 0 < top_p <= 1:
        raise UserError(f"top_p must lie in (0, 1] (got {top_p}).")
    return Sampling(np.float32(temperature), np.int32(top_k or 0), np.float32(1.0 if top_p is None else top_p))


TOP_K_FAST = 128  # top-k up to this many uses lax.top_k on the logits; larger k sorts the vocab


def _inverse_cdf(key, x):
    """One categorical draw per row from logits x (B, N) with ONE uniform number per row: the
    cumulative sum beats the Gumbel trick's N random numbers per row (threefry is slow on CPU)."""
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
    c = jnp.cumsum(p, axis=-1)
    u = jax.random.uniform(key, (x.shape[0], 1), jnp.float32) * c[:, -1:]
    return jnp.minimum(jnp.sum(c <= u, axis=-1), x.shape[-1] - 1).astype(jnp.int32)


def _nucleus(srt, p):
    """Mask logits sorted in decreasing order to the smallest prefix whose probability reaches p
    (the most likely token always stays)."""
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass ranked above each token
    return jnp.where(before < p, srt, -jnp.inf)


def sample_token(logits: jax.Array, key: jax.Array, s: Sampling, step=None) -> jax.Array:
    """logits (B,V) fp32 -> (B,) int32. `lax.cond` runs only the branch in use, so greedy draws no
    random numbers and only a large top-k or a top-p without top-k pays for a full sort. With
    `step`, the draw uses `fold_in(key, step)`, derived inside the sampling branch: a greedy decode
    loop then never runs the PRNG (it used to split the key every step, whatever the sampling)."""
    V = logits.shape[-1]
    kf = min(TOP_K_FAST, V)

    def greedy(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def few(x, key):  # 0 < top_k <= kf: choose among the top candidates only
        vals, idx = jax.lax.top_k(x, kf)
        vals = jnp.where(jnp.arange(kf) < s.top_k, vals, -jnp.inf)
        vals = jax.lax.cond(s.top_p < 1, lambda v: _nucleus(v, s.top_p), lambda v: v, vals)
        pick = _inverse_cdf(key, vals)
        return jnp.take_along_axis(idx, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)

    def full(x, key):  # no top-k, or a large one
        def filtered(x):
            srt = jnp.sort(x, axis=-1)[:, ::-1]
            k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, V), V)
            srt = jnp.where(jnp.arange(V) < k, srt, -jnp.inf)
            srt = jax.lax.cond(s.top_p < 1, lambda v: _nucleus(v, s.top_p), lambda v: v, srt)
            cutoff = jnp.min(jnp.where(jnp.isfinite(srt), srt, jnp.inf), axis=-1, keepdims=True)
            return jnp.where(x < cutoff, -jnp.inf, x)
        x = jax.lax.cond((s.top_k > 0) | (s.top_p < 1), filtered, lambda x: x, x)
        return _inverse_cdf(key, x)

    def stochastic(x):
        draw_key = key if step is None else jax.random.fold_in(key, step)
        x = x / jnp.maximum(s.temperature, 1e-6)
        return jax.lax.cond((s.top_k > 0) & (s.top_k <= kf), few, full, x, draw_key)

    return jax.lax.cond(s.temperature > 0, stochastic, greedy, logits)


# --- the generation loop --------------------------------------------------------------------------


class GenState(NamedTuple):
    """Everything the decode loop carries; donated to each call so the cache is updated in place."""
    cache: KVCache
    tokens: jax.Array  # (B, T) i32: the prompt, then every token sampled or forced
    pos: jax.Array  # () i32: index of the newest token, the next one the model reads
    key: jax.Array  # PRNG key; the draw after position p uses fold_in(key, p)
    done: jax.Array  # (B,) bool: the row wrote a stop token
    forced: jax.Array  # (B, FORCED_MAX) i32: tool output the host queued for each row
    forced_len: jax.Array  # (B,) i32
    forced_ptr: jax.Array  # (B,) i32: how many of the queued tokens were fed already


class Controls(NamedTuple):
    """Per-call settings, all traced: a new temperature or stop list never recompiles."""
    sampling: Sampling
    stop: jax.Array  # (MAX_STOP,) i32, padded with -1
    tool_end: jax.Array  # () i32: <|python_end|>, or -1 without tools
    end_pos: jax.Array  # () i32: the last index of `tokens` generation may write
    n_steps: jax.Array  # () i32: at most this many tokens in this call


def _start(graphdef, cache_len, params, prompt, length, key, controls: Controls) -> GenState:
    """Prefill the (padded) prompt and sample the first token from the logits at length-1."""
    model = nnx.merge(graphdef, params)
    B, P = prompt.shape
    logits, cache = prefill(model, prompt, cache_len)
    last = jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)
    first = sample_token(last, key, controls.sampling, step=length - 1)
    tokens = jnp.zeros((B, cache_len), jnp.int32).at[:, :P].set(prompt)
    tokens = jax.lax.dynamic_update_slice(tokens, first[:, None], (0, length))
    zeros = jnp.zeros((B,), jnp.int32)
    return GenState(cache, tokens, jnp.asarray(length, jnp.int32), key, jnp.isin(first, controls.stop),
                    jnp.zeros((B, FORCED_MAX), jnp.int32), zeros, zeros)


def _advance(graphdef, params, state: GenState, controls: Controls) -> GenState:
    """Decode up to n_steps tokens in one while_loop; stop early when every row is done or a row
    just wrote <|python_end|> (the host runs the tool and queues its output in `forced`)."""
    model = nnx.merge(graphdef, params)
    B, F = state.forced.shape
    rows = jnp.arange(B)

    def cond(c):
        i, s, pause = c
        return (i < controls.n_steps) & (s.pos < controls.end_pos) & ~jnp.all(s.done) & ~pause

    def body(c):
        i, s, _ = c
        tok = jax.lax.dynamic_slice_in_dim(s.tokens, s.pos, 1, axis=1)
        prev = jax.lax.dynamic_index_in_dim(s.tokens, s.pos - 1, axis=1, keepdims=False)
        logits, cache = forward_cached(model, s.cache, tok, prev, s.pos)
        sampled = sample_token(logits[:, 0], s.key, controls.sampling, step=s.pos)
        use_forced = s.forced_ptr < s.forced_len
        nxt = jnp.where(use_forced, s.forced[rows, jnp.minimum(s.forced_ptr, F - 1)], sampled)
        fresh = ~use_forced & ~s.done  # a token the model chose (forced ones never stop a row)
        done = s.done | (fresh & jnp.isin(nxt, controls.stop))
        pause = jnp.any(fresh & (nxt == controls.tool_end))
        tokens = jax.lax.dynamic_update_slice(s.tokens, nxt[:, None], (0, s.pos + 1))
        s = GenState(cache, tokens, s.pos + 1, s.key, done, s.forced, s.forced_len,
                     s.forced_ptr + use_forced.astype(jnp.int32))
        return i + 1, s, pause

    _, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.bool_(False)))
    return state


def _bucket(n: int, lo: int, hi: int) -> int:
    """The smallest power of two >= n (at least lo), capped at hi: few shapes, few compiles."""
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)


# --- the engine -----------------------------------------------------------------------------------

_COMPILED: dict[tuple, object] = {}
_COMPILE_LOCK = threading.Lock()
compile_log: list[tuple[tuple, float]] = []  # ((graphdef, name, shapes...), seconds) of every compile


class Engine:
    """Compiled generation for one model; several threads may generate at once (the web server).

    `generate` streams one column of tokens per step (one token per sample) as they come;
    `generate_batch` returns whole samples. Compiled functions are kept per shape and reused.
    """

    def __init__(self, model: GPT, tokenizer=None, *, tools: bool = True, tool_timeout: float = 3.0,
                 tool_runner=None, sandbox: str = "best-effort"):
        from flaxchat.tools import run_tool
        self.model = model
        self.config = model.config
        self.graphdef, self.params = nnx.split(model)
        self.tokenizer = tokenizer
        self.tools = tools and tokenizer is not None
        self.tool_runner = tool_runner or (lambda expr: run_tool(expr, tool_timeout, sandbox))

    # -- compiled functions, one per shape --

    def _compiled_fn(self, key: tuple, build):
        """The executable for `key`, compiled once per process: it depends only on the model's
        structure (graphdef) and the shapes, so engines of the same architecture share it."""
        key = (self.graphdef,) + key
        with _COMPILE_LOCK:  # one compile at a time; a thread waiting for it then reuses it
            fn = _COMPILED.get(key)
            if fn is None:
                if any(k == key for k, _ in compile_log):
                    log.warning("recompiling %s: a compiled function was lost; calls will stall", key[1:])
                t0 = time.perf_counter()
                fn = build()
                seconds = time.perf_counter() - t0
                compile_log.append((key, seconds))
                log.info("compiled %s in %.2f s", key[1:], seconds)
                _COMPILED[key] = fn
        return fn

    def _start_fn(self, args, cache_len: int):
        return self._compiled_fn(("start", args[0].shape, cache_len), lambda: jax.jit(
            functools.partial(_start, self.graphdef, cache_len)).lower(self.params, *args).compile())

    def _advance_fn(self, state: GenState, controls: Controls):
        return self._compiled_fn(("advance", state.tokens.shape), lambda: jax.jit(
            functools.partial(_advance, self.graphdef), donate_argnums=(1,)).lower(
            self.params, state, controls).compile())

    # -- planning and checks --

    def stop_tokens(self) -> list[int]:
        """<|assistant_end|> and <|bos|>: the end of a reply or of a document."""
        if self.tokenizer is None:
            return []
        return [self.tokenizer.encode_special("<|assistant_end|>"), self.tokenizer.bos_token_id]

    def plan(self, tokens: Sequence[int], max_tokens: int | None) -> tuple[list[int], int, int, int]:
        """Check a prompt; return (prompt, tokens to generate at most, cache length, prompt bucket)."""
        prompt = [int(t) for t in tokens]
        T, V = self.config.sequence_len, self.config.vocab_size
        if not prompt:
            raise UserError("the prompt is empty; give at least one token (a chat prompt starts with <|bos|>).")
        if len(prompt) >= T:
            raise UserError(f"the prompt has {len(prompt)} tokens but the model's context holds {T}; "
                            f"shorten it to at most {T - 1} tokens.")
        if min(prompt) < 0 or max(prompt) >= V:
            raise UserError(f"the prompt holds token ids outside the vocabulary [0, {V}).")
        if max_tokens is not None and max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1 (got {max_tokens}).")
        room = T - len(prompt)
        n_max = room if max_tokens is None else min(max_tokens, room)
        cache_len = _bucket(len(prompt) + n_max, MIN_BUCKET, T)
        return prompt, n_max, cache_len, _bucket(len(prompt), 16, cache_len)

    def _controls(self, sampling: Sampling, stop: Sequence[int], end_pos: int, n_steps: int) -> Controls:
        stop = list(stop)[:MAX_STOP]
        tool_end = self.tokenizer.encode_special("<|python_end|>") if self.tools else -1
        return Controls(sampling, np.array(stop + [-1] * (MAX_STOP - len(stop)), np.int32),
                        np.int32(tool_end), np.int32(end_pos), np.int32(n_steps))

    # -- generation --

    def generate(self, tokens: Sequence[int], num_samples: int = 1, max_tokens: int | None = None, *,
                 temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                 seed: int = 0, stop_tokens: Sequence[int] | None = None,
                 chunk: int = 16) -> Iterator[tuple[list[int | None], list[bool]]]:
        """Yield (tokens, forced) per step: one token per sample (None once that sample has ended,
        after its stop token) and whether it was forced by the tool rather than sampled. Stops when
        every sample wrote a stop token, after `max_tokens`, or when the context is full; stop
        iterating to cancel. `chunk` tokens are decoded per compiled call between yields."""
        prompt, n_max, cache_len, p_len = self.plan(tokens, max_tokens)
        P, B = len(prompt), int(num_samples)
        if B < 1:
            raise UserError(f"num_samples must be at least 1 (got {num_samples}).")
        stop = set(self.stop_tokens() if stop_tokens is None else stop_tokens)
        end_pos = P + n_max - 1
        controls = self._controls(make_sampling(temperature, top_k, top_p), sorted(stop), end_pos, max(1, chunk))
        padded = np.zeros((B, p_len), np.int32)
        padded[:, :P] = prompt
        args = (padded, np.int32(P), jax.random.key(seed), controls)
        state = self._start_fn(args, cache_len)(self.params, *args)
        advance = None
        rows = [self._tool_state() for _ in range(B)]
        active, pending = [True] * B, [0] * B  # pending: forced tokens of the row still to come
        seen = P - 1
        while True:
            toks, pos = np.asarray(state.tokens), int(state.pos)
            queued = {}
            for t in range(seen + 1, pos + 1):
                column, forced = [None] * B, [False] * B
                for r in range(B):
                    if not active[r]:
                        continue
                    column[r] = tok = int(toks[r, t])
                    if pending[r]:
                        pending[r] -= 1
                        forced[r] = True
                    elif tok in stop:
                        active[r] = False
                    elif rows[r] is not None and (out := rows[r].feed(tok)):
                        queued[r] = out
                yield column, forced
            seen = pos
            if not any(active) or pos >= end_pos:
                return
            if queued:
                state = _queue_forced(state, queued, pending)
            advance = advance or self._advance_fn(state, controls)
            state = advance(self.params, state, controls)

    def _tool_state(self):
        if not self.tools:
            return None
        from flaxchat.tools import ToolState
        return ToolState(self.tokenizer, self.tool_runner, FORCED_MAX)

    def generate_batch(self, tokens: Sequence[int], num_samples: int = 1, max_tokens: int | None = None,
                       **kwargs) -> tuple[list[list[int]], list[list[int]]]:
        """Whole samples (stop tokens left out) and masks (1 sampled, 0 forced by the tool). The
        loop runs to the end in one compiled call unless a tool call needs the host."""
        results = [[] for _ in range(num_samples)]
        masks = [[] for _ in range(num_samples)]
        stop = set(self.stop_tokens() if kwargs.get("stop_tokens") is None else kwargs["stop_tokens"])
        kwargs.setdefault("chunk", self.config.sequence_len)
        for column, forced in self.generate(tokens, num_samples, max_tokens, **kwargs):
            for r, tok in enumerate(column):
                if tok is not None and (forced[r] or tok not in stop):
                    results[r].append(tok)
                    masks[r].append(0 if forced[r] else 1)
        return results, masks

    def warmup(self, prompt_len: int = 16, max_tokens: int = 128, num_samples: int = 1) -> None:
        """Compile (once) for this prompt bucket, cache bucket and batch size."""
        for _ in self.generate([0] * prompt_len, num_samples, max_tokens, temperature=0.0, stop_tokens=()):
            pass


    # -- speculative decoding --

    def generate_speculative(self, tokens: Sequence[int], draft: "Engine", max_tokens: int | None = None, *,
                             k: int = 4, stop_tokens: Sequence[int] | None = None) -> tuple[list[int], dict]:
        """Greedy speculative decoding (batch 1): `draft` proposes k tokens one at a time, this model
        checks all of them in one forward and keeps the longest agreeing prefix plus its own next
        token. The output is this model's greedy decoding, token for token. Returns (tokens without
        the stop token, stats with the acceptance rate)."""
        if draft.config.vocab_size != self.config.vocab_size:
            raise UserError(f"the draft model's vocabulary ({draft.config.vocab_size}) differs from the "
                            f"main model's ({self.config.vocab_size}); speculative decoding needs the same tokenizer.")
        if draft.config.sequence_len < self.config.sequence_len:
            raise UserError("the draft model's context is shorter than the main model's.")
        if k < 1:
            raise UserError(f"k, the draft tokens per round, must be at least 1 (got {k}).")
        prompt, n_max, cache_len, p_len = self.plan(tokens, max_tokens)
        P = len(prompt)
        stop = list(self.stop_tokens() if stop_tokens is None else stop_tokens)
        stop_arr = np.array(stop[:MAX_STOP] + [-1] * (MAX_STOP - len(stop[:MAX_STOP])), np.int32)
        padded = np.zeros((1, p_len), np.int32)
        padded[0, :P] = prompt
        args = (self.params, draft.params, padded, np.int32(P), np.int32(P + n_max - 1), stop_arr)
        key = ("speculative", draft.graphdef, p_len, cache_len, k)
        fn = self._compiled_fn(key, lambda: jax.jit(functools.partial(
            _speculate, self.graphdef, draft.graphdef, cache_len + k + 1, k)).lower(*args).compile())
        toks, rounds, accepted = fn(*args)
        out = [int(t) for t in np.asarray(toks)[0, P:P + n_max]]
        for i, t in enumerate(out):
            if t in stop:
                out = out[:i]
                break
        rounds, accepted = int(rounds), int(accepted)
        return out, dict(rounds=rounds, accepted=accepted, proposed=rounds * k,
                         acceptance=accepted / max(1, rounds * k), tokens_per_round=len(out) / max(1, rounds))


def _queue_forced(state: GenState, queued: dict[int, list[int]], pending: list[int]) -> GenState:
    """Put each row's tool output into the device-side queue the loop feeds from."""
    forced, flen, fptr = (np.array(a) for a in (state.forced, state.forced_len, state.forced_ptr))
    for r, toks in queued.items():
        toks = toks[:FORCED_MAX]
        forced[r, :len(toks)] = toks
        flen[r], fptr[r] = len(toks), 0
        pending[r] = len(toks)
    return state._replace(forced=jnp.asarray(forced), forced_len=jnp.asarray(flen), forced_ptr=jnp.asarray(fptr))


def _speculate(graphdef, draft_graphdef, cache_len, k, params, draft_params, prompt, length, end_pos, stop):
    """Greedy speculative decoding in one while_loop; returns (tokens (1, cache_len), rounds, accepted).

    Each round: the draft runs k+1 one-token steps from the newest token (the extra step writes the
    k-th proposal into its cache, needed when all k are accepted), then the main model reads the
    newest token and the k proposals in ONE forward at positions pos..pos+k. Keys written for
    rejected proposals stay in the caches but sit after the new position, where the causal mask
    hides them until they are overwritten. `cache_len` has k+1 slots of slack for the last round.
    """
    main, draft = nnx.merge(graphdef, params), nnx.merge(draft_graphdef, draft_params)
    logits, mcache = prefill(main, prompt, cache_len)
    _, dcache = prefill(draft, prompt, cache_len)
    first = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, length - 1, 1, False), -1).astype(jnp.int32)
    tokens = jnp.zeros((1, cache_len), jnp.int32).at[:, :prompt.shape[1]].set(prompt)
    tokens = jax.lax.dynamic_update_slice(tokens, first[:, None], (0, length))
    ar = jnp.arange(k + 1)

    def cond(c):
        _, _, _, pos, done, _, _ = c
        return (pos < end_pos) & ~done

    def body(c):
        mcache, dcache, tokens, pos, _, rounds, accepted = c
        tok = jax.lax.dynamic_slice_in_dim(tokens, pos, 1, axis=1)  # (1, 1)
        prev = jax.lax.dynamic_index_in_dim(tokens, pos - 1, axis=1, keepdims=False)

        def propose(j, dc):
            dcache, t, p, props = dc
            lg, dcache = forward_cached(draft, dcache, t[:, None], p, pos + j)
            nxt = jnp.argmax(lg[:, 0], -1).astype(jnp.int32)
            return dcache, nxt, t, props.at[:, j].set(nxt)

        dcache, _, _, props = jax.lax.fori_loop(
            0, k + 1, propose, (dcache, tok[:, 0], prev, jnp.zeros((1, k + 1), jnp.int32)))
        lg, mcache = forward_cached(main, mcache, jnp.concatenate([tok, props[:, :k]], 1), prev, pos)
        best = jnp.argmax(lg[0], -1).astype(jnp.int32)  # (k+1,): the main model's choice after each
        n = jnp.sum(jnp.cumprod(props[0, :k] == best[:k]))  # proposals accepted
        new = jnp.where(ar < n, props[0], best[n])  # accepted proposals, then the main model's token
        done = jnp.any(jnp.isin(new, stop) & (ar <= n))
        tokens = jax.lax.dynamic_update_slice(tokens, new[None], (0, pos + 1))
        return mcache, dcache, tokens, pos + n + 1, done, rounds + 1, accepted + n

    init = (mcache, dcache, tokens, jnp.asarray(length, jnp.int32), jnp.isin(first, stop)[0], jnp.int32(0), jnp.int32(0))
    _, _, tokens, _, _, rounds, accepted = jax.lax.while_loop(cond, body, init)
    return tokens, rounds, accepted
