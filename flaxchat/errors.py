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


# glibc malloc tunables for XLA:CPU (read only at process start). hugetlb=1: transparent huge pages
# for malloc'd memory. The rest keep freed memory in the process: XLA:CPU allocates a fresh buffer
# arena for every step (314 MB for config A at 2K tokens), which glibc would otherwise unmap and map
# again, and every page of it would fault in again (88,900 faults a step with 4 KiB pages, 0 with
# these). One arena, no mmap'd chunks, no trimming. docs/cpu_performance.md has the measurements
# (an Intel Xeon with AMX: the main job 4-8% faster; AMD Zen 5: no change).
GLIBC_TUNABLES = ("glibc.malloc.hugetlb=1:glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                  "glibc.malloc.trim_threshold=17179869184")


def reexec_with_hugepages() -> None:
    """Restart this process once with `GLIBC_TUNABLES` above (huge pages, memory kept between steps).

    XLA:CPU allocates fresh large buffers every step; with 4 KiB pages each one page-faults in. With
    glibc.malloc.hugetlb=1 alone a 2K-token train step ran 19% faster on a 2-core machine (measured
    with one train step, interleaved). The tunables are read at process start, hence the re-exec; it
    is skipped when the user set GLIBC_TUNABLES, off Linux, or with FLAXCHAT_NO_HUGEPAGES=1.
    """
    import os
    if (not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ
            or os.environ.get("FLAXCHAT_NO_HUGEPAGES") == "1" or not getattr(sys, "orig_argv", None)):
        return
    env = dict(os.environ, GLIBC_TUNABLES=GLIBC_TUNABLES)
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError:
        return  # could not re-exec: run as we are
