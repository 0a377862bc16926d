"""What fits before you rent a pod: the d12-d24 presets under dp and fsdp on N fake CPU devices.

    python -m bench.scale                         # d12-d24 on 8 fake devices, 8 rows of 2048 per device
    python -m bench.scale --depths 24 --layouts fsdp --devices 8 --seq 2048 --batch 64 --compile-only
    python -m bench.scale --depths 12,16,20,24,26 --layouts fsdp --device-batch 8,16,32 --compile-only [--grad-checkpoint]
    python -m bench.scale --depths 12 --layouts fsdp --run-steps 12
    python -m bench.scale --depths 2,4 --devices 2 --seq 64 --batch 2     # small enough to run steps
    python -m bench.scale --topology v5e-8 --depths 12,20                 # libtpu's compiler, for 8 v5e chips
    python -m bench.scale --topology v5e-1 --depths 12 --layouts dp --vocab 32768 --scan-layers  # compile time, scanned
    python -m bench.scale --topology v5e-256 --slices 2 --depths 24       # two v5e-256 pods over the data-centre network

For each depth and layout, one row (MiB per device):
  params         parameter count
  param/dev      parameter bytes one device holds, from the arrays' shardings (sharding.bytes_per_device)
  opt/dev        optimizer-state bytes one device holds (Muon momentum, NorMuon moments, Adam moments)
  args/temp/out  XLA's memory analysis of the compiled train step, per device: arguments (state and
                 batch), temporaries (activations, gradients, gathered weights), outputs (the new
                 state, donated: it reuses the arguments' buffers)
  peak/dev       args + temp + out - aliased: what one device must hold during the step
  compile        seconds to lower and compile the step (jax AOT: `.lower(...).compile()`)
  step           one measured step after a warm-up step, or why it was not run

Nothing big is allocated to compile: the model and optimizer are built abstractly (nnx.eval_shape)
and placed by the sharding rules as ShapeDtypeStructs. A first compile uses XLA's cheapest code
generation (buffer assignment, hence every memory figure, is decided before code generation; marked
'*'). `--run-steps auto` then runs a step only where it fits this machine: the step's memory on all
fake devices within half the available RAM, and its FLOPs (XLA's cost analysis) within --max-step-s
at the measured matmul peak; such a row is compiled again with real code generation. Deeper presets
that are not run (above --exact-up-to) are compiled at 4 and 8 layers of their width and XLA's
figures extended linearly ('~'): a full compile of d24 takes ~4 minutes here, the two short ones ~40 s.

The fake devices share this machine's cores and memory, so step times compare layouts, not chips.
The memory figures are XLA:CPU's accounting of the per-device program; a TPU's compiler schedules
the same program differently, and --dtype bfloat16 shows the activations of bf16 compute.

--topology NAME (v5e-1, v5e-8, v4-32, v6e-64, v5p-8, ...) compiles for that TPU slice instead, on this
CPU machine: libtpu's compiler, ahead of time, for the slice's devices (jax.experimental.topologies;
bench/topology.py), with what a TPU run uses by default: bf16 compute, splash attention (Mosaic),
Polar Express in bf16. The figures are then the TPU compiler's own, every depth is compiled in full,
no step runs, and the fits column is that chip's HBM. A step that does not fit fails to compile with
the chip's out-of-memory message, whose sizes the row prints. libtpu must be importable but should
not be installed in the project's environment; without it the bench says how to install it beside.

--slices N (multislice): N slices joined by the data-centre network, data parallel across them and
the layout within each (flaxchat.sharding's 'slice' axis); with --topology, libtpu's own N-slice
topology. Under each row, the collectives whose device groups span slices (from the compiled
module's replica groups), by op, with the bytes of their results per device: the gradient reduction
that crosses the data-centre network.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import shlex
import sys
import time

from flaxchat.errors import UserError, cli_main

# Code-generation effort for compiles that are only measured, never run: the LLVM passes are most
# of a CPU compile, and buffer assignment (the memory analysis) happens before them.
CHEAP_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="12,16,20,24", help="comma-separated --depth presets (default: %(default)s)")
    p.add_argument("--devices", type=int, default=8,
                   help="fake CPU devices (default: %(default)s; with --topology, the slice's chips)")
    p.add_argument("--topology", default=None,
                   help="compile for this TPU slice with libtpu instead of fake CPU devices: v5e-1, v5e-8, "
                        "v4-32, v6e-64, v5p-8, ... (Cloud TPU's accelerator names; v5e is v5litepod)")
    p.add_argument("--slices", type=int, default=1,
                   help="slices joined by the data-centre network (multislice): the batch split over them and "
                        "the parameters whole in each (data parallel across slices, the layout within); with "
                        "--topology, that many copies of the named slice, else --devices split into this many "
                        "(default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: %(default)s, the seed's)")
    p.add_argument("--batch", type=int, default=None,
                   help="rows per step over all devices, one micro-batch; must divide over --devices")
    p.add_argument("--device-batch", default=None,
                   help="comma-separated rows per device, one table row each, e.g. 8,16,32 "
                        "(pretrain's --device-batch-size; default: 8 unless --batch is given)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches the step accumulates (pretrain's gradient accumulation): the program "
                        "with its accumulation loop (default: %(default)s)")
    p.add_argument("--attention", default="auto", help="attention kernel (flaxchat.kernels; auto is blockwise on these "
                   "CPU devices, whose memory, O(T), is what splash and cuDNN also keep, and splash with "
                   "--topology) (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default: %(default)s, pretrain's)")
    p.add_argument("--grad-checkpoint", action="store_true", help="rematerialise each block in the backward pass")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks that repeat under one lax.scan (pretrain's --scan-layers): compiled once")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="compute dtype; parameters and optimizer state stay fp32 (default: float32, "
                        "bfloat16 with --topology, as training picks on a TPU)")
    p.add_argument("--layouts", default="dp,fsdp", help="comma-separated: dp, fsdp (default: %(default)s)")
    p.add_argument("--run-steps", default="auto",
                   help="which depths to time one step for: auto (where it fits RAM and --max-step-s), "
                        "all, none, or comma-separated depths (default: %(default)s)")
    p.add_argument("--max-step-s", type=float, default=20.0,
                   help="auto: run a step only if its FLOPs take at most this long at the matmul peak (default: %(default)s)")
    p.add_argument("--compile-only", action="store_true", help="compile and report memory; run no step")
    p.add_argument("--exact-up-to", type=int, default=None,
                   help="deeper presets that are not run are compiled at 4 and 8 layers of their width and "
                        "XLA's figures extrapolated to their depth (a compile of d24 takes ~4 min here); "
                        "a large value compiles every depth in full (default: 12; with --topology, every depth in full)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.slice = None
    if args.topology is not None:
        from bench.topology import slice_for
        args.slice = slice_for(args.topology)
        args.devices = args.slice.chips * max(args.slices, 1)
        args.run_steps = "none"  # compile-only devices: nothing runs on them
    args.dtype = args.dtype or ("bfloat16" if args.slice else "float32")
    if args.exact_up_to is None:
        args.exact_up_to = 10**6 if args.slice else 12
    if args.slices < 1 or args.devices % args.slices:
        raise UserError(f"--slices must be at least 1 and divide the {args.devices} devices (got {args.slices}).")
    try:
        args.depth_list = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths takes comma-separated whole numbers, e.g. 12,16 (got {args.depths!r}).") from None
    args.layout_list = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not args.depth_list or min(args.depth_list) < 1:
        raise UserError(f"--depths must name depths of 1 or more (got {args.depths!r}).")
    if set(args.layout_list) - {"dp", "fsdp"} or not args.layout_list:
        raise UserError(f"--layouts takes dp and/or fsdp (got {args.layouts!r}).")
    if args.device_batch is not None and args.batch is not None:
        raise UserError("give --batch (rows over all devices) or --device-batch (rows per device), not both.")
    try:
        per_device = [int(b) for b in (args.device_batch or "8").split(",") if b.strip()]
    except ValueError:
        raise UserError(f"--device-batch takes comma-separated whole numbers, e.g. 8,16,32 (got {args.device_batch!r}).") from None
    args.batch_list = [args.batch] if args.batch is not None else [b * args.devices for b in per_device]
    if args.devices < 1 or args.seq < 2 or not args.batch_list or min(args.batch_list) < 1:
        raise UserError("--devices and --batch must be at least 1 and --seq at least 2.")
    if args.micro_batches < 1:
        raise UserError(f"--micro-batches must be at least 1 (got {args.micro_batches}).")
    for batch in args.batch_list:
        if batch % args.devices:
            where = (f"the {args.devices} chips of {_slices_name(args)}" if args.slice else f"{args.devices} devices")
            raise UserError(f"--batch {batch} does not split over {where}; use a multiple of "
                            f"{args.devices} (every device takes the same number of rows).")
    args.batch = args.batch_list[0]
    if args.compile_only:
        args.run_steps = "none"
    if args.run_steps not in ("auto", "all", "none"):
        try:
            args.run_steps = {int(d) for d in args.run_steps.split(",")}
        except ValueError:
            raise UserError(f"--run-steps takes auto, all, none or comma-separated depths (got {args.run_steps!r}).") from None
    return args


def fake_devices(n: int) -> None:
    """N CPU devices. JAX reads the count once, when its backend starts: importing JAX beforehand is
    fine (a CPU training process's malloc tuning does), computing with it is not."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backend has started
        if jax.device_count() != n or jax.default_backend() != "cpu":
            raise UserError(f"JAX is already running with {jax.device_count()} {jax.default_backend()} device(s); "
                            f"run `python -m bench.scale` in a fresh process for {n} fake CPU devices.") from None


def target_devices(args):
    """The devices the bench compiles for: N fake CPU devices (None: jax.devices()), or with --topology
    the slice's compile-only TPU devices. Either way this process computes on the CPU: it traces, and
    libtpu's compiler (loaded as a plugin beside it) compiles."""
    if args.slice is None:
        fake_devices(args.devices)
        return None
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # the backend has started (e.g. in a test process): it is the CPU's or it
        pass              # is a chip's, and either traces the step the same way
    from bench.topology import compile_devices
    return compile_devices(args.slice, "python -m bench.scale " + shlex.join(args.argv), slices=args.slices)


def available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- one depth under one layout ---------------------------------------------------------------------


def choice_of(args):
    """The backend's records (`flaxchat.kernels.Choice`) the bench's flags name (--attention,
    --grad-checkpoint): this machine's, or with --topology the TPU's, its splash kernel lowered for
    the chip (bench.topology)."""
    from flaxchat.kernels import choose
    if args.slice is None:
        return choose(attention=args.attention, grad_checkpoint=args.grad_checkpoint, scan_layers=args.scan_layers)
    from bench.topology import splash_compiled, splash_heads_first_compiled
    c = choose("tpu", attention=args.attention, grad_checkpoint=args.grad_checkpoint, scan_layers=args.scan_layers)
    if c.model.attention_name != "splash":
        return c
    return dataclasses.replace(c, model=dataclasses.replace(c.model, attention=splash_compiled,
                                                            attention_heads_first=splash_heads_first_compiled))


def build(cfg, dtype, mesh, abstract: bool, kernels=None, polar=None, ns_dtype: str = "float32"):
    """(model, optimizer) placed on `mesh` by the sharding rules; ShapeDtypeStructs when `abstract`.
    `kernels`, `polar`: the model's and Muon's records (`flaxchat.kernels.Choice`; default: this
    backend's). `ns_dtype`: Polar Express's dtype (pretrain's --ns-dtype auto takes `polar`'s)."""
    from flax import nnx

    from flaxchat import sharding
    from flaxchat.gpt import GPT
    from flaxchat.optim import OptimConfig, Schedule, make_optimizer

    opt_cfg = OptimConfig(n_embd=cfg.n_embd, ns_dtype=ns_dtype)

    def optimizer(model):  # pretraining's: the schedule's horizon an input of the step
        return make_optimizer(model, opt_cfg, Schedule(1000), polar)

    def make():
        model = GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels)
        return model, optimizer(model)

    if abstract:
        model, opt = nnx.eval_shape(make)
        sharding.shard_abstract(model, opt, mesh)
        return model, opt
    return sharding.create_sharded(lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels),
                                   optimizer, mesh)


def pure_step(graphdef, plan=None):
    """The real train step (accumulating as `plan` says; default: this backend's) as a function of
    the state, so the AOT-compiled executable can also be called on the real state (donated, as in
    training)."""
    import jax
    from flax import nnx

    from flaxchat.train import train_step

    def step(state, x, y):
        model, opt = nnx.merge(graphdef, state)
        loss = train_step(model, opt, x, y, plan=plan)
        return loss, nnx.state((model, opt))

    return jax.jit(step, donate_argnums=0)


def compile_step(cfg, mesh, args, cheap: bool):
    """AOT-compile the train step of `cfg` on `mesh` from abstract state: (compiled, seconds, graphdef, batch sharding)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from flaxchat import sharding

    # Built outside the mesh context, as pretrain does (under one, nnx.eval_shape would place each
    # variable by its own metadata instead of by our rules).
    model, opt = build_for(cfg, mesh, args, abstract=True)
    batch = NamedSharding(mesh, P(None, sharding.BATCH))
    xs = jax.ShapeDtypeStruct((args.micro_batches, args.batch, cfg.sequence_len), jnp.int32, sharding=batch)
    graphdef, state = nnx.split((model, opt))
    plan = choice_of(args).plan  # with --topology the TPU's, not this machine's
    t = time.perf_counter()
    if args.slice is not None:
        # The abstract mesh is all the trace needs (the arguments carry the real shardings). Under the
        # concrete mesh of compile-only TPU devices, splash's mask tables, made concrete while tracing
        # (jax.ensure_compile_time_eval), would be put on those devices and fail. No CPU codegen options.
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            compiled = pure_step(graphdef, plan).lower(state, xs, xs).compile()
        return compiled, time.perf_counter() - t, batch
    with jax.set_mesh(mesh):  # the model's logical activation constraints resolve on this mesh
        compiled = pure_step(graphdef, plan).lower(state, xs, xs).compile(CHEAP_CODEGEN if cheap else None)
    return compiled, time.perf_counter() - t, batch


def build_for(cfg, mesh, args, abstract: bool):
    """`build` with the bench's flags; with --topology, Polar Express in the TPU record's dtype, as
    pretrain picks it there."""
    import jax.numpy as jnp
    choice = choice_of(args)
    return build(cfg, jnp.dtype(args.dtype), mesh, abstract, kernels=choice.model, polar=choice.polar,
                 ns_dtype=choice.polar.ns_dtype if args.slice is not None else "float32")


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return dict(args_b=m.argument_size_in_bytes, temp_b=m.temp_size_in_bytes, out_b=m.output_size_in_bytes,
                peak_b=m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def measure(cfg, layout: str, args, run: str) -> dict:
    """One table row for `cfg` under `layout`; `run` is yes, no or auto (if it fits)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from flaxchat import sharding
    from flaxchat.common import measured_matmul_peak

    mesh = sharding.make_mesh(args.target_devices or jax.devices(), layout, slices=args.slices)
    model, opt = build_for(cfg, mesh, args, abstract=True)
    param_dev = max(sharding.bytes_per_device(nnx.state(model, nnx.Param)).values())
    opt_dev = max(sharding.bytes_per_device(nnx.state(opt)).values())
    row = dict(params=sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model, nnx.Param))),
               param_dev=param_dev, opt_dev=opt_dev, step_s=None, why="", fit=False)
    del model, opt
    if args.slice is not None:
        return row | compile_for_slice(cfg, mesh, args)
    ram = available_ram()
    L = cfg.n_layer
    if run != "yes" and L > args.exact_up_to and L > 8:
        # Every 4 layers repeat (window pattern SSSL, value embeddings on alternate layers), so each
        # XLA figure is a + b*L: two compiles at 4 and 8 layers of this width give a and b.
        small = [compile_step(dataclasses.replace(cfg, n_layer=n), mesh, args, cheap=True) for n in (4, 8)]
        m4, m8 = (memory(c) for c, _, _ in small)
        row.update({k: m4[k] + (m8[k] - m4[k]) * (L - 4) / 4 for k in m4})
        row.update(compile_s=sum(s for _, s, _ in small), cheap=True, fit=True)
        return row
    # A cheap compile gives the memory and FLOP figures; the real code generation (for a fair step
    # time) is paid only for a step that will run.
    compiled, seconds, batch = compile_step(cfg, mesh, args, cheap=run != "yes")
    row.update(memory(compiled), compile_s=seconds, cheap=run != "yes", across=across_slices(compiled, args))
    if run == "no":
        return row
    if run == "auto":
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        flops = float((cost or {}).get("flops", 0.0)) * args.devices  # every fake device runs on these cores
        est_s = flops / measured_matmul_peak()
        need = row["peak_b"] * args.devices  # state is born sharded: no extra copy at init
        if need > 0.5 * ram:
            row["why"] = f"needs {need / 2**30:.0f}G"
            return row
        if est_s > args.max_step_s:
            row["why"] = f"~{est_s:.0f}s"
            return row
        compiled, seconds, batch = compile_step(cfg, mesh, args, cheap=False)
        row.update(compile_s=seconds, cheap=False)
    # --- one real step: allocate, warm up once (first-touch page faults), time the second ---
    model, opt = build_for(cfg, mesh, args, abstract=False)
    real = nnx.state((model, opt))
    del model, opt
    shape = (args.micro_batches, args.batch, cfg.sequence_len)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, shape, np.int32)
    x = jax.device_put(tokens, batch)
    with jax.set_mesh(mesh):
        for _ in range(2):
            t = time.perf_counter()
            loss, real = compiled(real, x, x)
            loss.block_until_ready()
    row["step_s"] = time.perf_counter() - t
    row["loss"] = float(loss)
    return row


def compile_for_slice(cfg, mesh, args) -> dict:
    """--topology: the row's memory figures from libtpu's compile, or the sizes of its out-of-memory
    error (a step that does not fit the chip does not compile)."""
    t = time.perf_counter()
    try:
        compiled, seconds, _ = compile_step(cfg, mesh, args, cheap=False)
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory is a row; the rest is raised
        from bench.topology import out_of_memory
        oom = out_of_memory(str(e))
        if oom is None:
            raise
        return dict(args_b=None, temp_b=oom.get("temp_b"), out_b=None, peak_b=oom.get("peak_b"),
                    hbm_b=oom["hbm_b"], compile_s=time.perf_counter() - t, cheap=False, why="OOM", target=True)
    return dict(memory(compiled), compile_s=seconds, cheap=False, target=True, across=across_slices(compiled, args))


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\((.*)$", re.M)
_ARRAY = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|bf16|f16|f32|f64|f8\w*)\[([\d,]*)\]")
_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8}


def _array_bytes(dtype: str, dims: str) -> int:
    size = _ITEMSIZE.get(dtype) or (1 if dtype.startswith("f8") else max(1, int(re.sub(r"\D", "", dtype)) // 8))
    return size * math.prod(int(d) for d in dims.split(",") if d)


def _groups(attrs: str, devices: int) -> list[list[int]]:
    """The device groups of one collective, from its replica_groups (listed, or XLA's iota form
    `[G,S]<=[dims]T(perm)`) or a permute's source_target_pairs; none listed means all devices."""
    import numpy as np
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape, dims = [int(x) for x in m[1].split(",")], [int(x) for x in m[2].split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m[3]:
            ids = ids.transpose([int(x) for x in m[3].split(",")])
        return ids.reshape(shape[0], -1).tolist()
    m = re.search(r"(?:replica_groups|source_target_pairs)=\{(\{[\d,{} ]*\})\}", attrs)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d, ]*)\}", m[1])]
    return [list(range(devices))]


_MEGASCALE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = \((.*?)\) send\(.*_xla_megascale_transfer_type=\"(\w+)\"", re.M)


def cross_slice_collectives(hlo: str, devices: int, slices: int) -> dict[str, list[int]]:
    """op -> [count, bytes] of what a compiled module (`compiled.as_text()`) sends between slices.

    libtpu compiles one slice's program: its collectives stay within the slice, and what crosses
    the data-centre network is a host transfer to the Megascale runtime (`send` with
    `_xla_megascale_transfer_type`, e.g. ALL_REDUCE), counted by that type with its operand's bytes.
    Elsewhere (XLA:CPU's fake devices) it is every collective whose device groups span more than one
    slice (a device's slice: its position in the mesh over the slice count, the mesh's leading axis),
    with the bytes of its result (an async op's: its outputs)."""
    out: dict[str, list[int]] = {}
    for result, kind in _MEGASCALE.findall(hlo):
        arrays = _ARRAY.findall(result)[:1]  # (data, context, token)
        entry = out.setdefault(kind.lower().replace("_", "-"), [0, 0])
        entry[0] += 1
        entry[1] += sum(_array_bytes(dtype, dims) for dtype, dims in arrays)
    if out:
        return out
    per_slice = devices // slices
    for result, op, start, rest in _OP.findall(hlo):
        if not any(len({d // per_slice for d in g}) > 1 for g in _groups(rest, devices)):
            continue
        arrays = _ARRAY.findall(result)
        if start and op == "all-gather":
            arrays = arrays[len(arrays) // 2:]  # (operands, outputs)
        elif start and op == "collective-permute":
            arrays = arrays[:1]  # (operand, output, contexts)
        entry = out.setdefault(op, [0, 0])
        entry[0] += 1
        entry[1] += sum(_array_bytes(dtype, dims) for dtype, dims in arrays)
    return out


def across_slices(compiled, args) -> dict | None:
    if args.slices < 2:
        return None
    return cross_slice_collectives(compiled.as_text(), args.devices, args.slices)


def _slices_name(args) -> str:
    return f"{args.slices} x {args.slice.accelerator}" if args.slices > 1 else args.slice.accelerator


def format_across(r: dict, slices: int) -> str | None:
    """The line under a row: the collectives between slices, by op, with their bytes per device."""
    if r.get("across") is None:
        return None
    if not r["across"]:
        return f"      across the {slices} slices: no collective"
    parts = [f"{op} x{n} ({_mib(b)} MiB)" for op, (n, b) in sorted(r["across"].items())]
    return f"      across the {slices} slices: " + ", ".join(parts)


def _libtpu_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "(version unknown)"


# --- the table -------------------------------------------------------------------------------------


def _mib(b) -> str:
    if b is None:  # not known: the TPU compiler's out-of-memory error names only some sizes
        return "-"
    return f"{b / 2**20:,.0f}" if b >= 2**20 else f"{b / 2**20:.2f}"


# HBM per chip (Google's TPU pages; an 80 GB GPU): does the peak per device fit?
CHIPS = (("v5e", 16 * 2**30), ("v4", 32 * 2**30), ("v6e", 32 * 2**30), ("v5p", 95 * 2**30), ("80G", 80 * 10**9))


def fits(peak_b: float) -> str:
    return " ".join(f"{'y' if peak_b <= cap else '-':>3}" for _, cap in CHIPS)


def chip_columns(args) -> list[str]:
    """The fits columns: every chip for XLA:CPU's figures; with --topology, the target chip alone,
    where the compiler itself decides (a step that does not fit does not compile)."""
    if args.slice is not None:
        return [args.slice.accelerator.split("-")[0].replace("v5litepod", "v5e")]
    return [name for name, _ in CHIPS]


def format_row(depth: int, layout: str, r: dict, rows_per_device: int) -> str:
    fit = "~" if r["fit"] else ""  # extrapolated from 4- and 8-layer compiles
    step = f"{r['step_s']:.2f}s" if r["step_s"] is not None else (f"({r['why']})" if r["why"] else "-")
    mem = [f"{fit}{_mib(r[k])}" for k in ("args_b", "temp_b", "out_b", "peak_b")]
    if r.get("target"):  # --topology: compiled for the chip, or its compiler's OOM
        fitting = f"{'-' if r['why'] == 'OOM' else 'y':>3}"
    else:
        fitting = fits(r["peak_b"])
    return (f"{'d' + str(depth):>5} {layout:6} {r['params'] / 1e6:>7.1f}M {_mib(r['param_dev']):>9} "
            f"{_mib(r['opt_dev']):>8} {mem[0]:>7} {mem[1]:>7} {mem[2]:>7} {mem[3]:>8} "
            f"{r['compile_s']:>7.1f}s{'*' if r['cheap'] else ' '} {step:>9} {rows_per_device:>4} {fitting}")


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    args.target_devices = target_devices(args)
    import jax

    from flaxchat.config import config_for_depth

    choice = choice_of(args)
    what = (f"rows of {args.seq} tokens, vocab {args.vocab}, compute {args.dtype}, parameters and optimizer state "
            f"fp32, attention {choice.model.attention_name}{', --grad-checkpoint' if args.grad_checkpoint else ''}"
            f"{', --scan-layers' if args.scan_layers else ''}")
    if args.slice is None:
        slices = f" in {args.slices} slices" if args.slices > 1 else ""
        print(f"bench.scale: jax {jax.__version__}, {jax.device_count()} fake {jax.devices()[0].platform.upper()} "
              f"devices{slices} on {os.cpu_count()} cores, {available_ram() / 2**30:.0f} GiB RAM available; {what}", flush=True)
    else:
        s, dev = args.slice, args.target_devices[0]
        slices = f", {args.slices} slices over the data-centre network" if args.slices > 1 else ""
        print(f"bench.scale: jax {jax.__version__}, compiled by libtpu {_libtpu_version()} for {_slices_name(args)} "
              f"({args.devices} x {dev.device_kind}, {s.hbm_bytes / 2**30:.0f} GiB HBM each; topology {s.topology_name}"
              f"{slices}) "
              f"on this CPU machine ({os.cpu_count()} cores); {what}, Polar Express in "
              f"{choice.polar.ns_dtype}", flush=True)
    chips = chip_columns(args)
    head = (f"{'depth':>5} {'layout':6} {'params':>8} {'param/dev':>9} {'opt/dev':>8} {'args':>7} {'temp':>7} "
            f"{'out':>7} {'peak/dev':>8} {'compile':>8} {'step':>9} {'rows':>4} "
            + " ".join(f"{name:>3}" for name in chips))
    if args.slice is None:
        print("MiB per device. param/dev, opt/dev: from the arrays' shardings; args/temp/out/peak: XLA's memory "
              "analysis of the compiled train step; rows: per device; v5e..80G: whether peak/dev fits that chip's "
              "memory (16, 32, 32, 95 GiB, 80 GB)")
    else:
        print(f"MiB per device. param/dev, opt/dev: from the arrays' shardings; args/temp/out/peak: the TPU "
              f"compiler's memory analysis of the compiled train step; rows: per device; {chips[0]}: whether it "
              f"compiled within the chip's HBM (-: out of memory, with the sizes the compiler named)")
    print(head)
    print("-" * len(head), flush=True)
    rows, all_rows = {}, []
    for depth in args.depth_list:
        cfg = config_for_depth(depth, vocab_size=args.vocab, sequence_len=args.seq)
        if args.run_steps in ("none", "auto", "all"):
            run = {"none": "no", "auto": "auto", "all": "yes"}[args.run_steps]
        else:
            run = "yes" if depth in args.run_steps else "no"
        for batch in args.batch_list:
            args.batch = batch
            for layout in args.layout_list:
                r = measure(cfg, layout, args, run)
                rows.setdefault((depth, layout), r)
                all_rows.append((depth, layout, batch // args.devices, r))
                print(format_row(depth, layout, r, batch // args.devices), flush=True)
                if format_across(r, args.slices):
                    print(format_across(r, args.slices), flush=True)
    print("-" * len(head))
    notes = []
    if any(r["cheap"] for r in rows.values()):
        notes.append("* compile-only row (no step run): compiled with XLA's cheapest code generation, which "
                     "leaves the memory figures as they are and the compile time shorter than a real one")
    if any(r["fit"] for r in rows.values()):
        notes.append(f"~ extrapolated (not run): depths above {args.exact_up_to} are compiled at 4 and 8 "
                     "layers of their width and XLA's figures extended linearly to their depth (within ~2% of a "
                     "full compile at d24); the compile column is those two compiles")
    if any(r["why"] == "OOM" for _, _, _, r in all_rows):
        hbm = next(r["hbm_b"] for _, _, _, r in all_rows if r["why"] == "OOM")
        notes.append(f"(OOM): the TPU compiler found no schedule within the chip's {hbm / 2**30:.2f} GiB of usable HBM; "
                     "temp (or peak) is the size its error named, '-' what it did not")
    if any(r["why"] and r["why"] != "OOM" for r in rows.values()):
        notes.append("(needs NG): not run, the step would need N GiB on all fake devices, over half this machine's "
                     "RAM; (~Ns): not run, about N s per step at the measured matmul peak")
    for note in notes:
        print(note)
    for depth in args.depth_list:
        if (depth, "dp") in rows and (depth, "fsdp") in rows:
            dp, fs = rows[(depth, "dp")], rows[(depth, "fsdp")]
            per_slice = args.devices // args.slices  # fsdp splits within a slice
            if per_slice == 1 or dp["peak_b"] is None or fs["peak_b"] is None:
                continue
            print(f"d{depth}: fsdp holds {fs['param_dev'] / dp['param_dev']:.3f} of dp's parameter bytes per device "
                  f"(1/{per_slice} = {1 / per_slice:.3f}); peak per device {_mib(fs['peak_b'])} MiB vs "
                  f"{_mib(dp['peak_b'])} MiB under dp")
    if len(args.batch_list) > 1:
        if args.slice is None:
            chip, fit = "a 32 GiB chip (v4, v6e)", lambda r: r["peak_b"] <= 32 * 2**30
        else:
            chip, fit = f"one {chips[0]} chip", lambda r: r["why"] != "OOM"
        for depth in args.depth_list:
            for layout in args.layout_list:
                ok = [b for d, l, b, r in all_rows if d == depth and l == layout and fit(r)]
                print(f"d{depth} {layout}: " + (f"up to {max(ok)} rows per device fit {chip}" if ok
                      else f"no measured device batch fits {chip}"))
    print(f"bench.scale took {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    from flaxchat.kernels import tune_process
    tune_process()
    sys.exit(cli_main(main))
