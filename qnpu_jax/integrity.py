"""One digest over a manifest that lists every file of a directory by sha256 and size.

Integer artifacts and run directories both carry such a manifest. The manifest's own numbers
(graph constants, encodings, config) are covered by its `digest`, and each listed file by its
entry, so one check before use covers everything a reader trusts. The digest guards against
corruption and hand edits, not against someone who re-seals on purpose.

Standard library only (and `qnpu_jax.files`): the numpy emulator imports this through the
artifact reader.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import temp_stem

DIGEST_KEY = "digest"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a sha256 digest as hex, lower case


def canonical_json(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def manifest_digest(doc: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of `doc` without its digest key."""
    return hashlib.sha256(
        canonical_json({k: v for k, v in doc.items() if k != DIGEST_KEY})
    ).hexdigest()


def seal(doc: Mapping[str, Any]) -> dict[str, Any]:
    """`doc` with its digest added (any previous digest replaced)."""
    body = {k: v for k, v in doc.items() if k != DIGEST_KEY}
    return {**body, DIGEST_KEY: manifest_digest(body)}


def check_sealed(doc: Mapping[str, Any], where: str) -> None:
    """Raise unless `doc` carries the digest of its own content."""
    digest = doc.get(DIGEST_KEY)
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        raise QnpuError(
            f"{where}: no valid {DIGEST_KEY!r} (not sealed, or written by an older qnpu)"
        )
    actual = manifest_digest(doc)
    if actual != digest:
        raise QnpuError(
            f"{where}: digest mismatch: the manifest was edited or corrupted after it was written "
            f"(digest {actual}, recorded {digest})"
        )


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks."""
    with Path(path).open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_record(data: bytes) -> dict[str, Any]:
    return {"sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data)}


def check_record(shown: Path | str, data: bytes, sha256: str, nbytes: int) -> bytes:
    """`data` if it has the recorded size and sha256, else a QnpuError naming `shown`."""
    if len(data) != nbytes:
        kind = "truncated" if len(data) < nbytes else "extra data"
        raise QnpuError(
            f"{shown}: size mismatch ({kind}): {len(data)} bytes, manifest says {nbytes}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise QnpuError(
            f"{shown}: hash mismatch: sha256 {digest}, manifest says {sha256} (tampered or corrupt)"
        )
    return data


def relative_files(root: Path) -> list[str]:
    """Every non-directory entry below `root` as sorted POSIX paths: files, and symlinks
    (to files or directories, not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        out += [(rel_dir / n).as_posix() for n in filenames]
        out += [(rel_dir / n).as_posix() for n in dirnames if (Path(dirpath) / n).is_symlink()]
    return sorted(out)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


# A temporary sibling of a write in progress: `.STEM.tmp-PID-XXXXXXXX` (the new content) or
# `.STEM.old-PID-XXXXXXXX` (the previous content, moved aside; see `temp_stem`).
_SIBLING = re.compile(r"\.(.+)\.(tmp|old)-(\d+)-[A-Za-z0-9_]+")


def sibling_prefix(target: Path, kind: str) -> str:
    """The `tempfile.mkdtemp` prefix of a `kind` ("tmp" or "old") sibling of `target`."""
    return f".{temp_stem(target.name)}.{kind}-{os.getpid()}-"


def stale_siblings(
    parent: Path, stem: str | None = None, kinds: tuple[str, ...] = ("tmp", "old")
) -> list[Path]:
    """The temporary siblings in `parent` (of the target whose stem is `stem`, or of any) whose
    writing process is gone: a killed write's leftovers. Ours only: directories owned by this
    user."""
    try:
        entries = list(parent.iterdir())
    except OSError:
        return []
    found: list[Path] = []
    for p in entries:
        m = _SIBLING.fullmatch(p.name)
        if not m or m.group(2) not in kinds or (stem is not None and m.group(1) != stem):
            continue
        try:
            st = p.lstat()
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not pid_alive(int(m.group(3))):
            found.append(p)
    return sorted(found)


def remove_stale_siblings(target: Path, kinds: tuple[str, ...] = ("tmp", "old")) -> list[Path]:
    """Delete the temporary siblings a killed write left in `target`'s directory (of any
    target there, not only this one); a live process's are left alone. Returns what was
    removed."""
    removed = stale_siblings(target.parent, None, kinds)
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def safe_relative_path(root_real: Path, rel: object, where: str, inside: str) -> tuple[Path, Path]:
    """(shown, real) for a manifest's relative path below `root_real` (already resolved);
    refuses anything that could leave it (`inside` names it in messages)."""
    if not isinstance(rel, str) or not rel:
        raise QnpuError(f"{where}: file path must be a non-empty string, got {rel!r}")
    if "\\" in rel or "\x00" in rel:
        raise QnpuError(
            f"{where}: file path {rel!r} holds a backslash or NUL; use plain POSIX paths"
        )
    pure = PurePosixPath(rel)
    if pure.is_absolute():
        raise QnpuError(f"{where}: file path {rel!r} is absolute; it must be relative")
    if ".." in pure.parts:
        raise QnpuError(f"{where}: file path {rel!r} contains '..'")
    try:
        real = (root_real / pure).resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop (Python < 3.13)
        raise QnpuError(f"{where}: cannot resolve file path {rel!r} ({e})") from e
    if real == root_real or not real.is_relative_to(root_real):
        raise QnpuError(
            f"{where}: file path {rel!r} resolves to {real}, outside {inside} (symlink escape?)"
        )
    return root_real / pure, real
