"""Prefill and one-token decode with an explicit, fixed-size KV cache: pure functions of plain arrays.

These are the functions a TFLite app calls (`scripts.convert_to_tflite` exports them as the
`prefill` and `decode` signatures), so every shape is fixed when they are traced: the cache holds
`max_len` positions, a step writes one of them and attends over all of them with a mask. Nothing
depends on a data-dependent shape (LiteRT has no dynamic slicing of the time axis, and a symbolic
sequence length does not convert: `jnp.tril` on a symbolic dimension fails in the converter).

State between calls, all float32 except the ids:
  k_cache, v_cache   (n_layer, B, n_kv_head, max_len, head_dim): keys after rotary + QK-norm, values.
                     Heads before time: with (B, time, heads, D) XLA copied the whole cache every
                     step (measured: 2,270 -> 2,642 tok/s at batch 1 on a 2-core CPU).
  prev_embedding     (B, 1, n_embd): the normed embedding of the last token fed, for smear.
Positions at or past the tokens fed so far hold stale values; the mask never lets a query see them,
and the next step overwrites them. The model's own `attend` hook does the work, so the maths is the
GPT's (rotary, QK-norm, value embeddings, sliding windows), not a copy of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxchat import ops
from flaxchat.gpt import GPT

NEG_INF = -1e30  # finite: -inf through a quantized or fused softmax can turn into NaN


def dense_attend(layer, q, k, v, window):
    """The attention every exported program uses: dense causal (windowed) attention in plain XLA ops.

    The CPU training kernel loops over blocks (`lax.fori_loop`, O(T) memory for the backward); a
    loop does not convert to TFLite ("Failed to export flatbuffer"), and at the fixed inference
    lengths an export has, the T x T scores of one forward are small."""
    return ops.xla_attention(q, k, v, window)


def cache_shape(model: GPT, batch: int, max_len: int) -> tuple[int, ...]:
    cfg = model.config
    return (cfg.n_layer, batch, cfg.n_kv_head, max_len, cfg.head_dim)


def token_embedding(model: GPT, ids: jax.Array) -> jax.Array:
    """ids (B,) -> (B, 1, d): what `GPT.__call__` wants as `prev_embedding`."""
    return ops.rms_norm(model.wte(ids[:, None]).astype(model.dtype)).astype(jnp.float32)


def prefill(model: GPT, tokens: jax.Array, length: jax.Array, max_len: int):
    """Run a padded prompt and fill the cache.

    tokens (B, P) int32, the prompt in tokens[:, :length] and anything after it (padding is causal
    and so never seen by the real positions); length (B,) int32, 1 <= length <= P <= max_len.
    Returns (logits (B, vocab) of the last real token, k_cache, v_cache, prev_embedding).
    """
    B, P = tokens.shape
    if P > max_len:
        raise ValueError(f"prefill length {P} exceeds the cache length {max_len}")
    keys, values = [], []

    def attend(layer, q, k, v, window):
        keys.append(k)
        values.append(v)
        return dense_attend(layer, q, k, v, window)

    logits = model(tokens, attend=attend)
    last = jnp.clip(length - 1, 0, P - 1)
    logits = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]
    pad = [(0, 0), (0, 0), (0, 0), (0, max_len - P), (0, 0)]
    k_cache = jnp.pad(jnp.stack([k.transpose(0, 2, 1, 3) for k in keys]), pad)
    v_cache = jnp.pad(jnp.stack([v.transpose(0, 2, 1, 3) for v in values]), pad)
    last_ids = jnp.take_along_axis(tokens, last[:, None], axis=1)[:, 0]
    return logits, k_cache.astype(jnp.float32), v_cache.astype(jnp.float32), token_embedding(model, last_ids)


def decode_step(model: GPT, token: jax.Array, position: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                prev_embedding: jax.Array):
    """Feed one token per row at `position` (B,) int32 (< max_len); returns the same four as prefill.

    The new key/value goes into the cache with a one-hot select rather than a dynamic update
    slice: it is per row (rows may sit at different positions) and lowers to plain elementwise ops
    in every runtime; it reads the cache once, as the attention does anyway.
    """
    S = k_cache.shape[3]
    slot = (jnp.arange(S)[None, :] == position[:, None])[:, None, :, None]  # (B, 1, S, 1)
    new_k, new_v = [], []

    def attend(layer, q, k, v, window):
        B, _, H, D = q.shape
        Hkv = k.shape[2]
        kc = jnp.where(slot, k.transpose(0, 2, 1, 3).astype(k_cache.dtype), k_cache[layer])
        vc = jnp.where(slot, v.transpose(0, 2, 1, 3).astype(v_cache.dtype), v_cache[layer])
        new_k.append(kc)
        new_v.append(vc)
        qg = q.reshape(B, Hkv, H // Hkv, D).astype(jnp.float32)
        s = jnp.einsum("bhgd,bhsd->bhgs", qg, kc) * D ** -0.5
        kpos = jnp.arange(S)[None, :]
        visible = (kpos <= position[:, None]) & (kpos > position[:, None] - window)  # (B, S)
        s = jnp.where(visible[:, None, None, :], s, NEG_INF)
        p = jax.nn.softmax(s, axis=-1)
        y = jnp.einsum("bhgs,bhsd->bhgd", p, vc)
        return y.reshape(B, 1, H, D).astype(q.dtype)

    logits = model(token, positions=position[:, None], attend=attend, prev_embedding=prev_embedding)
    return logits[:, 0], jnp.stack(new_k), jnp.stack(new_v), token_embedding(model, token[:, 0])


_COMPILED: dict = {}


def greedy_generate(model: GPT, prompt: list[int], max_new: int, max_len: int | None = None) -> list[int]:
    """Greedy continuation of one prompt through prefill + decode_step (jitted once per shape).

    The JAX twin of what an app does with the TFLite `prefill`/`decode` signatures; tests compare
    the two token for token.
    """
    import numpy as np
    from flax import nnx

    max_len = max_len or model.config.sequence_len
    n = len(prompt)
    if not 1 <= n < max_len:
        raise ValueError(f"prompt of {n} tokens does not fit a cache of {max_len}")
    graphdef, state = nnx.split(model)
    key = (graphdef, max_len)
    if key not in _COMPILED:  # one compile per model shape, not per call (a new closure recompiled every call: 1-2 s)
        _COMPILED[key] = (jax.jit(lambda s, t, l: prefill(nnx.merge(graphdef, s), t, l, max_len)),
                          jax.jit(lambda s, *a: decode_step(nnx.merge(graphdef, s), *a)))
    pre, step = _COMPILED[key]
    tokens = np.zeros((1, max_len), np.int32)
    tokens[0, :n] = prompt
    logits, kc, vc, prev = pre(state, tokens, np.array([n], np.int32))
    out = []
    for pos in range(n, min(max_len, n + max_new)):
        nxt = int(jnp.argmax(logits[0]))
        out.append(nxt)
        if len(out) == max_new or pos == max_len - 1:
            break
        logits, kc, vc, prev = step(state, np.array([[nxt]], np.int32), np.array([pos], np.int32), kc, vc, prev)
    return out
