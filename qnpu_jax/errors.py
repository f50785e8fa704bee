"""The one exception type for bad user input: the CLI prints its message and exits non-zero."""


class QnpuError(Exception):
    """A user-facing error: a wrong path, a corrupt file, an unsupported config, bad data."""
