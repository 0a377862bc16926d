"""The losses of the first N train steps, to check that a speed change changed no arithmetic.

    python -m bench.cpu.same_losses --out before.json          # on the old code
    python -m bench.cpu.same_losses --compare before.json      # on the new code: the largest difference

The main job's shape (depth 4, 8 rows of 256 tokens per step, Muon + AdamW with the default
recipe, Polar Express in fp32 unless `--ns-dtype` says otherwise), a fixed seed and fixed token
rows drawn from the built-in stories' vocabulary size, so two checkouts run the same steps.
`--compare` prints each step's two losses and exits 1 when one differs by more than `--rtol`
(float summation order differs between kernels; a recipe change moves the losses by far more).

Through the recipe's loss spike (steps 8-12 here) a one-ulp change grows about threefold a step,
so a change that rounds differently, not only one that changes the arithmetic, can move step 12
by 1e-3. `--ulps N` measures that yardstick on this checkout: it runs again with the logits
scaled by (1 + N·2⁻²³) and accepts a difference up to what that moved (two ulps: 4.8e-3 on a
2-core AMD EPYC).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np


def losses(steps: int, rows: int, accum: int, seed: int = 0, ns_dtype: str = "float32",
           ulps: int = 0) -> list[float]:
    """The losses of `steps` train steps; `ulps` > 0 scales the logits by (1 + ulps·2⁻²³) first."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flaxchat.config import config_for_depth
    from flaxchat.gpt import GPT
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import train_step

    cfg = config_for_depth(4, vocab_size=4096, sequence_len=256)
    kernels, polar = {}, ()
    try:  # a checkout from before flaxchat.kernels (the base side of bench.cpu.before_after) runs --out
        from flaxchat.kernels import choose
        chosen = choose()
        # a Choice of the model's, Muon's and the step's records; before they were split, one record
        record, polar = getattr(chosen, "model", chosen), (getattr(chosen, "polar", chosen),)
        if ulps:  # the loss's logits nudged by (1 + ulps·2⁻²³)
            scale, loss = 1.0 + ulps * 2.0 ** -23, record.cross_entropy
            record = dataclasses.replace(record, cross_entropy=lambda z, labels, cap: loss(z * scale, labels, cap))
        kernels = dict(kernels=record)
    except ImportError:
        pass
    model = GPT(cfg, rngs=nnx.Rngs(seed), **kernels)
    if ns_dtype == "auto":
        if polar:
            ns_dtype = polar[0].ns_dtype
        else:
            from flaxchat.optim import orthogonalisation_dtype
            ns_dtype = orthogonalisation_dtype(jax.default_backend())
    tx = build_optimizer(OptimConfig(optimizer="muon", n_embd=cfg.n_embd, ns_dtype=ns_dtype), Schedule(1000), *polar)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(seed)
    # A Zipf-like token distribution, so the model has something to learn in 20 steps.
    p = 1.0 / np.arange(1, cfg.vocab_size + 1)
    out = []
    for _ in range(steps):
        x = rng.choice(cfg.vocab_size, size=(accum, rows, cfg.sequence_len + 1), p=p / p.sum()).astype(np.int32)
        out.append(float(train_step(model, optimizer, jnp.asarray(x[..., :-1]), jnp.asarray(x[..., 1:]))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu.same_losses", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rows", type=int, default=8, help="rows of 256 tokens per micro-batch (default 8)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (default 1)")
    ap.add_argument("--ns-dtype", default="float32", choices=["float32", "bfloat16", "bf16-products", "bf16-operands", "auto"],
                    help="Polar Express's dtype (default float32, the same on every machine; auto: what "
                         "pretraining picks on this one)")
    ap.add_argument("--out", help="write the losses to this JSON file")
    ap.add_argument("--compare", help="compare with the losses in this JSON file")
    ap.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference accepted (default 1e-4)")
    ap.add_argument("--ulps", type=int, default=0,
                    help="with --compare: also accept a difference up to what N ulps on this checkout's logits make")
    args = ap.parse_args(argv)
    if args.ulps < 0 or args.steps < 1:
        ap.error("--ulps must be >= 0 and --steps >= 1")
    if args.ulps and not args.compare:
        ap.error("--ulps widens --compare's tolerance; pass --compare too")
    ref = None
    if args.compare:  # read before the steps run, so a wrong path fails at once
        try:
            with open(args.compare) as f:
                ref = json.load(f)
        except (OSError, ValueError) as e:
            ap.error(f"cannot read --compare {args.compare}: {e}")
        if not isinstance(ref, list) or not all(isinstance(v, (int, float)) for v in ref):
            ap.error(f"--compare {args.compare} is not a list of losses (write one with --out)")
    got = losses(args.steps, args.rows, args.accum, ns_dtype=args.ns_dtype)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(got, f)
    if not args.compare:
        print(" ".join(f"{v:.7f}" for v in got))
        return 0
    if len(ref) != len(got):
        print(f"{args.compare} holds {len(ref)} losses, this run {len(got)}; run both with the same --steps.")
        return 2
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref, got), 1):
        rel = abs(a - b) / max(abs(a), 1e-12)
        worst = max(worst, rel)
        print(f"step {i:3d}  {a:.7f}  {b:.7f}  rel diff {rel:.1e}")
    tol, what = args.rtol, f"rtol {args.rtol:g}"
    if args.ulps:
        nudged = losses(args.steps, args.rows, args.accum, ns_dtype=args.ns_dtype, ulps=args.ulps)
        yardstick = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(got, nudged))
        print(f"{args.ulps} ulp(s) on this checkout's logits move its losses by up to {yardstick:.1e}")
        tol, what = max(tol, yardstick), f"rtol {args.rtol:g} or {args.ulps} ulp(s) ({yardstick:.1e})"
    ok = worst <= tol
    print(f"largest relative difference {worst:.1e}: {'same' if ok else 'DIFFERENT'} within {what}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
