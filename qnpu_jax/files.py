"""Atomic file writes (a reader sees the old file or the whole new one, never half of one),
JSON-lines reading with errors that name the file and line, outputs checked against inputs,
exclusive locks, bounded text reading (regular files only, at most a size cap), and a full disk
as one error."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from qnpu_jax.errors import QnpuError, StorageFullError, first_line
from qnpu_jax.limits import MAX_TEXT_BYTES, MIB

# Longest name a temporary sibling's stem may keep: `.STEM.tmp-PID-XXXXXXXX` stays below the
# usual 255-byte NAME_MAX even for a 255-byte final name.
_STEM_BYTES = 180


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def temp_stem(name: str) -> str:
    """`name`, or for a long one a bounded prefix and a hash of it: the stem of the temporary
    siblings (`.STEM.tmp-*`, `.STEM.old-*`) made while writing `name`."""
    raw = os.fsencode(name)
    if len(raw) <= _STEM_BYTES:
        return name
    head = raw[:64].decode("utf-8", "ignore")
    return f"{head}~{hashlib.sha256(raw).hexdigest()[:16]}"


def check_name_length(path: Path, what: str) -> None:
    """Refuse a final path component longer than its file system allows (before any work)."""
    path = Path(os.path.abspath(path))
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(path.name)) > limit:
        raise QnpuError(
            f"{what} {path}: the name is {len(os.fsencode(path.name))} bytes; this file system "
            f"allows at most {limit}"
        )


def check_outside(output: Path, inputs: Mapping[str, Path | str | None], what: str) -> None:
    """Refuse an output at or below one of the command's inputs (`inputs`: flag -> path):
    writing it would replace what the command reads."""
    target = Path(output).resolve()
    for flag, given in inputs.items():
        if given is None or not Path(given).exists():
            continue
        source = Path(given).resolve()
        if target == source or source in target.parents:
            raise QnpuError(
                f"{what} {output} is inside {flag} {given}: refusing to overwrite an input "
                "(write it elsewhere)"
            )


def make_output_dir(path: Path, what: str) -> list[Path]:
    """Create directory `path` (and missing parents); returns the directories it made,
    deepest first, for `remove_empty_dirs`. A dangling symlink or a file in the way is named."""
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise QnpuError(f"{what} {path} is a symlink to {os.readlink(path)}, which does not exist")
    if path.exists() and not path.is_dir():
        raise QnpuError(f"{what} {path} exists and is not a directory")
    made = []
    for p in (path, *path.parents):
        if p.exists() or p.is_symlink():
            break
        made.append(p)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:
        raise QnpuError(
            f"cannot create {what} {path}: {e.filename} is a file or a dangling symlink"
        ) from e
    return made


def remove_empty_dirs(made: list[Path]) -> None:
    """Remove the directories `make_output_dir` made, deepest first, while they are empty."""
    for p in made:
        try:
            p.rmdir()
        except OSError:
            return


@contextlib.contextmanager
def exclusive_lock(lock: Path, what: str) -> Iterator[None]:
    """Hold an exclusive `flock` on the file `lock` (created, holding this pid) for the block,
    then remove it; a lock another process holds is a QnpuError naming `what` and its pid."""
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise QnpuError(
                f"{what} is in use by another qnpu process (pid {holder}); wait for it to end"
            ) from None
        except OSError as e:
            os.close(fd)
            raise QnpuError(
                f"cannot lock {lock} ({e.strerror or e}), so {what} cannot be guarded against "
                "a second writer; use a file system that supports flock"
            ) from e
        except BaseException:
            os.close(fd)
            raise
        try:  # its last holder may have removed the file between our open and flock
            same = os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)  # while still held: a waiting process then locks a new file
        os.close(fd)


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
    fd, tmp = tempfile.mkstemp(prefix=f".{temp_stem(path.name)}.", dir=path.parent)
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


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_bytes_bounded(path: Path, *, what: str = "file", limit: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them (qnpu_jax.limits): a
    missing file, a FIFO, a device or a directory, or a larger file, is a QnpuError naming
    `what` and `path`. A FIFO is refused without blocking: it is opened non-blocking and
    checked before any read."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError as e:
        raise QnpuError(f"{what} {path} does not exist") from e
    except OSError as e:
        raise QnpuError(f"cannot read {what} {path}: {e.strerror or e}") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise QnpuError(
            f"cannot read {what} {path}: it is {_file_kind(info.st_mode)}, not a regular file"
        )
    too_big = QnpuError(
        f"cannot read {what} {path}: it is larger than the "
        f"{f'{limit // MIB} MiB' if limit % MIB == 0 else f'{limit} bytes'} that qnpu reads "
        f"({info.st_size} bytes; qnpu_jax.limits)"
    )
    if info.st_size > limit:
        os.close(fd)
        raise too_big
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise QnpuError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if len(data) > limit:  # it grew after the check
        raise too_big
    return data


def read_text(path: Path, *, what: str = "file", limit: int = MAX_TEXT_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (`read_bytes_bounded`); bytes that are not
    UTF-8, or NUL bytes (a binary or sparse file), are a QnpuError naming it."""
    data = read_bytes_bounded(path, what=what, limit=limit)
    if b"\0" in data:
        raise QnpuError(f"cannot read {what} {path}: it holds NUL bytes, so it is not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise QnpuError(
            f"cannot read {what} {path}: not UTF-8 text ({e.reason} at byte {e.start})"
        ) from e


def iter_jsonl(path: Path, what: str = "file") -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of every non-blank line of a JSON-lines file (`read_text`); a
    line that is not a JSON object is a QnpuError naming path:line."""
    path = Path(path)
    for lineno, line in enumerate(read_text(path, what=what).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QnpuError(f"{path}:{lineno}: not JSON: {e}") from e
        if not isinstance(row, dict):
            raise QnpuError(f"{path}:{lineno}: expected a JSON object")
        yield lineno, row


# errno values of a write that failed because the storage is full or a limit was reached
STORAGE_FULL = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "a file would exceed the file size limit (ulimit -f)",
}
# tensorstore (orbax's writer) reports an OS error inside a ValueError's text
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_FAILED_FILE = re.compile(r'(?:Failed writing|local file): "([^"]+)"')


def storage_full(e: BaseException) -> str | None:
    """What `e` (or an exception it was raised from) says when a write failed for want of
    space or a file size limit: an OSError's errno, or the OS error code in tensorstore's
    message; None for any other failure."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in STORAGE_FULL:
            return STORAGE_FULL[cur.errno]
        m = _OS_ERROR_CODE.search(str(cur))
        if m and int(m.group(1)) in STORAGE_FULL:
            return STORAGE_FULL[int(m.group(1))]
        cur = cur.__cause__ or cur.__context__
    return None


class _StorageFullFilter(logging.Filter):
    """Drops log records about a full-storage failure (orbax logs one, with a traceback, from
    every thread a failed checkpoint write ran in)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and storage_full(error) is not None:
            return False
        m = _OS_ERROR_CODE.search(record.getMessage())
        return not (m and int(m.group(1)) in STORAGE_FULL)


@contextlib.contextmanager
def storage_full_is_an_error(
    logger_names: tuple[str, ...] = ("absl", "asyncio"),
) -> Iterator[None]:
    """Within: a write that fails for want of space or a file size limit (ENOSPC, EDQUOT,
    EFBIG; directly or as orbax/tensorstore report it) is one StorageFullError saying so, and
    the loggers `logger_names` (orbax logs through absl; asyncio reports its writer tasks'
    other failures) drop their records about it. What was being written is left as it is: a
    run stays unsealed, and --resume continues it. After such a failure orbax's writer
    callbacks may still run on its closed event loop; their "Event loop is closed" reports
    (through sys.unraisablehook) are dropped too. Everything is restored on the way out (the
    `qnpu` command then ends at once: `cli.main`'s exit_on_failed_write)."""
    quiet = _StorageFullFilter()
    loggers = [logging.getLogger(name) for name in logger_names]
    for logger in loggers:
        logger.addFilter(quiet)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = partial(_drop_closed_loop_reports, previous_hook)
    try:
        yield
    except QnpuError:
        raise
    except Exception as e:
        reason = storage_full(e)
        if reason is None:
            raise
        file = e.filename if isinstance(e, OSError) else None
        match = _FAILED_FILE.search(str(e))
        where = file or (match.group(1) if match else first_line(e, 200))
        raise StorageFullError(
            f"writing failed: {reason} ({where}); free space or raise the limit and run the "
            "command again (`qnpu quantize --resume` continues an unfinished run)"
        ) from e
    finally:
        sys.unraisablehook = previous_hook
        for logger in loggers:
            logger.removeFilter(quiet)


def _drop_closed_loop_reports(previous: Any, unraisable: Any) -> None:
    """sys.unraisablehook: tensorstore reports there an exception its callback raised; a
    callback scheduling onto orbax's event loop after a failed write closed it says nothing
    a user can act on."""
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return
    previous(unraisable)
