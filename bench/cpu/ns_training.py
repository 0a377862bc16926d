"""Whether Polar Express's precision changes what the main job learns: validation bpb per dtype.

    python -m bench.cpu.ns_training                                  # 600 steps, seeds 0-3, ~40 min
    python -m bench.cpu.ns_training --steps 200 --seeds 0 --dtypes float32,bfloat16

Runs the main job (`scripts.run_tinystories`, depth 4 on the built-in stories, no export) once per
seed and `--ns-dtype`, each in its own process as a user would start it, and prints the final
validation bits per byte of each run, each dtype's mean, and its mean difference to float32's run
of the same seed (the seed sets the initialisation and the data order, so the seeds are the noise
to compare a difference with). `bench.cpu.ns_accuracy` measures how far each dtype's update is from
float64; this bench says whether the trained model notices. Flags after `--` go to every run.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from flaxchat.errors import UserError, cli_main
from flaxchat.paths import RunFolder

DTYPES = ("float32", "bf16-products", "bf16-operands", "bfloat16")
SECONDS_PER_STEP = 5.0  # a bound on one run: far above the ~0.3 s a step of the main job takes here


def final_val_bpb(run_dir: str) -> float:
    """The last validation bpb in a run folder's metrics.jsonl."""
    from flaxchat.report import MetricsLog
    vals = [r["val_bpb"] for r in MetricsLog(RunFolder(run_dir).metrics).read() if r.get("kind") == "val"]
    if not vals:
        raise UserError(f"{run_dir} has no validation figure.")
    return vals[-1]


def train(run_dir: str, dtype: str, seed: int, steps: int, depth: int, extra: list[str]) -> float:
    """One main-job run in a fresh process; its final validation bpb."""
    cmd = [sys.executable, "-m", "scripts.run_tinystories", f"--depth={depth}", f"--steps={steps}",
           f"--ns-dtype={dtype}", f"--seed={seed}", f"--run-dir={run_dir}", "--no-export", *extra]
    limit = 600 + SECONDS_PER_STEP * steps
    with open(run_dir + ".log", "w") as log:
        try:
            done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            raise UserError(f"the run with --ns-dtype={dtype} --seed={seed} did not finish in {limit:.0f} s; "
                            f"its output is in {run_dir}.log.") from None
    if done.returncode != 0:
        raise UserError(f"the run with --ns-dtype={dtype} --seed={seed} failed (exit {done.returncode}); "
                        f"its output is in {run_dir}.log.")
    return final_val_bpb(run_dir)


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=600, help="training steps per run (default: %(default)s)")
    p.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds (default: %(default)s)")
    p.add_argument("--dtypes", default="float32,bf16-operands,bfloat16",
                   help=f"comma-separated --ns-dtype values, float32 first (default: %(default)s; any of {', '.join(DTYPES)})")
    p.add_argument("--depth", type=int, default=4, help="model depth (default: %(default)s, the main job's)")
    p.add_argument("--keep", default=None, help="folder for the run folders and logs (default: a temporary one, removed)")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, not {args.seeds!r}")
    if dtypes[0] != "float32" or any(dt not in DTYPES for dt in dtypes):
        p.error(f"--dtypes starts with float32 and names only {', '.join(DTYPES)}, not {args.dtypes!r}")
    if len(set(seeds)) < len(seeds) or len(set(dtypes)) < len(dtypes):
        p.error("--seeds and --dtypes name each value once")
    if args.steps < 1 or args.depth < 1:
        p.error("--steps and --depth are at least 1")

    from bench.train_throughput import cpu_line
    print(cpu_line(), flush=True)
    bpb = {dt: {} for dt in dtypes}
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or tmp
        os.makedirs(folder, exist_ok=True)
        for seed in seeds:  # seeds outermost: a drifting host shifts whole seeds, not whole dtypes
            for dt in dtypes:
                t, run_dir = time.perf_counter(), os.path.join(folder, f"{dt}_seed{seed}")
                print(f"seed {seed} {dt}: training {args.steps} steps (its output: {run_dir}.log)", flush=True)
                bpb[dt][seed] = train(run_dir, dt, seed, args.steps, args.depth, extra)
                print(f"seed {seed} {dt}: val bpb {bpb[dt][seed]:.5f} ({time.perf_counter() - t:.0f} s)", flush=True)
    print(f"validation bpb after {args.steps} steps (depth {args.depth}); diff = mean over seeds of (dtype - float32)")
    print(f"{'dtype':<14}" + "".join(f"{'seed ' + str(s):>10}" for s in seeds) + f"{'mean':>10}{'diff':>10}")
    for dt in dtypes:
        diffs = [bpb[dt][s] - bpb["float32"][s] for s in seeds]
        print(f"{dt:<14}" + "".join(f"{bpb[dt][s]:>10.5f}" for s in seeds)
              + f"{np.mean(list(bpb[dt].values())):>10.5f}{np.mean(diffs):>+10.5f}")
    return bpb


if __name__ == "__main__":
    raise SystemExit(cli_main(main))
