"""The model's hot kernels, chosen per backend in this one module.

* `matmul(x, w)`: a linear layer. On CPU its backward computes dW as `transpose(x) @ g` (or, for a
  layer that narrows, as the transpose of `transpose(g) @ x`), the transpose stored first
  (`stored_transpose`): XLA:CPU lowers the token-contracting dot `xᵀ·g` to a slow generic dot,
  and an explicit transpose followed by a plain NN matmul goes to the fast library (57% -> 66%
  MFU on an 8L/512d GPT). On TPU and GPU it is a plain `jnp.matmul`: the
  explicit transpose would only stop their compilers from fusing.
* `rotary_rms_norm(x, table, scale)`: attention's q and k rotated, then QK-normed; on CPU one op
  whose backward reads only its output and one RMS per row.
* `attention(q, k, v, window, kernel)`: causal, optionally sliding-window, grouped-query attention
  through one of `KERNELS`; `resolve_attention("auto")` picks Pallas splash attention on TPU,
  cuDNN flash attention on GPU and the blockwise kernel below on CPU.
* `causal_attention(q, k, v, window)`, the blockwise kernel: per block of queries over only the key
  blocks it can see, so the causal triangle and a sliding window skip work instead of masking it.
  Up to SHORT_TOKENS tokens the tiles are unrolled and their probabilities kept for the backward;
  longer sequences run loops with flash-style memory: the forward keeps one log-sum-exp per query
  row (O(T)), the backward recomputes each block's probabilities from it; nothing of size T×T
  outlives a block.
All compute the same numbers as `reference_attention`, up to float summation order.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flaxchat.config import ATTENTION_KERNELS as KERNELS  # auto, blockwise, xla, splash, cudnn


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def stored_transpose(x: jax.Array, perm) -> jax.Array:
    """`jnp.transpose(x, perm)` as a copy of the materialised x, on CPU.

    XLA:CPU fuses a transpose with the elementwise work that produced its input and then runs the
    producer column by column: relu²(h)ᵀ for h (2048, 1024) took 12.2 ms where transposing a
    stored array took 0.6 ms. It drops optimization barriers before fusing, but never fuses
    across a conditional, so the transpose goes in one (both branches the same; the predicate reads
    the data, so the compiler cannot fold the conditional away). One train step of an 8L/512d GPT:
    1,171 -> 1,059 ms; 4L/256d: 295 -> 270 ms (2-core AMD EPYC, interleaved).
    """
    if not _on_cpu():
        return jnp.transpose(x, perm)
    flat = x.reshape(-1)
    keep = flat[0] == flat[0]  # True, except for a NaN (then the other, identical branch runs)
    return jax.lax.cond(keep, lambda a: jnp.transpose(a, perm), lambda a: jnp.transpose(a, perm), x)


# --- linear -------------------------------------------------------------------------------------


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x (..., in) @ w (in, out); the CPU-tuned backward only on CPU."""
    return _matmul_cpu(x, w) if _on_cpu() else jnp.matmul(x, w)


@jax.custom_vjp
def _matmul_cpu(x, w):
    return jnp.matmul(x, w)


def _matmul_fwd(x, w):
    return jnp.matmul(x, w), (x, w)


def _matmul_bwd(res, g):
    x, w = res
    x2 = x.reshape(-1, x.shape[-1])
    g2 = g.reshape(-1, g.shape[-1])
    dw = _weight_grad(x2, g2).astype(w.dtype)
    dx = jnp.matmul(g, w.T).astype(x.dtype)
    return dx, dw


_matmul_cpu.defvjp(_matmul_fwd, _matmul_bwd)


def _weight_grad(x: jax.Array, g: jax.Array) -> jax.Array:
    """dW = xᵀ·g for x (N, in) and g (N, out), as a plain NN product of a stored transpose.

    The token-by-feature matrix that gets transposed is the narrower of x and g: for a layer that
    narrows (in > out, the MLP's c_proj) that is g, and then the small (out, in) result is
    transposed back. c_proj's dW at 2,048 tokens (relu² input materialised, 2-core AMD EPYC,
    interleaved): 1024 -> 256 in 5.1-5.9 ms against 7.1-9.4, 2048 -> 512 in 18.2 against 29.2;
    config A's whole step 357.7 -> 342.2 and 323.6 -> 311.3 ms (medians of 20 rounds). A layer that
    widens keeps the transpose of x: the other way took 6.3 against 4.4 ms at 256 -> 1024.
    """
    if x.shape[1] > g.shape[1]:
        return stored_transpose(jnp.matmul(stored_transpose(g, (1, 0)), x), (1, 0))
    return jnp.matmul(stored_transpose(x, (1, 0)), g)


# --- kernel choice ------------------------------------------------------------------------------


class Kernel(NamedTuple):
    """A resolved attention kernel (hashable: it is a static argument of the jitted step)."""
    name: str  # blockwise, xla, splash or cudnn
    block: int = 128  # the blockwise kernel's query/key block


_announced: set = set()


def resolve_attention(name: str = "auto", block: int = 128, backend: str | None = None) -> Kernel:
    """The kernel `name` means on this backend: `auto` is splash on TPU, cudnn on GPU, blockwise on
    CPU (printed once per process, so a log says what ran)."""
    if name not in KERNELS:
        from flaxchat.errors import UserError
        raise UserError(f"--attention must be one of {', '.join(KERNELS)} (got {name!r}).")
    backend = backend or jax.default_backend()
    chosen = name
    if name == "auto":
        chosen = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn", "rocm": "xla"}.get(backend, "blockwise")
        if (backend, chosen) not in _announced and jax.process_index() == 0:
            print(f"attention: {chosen} (auto on {backend})", flush=True)
        _announced.add((backend, chosen))
    return Kernel(chosen, block)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int, kernel: Kernel = Kernel("blockwise")) -> jax.Array:
    """Causal attention over keys max(0, t-window+1) .. t. q (B,T,H,D); k, v (B,T,Hkv,D) -> (B,T,H,D)."""
    if kernel.name == "blockwise":
        return causal_attention(q, k, v, window, kernel.block)
    if kernel.name == "xla":
        return xla_attention(q, k, v, window)
    if kernel.name == "cudnn":
        return cudnn_attention(q, k, v, window)
    if kernel.name == "splash":
        if q.shape[1] % 128:  # splash tiles the sequence in 128-lane blocks; `auto` may land here
            return causal_attention(q, k, v, window, kernel.block)
        return splash_attention(q, k, v, window)
    raise ValueError(f"unresolved attention kernel {kernel.name!r}; pass it through resolve_attention")


def _local_window(window: int, T: int):
    return None if window >= T else (window - 1, 0)  # (keys to the left, keys to the right)


def xla_attention(q, k, v, window: int) -> jax.Array:
    """`jax.nn.dot_product_attention` as XLA lowers it (dense T×T scores: O(T²) memory)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_local_window(window, q.shape[1]),
                                        implementation="xla")


def cudnn_attention(q, k, v, window: int) -> jax.Array:
    """cuDNN's fused flash attention with its local window; XLA's form where cuDNN does not take
    the call (no GPU, fp32 inputs, a head size it lacks), said once."""
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=_local_window(window, q.shape[1]),
                                            implementation="cudnn")
    except Exception as e:  # cuDNN refuses at trace time, with a reason
        key = ("cudnn-fallback", type(e).__name__)
        if key not in _announced and jax.process_index() == 0:
            print(f"attention: cudnn unavailable here ({type(e).__name__}: {str(e).splitlines()[0][:120]}); using xla",
                  flush=True)
        _announced.add(key)
        return xla_attention(q, k, v, window)


# --- splash (TPU; Pallas interpret mode elsewhere) -----------------------------------------------


@functools.lru_cache(maxsize=64)
def _splash_kernel(T: int, G: int, window: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    mask = sa.CausalMask((T, T)) if window >= T else sa.LocalMask((T, T), (window - 1, 0), 0)
    b = min(block, T)
    sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
    # One kv head serves its G query heads (MQA per kv head); vmapped over batch and kv heads.
    # Built as concrete arrays (the mask tables), so the cached kernel never holds a tracer.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mqa_single_device(sa.MultiHeadMask([mask] * G), block_sizes=sizes, interpret=interpret)


def splash_attention(q, k, v, window: int, block: int | None = None, interpret: bool | None = None) -> jax.Array:
    """Pallas splash attention (TPU): causal or local mask, blocks outside it skipped, GQA.

    Under a mesh the kernel runs per device through shard_map (rows split as the rules split the
    batch); a Pallas call is not partitioned by the compiler. Off TPU it runs in Pallas interpret
    mode (slow; for tests). The sequence must be a multiple of 128 (the TPU lane width).
    """
    from flaxchat.sharding import BATCH, sharded_mesh
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    G = H // Hkv
    # 512-row blocks by default, as maxtext's splash defaults (not measured here: no TPU was lent)
    block = block or next(b for b in (512, 256, 128) if T % b == 0)
    kern = _splash_kernel(T, G, min(window, T), block, interpret)

    def local(q, k, v):
        b, t = q.shape[:2]
        qt = jnp.transpose(q.reshape(b, t, Hkv, G, D), (0, 2, 3, 1, 4)) * jnp.asarray(D ** -0.5, q.dtype)
        kt, vt = jnp.transpose(k, (0, 2, 1, 3)), jnp.transpose(v, (0, 2, 1, 3))
        out = jax.vmap(jax.vmap(kern))(qt, kt, vt)  # (b, Hkv, G, t, D)
        return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, H, D)

    if sharded_mesh() is None:
        return local(q, k, v)
    from jax.sharding import PartitionSpec as P
    spec = P(BATCH, None, None, None)
    return jax.shard_map(local, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


# --- blockwise (CPU) ----------------------------------------------------------------------------
#
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
# -51 ms of 3,255 at 16K, config B -101 ms of 3,779 at 2K. docs/cpu_performance.md.
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


def _rms(xf: jax.Array) -> jax.Array:
    """The reciprocal RMS of each row of an fp32 array (keepdims)."""
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + jnp.finfo(jnp.float32).eps)


def rms_norm(x: jax.Array) -> jax.Array:
    """Parameterless RMSNorm (nanochat `norm`), computed in fp32."""
    xf = x.astype(jnp.float32)
    return (xf * _rms(xf)).astype(x.dtype)


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
    return _rotate(x, table.cos.astype(x.dtype), table.sin.astype(x.dtype))


def _rotate(x, cos, sin, back: bool = False):
    """x's two halves rotated by the table's angles (`back`: by minus them, the inverse)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    if back:
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


def rotary_rms_norm(x: jax.Array, table: RotaryTable, scale: float) -> jax.Array:
    """rms_norm(rotary(x, table)) * scale: attention's q and k, rotated then QK-normed (nanochat).

    On CPU with a hand-written backward that reads only what the forward wrote (the output and one
    RMS per row; `_rotary_norm_bwd`). Autodiff of the two ops kept the input as well and ran the
    rotation's and the norm's backwards as separate passes with three reductions per row. Forward
    and backward alone (`python -m bench.norms`; 2-core AMD EPYC Zen 4, medians of 300 interleaved
    rounds): config A's q (8, 256, 4, 64) 1.78 -> 1.10 ms, config B's (2, 512, 8, 64) 1.62 ->
    1.17 ms, faster in 97% and 94% of the rounds. RMSNorm alone gained nothing from the same form
    (0.54 against 0.55 ms at (8, 256, 256)), so it keeps autodiff.
    """
    if not _on_cpu():
        return rms_norm(rotary(x, table)) * scale
    return _rotary_norm_cpu(x, table.cos, table.sin, scale)


def _rotary_norm_fwd(x, cos, sin, scale):
    xf = x.astype(jnp.float32)
    r = _rms(xf)  # the rotation keeps each head's norm, so the RMS is taken before it
    # One product by r·scale: with `(rotated · r) · scale` as two, forward+backward took 1.96
    # against 0.93 ms at config A's q (XLA:CPU then recomputed the forward inside the backward's
    # kernels); the rotation back written out (`back`) against rotary with -sin: 0.93 against 1.14.
    y = (_rotate(xf, cos.astype(jnp.float32), sin.astype(jnp.float32)) * (r * scale)).astype(x.dtype)
    return y, (y, r, cos, sin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotary_norm_cpu(x, cos, sin, scale):
    return _rotary_norm_fwd(x, cos, sin, scale)[0]


def _rotary_norm_bwd(scale, res, g):
    """The rotation R is orthogonal and y = scale·R·x̂ with x̂ = x·r, so the RMSNorm backward
    r·(u - x̂·mean(u·x̂)) at u = scale·Rᵀg becomes r·Rᵀ(scale·g - y·mean(g·y)/scale): one
    reduction and one rotation back, from the output alone."""
    y, r, cos, sin = res
    yf, gf = y.astype(jnp.float32), g.astype(jnp.float32)
    m = jnp.mean(gf * yf, axis=-1, keepdims=True) / scale
    back = _rotate(gf * scale - yf * m, cos.astype(jnp.float32), sin.astype(jnp.float32), back=True)
    return (back * r).astype(y.dtype), None, None


_rotary_norm_cpu.defvjp(_rotary_norm_fwd, _rotary_norm_bwd)


# --- the loss ----------------------------------------------------------------------------------


def softcap(z: jax.Array, cap: float) -> jax.Array:
    """cap·tanh(z/cap): logits squashed smoothly into (-cap, cap)."""
    return cap * jnp.tanh(z / cap)


def softcap_cross_entropy(z: jax.Array, labels: jax.Array, cap: float) -> jax.Array:
    """Per-token cross-entropy (nats, fp32) of the soft-capped logits softcap(z, cap).

    z: raw logits (..., V); labels (...) in [0, V). On CPU with a hand-written backward (see
    `_capped_ce_bwd`); on TPU and GPU the same forward under autodiff, which their compilers fuse.
    """
    z = z.astype(jnp.float32)
    return _capped_ce(z, labels, cap) if _on_cpu() else _capped_ce_loss(z, labels, cap)[0]


# Up to this cap the soft-capped logits s = cap·tanh(z/cap) need no row maximum before exp: exp(s -
# cap) lies in (e^(-2·cap), 1], within fp32's normal range (down to e^(-87)) for every logit.
FIXED_SHIFT_CAP = 40.0


def _capped_ce_loss(z, labels, cap):
    """(loss, (t, e, sum of e)): the loss, tanh(z/cap), exp(s - shift) and its row sums.

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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _capped_ce(z, labels, cap):
    return _capped_ce_loss(z, labels, cap)[0]


def _capped_ce_fwd(z, labels, cap):
    """Keeps tanh(z/cap) and the exponentials for the backward, not the raw z (z dies with the
    forward), so the backward computes no exp.

    Saving z held a second logits-sized buffer from the forward to the backward: config A's train
    step (8 x 256 tokens, 4,096-token vocab) needed a 347.6 MiB temporary arena with it and 315.6
    MiB with s (`compiled.memory_analysis()`), and XLA:CPU maps and faults in that arena afresh
    every step. The step, paired by round in one process (2-core Intel Xeon with AMX): 11.0 and
    5.1 ms faster at the median (30 rounds each, faster in 73% and 67%); pinned to one core, 19.9
    ms of 722.

    Then s, computed again in the backward (exp(s - lse)), gave way to tanh and the exponentials
    themselves: an exp per logit is dearer on XLA:CPU than writing and reading one more
    logits-sized array. The LM head with its loss, forward+backward at one 1,024 x 4,096 micro-batch
    (2-core Intel Xeon with AMX, 60 interleaved rounds, the training processes' malloc tuning):
    28.75 -> 26.40 ms, pinned to one core 52.3 -> 46.5; the main job's step (8 x 256 tokens) in five
    alternating pairs of fresh processes, 335.8 -> 328.7 ms on the means, faster in all five.
    The price is that second logits-sized buffer again: the step's temporary arena went from 315.6
    back to 347.6 MiB at that shape, 327.0 -> 342.1 MiB at 16 x 4 x 256 tokens (the training
    processes' malloc tuning, `errors.tune_cpu_runtime`, keeps the arena between steps now, so it
    is not faulted in afresh). docs/cpu_performance.md has the runs.
    """
    loss, (t, e, se) = _capped_ce_loss(z, labels, cap)
    return loss, (t, e, se, labels)


def _capped_ce_bwd(cap, res, g):
    """dz = g·(softmax - onehot)·(1 - tanh²) in one pass over what the forward kept.

    Autodiff of the composition (optax's cross-entropy on cap·tanh(z/cap)) wrote five
    logits-sized arrays per step (tanh, exp, its product with the row's gradient, a scatter of the
    labels' -1 into a copy, the tanh derivative); this writes one. The LM head's forward+backward
    at config A's 2,048 x 4,096 logits (2-core AMD EPYC, interleaved): 60.5 -> 55.7 ms.
    """
    t, e, se, labels = res
    p = e * (1.0 / se)[..., None]  # the softmax
    hot = jnp.arange(t.shape[-1]) == labels[..., None]
    return g[..., None] * (p - hot) * (1 - t * t), None


_capped_ce.defvjp(_capped_ce_fwd, _capped_ce_bwd)
