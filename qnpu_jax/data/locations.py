"""Where the evaluation data a user provides lives: nothing here ships with the package.

Two ways, as lm-evaluation-harness offers them:
  DIR   a local directory in the layout below, named by `qnpu eval --task-data DIR` (zero-shot
        tasks) or by the environment variable QNPU_DATA_DIR (tasks and the `wikitext2` spec);
  hf    the Hugging Face `datasets` library (`--task-data hf` or QNPU_DATA_DIR=hf): it reads
        its local cache, and downloads only when online and not HF_DATASETS_OFFLINE=1.

    DIR/wikitext-2-raw/wiki.test.raw       WikiText-2 raw test (data spec `wikitext2`)
    DIR/piqa/valid.jsonl, valid-labels.lst PIQA validation
    DIR/hellaswag/hellaswag_val_full.txt   HellaSwag validation, llama.cpp layout
    DIR/arc/arc_easy.jsonl, arc_challenge.jsonl      ARC test, llm-foundry layout
    DIR/winogrande/winogrande.jsonl        WinoGrande xl dev, llm-foundry layout
    DIR/lambada/lambada_test.jsonl         LAMBADA (OpenAI)
"""

from __future__ import annotations

import os
from pathlib import Path

from qnpu_jax.errors import QnpuError

DATA_DIR_ENV = "QNPU_DATA_DIR"
HF = "hf"  # the value that names the `datasets` library instead of a directory
WIKITEXT2_SPEC = "wikitext2"
WIKITEXT2_FILE = "wikitext-2-raw/wiki.test.raw"
WIKITEXT2_HF = "hf:wikitext:wikitext-2-raw-v1:test"
INSTALL_DATASETS = "pip install 'qnpu_jax[data]'"


def data_location(given: str | Path | None = None) -> Path | str | None:
    """The data location in force: `given` (a flag's value), else $QNPU_DATA_DIR, else None.
    "hf" stays the string "hf"; anything else is a directory that must exist."""
    origin = f"--task-data {given}"
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


def wikitext2_spec() -> str:
    """The data spec `wikitext2` stands for: `wikitext:$QNPU_DATA_DIR/wikitext-2-raw/
    wiki.test.raw`, or the `datasets` spec when QNPU_DATA_DIR=hf."""
    where = data_location()
    if where is None:
        raise QnpuError(
            f"data '{WIKITEXT2_SPEC}' is WikiText-2's raw test file, read from "
            f"${DATA_DIR_ENV}/{WIKITEXT2_FILE}, and {DATA_DIR_ENV} is not set: set "
            f"{DATA_DIR_ENV}=DIR (a directory holding {WIKITEXT2_FILE}) or {DATA_DIR_ENV}=hf "
            f"(the `datasets` cache, {INSTALL_DATASETS}), name the file as 'wikitext:PATH', "
            "or leave this set out (e.g. --set 'eval_data=[wiki]')"
        )
    if where == HF:
        return WIKITEXT2_HF
    path = Path(where) / WIKITEXT2_FILE
    if not path.is_file():
        raise QnpuError(
            f"data '{WIKITEXT2_SPEC}': {path} does not exist ({DATA_DIR_ENV} must name a "
            f"directory holding {WIKITEXT2_FILE})"
        )
    return f"wikitext:{path}"
