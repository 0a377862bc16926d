"""Data parallel between processes on one host: the gradients' all-reduce, and the train step.

    python -m bench.cpu.data_parallel                       # config A at 16K tokens per step, 2 processes
    python -m bench.cpu.data_parallel --config S --accum 2 --steps 2    # a smoke size: does the bench run here

Starts `--procs` copies of itself joined over 127.0.0.1 (JAX's distributed runtime; on CPU its
collectives go through gloo), each pinned to one core as a pod's hosts each own theirs, and one
process on every core as the baseline, in interleaved rounds. It prints:
  all-reduce  the model's gradients summed between the processes, one array per parameter (what
              the partitioner emits) against one flat buffer (what train._device_sums_then_one_reduce
              sends on CPU); median ms
  step        the real train step at the same tokens per step: one process (the baseline) against
              the processes, each summing its rows of every micro-batch before one all-reduce;
              median ms and tokens/s, and how many all-reduces the compiled step holds
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys

ROLE = "FLAXCHAT_BENCH_DP_ROLE"  # set in the processes the bench starts: "worker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(config: str, accum: int, rows: int, steps: int) -> dict:
    """One process's measurements (a process of the job, or the whole baseline): printed as JSON."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from bench.train_throughput import CONFIGS, _median_ms, step_optim
    from flaxchat.common import compute_init
    from flaxchat.gpt import GPT
    from flaxchat.optim import Schedule, build_optimizer
    from flaxchat.sharding import BATCH
    from flaxchat.train import train_step

    compute = compute_init("float32")  # joins the job from JAX_COORDINATOR_ADDRESS etc. when set
    n, i = jax.process_count(), jax.process_index()
    cfg = CONFIGS[config]["cfg"]
    out = dict(processes=n)

    with jax.set_mesh(compute.mesh):
        model = GPT(cfg, rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, build_optimizer(step_optim(cfg), Schedule(1000)), wrt=nnx.Param)
        if n > 1:  # the all-reduce alone: every parameter's gradient, as arrays and as one buffer
            sizes = [int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(model, nnx.Param))]
            spec = P(BATCH)
            where = NamedSharding(compute.mesh, spec)
            grads = [jax.make_array_from_process_local_data(where, np.ones(s, np.float32), (s * n,)) for s in sizes]
            forms = {"arrays": lambda *g: jax.lax.psum(g, BATCH),
                     "flat": lambda *g: jax.lax.psum(jnp.concatenate([x.reshape(-1) for x in g]), BATCH)}
            for name, form in forms.items():
                reduce = jax.jit(jax.shard_map(form, mesh=compute.mesh, in_specs=spec, out_specs=P()))
                out[f"allreduce_{name}_ms"] = _median_ms(lambda: reduce(*grads), steps)
            out["allreduce_mb"] = 4 * sum(sizes) / 1e6
            out["allreduce_arrays"] = len(sizes)

        full = np.random.default_rng(0).integers(0, cfg.vocab_size, (accum, rows, cfg.sequence_len)).astype(np.int32)
        mine = full[:, i * rows // n:(i + 1) * rows // n]
        where = compute.batch_sharding(1)
        x = jax.make_array_from_process_local_data(where, mine, full.shape)
        y = jax.make_array_from_process_local_data(where, np.roll(mine, -1, -1), full.shape)
        text = train_step.lower(model, opt, x, y).compile().as_text()
        out["step_allreduces"] = len(re.findall(r"= \S+ all-reduce(?:-start)?\(", text))
        step = nnx.cached_partial(train_step, model, opt)
        out["step_ms"] = _median_ms(lambda: step(x, y), steps)
        out["tokens"] = accum * rows * cfg.sequence_len
    return out


def _run(procs: int, args) -> dict:
    """Start the processes of one measurement; process 0's result."""
    cmd = [sys.executable, "-m", "bench.cpu.data_parallel", f"--config={args.config}", f"--accum={args.accum}",
           f"--rows={args.rows}", f"--steps={args.steps}"]
    env = {**os.environ, ROLE: "worker"}
    if procs > 1:
        port = _free_port()
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(procs))
    cores = sorted(os.sched_getaffinity(0))
    started = []
    for i in range(procs):
        penv = {**env, "JAX_PROCESS_ID": str(i)} if procs > 1 else env
        p = subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=(lambda c=cores[i % len(cores)]: os.sched_setaffinity(0, {c})) if procs > 1 else None)
        started.append(p)
    results = []
    try:
        for p in started:
            try:
                stdout, stderr = p.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"bench.cpu.data_parallel: {procs} process(es) did not finish in {args.timeout} s")
            if p.returncode != 0:
                raise SystemExit(f"bench.cpu.data_parallel: a process exited with {p.returncode}:\n{stderr[-3000:]}")
            results.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:  # one process failing leaves the others waiting on it
        for p in started:
            if p.poll() is None:
                p.kill()
    return results[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="A", choices=("S", "A", "B"), help="bench.train_throughput's config")
    p.add_argument("--procs", type=int, default=2, help="processes of the data-parallel job (each pinned to a core)")
    p.add_argument("--accum", type=int, default=16, help="micro-batches per step")
    p.add_argument("--rows", type=int, default=4, help="rows per micro-batch, all processes together")
    p.add_argument("--steps", type=int, default=5, help="timed calls per measurement (the median)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of baseline and processes")
    p.add_argument("--timeout", type=int, default=900, help="seconds one measurement may take")
    args = p.parse_args(argv)
    from flaxchat.kernels import tune_process
    tune_process()  # as training runs; the processes started below inherit its tunables
    if os.environ.get(ROLE) == "worker":
        print(json.dumps(worker(args.config, args.accum, args.rows, args.steps)), flush=True)
        return 0
    if args.procs < 2 or args.rows % args.procs:
        p.error(f"--procs must be at least 2 and divide --rows ({args.rows})")
    from bench.train_throughput import cpu_line
    print(cpu_line())
    print(f"config {args.config}: {args.accum} micro-batches of {args.rows} rows per step; {args.procs} processes "
          f"over 127.0.0.1, one core each, against one process on {len(os.sched_getaffinity(0))} core(s)", flush=True)
    for r in range(args.rounds):
        one, many = _run(1, args), _run(args.procs, args)
        print(f"round {r + 1}: all-reduce of {many['allreduce_mb']:.1f} MB: {many['allreduce_arrays']} arrays "
              f"{many['allreduce_arrays_ms']:.1f} ms, one flat buffer {many['allreduce_flat_ms']:.1f} ms")
        for name, res in (("1 process", one), (f"{args.procs} processes", many)):
            print(f"round {r + 1}: step, {name:12s} {res['step_ms']:8.1f} ms  {res['tokens'] / res['step_ms'] * 1e3:8,.0f} "
                  f"tok/s  ({res['step_allreduces']} all-reduce(s) in the compiled step)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
