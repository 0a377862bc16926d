"""The records of a backend's choices, one per reader, in a module of their own so that each
backend's file builds them without importing the package that chooses among them:

* `Kernels`, how the model runs (the model keeps it; `flaxchat.gpt`, the loss in `flaxchat.train`);
* `PolarExpress`, how Muon orthogonalises (the optimizer is built with it; `flaxchat.optim`);
* `StepPlan`, how the train step accumulates micro-batches (the step holds it; `flaxchat.train`);
* `Choice`, the three together: what `flaxchat.kernels.choose` returns.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels a model runs with (hashable: it is part of the model's static graph)."""

    backend: str  # cpu, gpu, tpu, or portable (export)
    attention_name: str  # what `attention` is: splash, cudnn, blockwise, xla, ...
    attention: Callable  # (q, k, v, window, block) -> y, each (B, T, heads, D)
    matmul: Callable  # (x, w) -> x @ w, with this backend's backward
    rotary_rms_norm: Callable  # (x, RotaryTable, scale) -> rms_norm(rotary(x)) * scale
    cross_entropy: Callable  # (raw logits, labels, cap) -> per-token nats of the soft-capped logits
    # The same attention on (B, heads, T, D) arrays, where the kernel computes in that layout (splash):
    # training's projections then write it directly, and no transpose surrounds the kernel.
    attention_heads_first: Callable | None = None
    remat: Callable | None = None  # (block, x, idx, rope, window, kernels) -> y when --grad-checkpoint
    head_loss: Callable | None = None  # (x, head weight, labels, weights, cap) -> weighted loss sum, fused
    scan_layers: bool = False  # the blocks that repeat run under one lax.scan (gpt.scan_plan), compiled once

    def describe(self) -> str:
        """One line for a log: what runs where."""
        extra = ", remat (--grad-checkpoint)" if self.remat is not None else ""
        extra += ", scanned layers (--scan-layers)" if self.scan_layers else ""
        return f"kernels: {self.backend}, attention {self.attention_name}{extra}"


@dataclasses.dataclass(frozen=True)
class PolarExpress:
    """How Muon orthogonalises its updates here: the optimizer's, not the model's, so a model
    never recompiles for a change of optimizer."""

    orthogonalise: Callable  # (g, steps, dtype) -> the orthogonalised g
    ns_dtype: str  # its dtype (or CPU form) when --ns-dtype is auto
    batched: bool = False  # run on stacks of same-shape matrices (`optim.muon`'s batched)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How the train step accumulates gradients over micro-batches; never what it sums (hashable:
    a static argument of the jitted step)."""

    scan_unroll: int = 1  # micro-batches the accumulation runs side by side
    halve_lone_micro_batch: bool = False  # a step of one micro-batch runs it as two halves
    flat_gradient_reduce: bool = False  # dp: gradients all-reduced as one flat buffer


@dataclasses.dataclass(frozen=True)
class Choice:
    """A backend's choices for each reader: the model's kernels, Muon's Polar Express, the step's plan."""

    model: Kernels
    polar: PolarExpress
    plan: StepPlan


def accelerator_choice(backend: str, attention_name: str, attention: Callable, grad_checkpoint: bool) -> Choice:
    """The records a TPU or GPU runs with, the same on both but for the attention: the plain ops, the
    head and its loss fused, nnx remat when `grad_checkpoint`, Polar Express in bf16 batched over
    same-shape matrices, and the step's plain plan."""
    from flaxchat import ops
    from flaxchat.kernels.fused_loss import softcap_loss_sum
    from flaxchat.kernels.remat import remat_block
    model = Kernels(backend=backend, attention_name=attention_name, attention=attention, matmul=ops.matmul,
                    rotary_rms_norm=ops.rotary_rms_norm, cross_entropy=ops.softcap_cross_entropy,
                    remat=remat_block if grad_checkpoint else None, head_loss=softcap_loss_sum)
    return Choice(model=model, polar=PolarExpress(orthogonalise=ops.polar_express, ns_dtype="bfloat16", batched=True),
                  plan=StepPlan())

