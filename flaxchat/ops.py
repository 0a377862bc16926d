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


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, block: int = 128) -> jax.Array:
    """Causal (optionally sliding-window) attention, blockwise.

    q: (B, T, H, D); k, v: (B, T, Hkv, D) with H a multiple of Hkv (grouped-query attention).
    A query at position t attends to keys max(0, t-window+1) .. t. Returns (B, T, H, D).
    Scores and softmax in fp32 whatever the input dtype.
    """
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    scale = D ** -0.5
    qg = q.reshape(B, T, Hkv, G, D)
    block = min(block, T)
    outs = []
    for q_start in range(0, T, block):
        q_end = min(T, q_start + block)
        k_start, k_end = _key_range(q_start, q_end, window, block)
        qb = qg[:, q_start:q_end]
        kb, vb = k[:, k_start:k_end], v[:, k_start:k_end]
        s = jnp.einsum("bqhgd,bkhd->bhgqk", qb, kb, preferred_element_type=jnp.float32) * scale
        qpos = jnp.arange(q_start, q_end)[:, None]
        kpos = jnp.arange(k_start, k_end)[None, :]
        visible = (kpos <= qpos) & (kpos > qpos - window)
        s = jnp.where(visible, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        outs.append(jnp.einsum("bhgqk,bkhd->bqhgd", p, vb))
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out.reshape(B, T, H, D)


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
