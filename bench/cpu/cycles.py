"""Where this process's CPU time goes while it runs a step: Linux `perf` samples, grouped by kind.

    usage, shares = sample(lambda: step(x, y).block_until_ready(), calls=10)
    print_cycles("config A, one step", usage, shares)

The XLA:CPU trace (bench/profiling.py) times kernels. It cannot see what the step costs outside
them: the operating system zeroing the fresh pages of the buffers XLA:CPU maps every step, malloc,
the thread pool. And on two cores its kernel times overlap. Sampled CPU time adds up over every
thread, so each kind's share is a share of the process's CPU time. Beside it, getrusage gives the
user and system CPU time per call, the page faults, how busy the cores were ((user + system) over
wall time x cores) and, on a virtual machine, how much of their time the host gave to something
else (steal, from /proc/stat). Busy well below 100% with no steal: the step waited on its longest
chain of kernels rather than on work; with steal, the host was busy and the timings are noisy.

Needs `perf` on PATH and allowed to read this process (kernel.perf_event_paranoid <= 2 for user
space; the kernel's own share needs <= 1 or root). Without it `sample` says why and returns None.
"""

from __future__ import annotations

import collections
import os
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time

# (kind, test on (shared object, symbol, in the kernel)); the first that matches. The symbols are
# those of the libraries jaxlib ships: YNNPACK (XLA:CPU's dots and many reductions, `ynn::`), the
# code XLA:CPU generates (a `[JIT]` object, addresses only), Eigen's thread pool, glibc.
KINDS = (
    ("products, fp32 (microkernels)", lambda o, s, k: not k and re.search(r"dot_fp32|sgemm|gemm.*f32", s)),
    ("products, bf16 operands", lambda o, s, k: not k and re.search(r"dot_bf16|bf16.*gemm|amx", s)),
    ("operand packing, transposes", lambda o, s, k: not k and re.search(r"transpose|interleave|pack", s)),
    ("YNNPACK elementwise, reductions", lambda o, s, k: not k and s.startswith(("ynn::", "slinky::"))),
    ("XLA-generated loops", lambda o, s, k: o.startswith("[JIT]")),
    ("OS: zeroing, faulting in pages", lambda o, s, k: k and re.search(r"clear_page|fault|huge|zero|page", s)),
    ("OS: other", lambda o, s, k: k),
    ("malloc, free, memcpy", lambda o, s, k: o.startswith("libc") and re.search(r"malloc|free|mem|alloc", s)),
    ("thread pool", lambda o, s, k: re.search(r"Eigen::|ThreadPool|RunQueue|futex|sched_yield", s)),
    ("Python", lambda o, s, k: "python" in o.lower()),
)
_LINE = re.compile(r"^\s*([\d.]+)%\s+(\[JIT\] tid \d+|\S+)\s+\[(.)\]\s+(.*?)\s*$")


def kind_of(shared_object: str, symbol: str, in_kernel: bool) -> str:
    for kind, test in KINDS:
        if test(shared_object, symbol, in_kernel):
            return kind
    return "other"


def parse_report(text: str) -> dict[str, float]:
    """Percent of the samples per kind, from `perf report --sort dso,symbol --stdio`."""
    shares = collections.Counter()
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            pct, obj, mark, symbol = m.groups()
            shares[kind_of(obj, symbol, mark == "k")] += float(pct)
    return dict(shares.most_common())


def unavailable() -> str | None:
    """Why `perf` cannot sample this process here, or None."""
    if not shutil.which("perf"):
        return "`perf` is not on PATH (Linux: the linux-tools package of your kernel)"
    try:
        level = int(open("/proc/sys/kernel/perf_event_paranoid").read())
    except (OSError, ValueError):
        return "/proc/sys/kernel/perf_event_paranoid is unreadable: not Linux, or perf events are off"
    if level > 2 and os.geteuid() != 0:
        return f"kernel.perf_event_paranoid is {level}; sampling one's own process needs 2 or less"
    return None


def _cpu_times() -> list[int] | None:
    """The machine's CPU time so far by state (/proc/stat: user, nice, system, idle, iowait, irq,
    softirq, steal), or None off Linux."""
    try:
        return [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def sample(run, calls: int = 5, frequency: int = 499, timeout: float = 600.0):
    """Run `run()` `calls` times under `perf record` on this process; (usage, shares) or None.
    `frequency`: samples per second per thread (perf's default is 4,000); five steps of ~0.7 s on
    two cores give ~3,500 samples at 499."""
    why = unavailable()
    if why:
        print(f"cycles: not sampled: {why}.")
        return None
    with tempfile.TemporaryDirectory(prefix="flaxchat-cycles-") as folder:  # removed on every way out
        data = os.path.join(folder, "perf.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-F", str(frequency), "-o", data, "-p", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # perf attaches to every thread before the first sample
        if perf.poll() is not None:
            print(f"cycles: not sampled: perf record exited: {perf.stderr.read().decode().strip()[:300]}")
            return None
        before, machine, t = resource.getrusage(resource.RUSAGE_SELF), _cpu_times(), time.perf_counter()
        try:
            for _ in range(calls):
                run()
        finally:
            wall = time.perf_counter() - t
            after, machine_after = resource.getrusage(resource.RUSAGE_SELF), _cpu_times()
            perf.send_signal(signal.SIGINT)
            try:
                perf.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                perf.kill()
                perf.wait()
        report = subprocess.run(["perf", "report", "-i", data, "--sort", "dso,symbol", "--stdio"],
                                capture_output=True, text=True, timeout=timeout)
    user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    usage = dict(wall_ms=1e3 * wall / calls, user_ms=1e3 * user / calls, system_ms=1e3 * system / calls,
                 faults=(after.ru_minflt - before.ru_minflt) / calls, busy=(user + system) / (wall * cores))
    if machine and machine_after:  # a virtual machine's host running something else on our cores
        spent = [b - a for a, b in zip(machine, machine_after)]
        usage["steal"] = spent[7] / max(sum(spent), 1)
    return usage, parse_report(report.stdout)


def print_cycles(what: str, usage: dict, shares: dict, top: int = 10) -> None:
    print(f"cycles of {what} (perf samples of this process): {usage['wall_ms']:,.1f} ms wall, "
          f"{usage['user_ms']:,.1f} ms user + {usage['system_ms']:,.1f} ms system CPU per call, "
          f"{usage['faults']:,.0f} page faults per call, cores {100 * usage['busy']:.0f}% busy"
          + (f", {100 * usage['steal']:.0f}% of their time taken by the host (steal)" if "steal" in usage else ""))
    for kind, pct in list(shares.items())[:top]:
        print(f"  {pct:5.1f}%  {kind}")
