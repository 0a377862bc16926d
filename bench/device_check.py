"""Device check: what this accelerator does with flaxchat's real train step, in one table.

    python -m bench.device_check                  # on a GPU or TPU: d12 and d20 at sequence 2048
    python -m bench.device_check --quick          # a d2 model at sequence 128 (seconds, any machine)

Prints the chip's measured bf16 matmul peak (a jitted 8192³ matmul; 2048³ on CPU), then one row per
depth and attention kernel that runs here (TPU: splash, xla, blockwise; GPU: cudnn, xla, blockwise;
CPU: blockwise, xla): tokens/s and MFU of the train step (Muon + AdamW, one micro-batch of
--device-batch rows per device, dp over every local device), its compile time, and its peak device
memory (the runtime's peak_bytes_in_use where the device reports it, else XLA's memory analysis).
MFU = model FLOPs per token (6·matmul params + 12·L·d·T, flaxchat.gpt.estimate_flops) x tok/s over
the measured peak of all devices; the spec sheet's peak is printed beside it when the chip is known.
A kernel that fails (out of memory, not supported) gets its reason in the row. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import time

from flaxchat.errors import UserError, cli_main

KERNELS = {"tpu": ("splash", "xla", "blockwise"), "gpu": ("cudnn", "xla", "blockwise"), "cpu": ("blockwise", "xla")}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="12,20", help="comma-separated --depth presets (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: %(default)s)")
    p.add_argument("--device-batch", type=int, default=8, help="rows per device per step (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed steps after one warm-up (default: %(default)s)")
    p.add_argument("--kernels", default="", help="comma-separated attention kernels (default: those that run here)")
    p.add_argument("--quick", action="store_true", help="d2, sequence 128, 2 rows, vocab 512, 2 steps: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.depths, args.seq, args.device_batch, args.vocab, args.steps = "2", 128, 2, 512, 2
    try:
        args.depth_list = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths takes comma-separated whole numbers, e.g. 12,20 (got {args.depths!r}).") from None
    if not args.depth_list or min(args.depth_list) < 1 or args.seq < 2 or args.device_batch < 1 or args.steps < 1:
        raise UserError("--depths, --device-batch and --steps must be at least 1 and --seq at least 2.")
    return args


def matmul_peak(n: int, dtype) -> float:
    """FLOP/s of a jitted n³ matmul on one device (best of 5)."""
    import jax
    import jax.numpy as jnp
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def peak_memory(compiled) -> tuple[int, str]:
    """Peak device bytes: the runtime's counter where the device keeps one, else XLA's analysis."""
    import jax
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"], "runtime"
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes), "xla"


def run_one(depth: int, kernel: str, args, dtype, peak_total) -> dict:
    """`peak_total`: a flaxchat.rates.Peak of all devices (a step faster than it re-times it)."""
    """Build, compile and time the real train step of `depth` with attention `kernel`."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from flaxchat import sharding
    from flaxchat.config import config_for_depth
    from flaxchat.gpt import GPT, estimate_flops
    from flaxchat.kernels import choose
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from bench.scale import pure_step

    cfg = config_for_depth(depth, vocab_size=args.vocab, sequence_len=args.seq)
    kernels = choose(attention=kernel)
    mesh = sharding.make_mesh(jax.devices(), "dp")
    ns = kernels.ns_dtype  # as pretraining picks it here
    tx = build_optimizer(OptimConfig(n_embd=cfg.n_embd, ns_dtype=ns), Schedule(1000), kernels)
    model, opt = sharding.create_sharded(lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels),
                                         lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param), mesh)
    flops = estimate_flops(model, window_aware=False)
    graphdef, state = nnx.split((model, opt))
    del model, opt
    rows = args.device_batch * jax.device_count()
    batch = NamedSharding(mesh, P(None, sharding.BATCH))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, rows, args.seq), np.int32)
    x = jax.device_put(tokens, batch)
    y = jax.device_put(np.roll(tokens, -1, axis=-1), batch)
    with jax.set_mesh(mesh):
        t = time.perf_counter()
        compiled = pure_step(graphdef).lower(state, x, y).compile()
        compile_s = time.perf_counter() - t
        loss, state = compiled(state, x, y)  # warm-up: first-touch allocation
        loss.block_until_ready()
        t = time.perf_counter()
        for _ in range(args.steps):
            loss, state = compiled(state, x, y)
        loss.block_until_ready()
        dt = (time.perf_counter() - t) / args.steps
    mem, source = peak_memory(compiled)
    tok_s = rows * args.seq / dt
    return dict(tok_s=tok_s, mfu=peak_total.mfu(flops * tok_s) / 100, compile_s=compile_s, mem=mem, mem_source=source,
                loss=float(loss), step_ms=dt * 1e3)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from flaxchat.common import PEAK_FLOPS_BY_KIND, resolve_dtype
    from flaxchat.rates import Peak

    backend = jax.default_backend()
    kernels = [k for k in args.kernels.split(",") if k] or list(KERNELS.get(backend, ("blockwise",)))
    dtype = resolve_dtype("auto")
    dev = jax.devices()[0]
    n = jax.device_count()
    size = 2048 if backend == "cpu" else 8192
    bf16 = matmul_peak(size, jnp.bfloat16)
    # MFU against the peak of the dtype the step computes in (fp32 on CPU, where bf16 is slower)
    peak = bf16 if jnp.dtype(dtype) == jnp.bfloat16 else matmul_peak(size, dtype)
    spec = next((p for name, p in PEAK_FLOPS_BY_KIND.items() if name.lower() in dev.device_kind.lower()), None)
    print(f"device_check: jax {jax.__version__}, {n} x {dev.device_kind} ({backend}); compute {jnp.dtype(dtype).name}; "
          f"measured bf16 matmul peak {bf16 / 1e12:.2f} TFLOP/s per device"
          + (f" (spec sheet {spec / 1e12:.0f})" if spec else "")
          + ("" if peak == bf16 else f", {jnp.dtype(dtype).name} {peak / 1e12:.2f}"), flush=True)
    print(f"train step: sequence {args.seq}, {args.device_batch} rows per device, vocab {args.vocab}, Muon + AdamW, "
          f"dp over {n} device(s); MFU against the measured {jnp.dtype(dtype).name} peak x {n}")
    # A matmul timed while the host was busy reads low (a CPU shared with other work): a step that
    # beats it re-times it, and one that still beats it becomes the peak, so MFU stays <= 100%.
    peak_total = Peak(probe=lambda: matmul_peak(size, dtype) * n, first=peak * n, log=print)
    head = (f"{'depth':>5} {'attention':>9} {'tok/s':>10} {'MFU':>6} {'step':>9} {'compile':>8} {'peak mem':>10} "
            f"{'loss':>7}")
    print(head)
    print("-" * len(head), flush=True)
    for depth in args.depth_list:
        for kernel in kernels:
            try:
                r = run_one(depth, kernel, args, dtype, peak_total)
            except Exception as e:  # report and go on: this is a survey, not a test
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                print(f"{'d' + str(depth):>5} {kernel:>9}  failed: {type(e).__name__}: {reason[:100]}", flush=True)
                continue
            mem = f"{r['mem'] / 2**30:.2f}G" + ("" if r["mem_source"] == "runtime" else "*")
            print(f"{'d' + str(depth):>5} {kernel:>9} {r['tok_s']:>10,.0f} {100 * r['mfu']:>5.1f}% "
                  f"{r['step_ms']:>7.1f}ms {r['compile_s']:>7.1f}s {mem:>10} {r['loss']:>7.3f}", flush=True)
    print("-" * len(head))
    print("peak mem: the device's peak_bytes_in_use over the whole run so far; * where the device keeps no such "
          "counter (CPU): XLA's memory analysis of the step")
    return 0


if __name__ == "__main__":
    from flaxchat.kernels import tune_process
    tune_process()
    raise SystemExit(cli_main(main))
