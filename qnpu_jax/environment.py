"""What a report records about where it was measured."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from qnpu_jax.version import __version__


def environment_info() -> dict[str, Any]:


    device = jax.devices()[0]
    return {
        "qnpu_jax": __version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }


def study_command(name: str, argv: Sequence[str] | None = None) -> str:
    """The command line a study's report records: `qnpu study NAME ARGS` (argv None: the
    arguments after the study's name on this process's command line)."""
    if argv is None:
        args = sys.argv[1:]
        if name in args:
            args = args[args.index(name) + 1 :]
    else:
        args = list(argv)
    return shlex.join(["qnpu", "study", name, *args])


def script_command(script: str, argv: Sequence[str] | None = None) -> str:
    """The command line a report records to be re-run from the repository root:
    `python scripts/NAME.py ARGS` (`script` is the script's `__file__`; argv None: sys.argv)."""
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", f"scripts/{Path(script).name}", *args])
