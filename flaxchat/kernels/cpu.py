"""The CPU's kernels: what XLA:CPU needs to run flaxchat's step near a core's matmul peak.

Each form computes what `flaxchat.ops` computes (the losses of the main job's first 20 steps agree
within a few ulps), only arranged for XLA:CPU; docs/cpu.md lists each technique with its measured gain.

* `matmul`: a linear layer whose backward takes dW through a stored transpose (`_weight_grad`).
* `rotary_rms_norm`, `softcap_cross_entropy`: hand-written backwards that read less memory.
* `remat_block`: gradient checkpointing that XLA:CPU's scheduler cannot undo.
* The accumulation: two micro-batches side by side, a lone one in halves on AMD, gradients
  all-reduced as one flat buffer between processes.
* Polar Express by the CPU's bf16 dot instructions (`cpu_muon`), the blockwise attention kernel
  (`cpu_attention`), and `tune_runtime`, the malloc tuning of a training process.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from flaxchat import ops
from flaxchat.kernels.cpu_layout import stored_transpose

DEFAULT_ATTENTION = "blockwise"


def _blockwise(q, k, v, window, block):
    from flaxchat.kernels.cpu_attention import causal_attention
    return causal_attention(q, k, v, window, block)


ATTENTION = {"blockwise": _blockwise}  # the kernels this file adds to --attention


def choice(attention_name: str, attention, grad_checkpoint: bool):
    """The CPU's records (`flaxchat.kernels.Choice`) with the given attention."""
    from flaxchat.kernels.cpu_muon import polar_express
    from flaxchat.kernels.record import Choice, Kernels, PolarExpress, StepPlan
    model = Kernels(backend="cpu", attention_name=attention_name, attention=attention, matmul=matmul,
                    rotary_rms_norm=rotary_rms_norm, cross_entropy=softcap_cross_entropy,
                    remat=remat_block if grad_checkpoint else None)
    # One matrix at a time: the CPU forms' stored transposes and Gram forms are tuned per matrix
    # (batched was slower; docs/cpu.md).
    polar = PolarExpress(orthogonalise=polar_express, ns_dtype=orthogonalisation_dtype(), batched=False)
    plan = StepPlan(scan_unroll=SIDE_BY_SIDE, halve_lone_micro_batch=halves_a_lone_micro_batch(),
                    flat_gradient_reduce=True)
    return Choice(model=model, polar=polar, plan=plan)


# --- linear -------------------------------------------------------------------------------------


@jax.custom_vjp
def matmul(x, w):
    """x (..., in) @ w (in, out), its dW computed as `transpose(x) @ g` (or, for a layer that
    narrows, as the transpose of `transpose(g) @ x`), the transpose stored first: XLA:CPU lowers
    the token-contracting dot `xᵀ·g` to a slow generic dot, a plain NN matmul to its fast library."""
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


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _weight_grad(x: jax.Array, g: jax.Array) -> jax.Array:
    """dW = xᵀ·g for x (N, in) and g (N, out), as a plain NN product of a stored transpose.

    The token-by-feature matrix that gets transposed is the narrower of x and g: for a layer that
    narrows (in > out, the MLP's c_proj) that is g, and then the small (out, in) result is
    transposed back; a layer that widens keeps the transpose of x (docs/cpu.md).
    """
    if x.shape[1] > g.shape[1]:
        return stored_transpose(jnp.matmul(stored_transpose(g, (1, 0)), x), (1, 0))
    return jnp.matmul(stored_transpose(x, (1, 0)), g)


# --- rotary + QK-norm ----------------------------------------------------------------------------


def rotary_rms_norm(x: jax.Array, table: ops.RotaryTable, scale: float) -> jax.Array:
    """`ops.rotary_rms_norm` with a hand-written backward that reads only what the forward wrote
    (the output and one RMS per row; `_rotary_norm_bwd`).

    Autodiff of the two ops kept the input as well and ran the rotation's and the norm's backwards
    as separate passes with three reductions per row (`python -m bench.cpu.norms`; docs/cpu.md).
    """
    return _rotary_norm(x, table.cos, table.sin, scale)


def _rotary_norm_fwd(x, cos, sin, scale):
    xf = x.astype(jnp.float32)
    r = ops.rms_reciprocal(xf)  # the rotation keeps each head's norm, so the RMS is taken before it
    # One product by r·scale: as two, XLA:CPU recomputed the forward inside the backward (docs/cpu.md).
    y = (ops.rotate(xf, cos.astype(jnp.float32), sin.astype(jnp.float32)) * (r * scale)).astype(x.dtype)
    return y, (y, r, cos, sin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rotary_norm(x, cos, sin, scale):
    return _rotary_norm_fwd(x, cos, sin, scale)[0]


def _rotary_norm_bwd(scale, res, g):
    """The rotation R is orthogonal and y = scale·R·x̂ with x̂ = x·r, so the RMSNorm backward
    r·(u - x̂·mean(u·x̂)) at u = scale·Rᵀg becomes r·Rᵀ(scale·g - y·mean(g·y)/scale): one
    reduction and one rotation back, from the output alone."""
    y, r, cos, sin = res
    yf, gf = y.astype(jnp.float32), g.astype(jnp.float32)
    m = jnp.mean(gf * yf, axis=-1, keepdims=True) / scale
    back = ops.rotate(gf * scale - yf * m, cos.astype(jnp.float32), sin.astype(jnp.float32), back=True)
    return (back * r).astype(y.dtype), None, None


_rotary_norm.defvjp(_rotary_norm_fwd, _rotary_norm_bwd)


# --- the loss ----------------------------------------------------------------------------------


def softcap_cross_entropy(z: jax.Array, labels: jax.Array, cap: float) -> jax.Array:
    """`ops.softcap_cross_entropy` with a hand-written backward (`_capped_ce_bwd`)."""
    return _capped_ce(z.astype(jnp.float32), labels, cap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _capped_ce(z, labels, cap):
    return ops.capped_cross_entropy_terms(z, labels, cap)[0]


def _capped_ce_fwd(z, labels, cap):
    """Keeps tanh(z/cap) and the exponentials for the backward, not the raw z (z dies with the
    forward), so the backward computes no exp.

    Cheaper on XLA:CPU than saving z, or s with an exp per logit in the backward; the price is a
    second logits-sized buffer (measurements: docs/cpu.md).
    """
    loss, (t, e, se) = ops.capped_cross_entropy_terms(z, labels, cap)
    return loss, (t, e, se, labels)


def _capped_ce_bwd(cap, res, g):
    """dz = g·(softmax - onehot)·(1 - tanh²) in one pass over what the forward kept.

    Autodiff of the composition wrote five logits-sized arrays per step; this writes one (docs/cpu.md).
    """
    t, e, se, labels = res
    p = e * (1.0 / se)[..., None]  # the softmax
    hot = jnp.arange(t.shape[-1]) == labels[..., None]
    return g[..., None] * (p - hot) * (1 - t * t), None


_capped_ce.defvjp(_capped_ce_fwd, _capped_ce_bwd)


# --- remat ---------------------------------------------------------------------------------------


def remat_block(block, x, idx, rope, window, kernels):
    """A block whose activations are recomputed in the backward pass (--grad-checkpoint).

    `nnx.remat` is not enough on CPU: XLA:CPU strips the optimization barriers remat relies on, so
    its scheduler ran each block's recomputation during the forward and the peak did not drop (it
    rose). Here the recomputation takes a (numerically void) input from the block's output
    cotangent, so it cannot run before the backward pass reaches the block.
    """
    graphdef, state = nnx.split(block)
    return _remat(graphdef, window, kernels, state, x, idx, rope)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _remat(graphdef, window, kernels, state, x, idx, rope):
    return nnx.merge(graphdef, state)(x, idx, rope, window, kernels)


def _remat_fwd(graphdef, window, kernels, state, x, idx, rope):
    return _remat(graphdef, window, kernels, state, x, idx, rope), (state, x, idx, rope)


def _remat_bwd(graphdef, window, kernels, res, ct):
    state, x, idx, rope = res
    # x + 0·ct[0]: XLA keeps a float multiply by zero (it is not an identity for inf/NaN), so this
    # is a true data dependency on the cotangent, the one ordering XLA:CPU's scheduler respects.
    x = x + (ct.reshape(-1)[0] * 0).astype(x.dtype)
    f = lambda state, x: nnx.merge(graphdef, state)(x, idx, rope, window, kernels)
    _, vjp = jax.vjp(f, state, x)
    d_state, dx = vjp(ct)
    return d_state, dx, None, None


_remat.defvjp(_remat_fwd, _remat_bwd)


# --- the accumulation ----------------------------------------------------------------------------

# Two micro-batches per loop body of the accumulation scan: XLA:CPU runs the two independent chains
# side by side, one filling the core the other leaves idle (3.6-4.4% faster; docs/cpu.md).
SIDE_BY_SIDE = 2


def halves_a_lone_micro_batch(cpuinfo: str | None = None) -> bool:
    """Whether a step of one micro-batch runs it as two halves side by side: on AMD CPUs.

    The halves' sums are the whole's, added in another order; faster on AMD, not on Intel (docs/cpu.md).
    `cpuinfo`: /proc/cpuinfo's text, for tests."""
    return read_cpuinfo(cpuinfo).get("vendor_id") == "AuthenticAMD"


# The plan's flat_gradient_reduce: gloo all-reduces one flat buffer ~3.5x faster than the arrays
# one by one (docs/cpu.md).


# --- the machine ----------------------------------------------------------------------------------


def read_cpuinfo(text: str | None = None) -> dict[str, str]:
    """The first value of each key of /proc/cpuinfo ("model name", "flags", "vendor_id", ...), or
    of `text` (that file's contents, for tests); empty off Linux."""
    if text is None:
        try:
            with open("/proc/cpuinfo") as f:
                text = f.read()
        except OSError:
            return {}
    info = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            info.setdefault(key.strip(), value.strip())
    return info


BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 CPU flags of bf16 dot-product instructions


def cpu_has_bf16_dots(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 dot-product instructions (the flags of /proc/cpuinfo, so Linux;
    elsewhere False). `cpuinfo`: that file's text, for tests."""
    flags = read_cpuinfo(cpuinfo).get("flags", "").split()
    return any(flag in flags for flag in BF16_DOT_FLAGS)


def orthogonalisation_dtype(cpu_bf16: bool | None = None, cpuinfo: str | None = None) -> str:
    """Polar Express's form on this CPU: with bf16 dot instructions (`cpu_has_bf16_dots`, or
    `cpu_bf16`) bf16-operands on AMD and bf16-products on Intel, else float32 (`cpu_muon` has the
    forms and their measurements). A CPU flag, not a timing probe: a probe on a busy machine could
    choose differently in two runs of one job, or in a run and its resume. `cpuinfo`:
    /proc/cpuinfo's text, for tests."""
    from flaxchat.kernels.cpu_muon import BF16_OPERANDS, BF16_PRODUCTS
    if not (cpu_has_bf16_dots(cpuinfo) if cpu_bf16 is None else cpu_bf16):
        return "float32"
    return BF16_OPERANDS if read_cpuinfo(cpuinfo).get("vendor_id") == "AuthenticAMD" else BF16_PRODUCTS


# --- the training process ------------------------------------------------------------------------

# glibc malloc for a training process: transparent huge pages, and freed memory kept for the next
# step rather than returned to the kernel (no mmap'd chunks, no trimming). See `tune_runtime`.
MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:"
                   "glibc.malloc.trim_threshold=17179869184")


def tune_runtime() -> None:
    """Set up this process's memory for training on a CPU: restart it once with MALLOC_TUNABLES,
    then run each jitted call on the calling thread (JAX's CPU async dispatch off). Called through
    `flaxchat.kernels.tune_process`, which skips it where the step runs on an accelerator.

    Why: XLA:CPU takes one block for a step's temporaries every step and frees it after; on a
    dispatch worker thread glibc maps and unmaps it each step and the kernel faults it in again.
    On the main thread, from a heap these tunables keep, it is reused (docs/cpu.md has the faults
    and the gains). The chat CLI and web server keep async dispatch. Skipped off Linux, when the
    user set GLIBC_TUNABLES (their choice is kept, with async dispatch) or with FLAXCHAT_NO_CPU_TUNING=1.
    """
    if (not sys.platform.startswith("linux") or os.environ.get("FLAXCHAT_NO_CPU_TUNING") == "1"
            or not getattr(sys, "orig_argv", None)):
        return
    if os.environ.get("GLIBC_TUNABLES") == MALLOC_TUNABLES:  # this process runs with them
        jax.config.update("jax_cpu_enable_async_dispatch", False)  # read when the CPU client starts
        return
    if "GLIBC_TUNABLES" in os.environ:
        return
    env = dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # could not re-exec: run as we are
