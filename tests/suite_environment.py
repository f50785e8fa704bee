"""The suite's environment, set when tests/conftest.py imports this, before JAX is imported,
so that the test processes, their pytest-xdist workers and every process they start share it."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# One XLA compilation cache for the session and every process it starts (before JAX is
# imported, so the CLI subprocesses inherit it). The suite is bound by compiling the same
# programs again: after each module's `jax.clear_caches`, in each `qnpu` subprocess, for each
# new jit of the same function. The cache keys on the program and the compiler, so a hit runs
# the very executable a miss would have built.
# Under pytest-xdist the controller runs this first and its workers inherit the directory,
# so they share it too. A size cap turns on JAX's file lock around the cache's reads and
# writes: without it a worker can read an entry another is still writing.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="qnpu-tests-xla-cache-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(16 * 2**30))
# XLA's optimizations off: the suite's time is mostly XLA compiling small programs once each,
# and its claims (equivalences, bit-exact integer engines) hold at any optimization level.
# Tests that must see what a user runs at the default level mark themselves `xla_optimized`
# (below), and README's examples run in the user's environment (`user_environment`).
if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
# The same for the data layer's cache (the parsed Wikipedia dump, token ids): the session's
# own, shared by its workers and subprocesses, and not the user's ~/.cache.
if "QNPU_CACHE_DIR" not in os.environ:
    _DATA_CACHE = tempfile.mkdtemp(prefix="qnpu-tests-data-cache-")
    atexit.register(shutil.rmtree, _DATA_CACHE, ignore_errors=True)
    os.environ["QNPU_CACHE_DIR"] = _DATA_CACHE
