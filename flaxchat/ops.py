"""The model's math in plain JAX: what every backend computes, written once.

* `matmul(x, w)`: a linear layer.
* `rms_norm(x)`, `rotary_table`, `rotary(x, table)`, `rotary_rms_norm(x, table, scale)`: the
  parameterless RMSNorm and the rotary embedding, and attention's q and k rotated then QK-normed.
* `xla_attention(q, k, v, window)`: causal (optionally sliding-window) grouped-query attention as
  XLA lowers `jax.nn.dot_product_attention`; `reference_attention`: the textbook dense form that
  tests hold every kernel to.
* `softcap(z, cap)`, `softcap_cross_entropy(z, labels, cap)`: the soft-capped logits and their loss.

How a backend runs them fast (Pallas splash attention on TPU, cuDNN on GPU, the blockwise kernel
and hand-written backwards on CPU) lives in `flaxchat.kernels`, chosen once per process; the
forms there compute the same numbers as these, up to float summation order.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxchat.errors import UserError


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., in) @ w (in, out)."""
    return jnp.matmul(x, w)


# --- attention ----------------------------------------------------------------------------------


def local_window(window: int, T: int):
    """`jax.nn.dot_product_attention`'s local_window_size for a causal window of `window` keys."""
    return None if window >= T else (window - 1, 0)  # (keys to the left, keys to the right)


def xla_attention(q, k, v, window: int) -> jax.Array:
    """`jax.nn.dot_product_attention` as XLA lowers it (dense T×T scores: O(T²) memory).
    q (B,T,H,D); k, v (B,T,Hkv,D) -> (B,T,H,D); a query at t sees keys max(0, t-window+1) .. t."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local_window(window, q.shape[1]),
                                        implementation="xla")


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


# --- RMSNorm and rotary ------------------------------------------------------------------------


def rms_reciprocal(xf: jax.Array) -> jax.Array:
    """The reciprocal RMS of each row of an fp32 array (keepdims)."""
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.finfo(jnp.float32).eps)


def rms_norm(x: jax.Array) -> jax.Array:
    """Parameterless RMSNorm (nanochat `norm`), computed in fp32."""
    xf = x.astype(jnp.float32)
    return (xf * rms_reciprocal(xf)).astype(x.dtype)


@functools.lru_cache(maxsize=32)
def _inv_freq(head_dim: int, base: float):
    return 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))


class RotaryTable(NamedTuple):
    cos: jax.Array  # (..., T, 1, D/2)
    sin: jax.Array


def rotary_table(positions, head_dim: int, base: float, dtype) -> RotaryTable:
    """The rotary angles' cos and sin at `positions` ((T,) or (B, T)), made once per forward.

    Positions known when tracing (a numpy array: training's 0..T-1) give numpy constants. Computed
    in the graph instead, XLA:CPU fused cos and sin into every consumer and recomputed them per
    element, per head, per layer and again in the backward; the constants took a config-A train
    step (4L/256d, 8 x 256 tokens, 2-core AMD EPYC) from 7,470 to 7,850 tok/s (medians of six
    interleaved runs of bench.train_throughput). Positions only known at run time (the KV cache's)
    are computed in the graph, once for all layers.
    """
    xp = np if isinstance(positions, np.ndarray) else jnp
    freqs = positions.astype(xp.float32)[..., None] * _inv_freq(head_dim, base)
    return RotaryTable(xp.cos(freqs)[..., None, :].astype(dtype), xp.sin(freqs)[..., None, :].astype(dtype))


def rotary(x: jax.Array, table: RotaryTable) -> jax.Array:
    """Rotary embedding on (B, T, H, D), rotating the two halves of D (nanochat's layout)."""
    return rotate(x, table.cos.astype(x.dtype), table.sin.astype(x.dtype))


def rotate(x, cos, sin, back: bool = False):
    """x's two halves rotated by the table's angles (`back`: by minus them, the inverse)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    if back:
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


def rotary_rms_norm(x: jax.Array, table: RotaryTable, scale: float) -> jax.Array:
    """rms_norm(rotary(x, table)) * scale: attention's q and k, rotated then QK-normed (nanochat)."""
    return rms_norm(rotary(x, table)) * scale


# --- the loss ----------------------------------------------------------------------------------


def softcap(z: jax.Array, cap: float) -> jax.Array:
    """cap·tanh(z/cap): logits squashed smoothly into (-cap, cap)."""
    return cap * jnp.tanh(z / cap)


# Up to this cap the soft-capped logits s = cap·tanh(z/cap) need no row maximum before exp: exp(s -
# cap) lies in (e^(-2·cap), 1], within fp32's normal range (down to e^(-87)) for every logit.
FIXED_SHIFT_CAP = 40.0


def capped_cross_entropy_terms(z, labels, cap):
    """(loss, (t, e, sum of e)): the per-token loss of softcap(z, cap), tanh(z/cap), exp(s - shift)
    and its row sums (what a hand-written backward can reuse).

    The shift is the cap itself up to FIXED_SHIFT_CAP (no pass for the row maximum), else each
    row's maximum of s."""
    t = jnp.tanh(z / cap)
    if cap <= FIXED_SHIFT_CAP:
        shift = jnp.full(t.shape[:-1] + (1,), cap, t.dtype)
    else:
        shift = cap * jnp.max(t, axis=-1, keepdims=True)
    e = jnp.exp(cap * t - shift)
    se = jnp.sum(e, axis=-1)
    ty = jnp.take_along_axis(t, labels[..., None], axis=-1)[..., 0]
    return jnp.log(se) + shift[..., 0] - cap * ty, (t, e, se)


def softcap_cross_entropy(z: jax.Array, labels: jax.Array, cap: float) -> jax.Array:
    """Per-token cross-entropy (nats, fp32) of the soft-capped logits softcap(z, cap).

    z: raw logits (..., V), cast to fp32; labels (...) in [0, V). Autodiff gives the backward, which
    the TPU and GPU compilers fuse."""
    return capped_cross_entropy_terms(z.astype(jnp.float32), labels, cap)[0]


# --- Polar Express (Muon's orthogonalisation; `flaxchat.optim` runs it) ---------------------------

# Polar Express coefficients for 5 iterations (nanochat optim.py / Amsel et al. 2025).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(g: jax.Array, steps: int = 5, dtype=jnp.float32) -> jax.Array:
    """Approximately the orthogonal polar factor U·Vᵀ of g = U·S·Vᵀ (kernel layout (in, out)).

    First MuonEq row equilibration (arXiv 2603.28254): every output neuron's weights (a column
    here, a row of torch's (out, in)) are rescaled to the mean norm, so the spectrum entering the
    iteration is better conditioned; then the Frobenius pre-normalisation with nanochat's x1.01;
    then Polar Express's five fixed-coefficient steps. `dtype` (a dtype or its name): float32, or
    bfloat16 for every product and the iterate (what TPU and GPU run; nanochat runs it in bf16 on
    GPU). The CPU's forms are `flaxchat.kernels.cpu_muon.polar_express`; the backend's
    `flaxchat.kernels.PolarExpress` says which one Muon runs.
    """
    if isinstance(dtype, str) and dtype not in ("float32", "bfloat16"):
        raise UserError(f"--ns-dtype {dtype} is a CPU form of Polar Express; use float32 or bfloat16 here.")
    x = normalised(g, jnp.dtype(dtype))
    tall = x.shape[0] > x.shape[1]
    return polar_iterations(x, steps, lambda x: x.T @ x if tall else x @ x.T).astype(g.dtype)


def polar_iterations(x: jax.Array, steps: int, gram, mm=jnp.matmul) -> jax.Array:
    """Polar Express's iterations x <- a·x + (b·A + c·A²)·x on a normalised x, with A = gram(x) the
    small Gram matrix (xᵀ·x for a tall x, x·xᵀ for a wide one) and the other products through `mm`."""
    tall = x.shape[0] > x.shape[1]
    for a, b, c in POLAR_EXPRESS[:steps]:
        A = gram(x)
        B = b * A + c * mm(A, A)
        x = a * x + (mm(x, B) if tall else mm(B, x))
    return x


def normalised(g: jax.Array, work) -> jax.Array:
    """MuonEq's equilibration, then the Frobenius pre-normalisation with nanochat's x1.01, in `work`.

    In fp32 both come from one pass of column sums of squares: the equilibrated matrix's norm
    follows from them (||x·s||² = Σ_j s_j²·||x_j||²), so x is read once and scaled once, where
    three norms and two scalings were each a small kernel on CPU. A bf16 iterate keeps the three:
    it is scaled in bf16 and its norm measured after rounding, and the fp32 shortcut moved its
    result further from float64's (3.6e-2 -> 3.9e-2 at 768 x 3072, worse for 12 seeds of 12).
    """
    if work != jnp.float32:
        x = g.astype(work)
        xf = x.astype(jnp.float32)
        col = jnp.maximum(jnp.linalg.norm(xf, axis=0, keepdims=True), 1e-6)
        x = x * (jnp.linalg.norm(xf) / math.sqrt(x.shape[1]) / col).astype(work)
        return x / (jnp.linalg.norm(x) * 1.01 + 1e-6)
    xf = g.astype(jnp.float32)
    sq = jnp.sum(xf * xf, axis=0, keepdims=True)
    s = jnp.sqrt(jnp.sum(sq) / g.shape[1]) / jnp.maximum(jnp.sqrt(sq), 1e-6)
    return xf * (s / (jnp.sqrt(jnp.sum(s * s * sq)) * 1.01 + 1e-6))
