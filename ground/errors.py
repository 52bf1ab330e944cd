"""User-facing errors: a one-line message and an exit code, never a traceback."""

from __future__ import annotations


class AmkError(Exception):
    """A problem caused by the user's input (bad file, unknown model, unsupported feature).

    The CLI prints ``str(err)`` on one line and exits with ``exit_code`` (2 by default:
    unusable input; 1 is reserved for "ran, and the result is a failure").
    """

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code
