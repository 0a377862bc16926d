"""The CPU attention kernel alone: forward+backward of each variant, interleaved in one process.

    python -m bench.attention                                  # the shapes of configs A and B
    python -m bench.attention --shape 8,256,4,64 --window 128 --rounds 40

Each variant is `jax.grad` of sum(attention(q, k, v) * dO) with respect to q, k and v, jitted on its
own; the rounds alternate between the variants (a shared host drifts), and each row prints the
median and the median of its paired difference to the first variant:
  tiles      the kernel as the model runs it (`kernels.cpu_attention.causal_attention`: SHORT_TILE-query tiles unrolled
             up to SHORT_TOKENS tokens, loops beyond)
  blocks128  the kernel before the tiles: 128-key blocks, unrolled only up to two of them (T <= 256)
  loops      the loops at every length (128-key blocks)
  dense      the textbook form (T x T masked scores) under autodiff
"""

from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

from bench import interleaved
from flaxchat import ops
from flaxchat.kernels import cpu_attention

# (B, T, heads, head_dim, window): a micro-batch of the main job / config A at 2K and 16K tokens
# per step, and config B's short and long layers (bench.train_throughput's configs).
SHAPES = [(8, 256, 4, 64, 128), (4, 256, 4, 64, 256), (2, 512, 8, 64, 128), (2, 512, 8, 64, 512)]


@contextlib.contextmanager
def _short(tile: int, tokens: int):
    saved = cpu_attention.SHORT_TILE, cpu_attention.SHORT_TOKENS
    cpu_attention.SHORT_TILE, cpu_attention.SHORT_TOKENS = tile, tokens
    try:
        yield
    finally:
        cpu_attention.SHORT_TILE, cpu_attention.SHORT_TOKENS = saved


def _blockwise(q, k, v, window):
    return cpu_attention.causal_attention(q, k, v, window, 128)  # the model's attn_block


VARIANTS = {  # name -> (how the kernel is set while it traces, the attention function)
    "tiles": (contextlib.nullcontext, _blockwise),
    "blocks128": (lambda: _short(128, 256), _blockwise),
    "loops": (lambda: _short(128, 0), _blockwise),
    "dense": (contextlib.nullcontext, ops.reference_attention),
}


def time_variants(shape, rounds: int, names=tuple(VARIANTS), seed: int = 0) -> dict[str, list[float]]:
    """Seconds per forward+backward of each variant, `rounds` interleaved rounds."""
    B, T, H, D, window = shape
    rng = np.random.default_rng(seed)
    q, k, v, dout = (jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.float32) for _ in range(4))
    runs, grads = {}, {}
    for name in names:
        setting, attend = VARIANTS[name]
        fn = jax.jit(jax.grad(lambda q, k, v, attend=attend: jnp.sum(attend(q, k, v, window) * dout), (0, 1, 2)))
        with setting():
            grads[name] = jax.block_until_ready(fn(q, k, v))  # traces (with the setting) and compiles
        runs[name] = fn
    ref = grads[names[0]]
    for name in names[1:]:  # the same gradients, up to float summation order
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(grads[name], ref))
        if err > 1e-4:
            raise RuntimeError(f"{name} disagrees with {names[0]}: relative error {err:.1e}")
    return interleaved(runs, (q, k, v), rounds)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", help="B,T,heads,head_dim (default: the shapes of configs A and B)")
    p.add_argument("--window", type=int, help="the window, with --shape (default: T)")
    p.add_argument("--rounds", type=int, default=40, help="interleaved rounds (default: %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, the first is the baseline of "
                   "the paired column (default: %(default)s)")
    args = p.parse_args(argv)
    names = tuple(args.variants.split(","))
    if args.rounds < 1 or not names or set(names) - set(VARIANTS):
        raise SystemExit(f"--rounds must be at least 1 and --variants a list of {', '.join(VARIANTS)}.")
    if args.window is not None and (not args.shape or args.window < 1):
        raise SystemExit("--window takes a whole number of at least 1, and goes with --shape.")
    shapes = SHAPES
    if args.shape:
        try:
            B, T, H, D = (int(x) for x in args.shape.split(","))
        except ValueError:
            raise SystemExit(f"--shape takes four whole numbers B,T,heads,head_dim (got {args.shape!r}).")
        shapes = [(B, T, H, D, args.window or T)]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; attention forward+backward, fp32, "
          f"SHORT_TILE {cpu_attention.SHORT_TILE}, SHORT_TOKENS {cpu_attention.SHORT_TOKENS}")
    for shape in shapes:
        times = time_variants(shape, args.rounds, names)
        base = np.array(times[names[0]])
        print(f"(B, T, heads, head_dim) = {shape[:4]}, window {shape[4]}, {args.rounds} rounds:")
        for name in names:
            t = np.array(times[name])
            print(f"  {name:10} {np.median(t) * 1e3:8.2f} ms   paired against {names[0]}: "
                  f"{np.median(t - base) * 1e3:+7.2f} ms, faster in {np.mean(t < base):4.0%} of rounds", flush=True)


if __name__ == "__main__":
    from flaxchat.kernels import tune_process
    tune_process()
    main()
