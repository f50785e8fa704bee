"""The one exception type for bad user input: the CLI prints its message and exits non-zero."""

import reprlib


class QnpuError(Exception):
    """A user-facing error: a wrong path, a corrupt file, an unsupported config, bad data."""


class StorageFullError(QnpuError):
    """A write failed for want of space or a file size limit (ENOSPC, EDQUOT, EFBIG)."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of a library's exception message (its type name when empty): enough to
    name the problem in a QnpuError without a library's whole traceback or dump."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


def some_of(names: list[str], shown: int = 3) -> str:
    """The first `shown` names and how many more, for an error message."""
    rest = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {rest} more" if rest > 0 else "")


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel = 3
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 120
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 8


def shown(value: object, limit: int = 200) -> str:
    """`repr(value)` for an error message, at most `limit` characters however large or deeply
    nested `value` is (a YAML alias bomb is never expanded): nested containers, long strings
    and long lists are elided with '...'."""
    text = _SHOWN.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
