"""The one exception type for user mistakes.

A :class:`UnisonError` carries a single-line message that names the culprit
and the fix. The CLI prints it without a traceback and exits with code 2.
Numerical trouble is *not* a UnisonError: it is counted and logged.
"""


class UnisonError(Exception):
    """A user-facing error: bad input, missing file, unknown name."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # always one line


class Stopped(Exception):
    """A run stopped on a signal after saving a checkpoint; the CLI exits with ``code`` (143 for
    SIGTERM, 130 for SIGINT) after printing the message in one line."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
