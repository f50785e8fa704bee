"""What a report records about where it was measured."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

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


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 FLOP/s of a jitted n×n×n matmul on the default device: the machine's
    speed, against which a benchmark's or a test suite's time is read (the CPUs CI runs on
    differ by 3× here)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


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
