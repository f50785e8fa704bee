"""The one exception type for bad user input: the CLI prints its message and exits non-zero."""


class QnpuError(Exception):
    """A user-facing error: a wrong path, a corrupt file, an unsupported config, bad data."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of a library's exception message (its type name when empty): enough to
    name the problem in a QnpuError without a library's whole traceback or dump."""
    lines = str(e).strip().splitlines()
    return lines[0][:limit] if lines else type(e).__name__


def some_of(names: list[str], shown: int = 3) -> str:
    """The first `shown` names and how many more, for an error message."""
    rest = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {rest} more" if rest > 0 else "")
