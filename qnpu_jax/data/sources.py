"""Text sources by spec string, and their token windows.

Specs:
  wiki                 the embedded Wikipedia corpus (gensim's test dump), split calib/eval/all
  wikitext:PATH        a WikiText raw file, rows joined as GPTQ/QuaRot/SpinQuant join them
  wikitext2            WikiText-2 raw test from $QNPU_DATA_DIR (`data.locations`): the
                       `wikitext:` form of $QNPU_DATA_DIR/wikitext-2-raw/wiki.test.raw
  hf:NAME[:CONFIG]:SPLIT   `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`, column "text"
                       (NAME may be a local folder of data files; hub names need a network)
  PATH                 any other existing text file, read whole as one document
Files are read only when regular, and at most `limits.MAX_TEXT_BYTES` (512 MiB) of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from qnpu_jax.data.cache import cached_bytes, digest
from qnpu_jax.data.locations import WIKITEXT2_SPEC, wikitext2_spec
from qnpu_jax.data.wiki import load_wiki
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import read_text
from qnpu_jax.models.tokenizer import Tokenizer


def _read_text(path: Path) -> str:
    """A data file's text: a regular UTF-8 file of at most MAX_TEXT_BYTES (`files.read_text`;
    a FIFO, a device or a larger file is refused before it is read)."""
    return read_text(path, what="data file")


def wikitext_rows(text: str) -> list[str]:
    """Rows as the Hugging Face `wikitext` dataset holds them: each line with its newline,
    whitespace-only lines as ""."""
    return [line if line.strip() else "" for line in text.splitlines(keepends=True)]


def _hf_documents(spec: str) -> list[str]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise QnpuError(f"bad data spec 'hf:{spec}': expected hf:NAME[:CONFIG]:SPLIT")
    name, config, split = (parts[0], None, parts[1]) if len(parts) == 2 else parts
    try:
        import datasets
    except ImportError as e:
        raise QnpuError("hf: data specs need the `datasets` package: pip install datasets") from e
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # datasets raises many unrelated types for a missing/offline dataset
        raise QnpuError(f"cannot load dataset hf:{spec}: {type(e).__name__}: {e}") from e
    if "text" not in ds.column_names:
        raise QnpuError(f"dataset hf:{spec} has no 'text' column (columns: {ds.column_names})")
    return [t or "" for t in ds["text"]]


def load_documents(spec: str, split: str | None = None) -> list[str]:
    """Documents of a data spec; `split` applies to `wiki` only (default: all)."""
    if spec == WIKITEXT2_SPEC:  # where the user keeps it (QNPU_DATA_DIR), or a clear error
        spec = wikitext2_spec()
    if spec == "wiki":
        docs = load_wiki(split or "all")
    else:
        if split is not None:
            raise QnpuError(f"--split applies to the 'wiki' corpus only, not to {spec!r}")
        if spec.startswith("hf:"):
            docs = _hf_documents(spec[3:])
        elif spec.startswith("wikitext:"):
            docs = wikitext_rows(_read_text(Path(spec[len("wikitext:") :]).expanduser()))
        else:
            path = Path(spec).expanduser()
            if not path.exists() or path.is_dir():  # a FIFO or a device: _read_text refuses it
                raise QnpuError(
                    f"unknown data {spec!r}: not 'wiki', 'wikitext2', 'wikitext:PATH', "
                    "'hf:NAME[:CONFIG]:SPLIT' or an existing text file"
                )
            docs = [_read_text(path)]
    if not any(d.strip() for d in docs):
        raise QnpuError(f"data {spec!r} holds no text")
    return docs


def tokenize_documents(docs: Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """Join documents with a blank line and tokenize without BOS (the GPTQ convention).
    Through the data cache (`data.cache`), keyed by the text and the tokenizer's whole
    serialization: the embedded corpus takes seconds to tokenize on a slow CPU."""
    text = "\n\n".join(docs)
    payload = cached_bytes(
        "tokens",
        digest(tokenizer.backend.to_str(), text),
        lambda: np.asarray(tokenizer.encode(text), dtype="<i4").tobytes(),
    )
    return np.frombuffer(payload, dtype="<i4").astype(np.int32)


def eval_windows(ids: np.ndarray, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows [n, seq_len] from the start; the remainder is dropped."""
    if seq_len < 2:
        raise QnpuError(f"seq_len must be at least 2, got {seq_len}")
    n = len(ids) // seq_len
    if n == 0:
        raise QnpuError(f"the text has {len(ids)} tokens, fewer than one window of {seq_len}")
    if max_windows is not None:
        if max_windows < 1:
            raise QnpuError(f"max_windows must be positive, got {max_windows}")
        n = min(n, max_windows)
    return np.asarray(ids[: n * seq_len], dtype=np.int32).reshape(n, seq_len)


def sample_windows(ids: np.ndarray, seq_len: int, count: int, key: jax.Array) -> np.ndarray:
    """`count` calibration windows [count, seq_len] at random starts drawn from `key`."""
    if count < 1:
        raise QnpuError(f"the number of calibration windows must be positive, got {count}")
    if len(ids) < seq_len:
        raise QnpuError(f"the text has {len(ids)} tokens, too few for windows of {seq_len}")
    starts = np.asarray(jax.random.randint(key, (count,), 0, len(ids) - seq_len + 1))
    return np.stack([ids[s : s + seq_len] for s in starts]).astype(np.int32)
