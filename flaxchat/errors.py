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
