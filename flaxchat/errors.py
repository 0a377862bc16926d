"""User-facing errors and the one wrapper every command-line entry point uses.

A mistake by the user (a bad flag value, a missing file, an impossible config) raises `UserError`
with one sentence that says what was wrong and what to do. `cli_main` turns it into that sentence
on stderr and a non-zero exit, never a traceback. Bugs still raise normally.
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence


class UserError(Exception):
    """A problem the user can fix; its message is one clear sentence."""

    exit_code = 2


def cli_main(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)`; print a UserError as one line on stderr and return its exit code."""
    try:
        result = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result) if isinstance(result, int) else 0


# glibc malloc for a training process: transparent huge pages, and freed memory kept for the next
# step rather than returned to the kernel (no mmap'd chunks, no trimming). See `tune_cpu_runtime`.
MALLOC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:"
                   "glibc.malloc.trim_threshold=17179869184")


def tune_cpu_runtime() -> None:
    """Set up this process's memory for training on a CPU: restart it once with MALLOC_TUNABLES,
    then run each jitted call on the calling thread (JAX's CPU async dispatch off).

    XLA:CPU takes one block for a train step's temporaries (315 MiB at the main job's depth 4 and
    2,048 tokens) every step and frees it after. Allocated on a dispatch worker thread, that block
    is larger than a thread's malloc heap can hold, so glibc maps it fresh and unmaps it each
    step, and the kernel zeroes and faults it in again: ~600 huge-page faults and 57-80 ms of
    system CPU per step on a 2-core Intel Xeon, 10% of the step's CPU time. Run on the main thread
    it comes from the main heap, which these tunables keep: 0-18 faults and 3-8 ms per step, and
    the step 7-15% faster at 2,048 tokens (within the noise at 16K tokens per step, where the block is
    reused over 16 micro-batches); peak RSS unchanged. Huge pages alone made a 2K-token step 19%
    faster than 4 KiB pages on a 2-core AMD EPYC. docs/cpu_performance.md has the runs.
    (Keeping freed memory with the step still on a worker thread needs glibc.malloc.arena_max=1,
    one heap for every thread: 7-8% slower at 16K tokens and ~1.7x the peak RSS.)

    Only training entry points call this. A call returns when its step is done, so Python prepares
    the next step after it (~6 ms at depth 4) instead of beside it, and batch-1 decoding reads a few
    percent slower; the chat CLI and web server keep async dispatch. Skipped off Linux, when the
    user set GLIBC_TUNABLES (their choice is kept, with async dispatch) or with
    FLAXCHAT_NO_CPU_TUNING=1.
    """
    import os
    if (not sys.platform.startswith("linux") or os.environ.get("FLAXCHAT_NO_CPU_TUNING") == "1"
            or not getattr(sys, "orig_argv", None)):
        return
    if os.environ.get("GLIBC_TUNABLES") == MALLOC_TUNABLES:  # this process runs with them
        import jax
        jax.config.update("jax_cpu_enable_async_dispatch", False)  # read when the CPU client starts
        return
    if "GLIBC_TUNABLES" in os.environ:
        return
    env = dict(os.environ, GLIBC_TUNABLES=MALLOC_TUNABLES)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # could not re-exec: run as we are
