"""A disk cache for what the data layer derives from its inputs: the Wikipedia dump's cleaned
pages and tokenized texts. Each costs seconds of pure Python on a slow CPU, and every run,
eval and study derives them again from the same bytes.

An entry is named by the sha256 of everything it derives from (the input's bytes, and the code
or tokenizer that derives it), so a changed input, parser or tokenizer makes a new entry and a
stale one is never read. An entry holds the sha256 of its payload: one that does not match
(a torn or edited file) is derived again and replaced. Entries are written to a temporary name
and renamed, so concurrent processes (test workers, a multi-host job) may share the directory.

Where: $QNPU_CACHE_DIR, else ~/.cache/qnpu_jax; QNPU_CACHE_DIR="" turns the cache off. A
directory that cannot be written leaves the cache off for that entry.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from qnpu_jax.files import write_bytes_atomic

CACHE_DIR_ENV = "QNPU_CACHE_DIR"


def cache_dir() -> Path | None:
    """The cache directory in force, or None when QNPU_CACHE_DIR is set to ""."""
    value = os.environ.get(CACHE_DIR_ENV)
    if value is None:
        return Path.home() / ".cache" / "qnpu_jax"
    return Path(value).expanduser() if value else None


def digest(*parts: bytes | str) -> str:
    """sha256 over `parts`, each length-prefixed (so ("ab", "c") and ("a", "bc") differ)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _read_entry(path: Path) -> bytes | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    head, sep, payload = raw.partition(b"\n")
    if not sep or head.decode("ascii", "replace") != hashlib.sha256(payload).hexdigest():
        return None
    return payload


def cached_bytes(kind: str, key: str, derive: Callable[[], bytes]) -> bytes:
    """The payload of entry `kind`-`key` (`key`: a `digest` of what it derives from), or
    `derive()`, stored there for the next caller."""
    directory = cache_dir()
    if directory is None:
        return derive()
    path = directory / f"{kind}-{key}"
    payload = _read_entry(path)
    if payload is not None:
        return payload
    payload = derive()
    entry = hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload
    with contextlib.suppress(OSError):  # a read-only or full disk: the value stands, uncached
        write_bytes_atomic(path, entry)
    return payload
