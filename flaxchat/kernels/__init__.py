"""How this backend runs training: its choices, made once per process, one record per reader.

    c = kernels.choose()                               # what the running backend does best
    c = kernels.choose(attention="xla", grad_checkpoint=True)
    model = GPT(cfg, rngs=..., kernels=c.model)        # compute_init(...).kernels in the scripts
    tx = optim.build_optimizer(opt_cfg, schedule, c.polar)          # compute.polar
    step = train.StepLoop(model, nnx.Optimizer(model, tx, wrt=nnx.Param), plan=c.plan)  # compute.plan

`choose` returns a `Choice` of three records, each holding choices that change how, never what,
its reader computes:

* `Kernels` (`.model`): attention, the linear layer, rotary + QK-norm, the capped cross-entropy,
  remat. The model keeps it (a static attribute, so a jitted function compiled for one record is
  never reused for another); the loss and the engine read it off the model.
* `PolarExpress` (`.polar`): Muon's orthogonalisation, its dtype when --ns-dtype is auto, and
  whether it runs batched over same-shape matrices. The optimizer is built with it.
* `StepPlan` (`.plan`): how the train step accumulates micro-batches (side by side, a lone one in
  halves, one flat all-reduce). The step holds it (`flaxchat.train.StepLoop`, `train_step`).

Export uses `portable()`, a model's kernels of plain XLA ops every runtime converts.

One file per backend holds its choices, its `choice` building the three records: `tpu.py` (Pallas
splash attention), `gpu.py` (cuDNN flash attention), `cpu.py` (the XLA:CPU forms: stored
transposes, hand-written backwards, the accumulation's plan, the malloc tuning of training
processes), with the CPU's attention in `cpu_attention.py` and its Polar Express forms in
`cpu_muon.py`. `flaxchat.ops` keeps the plain math they all compute.

Adding an attention kernel: write `fn(q, k, v, window, block) -> y` (q (B,T,H,D), k/v (B,T,Hkv,D),
keys max(0, t-window+1) .. t; `block` is the model's attention block, which a kernel with its own
tiling ignores) in the backend's file and name it in that file's ATTENTION and in
`flaxchat.config.ATTENTION_NAMES` (what flag checking reads without JAX); `--attention NAME` then
works everywhere, and a test holds it to `ops.reference_attention`. Nothing else changes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

from flaxchat.kernels.record import Choice, Kernels, PolarExpress, StepPlan  # noqa: F401 (flaxchat.kernels.X)

BACKENDS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu"}


def backend_module(backend: str):
    """The module of a backend's choices (cpu, gpu or tpu; cuda and rocm are gpu)."""
    backend = _ALIASES.get(backend, backend)
    if backend == "tpu":
        from flaxchat.kernels import tpu as module
    elif backend == "gpu":
        from flaxchat.kernels import gpu as module
    else:
        from flaxchat.kernels import cpu as module
    return module


def attention_kernels() -> dict[str, Callable]:
    """Every attention kernel by name: xla (anywhere) and those each backend's file adds."""
    found = {"xla": _xla}
    for backend in BACKENDS:
        found.update(backend_module(backend).ATTENTION)
    return found


def attention_names() -> tuple[str, ...]:
    """What --attention takes: auto (the backend's default) and every kernel's name
    (`flaxchat.config.ATTENTION_NAMES` lists them for flag checking, which imports no JAX)."""
    return ("auto", *sorted(attention_kernels()))


def _xla(q, k, v, window, block):
    from flaxchat import ops
    return ops.xla_attention(q, k, v, window)


@functools.lru_cache(maxsize=None)
def choose(backend: str | None = None, attention: str = "auto", grad_checkpoint: bool = False,
           scan_layers: bool = False) -> Choice:
    """The records for `backend` (default: JAX's) with attention `attention` (auto: the backend's
    default; any named kernel runs anywhere, a TPU kernel off TPU in Pallas's slow interpret mode),
    remat when `grad_checkpoint`, and the repeating blocks under one lax.scan when `scan_layers`
    (`flaxchat.gpt.scan_plan`). The same arguments give the same records (cached)."""
    import jax

    from flaxchat.errors import UserError
    backend = backend or jax.default_backend()
    backend = _ALIASES.get(backend, backend)
    module = backend_module(backend)
    name = module.DEFAULT_ATTENTION if attention == "auto" else attention
    table = attention_kernels()
    if name not in table:
        raise UserError(f"--attention must be one of {', '.join(attention_names())} (got {attention!r}).")
    choice = module.choice(name, table[name], grad_checkpoint)
    if scan_layers:
        choice = dataclasses.replace(choice, model=dataclasses.replace(choice.model, scan_layers=True))
    return choice


@functools.lru_cache(maxsize=None)
def portable() -> Kernels:
    """A model's kernels of plain XLA ops and dense attention: what an exported program (StableHLO,
    TFLite) is made of."""
    from flaxchat import ops
    return Kernels(backend="portable", attention_name="xla", attention=_xla, matmul=ops.matmul,
                   rotary_rms_norm=ops.rotary_rms_norm, cross_entropy=ops.softcap_cross_entropy)


def runs_on_cpu() -> bool:
    """Whether this process's JAX will compute on the CPU, decided without starting JAX's backend:
    JAX_PLATFORMS where set, else whether an accelerator plugin (libtpu, a CUDA or ROCm plugin) is
    installed. Starting the backend to ask would take the chip (a TPU is held by one process)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    import importlib.util
    plugins = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin")
    return not any(importlib.util.find_spec(name) for name in plugins)


def tune_process() -> None:
    """Prepare a training process for where its step runs: on a CPU, the malloc tuning and
    synchronous dispatch of `flaxchat.kernels.cpu.tune_runtime` (a restart of the process); on an
    accelerator, nothing. Call it first thing in a training entry point."""
    if runs_on_cpu():
        from flaxchat.kernels.cpu import tune_runtime
        tune_runtime()
