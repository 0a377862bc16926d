"""How far each Polar Express dtype lands from float64, on the matrices Muon really orthogonalises.

    python -m bench.cpu.ns_accuracy                       # the main job's model, steps 5, 20 and 60
    python -m bench.cpu.ns_accuracy --at 1,2 --depth 2    # smaller and sooner

The main job's model (depth 4, 8 rows of 256 tokens per step, vocabulary 4,096) trains on the
built-in stories with the default recipe, Polar Express in fp32 so that the trajectory does not
depend on the dtypes measured. At each step in --at, every matrix Muon orthogonalises is taken as
Muon's update sees it (the step's gradient lerped towards the Nesterov momentum buffer) and run
through `kernels.cpu_muon.polar_express` in each dtype. The table gives, per matrix shape in the kernel layout
(in, out), the median and the largest relative Frobenius difference to the standard iteration in
float64. The dtype this machine's PolarExpress record picks is starred.

Text-trained gradients are far from well conditioned (the smallest singular value of a c_proj
gradient was ~2e-4 of its largest after 5 steps), and that is where the bf16 forms lose accuracy:
random tokens give gentler matrices and smaller differences.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from bench import relative_difference

DTYPES = ("float32", "bf16-products", "bf16-operands", "bfloat16")


def polar_express_f64(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """Polar Express in numpy float64, the standard iteration (no Gram form), with the same MuonEq
    equilibration and x1.01 Frobenius pre-normalisation as `optim.polar_express`."""
    from flaxchat.optim import POLAR_EXPRESS
    x = np.asarray(g, np.float64)
    x = x * (np.linalg.norm(x) / math.sqrt(x.shape[1]) / np.maximum(np.linalg.norm(x, axis=0, keepdims=True), 1e-6))
    x = x / (np.linalg.norm(x) * 1.01 + 1e-6)
    wide = x.shape[0] <= x.shape[1]
    for a, b, c in POLAR_EXPRESS[:steps]:
        A = x @ x.T if wide else x.T @ x
        B = b * A + c * A @ A
        x = a * x + (B @ x if wide else x @ B)
    return x


def story_rows(vocab_size: int, rows: int, seq: int, count: int, seed: int = 0) -> np.ndarray:
    """`count` batches of (rows, seq + 1) tokens of the built-in stories, documents joined by BOS."""
    from flaxchat.data.sources import resolve_source
    from flaxchat.tokenizer import Tokenizer, texts_of
    tokenizer = Tokenizer.train(texts_of(resolve_source("stories", split="train", seed=seed)), vocab_size,
                                max_chars=10_000_000)
    need, tokens = count * rows * (seq + 1), []
    for text in texts_of(resolve_source("stories", split="train", seed=seed + 1)):
        tokens += tokenizer.encode(text, prepend=tokenizer.bos_token_id)
        if len(tokens) >= need:
            break
    return np.asarray(tokens[:need], np.int32).reshape(count, rows, seq + 1)


def muon_inputs(depth: int, at: list[int], rows: int = 8, seq: int = 256, vocab_size: int = 4096,
                seed: int = 0, log=None) -> dict[int, list[np.ndarray]]:
    """{step: the matrices Muon's update hands to Polar Express at that step}, from a real training
    run of the default recipe (fp32 Polar Express) on the stories. `log` (e.g. print) hears of each
    step taken."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.train_throughput import muon_matrices
    from flaxchat.config import config_for_depth
    from flaxchat.gpt import GPT
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer
    from flaxchat.train import _micro_loss, train_step

    cfg = config_for_depth(depth, vocab_size=vocab_size, sequence_len=seq)
    model = GPT(cfg, rngs=nnx.Rngs(seed))
    schedule = Schedule(1000)
    tx = build_optimizer(OptimConfig(optimizer="muon", n_embd=cfg.n_embd, ns_dtype="float32"), schedule)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    batches = story_rows(cfg.vocab_size, rows, seq, max(at) + 1, seed)

    graphdef = nnx.graphdef(model)

    def mean_loss(params, rest, x, y):  # as train_step normalises it: per counted token
        total, count = _micro_loss(params, graphdef, rest, x, y)
        return total / count

    gradient = jax.jit(jax.grad(mean_loss))
    momentum, out = None, {}
    for step, batch in enumerate(batches):
        x, y = jnp.asarray(batch[:, :-1]), jnp.asarray(batch[:, 1:])
        _, params, rest = nnx.split(model, nnx.Param, ...)
        grads = [np.asarray(g, np.float64) for g in muon_matrices(gradient(params, rest, x, y))]
        mom = float(schedule.muon_momentum(step))  # Muon's own lerps (optim.muon), in float64
        momentum = [np.zeros_like(g) for g in grads] if momentum is None else momentum
        momentum = [m + (1 - mom) * (g - m) for m, g in zip(momentum, grads)]
        if step in at:
            out[step] = [(g + mom * (m - g)).astype(np.float32) for g, m in zip(grads, momentum)]
        if log is not None and step in at:
            log(f"step {step} of {max(at)}: Muon's inputs taken")
        train_step(model, optimizer, x[None], y[None])
    return out


def measure(inputs: dict[int, list[np.ndarray]], dtypes=DTYPES) -> dict:
    """{step: {shape: {dtype: [relative difference of each matrix of that shape]}}}."""
    import jax
    import jax.numpy as jnp

    from flaxchat.kernels.cpu_muon import polar_express
    runs = {dt: jax.jit(lambda g, dt=dt: polar_express(g, 5, dt).astype(jnp.float32)) for dt in dtypes}
    table = {}
    for step, mats in inputs.items():
        rows = table.setdefault(step, {})
        for g in mats:
            if not np.any(g):  # a gradient the zero-initialised projections still block: nothing to measure
                continue
            ref = polar_express_f64(g)
            cells = rows.setdefault(tuple(g.shape), {dt: [] for dt in dtypes})
            for dt, run in runs.items():
                cells[dt].append(relative_difference(run(jnp.asarray(g)), ref))
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--at", default="5,20,60", help="comma-separated train steps whose matrices are measured "
                                                   "(default: %(default)s)")
    p.add_argument("--depth", type=int, default=4, help="model depth (default: %(default)s, the main job's)")
    args = p.parse_args(argv)
    try:
        at = sorted({int(s) for s in args.at.split(",")})
    except ValueError:
        p.error(f"--at takes comma-separated step numbers, not {args.at!r}")
    if at[0] < 0 or args.depth < 1:
        p.error("--at takes steps from 0 on, and --depth is at least 1")

    from flaxchat.kernels import tune_process
    tune_process()
    from bench.train_throughput import cpu_line
    from flaxchat.kernels import choose
    print(cpu_line())
    default = choose().polar.ns_dtype
    table = measure(muon_inputs(args.depth, at, log=lambda line: print(line, flush=True)))
    print("relative Frobenius difference to float64's standard iteration, median (largest) over the matrices of a "
          f"shape; * = this machine's default ({default})")
    names = [dt + ("*" if dt == default else "") for dt in DTYPES]
    print(f"{'step':>4}  {'shape':<12} {'n':>2}  " + "  ".join(f"{n:>18}" for n in names))
    for step, rows in table.items():
        for shape, cells in rows.items():
            n = len(next(iter(cells.values())))
            text = "  ".join(f"{np.median(v):>8.1e} ({np.max(v):.1e})" for v in cells.values())
            print(f"{step:>4}  {str(shape):<12} {n:>2}  {text}")
    return table


if __name__ == "__main__":
    main()
