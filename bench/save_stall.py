"""What a checkpoint save costs the training loop: step times around a save, beside the median.

    python -m bench.save_stall                     # d12 at sequence 2048, 8 rows (an accelerator)
    python -m bench.save_stall --depth 2 --seq 128 --rows 2 --vocab 512   # seconds, any machine

Trains --steps steps of the real loop (`flaxchat.train.StepLoop`, Muon + AdamW) and saves a
checkpoint (`flaxchat.checkpoint.Checkpointer`, as pretraining does: sync, then save) before step
--save-at. Each step's time is from one finished step to the next (the loop waits on the loss, as
the training log does when it prints); the save's own call, the steps after it and the median step
are printed. Saves are asynchronous: the call returns once the arrays are off the device, and the
files are written while training goes on. Nothing is asserted.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from flaxchat.errors import UserError, cli_main


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m bench.save_stall", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=12, help="depth preset (default: %(default)s)")
    p.add_argument("--seq", type=int, default=2048, help="sequence length (default: %(default)s)")
    p.add_argument("--rows", type=int, default=8, help="rows per step (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default: %(default)s)")
    p.add_argument("--steps", type=int, default=12, help="steps in all (default: %(default)s)")
    p.add_argument("--save-at", type=int, default=6, help="save before this step (default: %(default)s)")
    p.add_argument("--dir", default="", help="checkpoint folder (default: a temporary one, removed after)")
    args = p.parse_args(argv)
    if args.steps < 4 or not 1 < args.save_at < args.steps - 1:
        raise UserError("--steps must be at least 4 and --save-at between 2 and --steps - 2.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np
    from flax import nnx

    from flaxchat.checkpoint import Checkpointer
    from flaxchat.common import compute_init
    from flaxchat.config import config_for_depth
    from flaxchat.gpt import GPT
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import StepLoop

    compute = compute_init()
    cfg = config_for_depth(args.depth, vocab_size=args.vocab, sequence_len=args.seq)
    model = GPT(cfg, rngs=nnx.Rngs(0), dtype=compute.compute_dtype, kernels=compute.kernels)
    tx = build_optimizer(OptimConfig(n_embd=cfg.n_embd), Schedule(1000), compute.polar)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state((model, optimizer))))
    loop = StepLoop(model, optimizer, plan=compute.plan)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.rows, args.seq + 1), np.int32)
    x, y = jax.device_put(tokens[..., :-1]), jax.device_put(tokens[..., 1:])
    folder = args.dir or tempfile.mkdtemp(prefix="save_stall-")
    ckpt = Checkpointer(folder, max_to_keep=1)
    times, save_call = [], None
    loop(x, y).block_until_ready()  # compile
    end = time.perf_counter()
    for step in range(args.steps):
        if step == args.save_at:
            t = time.perf_counter()
            loop.sync()
            ckpt.save(step, model, optimizer, {})
            save_call = time.perf_counter() - t
        loop(x, y).block_until_ready()
        now = time.perf_counter()
        times.append(now - end)
        end = now
    t = time.perf_counter()
    ckpt.wait()
    left = time.perf_counter() - t
    ckpt.close()
    if not args.dir:
        import shutil
        shutil.rmtree(folder, ignore_errors=True)
    plain = statistics.median(times[:args.save_at] + times[args.save_at + 3:])
    after = times[args.save_at:args.save_at + 3]
    print(f"save_stall: d{args.depth}, {args.rows} x {args.seq} tokens per step, {jax.default_backend()}; "
          f"model + optimizer state {state_bytes / 2**30:.2f} GiB")
    print(f"median step {plain * 1e3:.1f} ms; the save's call {save_call * 1e3:.0f} ms; the steps from the save on: "
          + ", ".join(f"{t * 1e3:.1f} ms ({t / plain:.2f}x)" for t in after)
          + f"; writing went on {left * 1e3:.0f} ms after the last step")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
