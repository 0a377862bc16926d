"""The blockwise attention kernel: flash attention written for XLA:CPU (the CPU's default kernel).

`causal_attention(q, k, v, window, block)` computes, per block of queries, scores against only the
key blocks it can see, so the causal triangle and a sliding window skip work instead of masking
it. Up to SHORT_TOKENS tokens the tiles are unrolled and their probabilities kept for the backward;
longer sequences run loops with flash-style memory: the forward keeps one log-sum-exp per query
row (O(T)), the backward recomputes each block's probabilities from it; nothing of size T×T
outlives a block. The same numbers as `flaxchat.ops.reference_attention`, up to float summation
order. It runs on any backend (`--attention blockwise`); its transposes are stored only on a CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from flaxchat.kernels.cpu_layout import stored_transpose

# Flash attention written for XLA:CPU: a loop over query blocks, and inside it a loop over only the
# key blocks that block can see (causal triangle, sliding window), with an online softmax. Real
# loops, not an unrolled Python loop: XLA:CPU schedules unrolled blocks side by side (every
# block's T-wide scores alive at once, an O(T²) peak with nothing T×T saved) and removes the
# optimization barriers that would order them. Per layer the forward keeps out and one
# log-sum-exp per query row; the backward recomputes each tile's probabilities from it.


def _first_key_block(qs, window: int, block: int):
    return jnp.maximum(0, qs - window + 1) // block


def _visible(qs, ks, keys: int, G: int, block: int, window: int, xp=jnp):
    """Which of keys [ks, ks+keys) each row of a query block [qs, qs+block) sees, rows (g, query)
    g-major; numpy (`xp=np`) where the block's place is known when tracing."""
    qpos = qs + xp.tile(xp.arange(block), G)[:, None]
    kpos = ks + xp.arange(keys)[None, :]
    return (kpos <= qpos) & (kpos > qpos - window)


def _tile(q_rows, qs, k, v, ks, window, block, scale):
    """Masked fp32 scores of one query block (B,Hkv,G·n,D) against keys [ks, ks+block)."""
    kj = jax.lax.dynamic_slice_in_dim(k, ks, block, axis=2)
    vj = jax.lax.dynamic_slice_in_dim(v, ks, block, axis=2)
    s = jnp.einsum("bhqd,bhkd->bhqk", q_rows, kj, preferred_element_type=jnp.float32) * scale
    visible = _visible(qs, ks, block, q_rows.shape[2] // block, block, window)
    return jnp.where(visible, s, -jnp.inf), kj, vj


def _rows(x, qs, block):
    """Query block [qs, qs+block) of x (B,Hkv,G,T,...) as (B,Hkv,G·block,...)."""
    xi = jax.lax.dynamic_slice_in_dim(x, qs, block, axis=3)
    return xi.reshape(xi.shape[:2] + (-1,) + xi.shape[4:])


def _put_rows(x, rows, qs, block):
    B, Hkv, G = x.shape[:3]
    rows = rows.reshape((B, Hkv, G, block) + x.shape[4:]).astype(x.dtype)
    return jax.lax.dynamic_update_slice_in_dim(x, rows, qs, axis=3)


def _row_dot(a, b):
    """sum(a * b, axis=-1) in fp32, as a dot: XLA:CPU lowered the plain sum over head_dim of these
    5-D arrays (B, Hkv, G, T, D) to a reduce-window and a reduce, 2.7 ms at config A's
    (8, 4, 1, 256, 64) where this takes 0.22 ms (2-core AMD EPYC Zen 4)."""
    return jnp.einsum("...d,...d->...", a.astype(jnp.float32), b.astype(jnp.float32))


def _attn_fwd(q, k, v, window, block):
    """q (B,Hkv,G,T,D), k/v (B,Hkv,T,D), T a multiple of block -> out, lse (B,Hkv,G,T) fp32."""
    B, Hkv, G, T, D = q.shape
    scale = D ** -0.5

    def q_step(i, carry):
        out, lse = carry
        qs = i * block
        qi = _rows(q, qs, block)

        def k_step(j, acc):
            m, l, o = acc
            s, _, vj = _tile(qi, qs, k, v, j * block, window, block, scale)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with no visible key yet
            p = jnp.exp(s - m_safe[..., None])
            corr = jnp.exp(m - m_safe)
            o = o * corr[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), vj,
                                                 preferred_element_type=jnp.float32)
            return m_new, l * corr + jnp.sum(p, axis=-1), o

        rows = (B, Hkv, G * block)
        init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(rows + (D,), jnp.float32))
        m, l, o = jax.lax.fori_loop(_first_key_block(qs, window, block), i + 1, k_step, init)
        return _put_rows(out, o / l[..., None], qs, block), _put_rows(lse, m + jnp.log(l), qs, block)

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros(q.shape[:4], jnp.float32))
    return jax.lax.fori_loop(0, T // block, q_step, init)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, window, block):
    return _attn_fwd(q, k, v, window, block)[0]


def _attention_fwd(q, k, v, window, block):
    out, lse = _attn_fwd(q, k, v, window, block)
    return out, (q, k, v, out, lse)  # O(T) residuals: no probabilities are kept


def _attention_bwd(window, block, res, dout):
    """Each tile's probabilities recomputed from the saved log-sum-exp; the softmax backward
    through delta = rowsum(dO * O). Every dot is NN or NT (on CPU the TN ones of dK and dV go
    through explicit transposes)."""
    q, k, v, out, lse = res
    B, Hkv, G, T, D = q.shape
    scale = D ** -0.5
    delta = _row_dot(dout, out)  # (B,Hkv,G,T)

    def q_step(i, carry):
        dq, dk, dv = carry
        qs = i * block
        qi, doi = _rows(q, qs, block), _rows(dout, qs, block)
        lse_i, delta_i = _rows(lse, qs, block)[..., None], _rows(delta, qs, block)[..., None]

        def k_step(j, acc):
            dqi, dk, dv = acc
            ks = j * block
            s, kj, vj = _tile(qi, qs, k, v, ks, window, block, scale)
            p = jnp.exp(s - lse_i)
            dp = jnp.einsum("bhqd,bhkd->bhqk", doi, vj, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_i) * scale
            dqi = dqi + jnp.einsum("bhqk,bhkd->bhqd", ds.astype(q.dtype), kj, preferred_element_type=jnp.float32)
            dkj = jnp.matmul(stored_transpose(ds.astype(q.dtype), (0, 1, 3, 2)), qi, preferred_element_type=jnp.float32)
            dvj = jnp.matmul(stored_transpose(p.astype(v.dtype), (0, 1, 3, 2)), doi, preferred_element_type=jnp.float32)
            add = lambda x, d: jax.lax.dynamic_update_slice_in_dim(
                x, jax.lax.dynamic_slice_in_dim(x, ks, block, axis=2) + d, ks, axis=2)
            return dqi, add(dk, dkj), add(dv, dvj)

        init = (jnp.zeros(qi.shape, jnp.float32), dk, dv)
        dqi, dk, dv = jax.lax.fori_loop(_first_key_block(qs, window, block), i + 1, k_step, init)
        return _put_rows(dq, dqi, qs, block), dk, dv

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dq, dk, dv = jax.lax.fori_loop(0, T // block, q_step, init)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


# --- short sequences: the tiles unrolled, probabilities kept ----------------------------------
# Sequences of up to SHORT_TOKENS tokens (the main job's 256, config B's 512) take tiles of
# SHORT_TILE queries, unrolled: each query tile takes one tile over all the keys it can see (static
# slices and a numpy mask), one plain softmax, and keeps its probabilities for the backward instead
# of recomputing them: a layer keeps at most B·H·T·(T + tile)/2 floats more (0.66 MB per row of 256
# tokens at 4 heads, 4.7 MB per row of 512 at 8). Same numbers as the loops above up to float
# summation order. Longer sequences keep the loops and their O(T) memory.
#
# Why 64-query tiles: a 64-key granularity skips more of the causal triangle and the window than
# 128 (at T = 256, window 128: 36,864 scores per head instead of 49,152), and a 64 x 256 fp32 tile
# stays in L1/L2. Attention's forward+backward alone (`python -m bench.attention`), 2-core AMD EPYC
# (Zen 4), medians of 40 interleaved rounds, against 128-key tiles unrolled up to two tiles and the
# loops beyond:
#   (8, 256, 4 heads of 64), window 128: 24.5 -> 17.0 ms;  (4, 256, 4, 64), window 256: 12.9 -> 8.9 ms
#   (2, 512, 8, 64), window 128: 22.7 -> 15.9 ms;          (2, 512, 8, 64), window 512: 34.0 -> 34.6 ms
# Loops of 64-key blocks instead: 19.5, 11.9, 20.8 and 37.5 ms; of 32: slower still. The whole
# train step (interleaved in one process, paired medians): config A -12.7 ms of 516 at 2K tokens and
# -51 ms of 3,255 at 16K, config B -101 ms of 3,779 at 2K. docs/cpu.md.
SHORT_TOKENS = 512
SHORT_TILE = 64


def _short_spans(T: int, window: int, block: int):
    """Per query block (qs, ks, ke): its rows [qs, qs+block) see keys in [ks, ke), whole blocks."""
    return [(qs, max(0, qs - window + 1) // block * block, qs + block) for qs in range(0, T, block)]


def _short_fwd(q, k, v, window, block):
    """q (B,Hkv,G,T,D), k/v (B,Hkv,T,D) -> out (B,Hkv,G,T,D) and each query block's probabilities."""
    B, Hkv, G, T, D = q.shape
    outs, probs = [], []
    for qs, ks, ke in _short_spans(T, window, block):
        qi = q[:, :, :, qs:qs + block].reshape(B, Hkv, G * block, D)
        s = jnp.einsum("bhqd,bhkd->bhqk", qi, k[:, :, ks:ke], preferred_element_type=jnp.float32) * D ** -0.5
        p = jax.nn.softmax(jnp.where(_visible(qs, ks, ke - ks, G, block, window, np), s, -jnp.inf), axis=-1)
        o = jnp.matmul(p.astype(v.dtype), v[:, :, ks:ke], preferred_element_type=jnp.float32)
        outs.append(o.astype(q.dtype).reshape(B, Hkv, G, block, D))
        probs.append(p)
    return jnp.concatenate(outs, axis=3), probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _short_attention(q, k, v, window, block):
    return _short_fwd(q, k, v, window, block)[0]


def _short_attention_fwd(q, k, v, window, block):
    out, probs = _short_fwd(q, k, v, window, block)
    return out, (q, k, v, out, probs)


def _short_attention_bwd(window, block, res, dout):
    q, k, v, out, probs = res
    B, Hkv, G, T, D = q.shape
    delta = _row_dot(dout, out)  # (B,Hkv,G,T)
    dq = []
    dk, dv = ([[] for _ in range(T // block)] for _ in range(2))  # per key block, each tile's share
    for (qs, ks, ke), p in zip(_short_spans(T, window, block), probs):
        rows = lambda x: x[:, :, :, qs:qs + block].reshape((B, Hkv, G * block) + x.shape[4:])
        qi, doi, delta_i = rows(q), rows(dout), rows(delta)[..., None]
        dp = jnp.einsum("bhqd,bhkd->bhqk", doi, v[:, :, ks:ke], preferred_element_type=jnp.float32)
        ds = p * (dp - delta_i) * D ** -0.5
        dq.append(jnp.matmul(ds.astype(q.dtype), k[:, :, ks:ke], preferred_element_type=jnp.float32)
                  .reshape(B, Hkv, G, block, D))
        dkj = jnp.matmul(stored_transpose(ds.astype(q.dtype), (0, 1, 3, 2)), qi, preferred_element_type=jnp.float32)
        dvj = jnp.matmul(stored_transpose(p.astype(v.dtype), (0, 1, 3, 2)), doi, preferred_element_type=jnp.float32)
        for j in range(ks // block, ke // block):
            dk[j].append(dkj[:, :, j * block - ks:(j + 1) * block - ks])
            dv[j].append(dvj[:, :, j * block - ks:(j + 1) * block - ks])
    # Each key block's shares summed, then the blocks joined: one pass, where adding each tile into
    # a zeroed dk took a chain of updates (config B's (2, 512, 8, 64) at window 128: 12.31 -> 11.44
    # ms forward+backward, faster in 80% of 40 paired rounds; config A's shapes within +-0.3 ms).
    dk, dv = (jnp.concatenate([sum(parts) for parts in x], axis=2) for x in (dk, dv))
    return jnp.concatenate(dq, axis=3).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_short_attention.defvjp(_short_attention_fwd, _short_attention_bwd)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, block: int = 128) -> jax.Array:
    """Causal (optionally sliding-window) attention, blockwise, with a hand-written backward.

    q: (B, T, H, D); k, v: (B, T, Hkv, D) with H a multiple of Hkv (grouped-query attention).
    A query at position t attends to keys max(0, t-window+1) .. t. Returns (B, T, H, D).
    Each block of queries computes scores only against the key blocks it can see, so work outside
    the causal triangle or the window is skipped, not masked. Scores and softmax in fp32. Up to
    SHORT_TOKENS tokens the tiles (of at most SHORT_TILE) are unrolled and the probabilities kept
    (see there); longer sequences run loops over blocks of `block`.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    short = T <= SHORT_TOKENS
    block = min(block, SHORT_TILE, T) if short else min(block, T)
    pad = -T % block  # padded keys come after every real query, so causality hides them
    qt = jnp.transpose(q.reshape(B, T, Hkv, G, D), (0, 2, 3, 1, 4))  # (B, Hkv, G, T, D)
    kt = jnp.transpose(k, (0, 2, 1, 3))  # (B, Hkv, T, D)
    vt = jnp.transpose(v, (0, 2, 1, 3))
    if pad:
        qt = jnp.pad(qt, [(0, 0)] * 3 + [(0, pad), (0, 0)])
        kt, vt = (jnp.pad(x, [(0, 0)] * 2 + [(0, pad), (0, 0)]) for x in (kt, vt))
    out = (_short_attention if short else _attention)(qt, kt, vt, window, block)[:, :, :, :T]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, D)


