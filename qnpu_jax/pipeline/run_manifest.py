"""The run directory's manifest: every file of a finished run by sha256 and size, sealed.

`qnpu quantize` writes `manifest.json` last, once report.json is in place, so its presence
marks a finished run; `--resume` removes it first. Everything that reads a run (`load_run`,
`qnpu export`, `qnpu eval --run`, `qnpu report`) verifies it before trusting any file: a flipped
byte in `learned/`, a truncated checkpoint or an edited plan is refused by name instead of
loading into a silently different model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_bytes_atomic
from qnpu_jax.integrity import (
    check_record,
    check_sealed,
    file_record,
    relative_files,
    safe_relative_path,
    seal,
)
from qnpu_jax.pipeline.run_dir import RunDir

RUN_MANIFEST = RunDir.MANIFEST
# The lock `qnpu quantize` holds while it writes the run (`files.exclusive_lock`): not part of
# the run, so never sealed, and removed when the run ends.
RUN_LOCK = RunDir.LOCK
RUN_FORMAT = "qnpu-run"
RUN_VERSION = 1
# Directories whose every file is read as a whole by a loader (orbax): a file the manifest
# does not list there could change what loads, so it is refused, not ignored.
CLOSED_DIRS = (RunDir.LEARNED,)


def _run_files(run_dir: Path) -> list[str]:
    """Every regular file below `run_dir` but the manifest and the lock (links are not
    followed)."""
    return [
        rel
        for rel in relative_files(run_dir)
        if rel not in (RUN_MANIFEST, RUN_LOCK)
        and not (run_dir / rel).is_symlink()
        and (run_dir / rel).is_file()
    ]


def seal_run(run_dir: Path) -> Path:
    """Write run_dir/manifest.json over the files the run holds now (atomically)."""
    run_dir = Path(run_dir)
    files = {rel: file_record((run_dir / rel).read_bytes()) for rel in _run_files(run_dir)}
    doc = seal({"format": RUN_FORMAT, "version": RUN_VERSION, "files": files})
    text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"
    return write_bytes_atomic(RunDir(run_dir).manifest_path, text.encode())


def unseal_run(run_dir: Path) -> None:
    """Mark the run unfinished (its files are about to change)."""
    RunDir(run_dir).manifest_path.unlink(missing_ok=True)


def verify_run(run_dir: Path) -> dict[str, Any]:
    """Check run_dir/manifest.json's digest and every file it lists; returns the manifest."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise QnpuError(f"run directory not found: {run_dir}")
    mpath = RunDir(run_dir).manifest_path
    if not mpath.is_file():
        raise QnpuError(
            f"{run_dir} is not a finished run: {RUN_MANIFEST} is missing (the run was stopped "
            "before it ended, or made by a qnpu older than run manifests: finish it with "
            "`qnpu quantize --resume`, or make it again)"
        )
    try:
        doc = json.loads(mpath.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise QnpuError(f"{mpath}: not a readable JSON manifest ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != RUN_FORMAT:
        raise QnpuError(f"{mpath}: not a run manifest (format {RUN_FORMAT!r} expected)")
    if doc.get("version") != RUN_VERSION:
        raise QnpuError(f"{mpath}: unsupported run manifest version {doc.get('version')!r}")
    check_sealed(doc, str(mpath))
    files = doc.get("files")
    if not isinstance(files, dict):
        raise QnpuError(f"{mpath}: 'files' must be a JSON object")
    root_real = run_dir.resolve()
    for rel, entry in files.items():
        where = f"{mpath}: file {rel!r}"
        shown, real = safe_relative_path(root_real, rel, where, "the run directory")
        if not isinstance(entry, dict) or set(entry) != {"sha256", "nbytes"}:
            raise QnpuError(f"{where}: entry must hold sha256 and nbytes")
        if not real.is_file():
            raise QnpuError(f"{shown}: file missing (listed in {RUN_MANIFEST})")
        try:
            data = real.read_bytes()
        except OSError as e:
            raise QnpuError(f"{shown}: cannot read ({e})") from e
        check_record(shown, data, entry["sha256"], entry["nbytes"])
    unlisted = [
        rel
        for rel in _run_files(run_dir)
        if rel.split("/", 1)[0] in CLOSED_DIRS and rel not in files
    ]
    if unlisted:
        raise QnpuError(
            f"{run_dir}: files the manifest does not list: {', '.join(unlisted[:5])} "
            "(added after the run was made)"
        )
    return doc
