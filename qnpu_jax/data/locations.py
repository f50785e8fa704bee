"""Where the evaluation data a user provides lives: nothing here ships with the package.

Two ways, as lm-evaluation-harness offers them:
  DIR   a local directory in the layout below, named by `qnpu eval --task-data DIR` (zero-shot
        tasks), by `qnpu --data-dir DIR` or by the environment variable QNPU_DATA_DIR (tasks and
        the `wikitext2` spec; the flag wins over the variable);
  hf    the Hugging Face `datasets` library (`--task-data hf`, `--data-dir hf` or
        QNPU_DATA_DIR=hf): it reads its local cache, and downloads only when online and not
        HF_DATASETS_OFFLINE=1.

    DIR/wikitext-2-raw/wiki.test.raw       WikiText-2 raw test (data spec `wikitext2`)
    DIR/piqa/valid.jsonl, valid-labels.lst PIQA validation
    DIR/hellaswag/hellaswag_val_full.txt   HellaSwag validation, llama.cpp layout
    DIR/arc/arc_easy.jsonl, arc_challenge.jsonl      ARC test, llm-foundry layout
    DIR/winogrande/winogrande.jsonl        WinoGrande xl dev, llm-foundry layout
    DIR/lambada/lambada_test.jsonl         LAMBADA (OpenAI)
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from qnpu_jax.errors import QnpuError

DATA_DIR_ENV = "QNPU_DATA_DIR"
DATA_DIR_FLAG = "--data-dir"  # `qnpu --data-dir DIR`: QNPU_DATA_DIR for one command
HF = "hf"  # the value that names the `datasets` library instead of a directory
WIKITEXT2_SPEC = "wikitext2"
WIKITEXT2_FILE = "wikitext-2-raw/wiki.test.raw"
WIKITEXT2_HF = "hf:wikitext:wikitext-2-raw-v1:test"
INSTALL_DATASETS = "pip install 'qnpu_jax[data]'"


def data_location(given: str | Path | None = None, flag: str = "--task-data") -> Path | str | None:
    """The data location in force: `given` (the value of `flag`), else $QNPU_DATA_DIR, else
    None. "hf" stays the string "hf"; anything else is a directory that must exist."""
    origin = f"{flag} {given}"
    if given is None:
        given = os.environ.get(DATA_DIR_ENV) or None
        origin = f"{DATA_DIR_ENV}={given}"
    if given is None:
        return None
    if str(given) == HF:
        return HF
    path = Path(given).expanduser()
    if not path.is_dir():
        raise QnpuError(f"{origin}: no such directory")
    return path


@contextlib.contextmanager
def data_dir_override(given: str | Path | None) -> Iterator[None]:
    """$QNPU_DATA_DIR set to `given` (`qnpu --data-dir`: a directory that must exist, or "hf")
    while the block runs, and back to what it was after; None changes nothing."""
    if given is None:
        yield
        return
    where = data_location(given, DATA_DIR_FLAG)
    before = os.environ.get(DATA_DIR_ENV)
    os.environ[DATA_DIR_ENV] = str(where)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DATA_DIR_ENV, None)
        else:
            os.environ[DATA_DIR_ENV] = before


def wikitext2_spec() -> str:
    """The data spec `wikitext2` stands for: `wikitext:$QNPU_DATA_DIR/wikitext-2-raw/
    wiki.test.raw`, or the `datasets` spec when QNPU_DATA_DIR=hf."""
    where = data_location()
    if where is None:
        raise QnpuError(
            f"data '{WIKITEXT2_SPEC}' is WikiText-2's raw test file, read from "
            f"${DATA_DIR_ENV}/{WIKITEXT2_FILE}, and {DATA_DIR_ENV} is not set: set "
            f"{DATA_DIR_ENV}=DIR or give `qnpu {DATA_DIR_FLAG} DIR` (a directory holding "
            f"{WIKITEXT2_FILE}), set {DATA_DIR_ENV}=hf or give `qnpu {DATA_DIR_FLAG} hf` (the "
            f"`datasets` cache, {INSTALL_DATASETS}), name the file as 'wikitext:PATH', "
            "or leave this set out (e.g. --set 'eval_data=[wiki]')"
        )
    if where == HF:
        return WIKITEXT2_HF
    path = Path(where) / WIKITEXT2_FILE
    if not path.is_file():
        raise QnpuError(
            f"data '{WIKITEXT2_SPEC}': {path} does not exist ({DATA_DIR_ENV} or `qnpu "
            f"{DATA_DIR_FLAG}` must name a directory holding {WIKITEXT2_FILE})"
        )
    return f"wikitext:{path}"
