"""What every study shares: the provenance its JSON report records (command, environment,
seconds), the atomic write, the finished run a study opens (`open_run`) and the summary of it
a report repeats, and the options several studies take (each defined once here, with its help
line)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping, Sized
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.environment import environment_info
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params
from qnpu_jax.models.taps import SINK_PREFIXES
from qnpu_jax.pipeline.config import parse_bits
from qnpu_jax.pipeline.config_doc import CONFIG_KEYS
from qnpu_jax.pipeline.recipes import gptq_windows_of
from qnpu_jax.pipeline.run import (
    Run,
    calibration_data,
    eval_set_windows,
    evaluate,
    load_run,
)
from qnpu_jax.pipeline.steps import Calibration
from qnpu_jax.quant.plan import QuantPlan
from qnpu_jax.quant.state import QuantState


def provenance(command: str, started: float | None = None) -> dict[str, Any]:
    """The fields every study report ends with: `command` (re-runnable: `qnpu study NAME
    ARGS`), the `environment` it ran in, and the wall `seconds` since `started`
    (`time.perf_counter()`), when given."""

    out: dict[str, Any] = {}
    if started is not None:
        out["seconds"] = time.perf_counter() - started
    return {**out, "environment": environment_info(), "command": command}


def write_study_json(
    path: Path | str, doc: Mapping[str, Any], *, command: str, started: float | None = None
) -> dict[str, Any]:
    """Write `doc` plus its provenance to `path` atomically; returns what was written."""

    full = {**doc, **provenance(command, started)}
    write_json_atomic(Path(path), full)
    return full


def w_a_bits(text: str) -> tuple[int, int]:
    """An argparse type: "W4A8" -> (4, 8), read by `config.parse_bits` (a KV part ignored)."""
    try:
        bits = parse_bits(text)
    except QnpuError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return bits["w_bits"], bits["a_bits"]


def add_model_arg(parser: argparse.ArgumentParser) -> None:
    """`--model`: the base model, as the config's `model` key names it."""
    parser.add_argument("--model", default="smollm2-135m", help=CONFIG_KEYS["model"])


def add_window_args(
    parser: argparse.ArgumentParser, *, seq_len: int = 512, calib_windows: int = 16
) -> None:
    """`--seq-len` and `--calib-windows`: the windows a study calibrates (and trains) on."""
    parser.add_argument(
        "--seq-len",
        type=int,
        default=seq_len,
        help="tokens per window: calibration, evaluation and (in studies that train) stage 1",
    )
    parser.add_argument(
        "--calib-windows",
        type=int,
        default=calib_windows,
        help="calibration windows, at random starts in the `wiki` calib split",
    )


def add_seed_arg(parser: argparse.ArgumentParser) -> None:
    """`--seed`: the calibration windows, the rotations and stage 1's batches."""
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the calibration windows, the randomized Hadamard rotations and (in studies "
        "that train) stage 1's batches",
    )


def add_prefix_arg(parser: argparse.ArgumentParser, default: str) -> None:
    """`--prefix`: the sink prefix, as the config's `prefix` key."""
    parser.add_argument(
        "--prefix", choices=SINK_PREFIXES, default=default, help=CONFIG_KEYS["prefix"]
    )


def add_eval_data_arg(parser: argparse.ArgumentParser) -> None:
    """`--eval-data`: the one eval set a study scores on, as the config's `eval_data` names one."""
    parser.add_argument(
        "--eval-data",
        default="wiki",
        help="the eval set, as the config's eval_data names one (wikitext2 reads QNPU_DATA_DIR)",
    )


def add_eval_args(parser: argparse.ArgumentParser, *, windows: int) -> None:
    """`--seq-len` and `--windows` of the studies that only score: the first `windows`
    non-overlapping windows of the `wiki` eval split."""
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per evaluation window")
    parser.add_argument(
        "--windows",
        type=int,
        default=windows,
        help="wiki eval windows scored (the first N, non-overlapping)",
    )


def run_summary(
    run_path: Path | str, config: Any, windows: Sized, data: str = "wiki"
) -> dict[str, Any]:
    """What a report on one run repeats about it: its path, the config's summary and the
    evaluation windows the study measured on (of the eval set `data`)."""
    return {
        "run": str(run_path),
        **config.summary(),
        "eval": {"data": "wiki (eval split)" if data == "wiki" else data, "windows": len(windows)},
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class StudyRun(Run):
    """A finished run as a study reads it (`open_run`): the `Run` (its config, its
    QuantizedModel `model` and the float model `loaded` it was made from) with its plan, its
    encodings, the float weights a study measures on (`params`) and those the sink prefix runs
    on (`prefix_params`, None: `params`), and the directory it was read from (`path`)."""

    path: Path
    plan: QuantPlan
    state: QuantState
    params: Params
    prefix_params: Params | None

    @property
    def cfg(self) -> ModelConfig:
        """The model's config."""
        return self.loaded.config

    @property
    def prefix(self) -> tuple[int, ...]:
        """The sink prefix the run was made with (token ids)."""
        return self.model.prefix

    def eval_windows(self, cap: int | None, data: str = "wiki") -> np.ndarray:
        """The first `cap` windows of the eval set `data` (default: the `wiki` eval split)
        at the run's seq_len."""
        return eval_set_windows(self.config, self.tokenizer, data, cap)

    def calib_windows(self) -> np.ndarray:
        """The run's own calibration windows [N, T] (its calib data, seed and count)."""
        return calibration_data(self.config, self.tokenizer)[1]

    def gptq_windows(self) -> np.ndarray:
        """The windows the run's GPTQ took its Hessians over (`gptq_windows_of`)."""
        data = Calibration(*calibration_data(self.config, self.tokenizer))
        return gptq_windows_of(self.config, data)

    def float_ppl(self, windows: np.ndarray) -> float:
        """The perplexity of the float model the run was made from on `windows`, with the
        run's sink prefix."""
        return evaluate(self.loaded.params, None, None, self.cfg, windows, self.prefix)["ppl"]

    def summary(self, windows: Sized, data: str = "wiki") -> dict[str, Any]:
        """`run_summary` of this run measured on `windows` of the eval set `data`."""
        return run_summary(self.path, self.config, windows, data)


def open_run(path: Path, *, rounded: bool = True) -> StudyRun:
    """The finished run in `path`, verified and loaded (`load_run`), announced with `say`.
    `params`: the run's weights with GPTQ's codes in place (`rounded`, as the run evaluates
    them), else the weights before rounding (a reference to recalibrate or re-round from,
    which the sink prefix then runs on too). Raises QnpuError for a run that is not finished
    or holds no plan or encodings."""
    say(f"reading and verifying the run {path}")
    run = load_run(path)
    plan, state = run.model.require_plan(), run.model.require_state()
    if rounded:
        params, prefix_params = run.model.params(), run.model.prefix_params()
    else:
        params = run.model.unrounded_params()
        prefix_params = params
    return StudyRun(
        config=run.config,
        model=run.model,
        loaded=run.loaded,
        path=path,
        plan=plan,
        state=state,
        params=params,
        prefix_params=prefix_params,
    )


_STARTED = time.perf_counter()


def say(message: str) -> None:
    """A study's phase line on stderr, with the seconds since its start (as `qnpu quantize`
    announces its phases), so a long study does not run silent."""
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", file=sys.stderr, flush=True)
