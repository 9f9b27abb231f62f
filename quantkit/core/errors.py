"""The one exception type the CLI turns into a one-line message and exit status 2.

Raise `QuantkitError` for anything the user can fix (bad input, bad options, a corrupt file);
any other exception is an internal error (exit 1).
"""

__all__ = ["QuantkitError"]


class QuantkitError(Exception):
    """A user-facing error: the message names the file and tensor and fits on one line."""
