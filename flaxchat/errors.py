"""User-facing errors and the one wrapper every command-line entry point uses.

A mistake by the user (a bad flag value, a missing file, an impossible config) raises `UserError`
with one sentence that says what was wrong and what to do. `cli_main` turns it into that sentence
on stderr and a non-zero exit, never a traceback. Bugs still raise normally. A stage stopped on a
signal ends with its ExitCode (`Preempted`: 75, Ctrl-C: 130), and under a supervisor that asks for it
the process writes its stacks on SIGUSR1 (`listen_for_stack_dumps`).
"""

from __future__ import annotations

import enum
import faulthandler
import os
import signal
import sys
import threading
from typing import Callable, Sequence


class ExitCode(enum.IntEnum):
    """Why a stage's process ended: what launchers and managed jobs recover by (docs/deployment.md).

    A preempted run resumes without counting as a failure; a user error is not retried; a hang had
    its stacks written into the run folder first."""

    FINISHED = 0
    CRASHED = 1  # an uncaught exception: Python's own exit code
    USER_ERROR = 2  # one sentence on stderr; running it again fails the same way
    PREEMPTED = 75  # sysexits' EX_TEMPFAIL: the step was saved on the notice; run it again
    HUNG = 124  # as timeout(1) exits: a step or the distributed start stalled past its deadline
    STOPPED = 130  # 128 + SIGINT: the user stopped it (Ctrl-C)


class Preempted(BaseException):
    """A stop notice (SIGTERM) was acted on: the step was saved and the process ends with
    ExitCode.PREEMPTED. A BaseException, as KeyboardInterrupt is, so no `except Exception` keeps
    the loop going."""

    exit_code = ExitCode.PREEMPTED


class UserError(Exception):
    """A problem the user can fix; its message is one clear sentence."""

    exit_code = ExitCode.USER_ERROR


# A supervisor (flaxchat/runner/worker.py) names a folder here; the process then writes every thread's
# Python stack to <folder>/stacks-<pid>.txt when sent SIGUSR1: what `worker.py dump` gathers from a
# hung run before it is killed. From the first line of main, so a hang in jax.distributed.initialize
# shows too.
STACKS_ENV = "FLAXCHAT_STACKS_DIR"
_stacks_file = None  # kept open: faulthandler writes to its descriptor from the signal handler


def listen_for_stack_dumps() -> None:
    global _stacks_file
    folder = os.environ.get(STACKS_ENV)
    if not folder or _stacks_file is not None or threading.current_thread() is not threading.main_thread():
        return
    try:
        _stacks_file = open(os.path.join(folder, f"stacks-{os.getpid()}.txt"), "w")
    except OSError:
        return  # a folder gone or read-only: run on, without stacks on demand
    faulthandler.register(signal.SIGUSR1, file=_stacks_file, all_threads=True)


def cli_main(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> int:
    """Run `main(argv)`; print a UserError as one line on stderr and return its exit code (a stop
    on a signal returns ExitCode.PREEMPTED or STOPPED)."""
    listen_for_stack_dumps()
    try:
        result = main(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.STOPPED
    except Preempted as e:
        print(f"{e}: run the same command to resume", file=sys.stderr)
        return e.exit_code
    return int(result) if isinstance(result, int) else 0
