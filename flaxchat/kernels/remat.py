"""`nnx.remat` of a transformer block under --grad-checkpoint, for the backends whose compiler keeps
the optimization barriers remat relies on (TPU and GPU; the CPU's form is `cpu.remat_block`)."""

from __future__ import annotations

import jax
from flax import nnx


def _call_block(block, x, idx, rope, window, kernels):
    return block(x, idx, rope, window, kernels)


# What a block keeps for the backward pass under --grad-checkpoint (TPU and GPU); the rest is
# recomputed. "full": only the block's input; "dots": every matmul's output (the elementwise
# work and attention are recomputed); "attention": only attention's output (named in gpt.Attention,
# or by splash itself), so the backward recomputes the projections and the MLP but never the
# attention kernel.
REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "attention": jax.checkpoint_policies.save_only_these_names("attention"),
}
remat_blocks = {name: nnx.remat(_call_block, static_argnums=(4, 5), policy=policy)
                for name, policy in REMAT_POLICIES.items()}
remat_block = remat_blocks["full"]

# A layer under --scan-layers without --grad-checkpoint (gpt.GPT._scanned_blocks) keeps the matmuls'
# outputs and attention's ("attention": its output, and splash's log-sum-exp, kernels.tpu) and
# recomputes the elementwise work between them, one layer at a time in the backward pass. Unrolled,
# XLA fuses that work into the matmuls and keeps few of its intermediates; a scan would keep every
# one JAX's autodiff lists, stacked per iteration (docs/accelerators.md).
SCAN_POLICY = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable, jax.checkpoint_policies.save_only_these_names("attention"))
