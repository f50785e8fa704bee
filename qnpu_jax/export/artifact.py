"""The on-disk container of the integer artifact: a manifest, one .npy per tensor, opaque files.

Only the standard library, numpy and `qnpu_jax.errors`/`qnpu_jax.files` are imported here: a
numpy-only NPU emulator reads artifacts and must never import JAX.

Layout::

    DIR/manifest.json        JSON, keys sorted, indent 1, trailing newline
    DIR/<name>               opaque files listed in manifest["files"] (e.g. tokenizer.json)
    DIR/tensors/<name>.npy   one .npy (format 1.0, little-endian, C order) per tensor

Every file the manifest lists carries its sha256 and size, and the manifest carries one digest
over its own content (`qnpu_jax.integrity`), so its numbers are covered too. The reader checks
the digest and the whole manifest, then each file's size, hash and .npy header against the
manifest, before it trusts any of it.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError, some_of
from qnpu_jax.files import check_name_length, current_umask, temp_stem, write_bytes_atomic
from qnpu_jax.integrity import (
    DIGEST_KEY,
    SHA256_HEX,
    check_record,
    check_sealed,
    file_record,
    relative_files,
    remove_stale_siblings,
    safe_relative_path,
    seal,
    sibling_prefix,
    stale_siblings,
)

FORMAT = "qnpu-int-artifact"
VERSION = 2  # 2: the manifest carries a digest over its own content
MANIFEST = "manifest.json"
TENSOR_DIR = "tensors"
DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "int64")
PACKINGS = ("none", "int4")
TENSOR_KEYS = frozenset({"file", "dtype", "shape", "packing", "sha256", "nbytes"})
FILE_KEYS = frozenset({"sha256", "nbytes"})
RESERVED_KEYS = ("format", "version", "tensors", "files", DIGEST_KEY)
INT4_MIN, INT4_MAX = -8, 7

_TENSOR_NAME = re.compile(r"[A-Za-z0-9_.]+")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Top-level names an extra file may not take (compared lower-cased: case-insensitive filesystems).
_RESERVED_FILE_NAMES = frozenset({MANIFEST, TENSOR_DIR, ".", ".."})


# --------------------------------------------------------------------------------------- int4


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """Pack int4 codes in [-8, 7] along the last axis into uint8 of shape [..., ceil(n/2)].

    Two's complement nibbles: element 2i goes in the low nibble of byte i, 2i+1 in the high one;
    an odd n is padded with a 0 nibble.
    """
    codes = np.asarray(codes)
    if codes.dtype.kind not in "iu":
        raise QnpuError(f"pack_int4 needs integer codes, got dtype {codes.dtype}")
    if codes.ndim == 0:
        raise QnpuError("pack_int4 needs an array with at least one axis (it packs the last one)")
    if codes.size and (codes.min() < INT4_MIN or codes.max() > INT4_MAX):
        raise QnpuError(
            f"pack_int4: codes must lie in [{INT4_MIN}, {INT4_MAX}], "
            f"got values in [{codes.min()}, {codes.max()}]"
        )
    nibbles = (codes.astype(np.int8) & 0x0F).astype(np.uint8)  # low 4 bits = two's complement
    if nibbles.shape[-1] % 2:
        nibbles = np.pad(nibbles, [(0, 0)] * (nibbles.ndim - 1) + [(0, 1)])
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, n: int) -> np.ndarray:
    """Inverse of `pack_int4`: uint8 [..., ceil(n/2)] -> int8 codes [..., n] in [-8, 7]."""
    packed = np.asarray(packed)
    if packed.dtype != np.uint8:
        raise QnpuError(f"unpack_int4 needs uint8 packed bytes, got dtype {packed.dtype}")
    if packed.ndim == 0:
        raise QnpuError("unpack_int4 needs an array with at least one axis")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 0:
        raise QnpuError(f"unpack_int4: n must be a non-negative int, got {n!r}")
    n = int(n)
    if packed.shape[-1] != (n + 1) // 2:
        raise QnpuError(
            f"unpack_int4: {n} codes need a last axis of {(n + 1) // 2} bytes, "
            f"got {packed.shape[-1]}"
        )
    nibbles = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=np.uint8)
    nibbles[..., 0::2] = packed & 0x0F
    nibbles[..., 1::2] = packed >> 4
    # A nonzero pad nibble means the bytes were not written by pack_int4 (or were corrupted).
    if n % 2 and np.any(nibbles[..., n]):
        raise QnpuError("unpack_int4: the padding nibble of an odd-length row is not 0")
    # Sign-extend: move the nibble to the top of an int8, then shift back arithmetically.
    return ((nibbles[..., :n].view(np.int8) << 4) >> 4).astype(np.int8)


# -------------------------------------------------------------------------------------- write


@dataclass(frozen=True)
class _Prepared:
    stored: np.ndarray  # what goes into the .npy (packed uint8 for int4)
    dtype: str  # logical dtype, as in the manifest
    shape: tuple[int, ...]  # logical shape, as in the manifest
    packing: str


def _check_tensor_name(name: object, where: str) -> str:
    if not isinstance(name, str) or not _TENSOR_NAME.fullmatch(name):
        raise QnpuError(f"{where}: tensor name {name!r} must match [A-Za-z0-9_.]+")
    return name


def _check_file_name(name: object, where: str) -> str:
    if (
        not isinstance(name, str)
        or not _FILE_NAME.fullmatch(name)
        or name.lower() in _RESERVED_FILE_NAMES
    ):
        raise QnpuError(
            f"{where}: extra file name {name!r} must match [A-Za-z0-9_.-]+ and not be one of "
            f"{sorted(_RESERVED_FILE_NAMES)}"
        )
    return name


def _prepare_tensors(
    out_dir: Path, tensors: Mapping[str, np.ndarray], int4: Collection[str]
) -> dict[str, _Prepared]:
    where = f"cannot write artifact {out_dir}"
    int4_names = set(int4)
    unknown = sorted(int4_names - set(tensors))
    if unknown:
        raise QnpuError(f"{where}: int4 names {unknown} are not among the tensors")
    prepared: dict[str, _Prepared] = {}
    lowered: dict[str, str] = {}
    for name, value in tensors.items():
        _check_tensor_name(name, where)
        # tensors/A.npy and tensors/a.npy would collide on a case-insensitive filesystem.
        if name.lower() in lowered:
            raise QnpuError(
                f"{where}: tensor names {lowered[name.lower()]!r} and {name!r} differ only in case"
            )
        lowered[name.lower()] = name
        arr = np.asarray(value)
        if arr.dtype.name not in DTYPES:
            raise QnpuError(
                f"{where}: tensor {name!r} has dtype {arr.dtype}; artifacts hold only {DTYPES}"
            )
        # Little-endian, C order: the layout the reader (and the NPU) expects.
        arr = np.asarray(arr, dtype=arr.dtype.newbyteorder("<"), order="C")
        if name in int4_names:
            if arr.dtype != np.int8:
                raise QnpuError(f"{where}: int4 tensor {name!r} must be int8, got {arr.dtype}")
            try:
                packed = pack_int4(arr)
            except QnpuError as e:
                raise QnpuError(f"{where}: int4 tensor {name!r}: {e}") from e
            prepared[name] = _Prepared(packed, "int8", arr.shape, "int4")
        else:
            prepared[name] = _Prepared(arr, arr.dtype.name, arr.shape, "none")
    return prepared


def _check_files(out_dir: Path, files: Mapping[str, bytes]) -> dict[str, bytes]:
    where = f"cannot write artifact {out_dir}"
    checked: dict[str, bytes] = {}
    lowered: set[str] = set()
    for name, data in files.items():
        _check_file_name(name, where)
        if name.lower() in lowered:
            raise QnpuError(f"{where}: extra file names collide (case-insensitively): {name!r}")
        lowered.add(name.lower())
        if not isinstance(data, bytes | bytearray | memoryview):
            raise QnpuError(f"{where}: extra file {name!r} must be bytes, got {type(data)}")
        checked[name] = bytes(data)
    return checked


def _dump_manifest(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def _listed_paths(doc: Mapping[str, Any]) -> set[str]:
    """The relative paths a manifest accounts for (itself included)."""
    listed = {MANIFEST}
    files, tensors = doc.get("files"), doc.get("tensors")
    if isinstance(files, dict):
        listed |= {name for name in files if isinstance(name, str)}
    if isinstance(tensors, dict):
        listed |= {
            e["file"]
            for e in tensors.values()
            if isinstance(e, dict) and isinstance(e.get("file"), str)
        }
    return listed


def check_destination(out_dir: Path) -> None:
    """Refuse to replace anything but one of our own artifacts: a manifest of this format
    (sealed, from version 2 on) that lists every file in the directory."""
    where = f"cannot write artifact {out_dir}"
    check_name_length(out_dir, "cannot write artifact")
    if out_dir.is_symlink():
        raise QnpuError(f"{where}: it is a symlink; refusing to replace it")
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise QnpuError(f"{where}: it exists and is not a directory")
    try:
        files = relative_files(out_dir)
        empty = not files and next(out_dir.iterdir(), None) is None
    except OSError as e:
        raise QnpuError(f"{where}: cannot list it ({e})") from e
    if empty:
        return
    refuse = f"{where}: it is a non-empty directory that is not a qnpu artifact"
    try:
        doc = _parse_manifest(out_dir / MANIFEST)
    except QnpuError as e:
        raise QnpuError(f"{refuse} ({e}); refusing to replace it") from e
    if doc.get("format") != FORMAT:
        raise QnpuError(f"{refuse} (its {MANIFEST} has format {doc.get('format')!r})")
    if doc.get("version") != 1:  # version 1 manifests carried no digest
        try:
            check_sealed(doc, str(out_dir / MANIFEST))
        except QnpuError as e:
            raise QnpuError(f"{refuse} ({e}); refusing to replace it") from e
    unlisted = [f for f in files if f not in _listed_paths(doc)]
    if unlisted:
        raise QnpuError(
            f"{where}: it holds files its manifest does not list ({some_of(unlisted, 5)}); "
            "refusing to replace it (move them away, or choose another --out)"
        )


def _swap_into_place(new: Path, out_dir: Path) -> None:
    if not out_dir.exists():
        os.rename(new, out_dir)
        return
    # Rename the old artifact aside (inside a fresh temp dir, so the name is free), move the new
    # one in, then delete the old. Between the two renames out_dir briefly does not exist.
    aside_root = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=sibling_prefix(out_dir, "old")))
    aside = aside_root / "old"
    try:
        os.rename(out_dir, aside)
        try:
            os.rename(new, out_dir)
        except BaseException:
            os.rename(aside, out_dir)  # put the previous artifact back
            raise
    except BaseException:
        with contextlib.suppress(OSError):
            aside_root.rmdir()  # empty unless restoring the old artifact failed too
        raise
    # The new artifact is in place: failing to delete the old one must not report failure.
    shutil.rmtree(aside_root, ignore_errors=True)


def write_artifact(
    out_dir: Path,
    manifest: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    int4: Collection[str] = (),
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write an artifact directory at `out_dir` and return its path.

    `manifest` holds the caller's keys ("model", "graph", ...); "format", "version", "tensors" and
    "files" are added here. `int4` names int8 tensors with codes in [-8, 7] to store packed two
    per byte. `files` are opaque top-level blobs (e.g. "tokenizer.json").

    Everything is built in a temporary sibling directory and renamed into place, so a failure
    leaves no temp dir behind and a previous artifact at `out_dir` untouched. The output is
    deterministic: the same inputs give byte-identical files.
    """
    out_dir = Path(os.path.abspath(out_dir))  # a real name and parent even for "." or "x/.."
    where = f"cannot write artifact {out_dir}"
    # Everything that can be checked in memory is checked before the disk is touched.
    if not isinstance(manifest, Mapping):
        raise QnpuError(f"{where}: manifest must be a mapping, got {type(manifest)}")
    clash = sorted(k for k in RESERVED_KEYS if k in manifest)
    if clash:
        raise QnpuError(
            f"{where}: manifest keys {clash} are added by write_artifact; leave them out"
        )
    try:
        _dump_manifest(manifest)
    except (TypeError, ValueError) as e:
        raise QnpuError(f"{where}: manifest is not plain JSON ({e})") from e
    prepared = _prepare_tensors(out_dir, tensors, int4)
    blobs = _check_files(out_dir, files or {})
    check_destination(out_dir)

    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_siblings(out_dir)  # what a killed export left behind
        tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=sibling_prefix(out_dir, "tmp")))
    except OSError as e:
        raise QnpuError(f"{where}: {e}") from e
    try:
        (tmp / TENSOR_DIR).mkdir()
        tensor_entries: dict[str, Any] = {}
        for name in sorted(prepared):
            p = prepared[name]
            buf = io.BytesIO()
            np.save(buf, p.stored, allow_pickle=False)
            data = buf.getvalue()
            rel = f"{TENSOR_DIR}/{name}.npy"
            write_bytes_atomic(tmp / rel, data)
            tensor_entries[name] = {
                "file": rel,
                "dtype": p.dtype,
                "shape": list(p.shape),
                "packing": p.packing,
                **file_record(data),
            }
        file_entries: dict[str, Any] = {}
        for name in sorted(blobs):
            write_bytes_atomic(tmp / name, blobs[name])
            file_entries[name] = file_record(blobs[name])
        doc = seal(
            {
                **manifest,
                "format": FORMAT,
                "version": VERSION,
                "tensors": tensor_entries,
                "files": file_entries,
            }
        )
        write_bytes_atomic(tmp / MANIFEST, _dump_manifest(doc))
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it private (0700)
        _swap_into_place(tmp, out_dir)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise QnpuError(f"{where}: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# --------------------------------------------------------------------------------------- read


@dataclass(frozen=True)
class Artifact:
    """A verified artifact: int4 tensors are unpacked to int8 with their logical shape."""

    path: Path
    manifest: dict[str, Any]
    tensors: dict[str, np.ndarray]
    files: dict[str, bytes]

    def tensor(self, name: str) -> np.ndarray:
        try:
            return self.tensors[name]
        except KeyError:
            raise QnpuError(f"artifact {self.path} has no tensor {name}") from None


@dataclass(frozen=True)
class _Entry:
    shown: Path  # the path as the manifest names it, for messages
    real: Path  # resolved, checked to lie inside the artifact directory
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class _TensorEntry:
    entry: _Entry
    dtype: str
    shape: tuple[int, ...]
    packing: str


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard constant {name}")


def _parse_manifest(mpath: Path) -> dict[str, Any]:
    """The manifest as a JSON object (strict: no duplicate keys, no NaN)."""
    if not mpath.is_file():
        raise QnpuError(f"{mpath}: manifest missing ({mpath.parent} is not an artifact directory)")
    try:
        doc = json.loads(
            mpath.read_bytes().decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_no_constant,
        )
    except OSError as e:
        raise QnpuError(f"{mpath}: cannot read the manifest ({e})") from e
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and the hooks above
        raise QnpuError(f"{mpath}: manifest is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise QnpuError(f"{mpath}: manifest must be a JSON object, got {type(doc).__name__}")
    return doc


def _read_manifest(root: Path) -> tuple[Path, dict[str, Any]]:
    mpath = root / MANIFEST
    doc = _parse_manifest(mpath)
    if doc.get("format") != FORMAT:
        raise QnpuError(f"{mpath}: format is {doc.get('format')!r}, expected {FORMAT!r}")
    version = doc.get("version")
    if type(version) is not int or version != VERSION:  # type(): True == 1 must not pass
        hint = " (written before manifests carried a digest: export the run again)"
        raise QnpuError(
            f"{mpath}: unsupported version {version!r} (this reader supports version {VERSION})"
            + (hint if version == 1 else "")
        )
    check_sealed(doc, str(mpath))
    for key in ("tensors", "files"):
        if not isinstance(doc.get(key), dict):
            raise QnpuError(f"{mpath}: {key!r} must be a JSON object")
    return mpath, doc


def _safe_path(root_real: Path, rel: object, where: str) -> tuple[Path, Path]:
    return safe_relative_path(root_real, rel, where, "the artifact directory")


def _check_hash_fields(entry: Mapping[str, Any], where: str) -> tuple[str, int]:
    sha = entry["sha256"]
    if not isinstance(sha, str) or not SHA256_HEX.fullmatch(sha):
        raise QnpuError(f"{where}: sha256 must be 64 lower-case hex digits, got {sha!r}")
    nbytes = entry["nbytes"]
    if type(nbytes) is not int or nbytes < 0:
        raise QnpuError(f"{where}: nbytes must be a non-negative int, got {nbytes!r}")
    return sha, nbytes


def _check_keys(entry: object, expected: frozenset[str], where: str) -> dict[str, Any]:
    if not isinstance(entry, dict):
        raise QnpuError(f"{where}: entry must be a JSON object, got {type(entry).__name__}")
    if set(entry) != expected:
        missing, extra = sorted(expected - set(entry)), sorted(set(entry) - expected)
        raise QnpuError(
            f"{where}: entry keys must be {sorted(expected)} (missing {missing}, extra {extra})"
        )
    return entry


def _check_tensor_entry(root_real: Path, mpath: Path, name: str, raw: object) -> _TensorEntry:
    where = f"{mpath}: tensor {name!r}"
    _check_tensor_name(name, f"{mpath}")
    entry = _check_keys(raw, TENSOR_KEYS, where)
    dtype = entry["dtype"]
    if dtype not in DTYPES:
        raise QnpuError(f"{where}: dtype {dtype!r} is not one of {DTYPES}")
    packing = entry["packing"]
    if packing not in PACKINGS:
        raise QnpuError(f"{where}: packing {packing!r} is not one of {PACKINGS}")
    if packing == "int4" and dtype != "int8":
        raise QnpuError(f"{where}: int4 packing needs dtype 'int8', got {dtype!r}")
    shape = entry["shape"]
    if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
        raise QnpuError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if packing == "int4" and not shape:
        raise QnpuError(f"{where}: an int4 tensor needs at least one axis")
    sha, nbytes = _check_hash_fields(entry, where)
    shown, real = _safe_path(root_real, entry["file"], where)
    return _TensorEntry(_Entry(shown, real, sha, nbytes), dtype, tuple(shape), packing)


def _check_file_entry(root_real: Path, mpath: Path, name: str, raw: object) -> _Entry:
    where = f"{mpath}: file {name!r}"
    _check_file_name(name, f"{mpath}")
    entry = _check_keys(raw, FILE_KEYS, where)
    sha, nbytes = _check_hash_fields(entry, where)
    shown, real = _safe_path(root_real, name, where)
    return _Entry(shown, real, sha, nbytes)


def _read_verified(entry: _Entry) -> bytes:
    if not entry.real.is_file():
        raise QnpuError(f"{entry.shown}: file missing (listed in the manifest)")
    try:
        data = entry.real.read_bytes()
    except OSError as e:
        raise QnpuError(f"{entry.shown}: cannot read ({e})") from e
    return check_record(entry.shown, data, entry.sha256, entry.nbytes)


def _load_npy(shown: Path, data: bytes, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Parse verified .npy bytes, checking the header against the manifest before the data."""
    f = io.BytesIO(data)  # parse the bytes that were hashed, not a re-read of the file
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            got_shape, fortran, got_dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            got_shape, fortran, got_dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise QnpuError(f"{shown}: unsupported .npy format version {version}")
    except ValueError as e:
        raise QnpuError(f"{shown}: not a valid .npy file ({e})") from e
    if got_dtype.hasobject:
        raise QnpuError(
            f"{shown}: holds Python objects (pickled data); refused, artifacts hold integer arrays"
        )
    if fortran:
        raise QnpuError(f"{shown}: stored in Fortran order; artifacts need C order")
    if got_dtype.str[0] == ">":
        raise QnpuError(
            f"{shown}: stored big-endian ({got_dtype.str}); artifacts are little-endian"
        )
    if got_dtype.str != dtype.str:
        raise QnpuError(
            f"{shown}: dtype mismatch: the file holds {got_dtype.name}, the manifest implies "
            f"{dtype.name}"
        )
    if tuple(got_shape) != shape:
        raise QnpuError(
            f"{shown}: shape mismatch: the file holds {list(got_shape)}, the manifest implies "
            f"{list(shape)}"
        )
    payload = len(data) - f.tell()
    if payload != dtype.itemsize * math.prod(shape):
        raise QnpuError(
            f"{shown}: array data is {payload} bytes, expected {dtype.itemsize * math.prod(shape)}"
        )
    f.seek(0)
    try:
        arr = np.load(f, allow_pickle=False)
    except ValueError as e:  # e.g. "Cannot load file containing pickled data"
        raise QnpuError(f"{shown}: cannot load the .npy ({e})") from e
    if not isinstance(arr, np.ndarray):
        raise QnpuError(f"{shown}: not a plain .npy array")
    return arr


def read_artifact(path: Path) -> Artifact:
    """Read and verify the artifact at `path`; any inconsistency raises QnpuError naming the file.

    The whole manifest (keys, names, dtypes, shapes, path safety) is checked first, then each
    listed file's size and sha256, then each .npy header against the manifest. Files that the
    manifest does not list are ignored.
    """
    root = Path(path)
    if not root.exists():
        aside = [
            p / "old"
            for p in stale_siblings(root.absolute().parent, temp_stem(root.name), ("old",))
            if (p / "old").is_dir()
        ]
        where = (
            f" (an export was killed while it replaced it: the previous artifact is at "
            f"{aside[-1]}; move it back, or export again)"
            if aside
            else ""
        )
        raise QnpuError(f"artifact directory {root} does not exist{where}")
    if not root.is_dir():
        raise QnpuError(f"artifact path {root} is not a directory")
    root_real = root.resolve()
    # The manifest itself may not be a symlink out of the directory either.
    _safe_path(root_real, MANIFEST, f"{root / MANIFEST}")
    mpath, manifest = _read_manifest(root)
    tensor_entries = {
        name: _check_tensor_entry(root_real, mpath, name, raw)
        for name, raw in manifest["tensors"].items()
    }
    file_entries = {
        name: _check_file_entry(root_real, mpath, name, raw)
        for name, raw in manifest["files"].items()
    }

    tensors: dict[str, np.ndarray] = {}
    for name, t in tensor_entries.items():
        data = _read_verified(t.entry)
        if t.packing == "int4":
            stored_dtype = np.dtype(np.uint8)
            stored_shape = (*t.shape[:-1], (t.shape[-1] + 1) // 2)
        else:
            stored_dtype = np.dtype(t.dtype).newbyteorder("<")
            stored_shape = t.shape
        arr = _load_npy(t.entry.shown, data, stored_dtype, stored_shape)
        if t.packing == "int4":
            try:
                arr = unpack_int4(arr, t.shape[-1])
            except QnpuError as e:
                raise QnpuError(f"{t.entry.shown}: {e}") from e
        tensors[name] = arr
    files = {name: _read_verified(entry) for name, entry in file_entries.items()}
    return Artifact(path=root, manifest=manifest, tensors=tensors, files=files)
