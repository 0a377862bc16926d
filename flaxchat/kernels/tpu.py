"""The TPU's kernels: Pallas splash attention, everything else the plain ops XLA:TPU fuses.

Splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`) skips the blocks outside the
causal triangle and the window instead of masking them. On one v5e chip, d12 at sequence 2048 with
8 rows per step trained at 117,000 tok/s with it, against 59,185 with `--attention xla` and 65,420
with the blockwise kernel (flaxchat at f418ebc, `python -m bench.device_check --depths 12`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flaxchat.kernels.remat import REMAT_POLICIES, remat_blocks  # noqa: F401 (bench/device_check.py)

DEFAULT_ATTENTION = "splash"


def choice(attention_name: str, attention, grad_checkpoint: bool):
    """The TPU's records (`flaxchat.kernels.Choice`) with the given attention (`record.accelerator_choice`)."""
    from flaxchat.kernels.record import accelerator_choice
    choice = accelerator_choice("tpu", attention_name, attention, grad_checkpoint)
    if attention_name != "splash":
        return choice
    # splash computes heads before time: the model's projections write that layout for it
    model = dataclasses.replace(choice.model, attention_heads_first=_splash_heads_first)
    return dataclasses.replace(choice, model=model)


# --- splash (TPU; Pallas interpret mode elsewhere) -----------------------------------------------


@functools.lru_cache(maxsize=64)
def _splash_kernel(T: int, G: int, window: int, block: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    mask = sa.CausalMask((T, T)) if window >= T else sa.LocalMask((T, T), (window - 1, 0), 0)
    b = min(block, T)
    # One backward kernel for dq, dk and dv (no separate dq pass): d12's step at 8 x 2048 on a v5e
    # 120,561 -> 123,088 tok/s (docs/accelerators.md); 256-row blocks for the short windows lost 8%.
    sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                          block_kv_dkv_compute=b, use_fused_bwd_kernel=True)
    # One kv head serves its G query heads (MQA per kv head); vmapped over batch and kv heads.
    # Built as concrete arrays (the mask tables), so the cached kernel never holds a tracer.
    # Its output and log-sum-exp are named "attention", as gpt.Attention names other kernels' output
    # (not splash's heads-first one, which would then be kept twice): a remat policy that keeps
    # that name (--scan-layers', kernels.remat's "attention") keeps what the backward kernel reads,
    # and never the lane-wide fp32 log-sum-exp the kernel writes first.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mqa_single_device(sa.MultiHeadMask([mask] * G), block_sizes=sizes, interpret=interpret,
                                                residual_checkpoint_name="attention")


def splash_attention(q, k, v, window: int, block: int | None = None, interpret: bool | None = None,
                     heads_first: bool = False) -> jax.Array:
    """Pallas splash attention (TPU): causal or local mask, blocks outside it skipped, GQA.

    q (B, T, H, D), k and v (B, T, Hkv, D) -> (B, T, H, D); with `heads_first` every array is
    (B, heads, T, D), the layout the kernel computes in, and no transpose surrounds it.
    Under a mesh the kernel runs per device through shard_map (rows split as the rules split the
    batch); a Pallas call is not partitioned by the compiler. Off TPU it runs in Pallas interpret
    mode (slow; for tests). The sequence must be a multiple of 128 (the TPU lane width).
    `block`: the kernel's tile (default the largest of 512, 256, 128 that divides the sequence).
    """
    from flaxchat.sharding import BATCH, sharded_mesh
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    H, T, D = (q.shape[1], q.shape[2], q.shape[3]) if heads_first else (q.shape[2], q.shape[1], q.shape[3])
    Hkv = k.shape[1] if heads_first else k.shape[2]
    G = H // Hkv
    # 512-row blocks by default, as maxtext's splash defaults
    block = block or next(b for b in (512, 256, 128) if T % b == 0)
    kern = _splash_kernel(T, G, min(window, T), block, interpret)

    def local(q, k, v):
        b = q.shape[0]
        if not heads_first:
            q, k, v = (jnp.transpose(a, (0, 2, 1, 3)) for a in (q, k, v))
        # bf16 operands want the default matmul precision: Mosaic cannot lower a bf16 dot at fp32
        # contract precision ("Bad lhs type" on a v5e), which a program lowered under
        # jax.default_matmul_precision("highest") asks of it.
        qt = q.reshape(b, Hkv, G, T, D) * jnp.asarray(D ** -0.5, q.dtype)
        out = jax.vmap(jax.vmap(kern))(qt, k, v).reshape(b, H, T, D)  # one kv head's G query heads at a time
        return out if heads_first else jnp.transpose(out, (0, 2, 1, 3))

    if sharded_mesh() is None:
        return local(q, k, v)
    from jax.sharding import PartitionSpec as P
    spec = P(BATCH, None, None, None)
    return jax.shard_map(local, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


def _splash(q, k, v, window, block, heads_first: bool = False):
    """Splash on a sequence padded to whole 128-lane blocks (a prompt at inference, a short
    sequence): the padded keys come after every real query, so causality hides them."""
    axis = 2 if heads_first else 1
    T = q.shape[axis]
    pad = -T % 128
    if pad:
        widths = [(0, 0)] * 4
        widths[axis] = (0, pad)
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    y = splash_attention(q, k, v, window, heads_first=heads_first)
    return y[:, :, :T] if heads_first else y[:, :T]


def _splash_heads_first(q, k, v, window, block):
    """`_splash` on (B, heads, T, D) arrays: the record's attention_heads_first."""
    return _splash(q, k, v, window, block, heads_first=True)


ATTENTION = {"splash": _splash}  # the kernels this file adds to --attention
