"""The record of a backend's kernels (`Kernels`), in a module of its own so that each backend's file
builds one without importing the package that chooses among them."""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernels a model runs with (hashable: it is part of the model's static graph)."""

    backend: str  # cpu, gpu, tpu, or portable (export)
    attention_name: str  # what `attention` is: splash, cudnn, blockwise, xla, ...
    attention: Callable  # (q, k, v, window, block) -> y
    matmul: Callable  # (x, w) -> x @ w, with this backend's backward
    rotary_rms_norm: Callable  # (x, RotaryTable, scale) -> rms_norm(rotary(x)) * scale
    cross_entropy: Callable  # (raw logits, labels, cap) -> per-token nats of the soft-capped logits
    polar_express: Callable  # (g, steps, dtype) -> the orthogonalised g (Muon)
    ns_dtype: str  # Polar Express's dtype when --ns-dtype is auto
    muon_batched: bool = False  # Polar Express on stacks of same-shape matrices (`optim.muon`'s batched)
    remat: Callable | None = None  # (block, x, idx, rope, window, kernels) -> y when --grad-checkpoint
    head_loss: Callable | None = None  # (x, head weight, labels, weights, cap) -> weighted loss sum, fused
    scan_unroll: int = 1  # micro-batches the accumulation runs side by side
    halve_lone_micro_batch: bool = False  # a step of one micro-batch runs it as two halves
    flat_gradient_reduce: bool = False  # dp: gradients all-reduced as one flat buffer
    scan_layers: bool = False  # the blocks that repeat run under one lax.scan (gpt.scan_plan), compiled once

    def describe(self) -> str:
        """One line for a log: what runs where."""
        extra = ", remat (--grad-checkpoint)" if self.remat is not None else ""
        extra += ", scanned layers (--scan-layers)" if self.scan_layers else ""
        return f"kernels: {self.backend}, attention {self.attention_name}{extra}"
