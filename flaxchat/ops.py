"""The two hot kernels of the model, written so XLA's CPU backend takes its fast matmul paths.

* `matmul(x, w)`: a linear layer whose backward computes dW as `barrier(xᵀ) @ g`. XLA on CPU lowers
  the token-contracting dot `xᵀ·g` to a slow generic dot; an explicit transpose followed by a plain
  NN matmul goes to the fast library (measured 57% -> 66% MFU on an 8L/512d GPT, field notes).
* `causal_attention(q, k, v, window)`: attention computed per block of queries over only the key
  blocks it can see, so a sliding window or the causal triangle skips work instead of masking it
  (a dense TxT mask saves nothing: every masked score is still computed).
Both are exact: they compute the same numbers as the textbook forms, up to float summation order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# --- linear -------------------------------------------------------------------------------------


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., in) @ w (in, out)."""
    return jnp.matmul(x, w)


def _matmul_fwd(x, w):
    return jnp.matmul(x, w), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    # The barrier keeps XLA from folding the transpose back into a token-contracting dot.
    xt = jax.lax.optimization_barrier(x2.T)
    dw = jnp.matmul(xt, g2).astype(w.dtype)
    dx = jnp.matmul(g, w.T).astype(x.dtype)
    return dx, dw


matmul.defvjp(_matmul_fwd, _matmul_bwd)


# --- attention ----------------------------------------------------------------------------------


def _key_range(q_start: int, q_end: int, window: int, block: int) -> tuple[int, int]:
    """Keys [start, end) that queries [q_start, q_end) can see, start aligned to a key block."""
    lo = max(0, q_start - window + 1)
    return (lo // block) * block, q_end


def _blocks(T: int, window: int, block: int):
    """Static (q_start, q_end, k_start, k_end) of every query block and the keys it can see."""
    block = min(block, T)
    out = []
    for qs in range(0, T, block):
        qe = min(T, qs + block)
        ks, ke = _key_range(qs, qe, window, block)
        out.append((qs, qe, ks, ke))
    return out


def _mask(qs, qe, ks, ke, window):
    qpos = jnp.arange(qs, qe)[:, None]
    kpos = jnp.arange(ks, ke)[None, :]
    return (kpos <= qpos) & (kpos > qpos - window)


def _t(x, perm):
    # An explicit transpose the compiler may not fold into the next dot (field notes: folded
    # transposes make XLA:CPU pick a slow generic dot).
    return jax.lax.optimization_barrier(jnp.transpose(x, perm))


def _attn_fwd_blocks(q, k, v, window, block):
    """q (B,Hkv,G,T,D), k/v (B,Hkv,T,D) -> out (B,Hkv,G,T,D), probabilities per block (fp32)."""
    D = q.shape[-1]
    scale = D ** -0.5
    outs, probs = [], []
    for qs, qe, ks, ke in _blocks(q.shape[3], window, block):
        s = jnp.einsum("bhgqd,bhkd->bhgqk", q[:, :, :, qs:qe], k[:, :, ks:ke],
                       preferred_element_type=jnp.float32) * scale
        s = jnp.where(_mask(qs, qe, ks, ke, window), s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1)
        outs.append(jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), v[:, :, ks:ke]))
        probs.append(p)
    return jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0], probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, window, block):
    return _attn_fwd_blocks(q, k, v, window, block)[0]


def _attention_fwd(q, k, v, window, block):
    out, probs = _attn_fwd_blocks(q, k, v, window, block)
    return out, (q, k, v, probs)


def _attention_bwd(window, block, res, dout):
    """Softmax backward from the saved probabilities; every dot is NN or NT (no TN dots)."""
    q, k, v, probs = res
    B, Hkv, G, T, D = q.shape
    scale = D ** -0.5
    dq_blocks = []
    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    for (qs, qe, ks, ke), p in zip(_blocks(T, window, block), probs):
        n, kr = qe - qs, ke - ks
        do = dout[:, :, :, qs:qe]
        dp = jnp.einsum("bhgqd,bhkd->bhgqk", do, v[:, :, ks:ke], preferred_element_type=jnp.float32)
        ds = p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale
        dq_blocks.append(jnp.einsum("bhgqk,bhkd->bhgqd", ds.astype(q.dtype), k[:, :, ks:ke]))
        # dK = dSᵀ·Q and dV = Pᵀ·dO contract over (g, q): transpose explicitly, then NN dots.
        dsT = _t(ds, (0, 1, 4, 2, 3)).reshape(B, Hkv, kr, G * n).astype(q.dtype)
        pT = _t(p, (0, 1, 4, 2, 3)).reshape(B, Hkv, kr, G * n).astype(v.dtype)
        qb = q[:, :, :, qs:qe].reshape(B, Hkv, G * n, D)
        dob = do.reshape(B, Hkv, G * n, D)
        dk = dk.at[:, :, ks:ke].add(jnp.matmul(dsT, qb, preferred_element_type=jnp.float32))
        dv = dv.at[:, :, ks:ke].add(jnp.matmul(pT, dob, preferred_element_type=jnp.float32))
    dq = jnp.concatenate(dq_blocks, axis=3) if len(dq_blocks) > 1 else dq_blocks[0]
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, block: int = 128) -> jax.Array:
    """Causal (optionally sliding-window) attention, blockwise, with a hand-written backward.

    q: (B, T, H, D); k, v: (B, T, Hkv, D) with H a multiple of Hkv (grouped-query attention).
    A query at position t attends to keys max(0, t-window+1) .. t. Returns (B, T, H, D).
    Each block of queries computes scores only against the key blocks it can see, so work outside
    the causal triangle or the window is skipped, not masked. Scores and softmax in fp32.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    qt = jnp.transpose(q.reshape(B, T, Hkv, G, D), (0, 2, 3, 1, 4))  # (B, Hkv, G, T, D)
    kt = jnp.transpose(k, (0, 2, 1, 3))  # (B, Hkv, T, D)
    vt = jnp.transpose(v, (0, 2, 1, 3))
    out = _attention(qt, kt, vt, window, block)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, D)


def reference_attention(q, k, v, window: int) -> jax.Array:
    """The textbook dense form (TxT scores, masked): used by tests as the ground truth."""
    B, T, H, D = q.shape
    G = H // k.shape[2]
    k = jnp.repeat(k, G, axis=2)
    v = jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * D ** -0.5
    qpos = jnp.arange(T)[:, None]
    kpos = jnp.arange(T)[None, :]
    s = jnp.where((kpos <= qpos) & (kpos > qpos - window), s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def rms_norm(x: jax.Array) -> jax.Array:
    """Parameterless RMSNorm (nanochat `norm`), computed in fp32."""
    xf = x.astype(jnp.float32)
    eps = jnp.finfo(jnp.float32).eps
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, base: float):
    import numpy as np
    return 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))


def rotary(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embedding on (B, T, H, D), rotating the two halves of D (nanochat's layout)."""
    d = x.shape[-1] // 2
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(_inv_freq(x.shape[-1], base))
    cos = jnp.cos(freqs)[..., None, :].astype(x.dtype)  # (.., T, 1, D/2)
    sin = jnp.sin(freqs)[..., None, :].astype(x.dtype)
    x1, x2 = x[..., :d], x[..., d:]
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)
