"""Atomic file writes (a reader sees the old file or the whole new one, never half of one) and
JSON-lines reading with errors that name the file and line."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qnpu_jax.errors import QnpuError


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(path: Path) -> None:
    """Raise QnpuError now if `path` could not be written later (a directory, or under a file)."""
    path = Path(path)
    if path.is_dir():
        raise QnpuError(f"{path} is a directory, not a file path")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise QnpuError(f"cannot write {path}: {parent} is not a writable directory")


def write_bytes_atomic(path: Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp makes it private (0600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: Path, obj: Any) -> Path:
    return write_bytes_atomic(path, (json.dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSON-lines file; a line that is not
    a JSON object is a QnpuError naming path:line."""
    path = Path(path)
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QnpuError(f"{path}:{lineno}: not JSON: {e}") from e
        if not isinstance(row, dict):
            raise QnpuError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, row
