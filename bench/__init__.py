"""Benchmarks: each prints its figures beside a baseline timed in the same run."""

import argparse
import math
import statistics
import time


def interleaved(runs: dict, args: tuple, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each compiled function in `runs` on `args`, over `rounds` rounds that
    alternate the order (forwards, then backwards): a shared host drifts, so no variant gets all
    the quiet minutes."""
    import jax
    names = list(runs)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            jax.block_until_ready(runs[name](*args))
            times[name].append(time.perf_counter() - t)
    return times


def parse_rounds(argv, doc: str, default: int) -> argparse.Namespace:
    """The command line of a bench whose one option is how many interleaved rounds to time."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=default, help="interleaved rounds, median reported (default: %(default)s)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1.")
    return args


def median_interval(values, level: float = 0.95) -> tuple[float, float, float]:
    """The median of `values` and an interval that holds the true median with probability `level`,
    whatever the noise's shape: the order statistics x_(k) and x_(n+1-k), with k the largest rank
    that leaves at most (1 - level)/2 of Binomial(n, 1/2) below it. With too few values for that
    (n < 6 at 95%) the interval is their whole range."""
    v = sorted(float(x) for x in values)
    n = len(v)
    if n == 0:
        raise ValueError("no values")
    tail, below, k = (1 - level) / 2, math.comb(n, 0) / 2 ** n, 0
    while k < n and below <= tail:
        k += 1
        below += math.comb(n, k) / 2 ** n
    rank = max(k, 1)  # k = 0: too few values, the whole range
    return statistics.median(v), v[rank - 1], v[n - rank]


def relative_difference(out, ref) -> float:
    """||out - ref|| / ||ref|| (Frobenius), in float64: how far a form's result lands from a reference."""
    import numpy as np
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref))
