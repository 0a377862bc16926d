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


def reexec_with_hugepages() -> None:
    """Restart this process once with glibc's transparent huge pages for malloc.

    XLA:CPU allocates fresh large buffers every step; with 4 KiB pages each one page-faults in. With
    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 a 2K-token train step ran 19% faster on a 2-core machine
    (measured with one train step, interleaved). The tunable is read at process start, hence the
    re-exec; it is skipped when the user set GLIBC_TUNABLES, off Linux, or with
    FLAXCHAT_NO_HUGEPAGES=1.

    Keeping freed memory in the process too (adding glibc.malloc.arena_max=1, mmap_max=0 and
    trim_threshold=17179869184, so the step's buffers are not faulted in again) made the main job
    1-9% faster at 2,048 tokens per step on an Intel Xeon, but 7-8% slower at 16K tokens per step
    (gradient accumulation), and it held more memory; on AMD (Zen 5) it gained nothing at 2K and was
    4% slower at 16K. docs/cpu_performance.md has the runs. Set GLIBC_TUNABLES yourself to choose it.
    """
    import os
    if (not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ
            or os.environ.get("FLAXCHAT_NO_HUGEPAGES") == "1" or not getattr(sys, "orig_argv", None)):
        return
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # could not re-exec: run as we are
