"""Where a compiled program's time goes on XLA:CPU: its per-kernel trace events, summed by kind.

    enable()                                   # before the first computation (XLA_FLAGS is read then)
    per_kind, kernels = kernel_times(run, hlo_text, calls=n)
    print_table("one decode step", per_kind, kernels)

`run()` executes the program `calls` times under `jax.profiler`; only events named like an
instruction of `hlo_text` (the compiled module's `as_text()`) count, so host work and other programs
are left out, and so are while loops (their event spans their body's kernels). A kernel is grouped
by what it computes, read from its fused computation: one that holds a product as `dot` and the
product's output shape (`bf16 operands` when they are), everything else by its name without the
`.N` suffix, its output shape and the operations inside it. On XLA:CPU most products and most
reductions both run as YNNPACK fusions (`ynn_fusion`); grouped by name alone, one row held 78% of
a train step, the cross-entropy's and the norms' reductions among its products.

Traced runs are slower than untraced ones: read the shares, not the absolute times. On two cores
XLA:CPU runs independent kernels side by side and their times overlap; pinned to one core
(`taskset -c 0 python -m ...`) every kernel runs alone and the times add up to the step.
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
    kinds = kernel_kinds(hlo_text)
    per_kind, kernels = collections.Counter(), collections.defaultdict(set)
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or name not in kinds or name.startswith("while"):
            continue  # a while loop's event spans the kernels of its body, which are counted themselves
        per_kind[kinds[name]] += e["dur"] / max(calls, 1)
        kernels[kinds[name]].add(name)
    return per_kind, kernels


_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? (\S+?)\((.*)$", re.M)
_IGNORED_OPS = {"parameter", "constant", "bitcast", "broadcast", "reshape", "tuple", "get-tuple-element"}


def kernel_kinds(hlo_text: str) -> dict[str, str]:
    """Each instruction of a compiled module's text -> the kind its kernel is summed under."""
    bodies = {}  # computation name -> its instructions' (name, shape, op, rest of line)
    for block in re.split(r"\n(?=\S)", hlo_text):
        head = re.match(r"(?:ENTRY )?%(\S+) ", block)
        if head:
            bodies[head.group(1)] = _INSTRUCTION.findall(block)
    kinds = {}
    for instructions in bodies.values():
        for name, shape, op, rest in instructions:
            called = re.search(r"calls=%([\w.\-]+)", rest)
            inner = bodies.get(called.group(1), []) if called else [(name, shape, op, rest)]
            dots = [(s, r) for _, s, o, r in inner if o == "dot"]
            if dots:
                dot_shape, dot_rest = dots[0]
                operands = {n for n in re.findall(r"%([\w.\-]+)", dot_rest.split(")")[0])}
                scope = inner if called else instructions  # a plain dot's operands are its neighbours
                bf16 = any(s.startswith("bf16") for n, s, _, _ in scope if n in operands)
                kinds[name] = f"dot {dot_shape}" + (" (bf16 operands)" if bf16 else "")
            else:
                ops = sorted({o for _, _, o, _ in inner} - _IGNORED_OPS)
                base = re.sub(r"\.\d+$", "", name)
                kinds[name] = f"{base} {shape}" + (f" [{','.join(ops)}]" if called else "")
    return kinds


def print_table(what: str, per_kind, kernels, top: int = 8) -> None:
    total = sum(per_kind.values())
    if not total:
        print("profile: no per-kernel events (this jaxlib does not trace XLA:CPU kernels)")
        return
    dots = sum(v for k, v in per_kind.items() if k.startswith("dot "))
    print(f"profile of {what} (traced, so slower than untraced): {total:,.0f} us in "
          f"{sum(len(v) for v in kernels.values())} kernels, matrix products {dots / total:.0%}")
    for kind, us in per_kind.most_common(top):
        print(f"  {us:9.0f} us {us / total:6.1%}  {len(kernels[kind]):4d} x {kind}")
