"""Device check: what this accelerator does with flaxchat's real train step, in one table.

    python -m bench.device_check                  # on a GPU or TPU: d12 and d20 at sequence 2048
    python -m bench.device_check --depths 20 --remat none,attention --profile /tmp/trace
    python -m bench.device_check --quick          # a d2 model at sequence 128 (seconds, any machine)

For each depth, attention kernel and remat policy, three rows:
  fwd+bwd   the gradient of one micro-batch (--device-batch rows per device): the model alone
  step      the whole train step on that micro-batch: gradient, Muon + AdamW update
  step xA   the whole step at a realistic batch: A micro-batches accumulated to --total-batch
            (auto: nanochat's automatic batch for the depth, as pretraining picks it)
each with tokens/s, MFU against the spec sheet's bf16 peak and against a bf16 8192³ matmul timed
here (2048³ on CPU), its compile time, and the memory XLA's analysis gives the compiled program
(arguments + temporaries + outputs, less what is donated). The device's own peak_bytes_in_use, a
high-water mark of the whole process, is printed under the table.

FLOPs per token are `flaxchat.gpt.estimate_flops`: 6 per matmul parameter plus attention by the
keys each query sees (causal halves it, windows cap it), the count of the training log.
`--profile DIR` traces three steps of the one-micro-batch step (jax.profiler; open it in
TensorBoard or Perfetto) and prints the operations that took the most device time.
`--json PATH` writes every row. A configuration that fails (out of memory, not supported) gets its
reason in the row. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import gc
import time

from flaxchat.errors import UserError, cli_main
from flaxchat.profiling import top_lines

KERNELS = {"tpu": ("splash", "xla", "blockwise"), "gpu": ("cudnn", "xla", "blockwise"), "cpu": ("blockwise", "xla")}
REMATS = ("none", "full", "dots", "attention")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="12,20", help="comma-separated --depth presets (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: %(default)s)")
    p.add_argument("--device-batch", type=int, default=8, help="rows per device per micro-batch (default: %(default)s)")
    p.add_argument("--total-batch", default="auto",
                   help="tokens per step of the 'step xA' row: auto (nanochat's for the depth), a number, or 0 to "
                        "skip the row (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=5, help="timed calls after one warm-up (default: %(default)s)")
    p.add_argument("--kernels", default="", help="comma-separated attention kernels (default: those that run here)")
    p.add_argument("--remat", default="none",
                   help=f"comma-separated remat policies of a block ({', '.join(REMATS)}; default: %(default)s)")
    p.add_argument("--scan-layers", action="store_true",
                   help="run the blocks that repeat under one lax.scan, as pretrain's --scan-layers")
    p.add_argument("--what", default="fwd+bwd,step,accum",
                   help="which rows: fwd+bwd, step, accum (the step at --total-batch) (default: %(default)s)")
    p.add_argument("--profile", default="", metavar="DIR", help="trace the step into DIR and print its top operations")
    p.add_argument("--json", default="", metavar="PATH", help="write the rows to PATH as JSON")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                   help="compute dtype: auto (bf16 on TPU/GPU, fp32 on CPU), as pretraining's --dtype")
    p.add_argument("--quick", action="store_true", help="d2, sequence 128, 2 rows, vocab 512, 2 steps: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.depths, args.seq, args.device_batch, args.vocab, args.steps = "2", 128, 2, 512, 2
        if args.total_batch == "auto":
            args.total_batch = str(4 * 2 * 128)
    try:
        args.depth_list = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths takes comma-separated whole numbers, e.g. 12,20 (got {args.depths!r}).") from None
    if not args.depth_list or min(args.depth_list) < 1 or args.seq < 2 or args.device_batch < 1 or args.steps < 1:
        raise UserError("--depths, --device-batch and --steps must be at least 1 and --seq at least 2.")
    args.remat_list = [r.strip() for r in args.remat.split(",") if r.strip()]
    bad = [r for r in args.remat_list if r not in REMATS]
    if bad or not args.remat_list:
        raise UserError(f"--remat takes {', '.join(REMATS)} (got {args.remat!r}).")
    args.what_list = [w.strip() for w in args.what.split(",") if w.strip()]
    if not args.what_list or set(args.what_list) - {"fwd+bwd", "step", "accum"}:
        raise UserError(f"--what takes fwd+bwd, step and accum (got {args.what!r}).")
    if args.total_batch != "auto" and not args.total_batch.isdigit():
        raise UserError(f"--total-batch takes auto, 0 or a number of tokens (got {args.total_batch!r}).")
    return args


def runtime_peak() -> int | None:
    import jax
    return (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def timed(fn, args: tuple, steps: int, carry: bool):
    """Seconds per call of `fn` after one warm-up; with `carry`, fn returns (loss, state) and the
    state feeds the next call (a donated train state)."""
    import jax
    out = fn(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(steps):
        if carry:
            out = fn(out[1], *args[1:])
        else:
            out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps, out


def auto_batch(cfg) -> int:
    """nanochat's automatic tokens per step for `cfg`, as scripts.pretrain picks it."""
    from flax import nnx

    from flaxchat.config import TrainConfig
    from flaxchat.gpt import GPT, reference_scaling_param_count, scaling_param_count
    from flaxchat.recipe import scaling
    n = scaling_param_count(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
    tc = TrainConfig()
    return scaling(n, reference_scaling_param_count(cfg), tc.param_data_ratio, tc.weight_decay, -1).total_batch_size


def kernels_for(kernel: str, remat: str, scan_layers: bool = False):
    import dataclasses

    from flaxchat.kernels import choose
    kernels = choose(attention=kernel, scan_layers=scan_layers).model
    if remat == "none":
        return kernels
    if kernels.backend == "cpu":
        return choose(attention=kernel, grad_checkpoint=True, scan_layers=scan_layers).model  # the CPU's one remat form
    from flaxchat.kernels.tpu import remat_blocks
    return dataclasses.replace(kernels, remat=remat_blocks[remat])


def run_one(depth: int, kernel: str, remat: str, args, flops_rate) -> list[dict]:
    """Build, compile and time the gradient and the train step of `depth`; one dict per row."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from flaxchat import sharding
    from flaxchat.common import resolve_dtype
    from flaxchat.config import config_for_depth
    from flaxchat.gpt import GPT, estimate_flops
    from flaxchat.kernels import choose
    from flaxchat.optim import OptimConfig, Schedule, make_optimizer
    from flaxchat.train import _micro_loss
    from bench.scale import memory, pure_step

    cfg = config_for_depth(depth, vocab_size=args.vocab, sequence_len=args.seq)
    kernels = kernels_for(kernel, remat, args.scan_layers)
    dtype = resolve_dtype(args.dtype)
    mesh = sharding.make_mesh(jax.devices(), "dp")
    polar = choose().polar
    opt_cfg = OptimConfig(n_embd=cfg.n_embd, ns_dtype=polar.ns_dtype)
    model, opt = sharding.create_sharded(lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype, kernels=kernels),
                                         lambda m: make_optimizer(m, opt_cfg, Schedule(1000), polar), mesh)
    flops = estimate_flops(model)
    graphdef, state = nnx.split((model, opt))
    model_def, params, rest = nnx.split(model, nnx.Param, ...)
    del model, opt
    rows = args.device_batch * jax.device_count()
    micro = rows * args.seq
    total = auto_batch(cfg) if args.total_batch == "auto" else int(args.total_batch)
    accum = max(1, total // micro) if total else 0
    rng = np.random.default_rng(0)
    batch = NamedSharding(mesh, P(None, sharding.BATCH))

    def tokens(count):
        t = rng.integers(0, cfg.vocab_size, (count, rows, args.seq), np.int32)
        return jax.device_put(t, batch), jax.device_put(np.roll(t, -1, axis=-1), batch)

    results = []

    def record(kind, compiled, compile_s, seconds, n_tokens, **extra):
        tok_s = n_tokens / seconds
        r = dict(depth=depth, kernel=kernel, remat=remat, kind=kind, rows=rows, seq=args.seq, tokens=n_tokens,
                 tok_s=tok_s, ms=seconds * 1e3, compile_s=compile_s, scan_layers=args.scan_layers,
                 program_bytes=memory(compiled)["peak_b"],
                 flops_per_token=flops, **flops_rate(flops * tok_s), **extra)
        results.append(r)
        return r

    step = pure_step(graphdef)

    def fwd_bwd(params, x, y):
        grad = jax.jit(jax.grad(lambda p, x, y: _micro_loss(p, model_def, rest, x, y)[0]))
        t = time.perf_counter()
        compiled = grad.lower(params, x, y).compile()
        compile_s = time.perf_counter() - t
        seconds, _ = timed(compiled, (params, x, y), args.steps, carry=False)
        record("fwd+bwd", compiled, compile_s, seconds, micro)

    def whole_step(state, x, y, kind="step"):
        t = time.perf_counter()
        lowered = step.lower(state, x, y)
        lower_s = time.perf_counter() - t
        compiled = lowered.compile()
        compile_s = time.perf_counter() - t
        seconds, (loss, state) = timed(compiled, (state, x, y), args.steps if kind == "step" else 1, carry=True)
        record(kind, compiled, compile_s, seconds, x.shape[0] * micro, lower_s=lower_s, loss=float(loss))
        if args.profile and kind == "step":
            results[-1]["profile"] = profile(compiled, state, x, y, f"{args.profile}/d{depth}-{kernel}-{remat}")
            state = results[-1]["profile"].pop("state")
        return state

    with jax.set_mesh(mesh):
        x, y = tokens(1)
        if "fwd+bwd" in args.what_list:
            fwd_bwd(params, x[0], y[0])
        del params
        gc.collect()
        if "step" in args.what_list:
            state = whole_step(state, x, y)
            gc.collect()
        if accum and "accum" in args.what_list:
            state = whole_step(state, *tokens(accum), kind=f"step x{accum}")
    results[-1]["runtime_peak_bytes"] = runtime_peak()
    return results


def profile(compiled, state, x, y, folder: str, steps: int = 3, top: int = 12) -> dict:
    """Trace `steps` calls of the compiled step into `folder`; the device time per operation."""
    import jax

    from flaxchat.profiling import top_operations
    with jax.profiler.trace(folder):
        for _ in range(steps):
            loss, state = compiled(state, x, y)
        jax.block_until_ready(loss)
    return dict(folder=folder, state=state, **top_operations(folder, steps, top))


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from flaxchat.common import PEAK_FLOPS_BY_KIND, enable_compilation_cache, matmul_flops, resolve_dtype

    cache = enable_compilation_cache()
    backend = jax.default_backend()
    kernels = [k for k in args.kernels.split(",") if k] or list(KERNELS.get(backend, ("blockwise",)))
    dtype = resolve_dtype(args.dtype)
    dev = jax.devices()[0]
    n = jax.device_count()
    size = 2048 if backend == "cpu" else 8192
    measured = matmul_flops(size, jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else dtype) * n
    spec = next((p for name, p in PEAK_FLOPS_BY_KIND.items() if name.lower() in dev.device_kind.lower()), None)
    spec = spec * n if spec else None

    def flops_rate(flops_per_s: float) -> dict:
        return dict(mfu_spec=flops_per_s / spec if spec else None, mfu_measured=flops_per_s / measured)

    print(f"device_check: jax {jax.__version__}, {n} x {dev.device_kind} ({backend}); compute {jnp.dtype(dtype).name}; "
          f"spec sheet {spec / n / 1e12:.0f} TFLOP/s per device, " if spec else
          f"device_check: jax {jax.__version__}, {n} x {dev.device_kind} ({backend}); compute {jnp.dtype(dtype).name}; ",
          end="")
    print(f"a {jnp.dtype(dtype).name} {size}³ matmul measures {measured / n / 1e12:.2f} TFLOP/s per device; "
          f"compile cache {cache or 'off'}", flush=True)
    print(f"sequence {args.seq}, {args.device_batch} rows per device per micro-batch, vocab {args.vocab}, "
          f"Muon + AdamW, dp over {n} device(s); FLOPs by the keys each query sees")
    head = (f"{'depth':>5} {'attention':>9} {'remat':>9} {'what':>9} {'tok/s':>10} {'MFU spec':>8} {'MFU meas':>8} "
            f"{'time':>9} {'compile':>8} {'program':>8}")
    print(head)
    print("-" * len(head), flush=True)
    rows, peak = [], None
    for depth in args.depth_list:
        for kernel in kernels:
            for remat in args.remat_list:
                try:
                    results = run_one(depth, kernel, remat, args, flops_rate)
                except Exception as e:  # report and go on: this is a survey, not a test
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    print(f"{'d' + str(depth):>5} {kernel:>9} {remat:>9}  failed: {type(e).__name__}: {reason[:160]}",
                          flush=True)
                    rows.append(dict(depth=depth, kernel=kernel, remat=remat, failed=f"{type(e).__name__}: {reason}"))
                    continue
                finally:
                    jax.clear_caches()
                    gc.collect()
                for r in results:
                    spec_mfu = f"{100 * r['mfu_spec']:>7.1f}%" if r["mfu_spec"] is not None else f"{'-':>8}"
                    print(f"{'d' + str(depth):>5} {kernel:>9} {remat:>9} {r['kind']:>9} {r['tok_s']:>10,.0f} "
                          f"{spec_mfu} {100 * r['mfu_measured']:>7.1f}% {r['ms']:>7.1f}ms {r['compile_s']:>7.1f}s "
                          f"{r['program_bytes'] / 2**30:>7.2f}G", flush=True)
                    if r.get("profile"):
                        print("\n".join(top_lines(r["profile"])))
                peak = results[-1].get("runtime_peak_bytes") or peak
                rows.extend(results)
    print("-" * len(head))
    print("program: XLA's memory analysis of the compiled program (arguments + temporaries + outputs - donated)"
          + (f"; the device's peak_bytes_in_use over the whole run: {peak / 2**30:.2f} GiB" if peak else ""))
    if args.json:
        from flaxchat.report import write_json
        write_json(args.json, dict(device=dev.device_kind, devices=n, jax=jax.__version__, spec_flops=spec,
                                   measured_flops=measured, rows=rows))
    failed = [r for r in rows if "failed" in r]
    if failed:
        print(f"{len(failed)} configuration(s) failed (the rows above say why)")
    return 1 if failed and len(failed) == len(rows) else 0  # nothing measured is not a success


if __name__ == "__main__":
    from flaxchat.kernels import tune_process
    tune_process()
    raise SystemExit(cli_main(main))
