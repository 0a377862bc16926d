"""Where a compiled program's time goes on XLA:CPU: its per-kernel trace events, summed by kind.

    enable()                                   # before the first computation (XLA_FLAGS is read then)
    per_kind, kernels = kernel_times(run, hlo_text, calls=n)
    print_table("one decode step", per_kind, kernels)

`run()` executes the program `calls` times under `jax.profiler`; only events named like an
instruction of `hlo_text` (the compiled module's `as_text()`) count, so host work and other programs
are left out, and so are while loops (their event spans their body's kernels). Matrix products are grouped by their output shape, everything else by its name
without the `.N` suffix (fusion, copy, transpose, ...). Traced runs are slower than untraced ones:
read the shares, not the absolute times.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax


def enable() -> None:
    """Ask XLA:CPU to emit per-kernel trace events (read when the CPU backend starts)."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()


def kernel_times(run, hlo_text: str, calls: int = 1):
    """(microseconds per call by kind, the kernel names of each kind) from one traced `run()`."""
    folder = tempfile.mkdtemp(prefix="flaxchat-profile-")
    jax.profiler.start_trace(folder, create_perfetto_trace=True)
    run()
    jax.profiler.stop_trace()
    files = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
    events = []
    if files:
        with gzip.open(files[0]) as f:
            events = json.load(f)["traceEvents"]
    names = set(re.findall(r"%(\S+) = ", hlo_text))
    out_shape = dict(re.findall(r"%(dot[.\d]*) = (\S+?)\{", hlo_text))
    per_kind, kernels = collections.Counter(), collections.defaultdict(set)
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name not in names or name.startswith("while"):
            continue  # a while loop's event spans the kernels of its body, which are counted themselves
        kind = f"dot -> {out_shape.get(name, '?')}" if name.startswith("dot") else re.sub(r"\.\d+$", "", name)
        per_kind[kind] += e["dur"] / max(calls, 1)
        kernels[kind].add(name)
    return per_kind, kernels


def print_table(what: str, per_kind, kernels, top: int = 8) -> None:
    total = sum(per_kind.values())
    if not total:
        print("profile: no per-kernel events (this jaxlib does not trace XLA:CPU kernels)")
        return
    # On XLA:CPU most products run as YNNPACK fusions (`ynn_fusion`), the rest as plain `dot`s.
    dots = sum(v for k, v in per_kind.items() if k.startswith("dot") or "ynn" in k)
    print(f"profile of {what} (traced, so slower than untraced): {total:,.0f} us in "
          f"{sum(len(v) for v in kernels.values())} kernels, matrix products {dots / total:.0%}")
    for kind, us in per_kind.most_common(top):
        print(f"  {us:9.0f} us {us / total:6.1%}  {len(kernels[kind]):4d} x {kind}")
