"""q and k's rotary + QK-norm alone: forward+backward with the CPU's hand-written backward against
autodiff, interleaved in one process (and RMSNorm, whose same form did not pay, under autodiff).

    python -m bench.cpu.norms                      # the shapes of configs A and B, 300 rounds
    python -m bench.cpu.norms --rounds 100

Each variant is the VJP of the op at one cotangent, jitted on its own; the rounds alternate between
the two variants (a shared host drifts), and each row prints the medians and the median of the
paired difference:
  rotary_rms_norm  `kernels.cpu.rotary_rms_norm` on q (B, T, heads, head_dim), hand-written, against autodiff
                   of rms_norm(rotary(x)) * 1.2, the two ops the model ran before
  rms_norm         on the residual stream (B, T, d), the hand-written form this module keeps
                   (`rms_norm_by_hand`: dx = r·(g - y·mean(g·y)) from the output) against autodiff
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench import interleaved, parse_rounds
from flaxchat import ops
from flaxchat.kernels import cpu

# (B, T, heads, head_dim): a micro-batch of config A (the main job) and of config B.
SHAPES = [(8, 256, 4, 64), (2, 512, 8, 64)]


@jax.custom_vjp
def rms_norm_by_hand(x):
    return ops.rms_norm(x)


def _rms_norm_fwd(x):
    xf = x.astype(jnp.float32)
    r = ops.rms_reciprocal(xf)
    y = (xf * r).astype(x.dtype)  # ops.rms_norm's arithmetic, keeping its r for the backward
    return y, (y, r)


def _rms_norm_bwd(res, g):
    y, r = res
    yf, gf = y.astype(jnp.float32), g.astype(jnp.float32)
    return ((gf - yf * jnp.mean(gf * yf, axis=-1, keepdims=True)) * r).astype(y.dtype),


rms_norm_by_hand.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def variants(shape):
    """op -> (input shape, hand-written, autodiff) for a micro-batch of `shape`."""
    B, T, H, D = shape
    table = ops.rotary_table(np.arange(T), D, 100_000.0, jnp.float32)
    return {
        "rotary_rms_norm": ((B, T, H, D), lambda x: cpu.rotary_rms_norm(x, table, 1.2),
                            lambda x: ops.rms_norm(ops.rotary(x, table)) * 1.2),
        "rms_norm": ((B, T, H * D), rms_norm_by_hand, ops.rms_norm),
    }


def time_pair(x_shape, ours, plain, rounds: int, seed: int = 0) -> dict[str, list[float]]:
    """Seconds per forward+backward of the hand-written and the autodiff form, interleaved."""
    rng = np.random.default_rng(seed)
    x, g = (jnp.asarray(rng.standard_normal(x_shape), jnp.float32) for _ in range(2))
    runs = {name: jax.jit(lambda x, g, f=f: (lambda y, vjp: (y, vjp(g)[0]))(*jax.vjp(f, x)))
            for name, f in (("hand-written", ours), ("autodiff", plain))}
    out = {name: jax.block_until_ready(run(x, g)) for name, run in runs.items()}  # compiles
    for i, what in enumerate(("forward", "backward")):  # equal up to how each program was fused
        a, b = out["hand-written"][i], out["autodiff"][i]
        err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        if err > 1e-5:
            raise RuntimeError(f"the hand-written op's {what} disagrees with autodiff's: relative error {err:.1e}")
    return interleaved(runs, (x, g), rounds)


def main(argv=None):
    args = parse_rounds(argv, __doc__, 300)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; forward+backward, fp32, {args.rounds} rounds")
    for shape in SHAPES:
        for op, (x_shape, ours, plain) in variants(shape).items():
            times = time_pair(x_shape, ours, plain, args.rounds)
            a, b = np.array(times["hand-written"]), np.array(times["autodiff"])
            print(f"  {op:16} {str(x_shape):18} hand-written {np.median(a) * 1e3:7.3f} ms, autodiff "
                  f"{np.median(b) * 1e3:7.3f} ms; paired {np.median(a - b) * 1e3:+7.3f} ms, faster in "
                  f"{np.mean(a < b):4.0%} of rounds", flush=True)


if __name__ == "__main__":
    from flaxchat.kernels import tune_process
    tune_process()
    main()
