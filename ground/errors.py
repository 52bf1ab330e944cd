"""User-facing errors: a one-line message and an exit code, never a traceback."""

from __future__ import annotations

import os
import sys
from typing import Callable, NoReturn


class AmkError(Exception):
    """A problem caused by the user's input (bad file, unknown model, unsupported feature).

    The CLI prints ``str(err)`` on one line and exits with ``exit_code`` (2 by default:
    unusable input; 1 is reserved for "ran, and the result is a failure").
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def run_main(main: Callable[[], int | None], name: str) -> NoReturn:
    """Run a script's ``main()`` and exit with what it returns. An AmkError (e.g. a result
    file that cannot be written) ends it with one line ``NAME: error: MESSAGE`` on stderr
    and the error's exit code, never a traceback."""
    try:
        code = main()
    except AmkError as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        raise SystemExit(err.exit_code) from None
    raise SystemExit(code)


def rank_exit_code(name: str, body: Callable[[], int]) -> int:
    """Run one rank's part of a multi-process script and return its exit code: ``body()``'s,
    or, for an AmkError, the error's after one line ``NAME: error: rank R: MESSAGE`` on stderr
    (``rank R: `` when the environment names the rank, as torchrun's ``RANK`` does), or 130
    after ``NAME: interrupted`` for Ctrl-C; never a traceback."""
    try:
        return body()
    except AmkError as err:
        rank = os.environ.get("RANK")
        print(f"{name}: error: {'rank ' + rank + ': ' if rank else ''}{err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
