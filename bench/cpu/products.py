"""The model's matrix products alone: fp32 against the forms that run them on bf16 hardware.

    python -m bench.cpu.products                  # config A's products at 2,048 tokens, 10 rounds
    python -m bench.cpu.products --rounds 30

On a CPU with AMX or AVX-512 BF16 a product from bf16 operands can run several times faster than
in fp32, but one bf16 pass rounds each operand to 8 bits of mantissa. "bf16x3" keeps about 16:
each operand is split into a bf16 high part and a bf16 remainder, and three bf16-operand products
(hi·hi + hi·lo + lo·hi, accumulated in fp32) stand for one fp32 product. It pays only where bf16
products run more than three times as fast as fp32 ones, counting the splits.

Each row is one product shape (m × k × n, as the train step meets it) and each column one form,
jitted on its own with its casts inside (as a step would run it); the rounds alternate between the
forms (a shared host drifts). It prints the median GFLOP/s and each form's relative Frobenius error
against the float64 product. The forms:
  fp32        jnp.matmul in fp32, what the model runs on CPU
  bf16        one product of bf16 operands into fp32 (the accelerators' precision)
  bf16x3      three bf16-operand products, summed in fp32
  bf16x3-cat  the same three as one product, the operands' parts concatenated along k
  xla-x3      jnp.matmul with precision=DotAlgorithmPreset.BF16_BF16_F32_X3: XLA's own bf16x3. A
              backend that ignores it runs fp32 (the error column then equals fp32's, and it says so)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bench import interleaved, parse_rounds, relative_difference

# (m, k, n, what): config A's step at 2,048 tokens (d=256, MLP 1,024, vocab 4,096).
SHAPES = [
    (2048, 256, 256, "q/k/v/o forward, their input gradients"),
    (2048, 256, 1024, "c_fc forward"),
    (2048, 1024, 256, "c_proj forward, c_fc's input gradient"),
    (2048, 256, 4096, "LM head forward"),
    (2048, 4096, 256, "LM head's input gradient"),
    (256, 2048, 256, "q/k/v/o weight gradients"),
    (256, 2048, 1024, "c_fc / c_proj weight gradients"),
    (256, 2048, 4096, "LM head's weight gradient"),
]


def _split(a):
    hi = a.astype(jnp.bfloat16)
    return hi, (a - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def _dot(a, b):
    return jnp.matmul(a, b, preferred_element_type=jnp.float32)


def bf16x3(a, b):
    (ah, al), (bh, bl) = _split(a), _split(b)
    return _dot(ah, bh) + (_dot(ah, bl) + _dot(al, bh))


def bf16x3_cat(a, b):
    (ah, al), (bh, bl) = _split(a), _split(b)
    return _dot(jnp.concatenate([ah, ah, al], axis=1), jnp.concatenate([bh, bl, bh], axis=0))


FORMS = {
    "fp32": jnp.matmul,
    "bf16": lambda a, b: _dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)),
    "bf16x3": bf16x3,
    "bf16x3-cat": bf16x3_cat,
    "xla-x3": lambda a, b: jnp.matmul(a, b, precision=lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
}


def measure(m: int, k: int, n: int, rounds: int, seed: int = 0) -> dict[str, tuple[float, float]]:
    """form -> (median GFLOP/s, relative error against float64) for one m × k × n product."""
    rng = np.random.default_rng(seed)
    a64, b64 = rng.standard_normal((m, k)), rng.standard_normal((k, n)) / np.sqrt(k)
    a, b = jnp.asarray(a64, jnp.float32), jnp.asarray(b64, jnp.float32)
    exact = a64.astype(np.float32).astype(np.float64) @ b64.astype(np.float32).astype(np.float64)
    runs, errors = {}, {}
    for name, f in FORMS.items():
        run = jax.jit(f)
        try:
            out = np.asarray(jax.block_until_ready(run(a, b)), np.float64)
        except Exception as e:  # a backend without that algorithm: say so and go on
            print(f"  {name}: not run here ({str(e).splitlines()[0][:120]})")
            continue
        runs[name], errors[name] = run, relative_difference(out, exact)
    times = interleaved(runs, (a, b), rounds)
    flops = 2.0 * m * k * n
    return {name: (flops / np.median(times[name]) / 1e9, errors[name]) for name in runs}


def main(argv=None):
    args = parse_rounds(argv, __doc__, 10)
    from bench.train_throughput import cpu_line
    print(cpu_line())
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; GFLOP/s (median of {args.rounds} rounds) "
          "and relative error against float64")
    preset_ignored = False
    for m, k, n, what in SHAPES:
        res = measure(m, k, n, args.rounds)
        cells = "  ".join(f"{name} {gf:5.0f} ({err:.0e})" for name, (gf, err) in res.items())
        print(f"{m:5d} x {k:4d} x {n:4d}  {cells}   {what}", flush=True)
        if "xla-x3" in res and res["xla-x3"][1] <= 2 * res["fp32"][1]:
            preset_ignored = True
    if preset_ignored:
        print("xla-x3 is as accurate as fp32 here: this backend ignores the preset and runs fp32.")


if __name__ == "__main__":
    main()
