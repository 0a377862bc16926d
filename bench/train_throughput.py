"""Training throughput: tokens/s and MFU of the real train step, against a plain baseline, in one run.

    python -m bench.train_throughput                 # configs A and B, all modes (~5 min on 2 cores)
    python -m bench.train_throughput --configs A --steps 5
    python -m bench.train_throughput --configs A --modes flaxchat --phases --profile
    python -m bench.train_throughput --configs S --steps 1 --phases    # a smoke size: does the bench run here

Peak = a jitted fp32 2048³ matmul, timed here beside every measured step (a shared host drifts).
MFU = flaxchat.gpt.estimate_flops (6·matmul params + attention by the keys each query sees)·tok/s ÷ peak, per
round against that round's peak, the median over rounds; the `peak` column is the rounds' median,
and a closing line divides every row by the run's best peak instead. Modes per config:
  baseline   a straightforward port: jnp.matmul backward, --attention xla (jax.nn.dot_product_attention, dense
             TxT masked scores), AdamW, no accumulation
  flaxchat   the real step (fast-backward matmul, --attention: auto is the blockwise kernel on CPU, Muon+AdamW),
             one micro-batch
  flaxchat16k  the real step at 16,384 tokens per optimizer step (gradient accumulation in one jit)

`--ablate` adds, for the flaxchat modes, forward+backward without each of attention, rotary, RMSNorm and
the CPU matmul backward (each its own compiled step, all timed in interleaved rounds): what each
piece costs, untraced.

`--phases` adds, for the flaxchat modes, where a step's time goes. Three copies of the real step run
in interleaved rounds (median ms): the full step, the step without Polar Express's iterations and
the step with a no-op optimizer; the phases are their differences, as ms, share of the step and
share of the same run's matmul peak (FLOPs: the model's 6N + 12LdT per token; Polar Express per
m x n matrix, m <= n, per iteration: 4m^2 n + 2m^3; in the Gram form: 4m^2 n + (4·steps - 3)·2m^3 in all):
  fwd+bwd    every micro-batch's forward and backward, the accumulation and the scan
  update     the optimizer: muon-ns (Polar Express as it costs inside the step, in the dtype the header
             names) + rest (momentum, MuonEq/NorMuon normalisations, weight decay, the AdamW groups)
  Under each difference, the median and the middle half of the rounds' own differences (a round's
  steps run back to back; the headline is the difference of the medians, so the phases add up to
  the step, and on a host that drifts it can fall outside that middle half). Under muon-ns also
  its share of each round's own step, with a 95% interval for that share's median (order
  statistics; no assumption about the noise): a threshold inside the interval is not decided by
  the run. On a shared 2-core host one 2K-token step can differ from the next by 10%, so a phase
  of a few percent of config A's step needs many rounds: on one Intel Xeon within the hour,
  muon-ns read 69.0 ms (17.6% of the step) over 4 steps and 46.2, 53.3 and 61.2 ms (12.1-12.2%)
  over 30, its rounds' middle half 31-71 ms.
  ns-fp32, ns-bf16, ns-bf16p, ns-bf16o  Polar Express alone on the model's gradients, jitted on its
             own, in each dtype (bf16p: cpu_muon.BF16_PRODUCTS, bf16o: cpu_muon.BF16_OPERANDS), and how much
             bf16, bf16p and bf16o change the update against fp32 (what `kernels.cpu.orthogonalisation_dtype`
             weighs)
  ns-products  the products of the step's Polar Express alone (`products_alone`): the same dot_generals,
             shapes and dtypes, independent and with no elementwise work between them, timed in the
             same rounds as the four above: what its arithmetic costs at this machine's product rates.
             Where Polar Express alone in the step's dtype reads about the same, it runs at those
             rates, and only less arithmetic makes it cheaper

`--profile` adds, for the flaxchat modes, one step's kernels by kind (XLA:CPU trace; bench/profiling.py);
`--cycles` where the process's CPU time goes over `--steps` steps by kind, with the user and system CPU
time per step, its page faults, how busy the cores were and the host's steal (Linux perf samples;
bench/cycles.py).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench import interleaved, median_interval
from flaxchat import ops
from flaxchat.common import matmul_flops
from flaxchat.kernels import Kernels, choose
from flaxchat.kernels.cpu import read_cpuinfo
from flaxchat.kernels.cpu_muon import BF16_OPERANDS, BF16_PRODUCTS, uses_gram_form
from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT, estimate_flops
from flaxchat.optim import OptimConfig, Schedule, build_optimizer, param_label
from flaxchat.train import StepLoop

CONFIGS = {  # A: the main job's shape (run_tinystories --depth=4); B: depth 8; S: a smoke size, seconds to compile
    "S": dict(cfg=GPTConfig(sequence_len=128, vocab_size=1024, n_layer=2, n_head=2, n_kv_head=2, n_embd=128),
              rows=4, micro_rows=2),
    "A": dict(cfg=GPTConfig(sequence_len=256, vocab_size=4096, n_layer=4, n_head=4, n_kv_head=4, n_embd=256),
              rows=8, micro_rows=4),
    "B": dict(cfg=GPTConfig(sequence_len=512, vocab_size=4096, n_layer=8, n_head=8, n_kv_head=8, n_embd=512),
              rows=4, micro_rows=2),
}


def baseline_kernels() -> Kernels:
    """The baseline's kernels: dense XLA attention and jnp.matmul with autodiff's backward."""
    return dataclasses.replace(choose(attention="xla").model, matmul=ops.matmul)


class PeakProbe:
    """The fp32 2048³ matmul peak, timed beside each measured step.

    A shared 2-core host drifts: the peak read 106 to 213 GFLOP/s within one hour on a 2-core AMD
    EPYC (Zen 4), so a peak taken once at the start can put a later step's MFU anywhere from 50%
    to 80%. Each round times this product (the faster of two calls) right before the step, and a
    mode's MFU is the median over rounds of (the step's FLOP/s) / (that round's peak)."""

    def __init__(self):
        self.samples: list[float] = []

    def sample(self) -> float:
        self.samples.append(matmul_flops(2048, jnp.float32, reps=2))
        return self.samples[-1]


def _median_ms(fn, steps: int) -> float:
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


MODES = ("baseline", "flaxchat", "flaxchat16k")
# Phases that are differences of two timed steps: phase -> (step variant, minus this variant).
DIFFERENCES = {"update": ("full", "noop"), "muon-ns": ("full", "no-ns"), "rest": ("no-ns", "noop")}
PHASES = {
    "step": "(the full step, timed interleaved with the two below)",
    "fwd+bwd": "(the step with a no-op optimizer)",
    "update": "(step - fwd+bwd: Muon and the AdamW groups)",
    "muon-ns": "(step - the step without Polar Express's iterations)",
    "rest": "(the update's rest: momentum, normalisations, NorMuon, AdamW groups)",
    "ns-fp32": "(Polar Express alone, jitted on its own, fp32)",
    "ns-bf16": "(the same in bf16)",
    "ns-bf16p": "(the same, bf16-products: square matrices' polynomial products from bf16 operands, rectangular "
                "ones in the Gram form, fp32)",
    "ns-bf16o": "(the same, bf16-operands: as bf16-products, with the products that read the iterate from bf16 "
                "operands too)",
    "ns-products": "(the step's Polar Express with its products alone: the same dot_generals, independent and "
                   "with nothing between them; the four rows above and this one timed in the same rounds)",
}


def muon_matrices(state: nnx.State) -> list[jax.Array]:
    """The block matrices of a parameter-shaped state (parameters or gradients) that Muon
    orthogonalises (by the optimizer's own labels)."""
    out = []
    for path, var in nnx.to_flat_state(state):
        if param_label(".".join(map(str, path))) == "matrix":
            out.append(var.get_value() if hasattr(var, "get_value") else var)
    return out


def step_optim(cfg: GPTConfig, optimizer: str = "muon", **kw) -> OptimConfig:
    """The optimizer of the real step, Polar Express in the dtype pretraining picks on this machine."""
    return OptimConfig(optimizer=optimizer, n_embd=cfg.n_embd, ns_dtype=choose().polar.ns_dtype, **kw)


def ns_flops(shape, steps: int = 5, dtype="float32") -> float:
    """FLOPs of Polar Express on one matrix of `shape`, in the form `cpu_muon.polar_express` takes for
    `dtype`: the standard iteration, or (BF16_PRODUCTS or BF16_OPERANDS, rectangular) the Gram form, which does
    4·steps - 3 products of m x m x m plus the Gram matrix and the final product."""
    m, n = sorted(shape[-2:])
    count = int(np.prod(shape[:-2], dtype=np.int64))
    if uses_gram_form(shape, dtype) and steps:
        return (4 * m * m * n + (4 * steps - 3) * 2 * m ** 3) * count
    return steps * (4 * m * m * n + 2 * m ** 3) * count


def dot_generals(fn, *args) -> list[tuple]:
    """Every dot_general `fn(*args)` traces to, nested calls included: (lhs aval, rhs aval, params)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append((eqn.invars[0].aval, eqn.invars[1].aval, eqn.params))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr, or a Jaxpr
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def dot_flops(lhs, rhs, params) -> int:
    """2·batch·m·n·k of one dot_general (avals and params as `dot_generals` gives them)."""
    (lc, _), (lb, _) = params["dimension_numbers"]
    k = int(np.prod([lhs.shape[d] for d in lc], dtype=np.int64))
    batch = int(np.prod([lhs.shape[d] for d in lb], dtype=np.int64))
    m = int(np.prod(lhs.shape, dtype=np.int64)) // (k * batch)
    n = int(np.prod(rhs.shape, dtype=np.int64)) // (k * batch)
    return 2 * batch * m * n * k


def products_alone(dots: list[tuple], seed: int = 0):
    """(a call, its FLOPs): the products `dots` (from `dot_generals`), each with its own shapes,
    dtypes and dimension numbers, as independent products with no other work between them: what
    they cost at this machine's product rates, with nothing waiting on a product before it and no
    elementwise kernel between two. Each takes its own pair of inputs from a pool per operand
    shape and dtype, so no two are the same computation (XLA would merge those)."""
    rng = np.random.default_rng(seed)
    key = lambda aval: (aval.shape, str(aval.dtype))  # noqa: E731
    counts = collections.Counter((key(lhs), key(rhs)) for lhs, rhs, _ in dots)
    size = int(np.ceil(np.sqrt(max(counts.values(), default=1))))  # size² distinct pairs per signature
    pools = {k: [jnp.asarray(rng.standard_normal(k[0]) / np.sqrt(k[0][-1]), k[1]) for _ in range(size)]
             for k in {key(aval) for lhs, rhs, _ in dots for aval in (lhs, rhs)}}
    picks, seen = [], collections.Counter()  # per product: its (lhs, rhs) indices into the pools
    for lhs, rhs, _ in dots:
        j = seen[key(lhs), key(rhs)]
        seen[key(lhs), key(rhs)] += 1
        picks.append((j % size, j // size))

    def run(pools):
        return [jax.lax.dot_general(pools[key(lhs)][i], pools[key(rhs)][j], params["dimension_numbers"],
                                    preferred_element_type=params["preferred_element_type"])
                for (lhs, rhs, params), (i, j) in zip(dots, picks)]

    return functools.partial(jax.jit(run), pools), sum(dot_flops(*d) for d in dots)


def noise_note(phase: str, ms: float, flops: float | None, peak: float, ceiling: float | None = None) -> str:
    """A warning for a phase that cannot be read: the difference of two medians can come out above
    the peak or below zero on a busy machine. A measured row cannot (bf16 products may beat the
    fp32 peak for real). `ceiling`: the fastest rate the phase's own work was measured at alone,
    where that beats the fp32 peak (Polar Express from bf16 operands); then only a difference
    above it is flagged."""
    limit = max(peak, ceiling or 0.0)
    if phase not in DIFFERENCES or not (ms < 0 or (flops and flops / (ms / 1e3) > limit)):
        return ""
    return f" [{'below zero' if ms < 0 else 'above peak'}: noise between the medians; rerun with more --steps]"


def phases(cfg: GPTConfig, rows: int, accum: int, steps: int, seed: int = 0, probe: PeakProbe | None = None,
           kernels: Kernels | None = None) -> dict:
    """ms per step of each phase (see the module docstring), its FLOPs (None: not counted), and
    Polar Express alone in each dtype with the update difference bf16 and bf16-products make.

    Three copies of the real train step (same jit, donation and scan) run in interleaved rounds, so a
    machine that speeds up or slows down mid-run moves all of them alike: the full step; the step
    with Polar Express's iterations removed (ns_steps=0); and the step with a no-op optimizer (adds
    0 x gradient). Their differences are the phases as they cost inside the step. "spread" holds,
    for each difference, the three quartiles of the rounds' own differences (each round's two steps
    run back to back): their median, and how far one reading can move on this host, which a
    difference of two medians does not show."""
    import optax
    from flaxchat.train import token_losses
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, cfg.vocab_size, (accum, rows, cfg.sequence_len)), jnp.int32)
    y = jnp.roll(x, -1, axis=-1)
    variants = {"full": step_optim(cfg), "no-ns": step_optim(cfg, ns_steps=0), "noop": None}
    models, runs, times = {}, {}, {k: [] for k in variants}
    kernels = kernels or choose().model
    polar_express = choose().polar.orthogonalise
    for name, oc in variants.items():
        models[name] = GPT(cfg, rngs=nnx.Rngs(seed), kernels=kernels)
        tx = optax.sgd(0.0) if oc is None else build_optimizer(oc, Schedule(1000))
        runs[name] = StepLoop(models[name], nnx.Optimizer(models[name], tx, wrt=nnx.Param))
        runs[name](x, y).block_until_ready()  # compile
    for _ in range(steps):
        if probe is not None:
            probe.sample()
        for name, step in runs.items():
            t = time.perf_counter()
            step(x, y).block_until_ready()
            times[name].append(time.perf_counter() - t)
    rounds = {k: np.asarray(v) * 1e3 for k, v in times.items()}
    ms = {k: float(np.median(v)) for k, v in rounds.items()}
    between = {phase: ms[a] - ms[b] for phase, (a, b) in DIFFERENCES.items()}
    spread = {phase: tuple(float(q) for q in np.percentile(rounds[a] - rounds[b], [25, 50, 75]))
              for phase, (a, b) in DIFFERENCES.items()}
    # Muon's share of each round's own step, and a 95% interval for its median: whether this run
    # can tell a share from a threshold.
    share = median_interval(100 * (rounds["full"] - rounds["no-ns"]) / rounds["full"])
    # Polar Express alone, on the gradients of the (by now trained a few steps) full model.
    runs["full"].sync()
    model = models["full"]
    grads = nnx.grad(lambda m: jnp.mean(token_losses(m, x[0], y[0])))(model)
    mats = muon_matrices(grads)
    # Beside them, in the same rounds, the products of the step's Polar Express alone (its dtype).
    dtypes = ("float32", "bfloat16", BF16_PRODUCTS, BF16_OPERANDS)
    ns = {dtype: jax.jit(lambda ms, dtype=dtype: [polar_express(g, 5, dtype) for g in ms]) for dtype in dtypes}
    step_dtype = variants["full"].ns_dtype
    products, products_flops = products_alone(
        dot_generals(lambda ms: [polar_express(g, 5, step_dtype) for g in ms], mats))
    calls = {**{dtype: (lambda f=f: f(mats)) for dtype, f in ns.items()}, "products": products}
    for call in calls.values():
        jax.block_until_ready(call())  # compile
    rounds_s = interleaved(calls, (), steps)
    alone = {dtype: (float(np.median(rounds_s[dtype])) * 1e3, ns[dtype](mats)) for dtype in dtypes}
    products_ms = float(np.median(rounds_s["products"])) * 1e3

    def diff(dtype):  # median relative Frobenius difference to fp32 over the matrices (zero ones left out)
        return float(np.median([float(jnp.linalg.norm(a.astype(jnp.float32) - b) / jnp.linalg.norm(b))
                                for a, b in zip(alone[dtype][1], alone["float32"][1]) if jnp.linalg.norm(b) > 0]))
    tokens = accum * rows * cfg.sequence_len
    flops = {dtype: sum(ns_flops(g.shape, 5, dtype) for g in mats) for dtype in alone}
    return {"step": (ms["full"], None),
            "fwd+bwd": (ms["noop"], tokens * estimate_flops(model)),
            "update": (between["update"], None),
            "muon-ns": (between["muon-ns"], flops[variants["full"].ns_dtype]),
            "rest": (between["rest"], None),
            "ns-fp32": (alone["float32"][0], flops["float32"]),
            "ns-bf16": (alone["bfloat16"][0], flops["bfloat16"]),
            "ns-bf16p": (alone[BF16_PRODUCTS][0], flops[BF16_PRODUCTS]),
            "ns-bf16o": (alone[BF16_OPERANDS][0], flops[BF16_OPERANDS]),
            "ns-products": (products_ms, products_flops),
            "diff": {"bf16": diff("bfloat16"), BF16_PRODUCTS: diff(BF16_PRODUCTS), BF16_OPERANDS: diff(BF16_OPERANDS)},
            "spread": spread, "share": share}


ABLATIONS = {  # name -> {kernels-record field or ops function replaced: its stand-in}; the stand-ins keep
    # every input used
    "attention": {"attention": lambda q, k, v, window, block: v + 0 * q + 0 * k},
    "rotary": {"rotary_rms_norm": lambda x, table, scale: ops.rms_norm(x) * scale},
    "rms_norm": {"ops.rms_norm": lambda x: x, "rotary_rms_norm": lambda x, table, scale: ops.rotary(x, table) * scale},
    "cpu matmul backward": {"matmul": ops.matmul},
}


def ablations(cfg: GPTConfig, rows: int, accum: int, steps: int, seed: int = 0, kernels: Kernels | None = None) -> dict:
    """ms of forward+backward (the no-op optimizer's step) whole and without each of ABLATIONS.

    Each variant is its own compiled step (a kernels record with the stand-in; an `ops` function is
    swapped while it traces); all run
    in interleaved rounds in this process, so drift moves them alike. Traced profiles cannot give
    this: tracing inflates each of the step's ~1,800 small kernels."""
    import optax
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, cfg.vocab_size, (accum, rows, cfg.sequence_len)), jnp.int32)
    y = jnp.roll(x, -1, axis=-1)
    runs, programs = {}, {}
    kernels = kernels or choose().model
    for name in ("whole", *ABLATIONS):
        stand_ins = ABLATIONS.get(name, {})
        in_ops = {attr[4:]: fn for attr, fn in stand_ins.items() if attr.startswith("ops.")}
        record = dataclasses.replace(kernels, **{k: v for k, v in stand_ins.items() if not k.startswith("ops.")})
        saved = {attr: getattr(ops, attr) for attr in in_ops}
        for attr, stand_in in in_ops.items():
            setattr(ops, attr, stand_in)
        try:
            model = GPT(cfg, rngs=nnx.Rngs(seed), kernels=record)
            opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
            runs[name] = StepLoop(model, opt)  # a jit of its own, traced here with the stand-in
            programs[name] = runs[name].lower(x, y).as_text()
            runs[name](x, y).block_until_ready()  # compiles
        finally:
            for attr, fn in saved.items():
                setattr(ops, attr, fn)
        if name != "whole" and programs[name] == programs["whole"]:
            raise RuntimeError(f"replacing {', '.join(stand_ins)} did not change the step: the model no "
                               "longer calls it there")
    times = {k: [] for k in runs}
    for _ in range(steps):
        for name, run in runs.items():
            t = time.perf_counter()
            run(x, y).block_until_ready()
            times[name].append(time.perf_counter() - t)
    return {k: float(np.median(v)) * 1e3 for k, v in times.items()}


def real_step(cfg: GPTConfig, rows: int, accum: int, seed: int = 0, kernels: Kernels | None = None):
    """One real train step, compiled and run once: (run it again, its compiled module's text)."""
    model = GPT(cfg, rngs=nnx.Rngs(seed), kernels=kernels)
    opt = nnx.Optimizer(model, build_optimizer(step_optim(cfg), Schedule(1000)), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (accum, rows, cfg.sequence_len)), jnp.int32)
    y = jnp.roll(x, -1, axis=-1)
    step = StepLoop(model, opt)  # as the stages call it
    text = step.lower(x, y).compile().as_text()
    step(x, y).block_until_ready()
    return (lambda: step(x, y).block_until_ready()), text


def profile_mode(what: str, cfg: GPTConfig, rows: int, accum: int, kernels: Kernels | None = None) -> None:
    """Where one real train step's time goes, kernel by kernel (XLA:CPU trace; bench/cpu/profiling.py)."""
    from bench.cpu import profiling
    run, text = real_step(cfg, rows, accum, kernels=kernels)
    per_kind, kernels = profiling.kernel_times(run, text)
    profiling.print_table(what, per_kind, kernels, top=12)


def cycles_mode(what: str, cfg: GPTConfig, rows: int, accum: int, steps: int, kernels: Kernels | None = None) -> None:
    """Where the process's CPU time goes over `steps` real train steps (perf samples; bench/cpu/cycles.py)."""
    from bench.cpu import cycles
    run, _ = real_step(cfg, rows, accum, kernels=kernels)
    run()  # a second call: the first one's buffers are not the steady state
    sampled = cycles.sample(run, calls=steps)
    if sampled:
        cycles.print_cycles(what, *sampled)


def run_mode(cfg: GPTConfig, rows: int, accum: int, optimizer: str, steps: int, seed: int = 0,
             probe: PeakProbe | None = None, kernels: Kernels | None = None):
    """Median ms, tok/s and MFU of the real step; MFU per round against the peak timed just before
    that round's step (`PeakProbe`), then the median over rounds."""
    model = GPT(cfg, rngs=nnx.Rngs(seed), kernels=kernels)
    tx = build_optimizer(step_optim(cfg, optimizer), Schedule(1000))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.integers(0, cfg.vocab_size, (accum, rows, cfg.sequence_len)), jnp.int32)
    y = jnp.roll(x, -1, axis=-1)
    step = StepLoop(model, opt)  # as the stages call it; each mode traces anew
    t = time.perf_counter()
    step(x, y).block_until_ready()
    compile_s = time.perf_counter() - t
    probe = probe or PeakProbe()
    tokens = accum * rows * cfg.sequence_len
    flops = estimate_flops(model)
    times, mfus, peaks = [], [], []
    for _ in range(steps):
        peaks.append(probe.sample())
        t = time.perf_counter()
        step(x, y).block_until_ready()
        times.append(time.perf_counter() - t)
        mfus.append(tokens * flops / times[-1] / peaks[-1])
    dt = float(np.median(times))
    return dict(tokens=tokens, ms=dt * 1e3, tok_s=tokens / dt, flops_per_tok=flops, compile_s=compile_s,
                mfu=100 * float(np.median(mfus)), peak=float(np.median(peaks)))


def cpu_line() -> str:
    """`cpu: <model name> (cpu family F, model M; its matrix flags)`, as every CPU bench prints it."""
    import platform
    info = read_cpuinfo()  # empty off Linux
    cpu = info.get("model name") or platform.processor() or "unknown CPU"
    flags = info.get("flags", "").split()
    matrix_flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    # Family and model tell apart CPU generations that share a name: an "AMD EPYC" of family 25,
    # model 17 (Zen 4: AVX-512 on 256-bit units) read a 2048³ fp32 peak of 160-206 GFLOP/s on 2
    # cores, where the "AMD EPYC" machines of earlier sittings (taken for Zen 5) read 430-510.
    generation = ", ".join(f"{k} {info[k]}" for k in ("cpu family", "model") if k in info)
    return f"cpu: {cpu} ({'; '.join(filter(None, [generation, ', '.join(matrix_flags) or 'no AVX2/AVX-512/AMX flags seen']))})"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="A,B", help="comma-separated: A (the main job's shape), B (depth 8), S (a smoke "
                                                      "size: does the bench run here)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per mode (median reported)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--attention", default="auto", help="attention kernel of the flaxchat modes (default: %(default)s)")
    p.add_argument("--phases", action="store_true", help="also split the flaxchat modes' step by phase")
    p.add_argument("--ablate", action="store_true",
                   help="also time the flaxchat modes' forward+backward without each of: " + ", ".join(ABLATIONS))
    p.add_argument("--profile", action="store_true",
                   help="also print where a flaxchat step's time goes, kernel by kernel (XLA:CPU trace)")
    p.add_argument("--cycles", action="store_true",
                   help="also print where the process's CPU time goes over a flaxchat mode's steps, by kind "
                        "(Linux perf samples: products, XLA's loops, page zeroing, malloc, ...), how busy the cores were and the host's steal")
    p.add_argument("--json", metavar="PATH",
                   help="also write the figures to this JSON file: the cpu line, one row per config and mode, and "
                        "with --phases each phase's ms, share of the step and share of the peak")
    args = p.parse_args(argv)
    if args.profile:  # read when the CPU backend starts, i.e. before the first computation
        from bench.cpu import profiling
        profiling.enable()
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1.")
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown config {unknown[0]!r}: choose from {', '.join(CONFIGS)}.")
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:  # before the peak is timed and the first config compiled
        raise SystemExit(f"unknown mode {unknown[0]!r}: choose from {', '.join(MODES)}.")
    print(cpu_line())
    figures = {"cpu": cpu_line(), "rows": []}  # what --json writes

    probe = PeakProbe()
    peak = probe.sample()
    choice = choose(attention=args.attention)
    kernels, plan = choice.model, choice.plan
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} cpus; "
          f"fp32 2048^3 matmul peak at the start: {peak / 1e9:.0f} GFLOP/s (each MFU below divides by the peak "
          f"timed beside each step); the flaxchat modes' {kernels.describe()}, Polar Express in "
          f"{choice.polar.ns_dtype}, micro-batches {plan.scan_unroll} at a time"
          f"{', a lone one in halves' if plan.halve_lone_micro_batch else ''} (flaxchat.kernels)")
    print(f"{'config':6} {'mode':12} {'tokens/step':>11} {'ms/step':>9} {'tok/s':>9} {'MFU':>6} {'peak':>7} {'compile':>8}")
    rows_seen = []  # (config, mode, FLOP/s) for the closing line against the run's best peak
    for name in args.configs.split(","):
        spec = CONFIGS[name]
        cfg = spec["cfg"]
        T = cfg.sequence_len
        for mode in args.modes.split(","):
            if mode == "baseline":
                r = run_mode(cfg, spec["rows"], 1, "adamw", args.steps, probe=probe, kernels=baseline_kernels())
            elif mode == "flaxchat":
                r = run_mode(cfg, spec["rows"], 1, "muon", args.steps, probe=probe, kernels=kernels)
            elif mode == "flaxchat16k":
                micro = spec["micro_rows"]
                r = run_mode(cfg, micro, 16384 // (micro * T), "muon", args.steps, probe=probe, kernels=kernels)
            else:
                raise AssertionError(mode)  # MODES is checked above
            print(f"{name:6} {mode:12} {r['tokens']:>11,} {r['ms']:>9.1f} {r['tok_s']:>9,.0f} {r['mfu']:>5.1f}% "
                  f"{r['peak'] / 1e9:>7.0f} {r['compile_s']:>7.1f}s", flush=True)
            rows_seen.append((name, mode, r["tok_s"] * r["flops_per_tok"]))
            figures["rows"].append(dict(config=name, mode=mode, **{k: r[k] for k in ("tokens", "ms", "tok_s", "mfu")},
                                        peak_gflops=r["peak"] / 1e9))
            rows, accum = (spec["rows"], 1) if mode != "flaxchat16k" else (micro, 16384 // (micro * T))
            if args.profile and mode != "baseline":
                profile_mode(f"one {mode} step of config {name}", cfg, rows, accum, kernels)
            if args.cycles and mode != "baseline":
                cycles_mode(f"a {mode} step of config {name}", cfg, rows, accum, args.steps, kernels)
            if args.phases and mode != "baseline":
                first = len(probe.samples)
                split = phases(cfg, rows, accum, args.steps, probe=probe, kernels=kernels)
                peak = float(np.median(probe.samples[first:]))  # the peak of these rounds
                diffs, spread, per_round = split.pop("diff"), split.pop("spread"), split.pop("share")
                step_ms = split["step"][0]
                # Polar Express's fastest rate alone this run: muon-ns is noise only above it
                alone = max(f / (m / 1e3) for k, (m, f) in split.items() if k.startswith("ns-") and m > 0)
                figures["rows"][-1]["phases"] = {
                    phase: dict(ms=ms, of_step=100 * ms / step_ms,
                                of_peak=100 * flops / (ms / 1e3) / peak if flops and ms > 0 else None)
                    for phase, (ms, flops) in split.items()}
                figures["rows"][-1]["phases"]["muon-ns"]["share_per_round"] = dict(
                    median=per_round[0], low=per_round[1], high=per_round[2], level=0.95, rounds=args.steps)
                for phase, (ms, flops) in split.items():
                    share = f"{100 * ms / step_ms:5.1f}% of the step"
                    at_peak = f", {100 * flops / (ms / 1e3) / peak:5.1f}% of peak ({flops / 1e9:,.1f} GFLOP)" if flops and ms > 0 else ""
                    at_peak += noise_note(phase, ms, flops, peak, alone if phase == "muon-ns" else None)
                    print(f"{'':6}   {phase:10} {ms:>9.1f} ms  {share}{at_peak}  {PHASES[phase]}", flush=True)
                    if phase in spread:
                        lo, mid, hi = spread[phase]
                        print(f"{'':6}   {'':10} rounds' own differences: median {mid:.1f}, middle half {lo:.1f} to "
                              f"{hi:.1f} ms", flush=True)
                    if phase == "muon-ns":
                        print(f"{'':6}   {'':10} its share of each round's step: median {per_round[0]:.1f}%, 95% interval "
                              f"for that median {per_round[1]:.1f}% to {per_round[2]:.1f}% ({args.steps} rounds)", flush=True)
                print(f"{'':6}   against fp32, Polar Express in bf16 changes the update by {diffs['bf16']:.1e}, in "
                      f"{BF16_PRODUCTS} by {diffs[BF16_PRODUCTS]:.1e}, in {BF16_OPERANDS} by {diffs[BF16_OPERANDS]:.1e} "
                      "(median relative Frobenius difference over "
                      "the block matrices)", flush=True)
            if args.ablate and mode != "baseline":
                ms = ablations(cfg, rows, accum, args.steps, kernels=kernels)
                whole = ms.pop("whole")
                print(f"{'':6}   fwd+bwd whole {whole:9.1f} ms  (a no-op optimizer; each line below: compiled without "
                      "that piece, timed interleaved)", flush=True)
                for piece, m in ms.items():
                    print(f"{'':6}   without {piece:20} {m:9.1f} ms  {m - whole:+8.1f} ms", flush=True)
    # The conservative reading: every row against the fastest peak any round of this run saw (a
    # neighbour's memory traffic slows the 2048³ product more than the model's cache-sized ones, so
    # a round's own peak can read low).
    best = max(probe.samples)
    print(f"MFU against the best peak of this run ({best / 1e9:.0f} GFLOP/s): "
          + ", ".join(f"{c} {m} {100 * f / best:.1f}%" for c, m, f in rows_seen))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {rss:.0f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    from flaxchat.kernels import tune_process
    tune_process()
    main()
