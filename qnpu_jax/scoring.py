"""What `qnpu eval` scores, as values a study can score too: the float model or a run's
fake-quant model (`scored_model`, `scored_quantized`), the zero-shot report over one
(`zero_shot_report`) and the report's last fields (`finish_eval_report`)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.environment import environment_info
from qnpu_jax.errors import QnpuError
from qnpu_jax.eval import LmScorer, evaluate_tasks
from qnpu_jax.eval.zeroshot import task_source
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import (
    FakeQuantTaps,
    sink_prefix,
    tapped_nll_argmax,
    tapped_span_nll_argmax,
    tapped_token_nll,
)
from qnpu_jax.pipeline.run import load_run


@dataclasses.dataclass(frozen=True)
class Scored:
    """What `qnpu eval` scores: next-token NLL (and greedy predictions) of token windows."""

    label: str
    nll_fn: Callable[[np.ndarray], Any]
    nll_argmax_fn: Callable[[np.ndarray], Any]
    tokenizer: Any
    max_length: int
    report: dict[str, object]
    # both at given positions alone (`LmScorer.span_nll_argmax_fn`); None: the engine has none
    span_nll_argmax_fn: Callable[[np.ndarray, np.ndarray], Any] | None = None


def scored_model(
    *, model: str | None = None, run: Path | None = None, prefix: str | None = None
) -> Scored:
    """The float `model` or the fake-quant model of the finished `run` (exactly one of them),
    as `qnpu eval --model/--run` scores it. `prefix` None: no sink prefix for a model, the
    run's own for a run."""

    if model is not None and run is not None:
        raise QnpuError("score a model or a run, not both")
    if run is not None:

        finished = load_run(run)
        config, loaded = finished.config, finished.loaded
        params, state = finished.model.params(), finished.model.state
        prefix_params = finished.model.prefix_params()
        taps: Any = FakeQuantTaps(finished.model.require_plan())
        prefix_spec = prefix or config.prefix
        label = f"run {run} ({config.method} W{config.bits.w}A{config.bits.a})"
    elif model is not None:
        loaded = load_model(model)
        params, state, taps, prefix_params = loaded.params, None, None, None
        prefix_spec = prefix or "none"
        label = model
    else:
        raise QnpuError("score a model or a run: neither was given")
    return _scored(
        params,
        state,
        taps,
        sink_prefix(prefix_spec, loaded.tokenizer),
        loaded.config,
        loaded.tokenizer,
        label=label,
        prefix_params=prefix_params,
        report={
            "model": model if run is None else None,
            "run": str(run) if run is not None else None,
            "path": "float" if run is None else "fake-quant (static)",
            "prefix": prefix_spec,
        },
    )


def scored_quantized(
    model: Any, tokenizer: Any, *, label: str, report: dict[str, object]
) -> Scored:
    """The fake-quant forward of a `QuantizedModel` value (no run directory: e.g. a run with a
    post-training step applied in memory), with its own sink prefix; `report` says what it is."""

    taps = FakeQuantTaps(model.require_plan())
    return _scored(
        model.params(),
        model.require_state(),
        taps,
        model.prefix,
        model.cfg,
        tokenizer,
        label=label,
        prefix_params=model.prefix_params(),
        report={"path": "fake-quant (static)", **report},
    )


def _scored(
    params: Any,
    state: Any,
    taps: Any,
    prefix_ids: Sequence[int],
    cfg: Any,
    tokenizer: Any,
    *,
    label: str,
    report: dict[str, object],
    prefix_params: Any = None,
) -> Scored:

    prefix = tuple(prefix_ids)
    fns = {
        f: partial(f, params, state, cfg=cfg, taps=taps, prefix=prefix, prefix_params=prefix_params)
        for f in (tapped_token_nll, tapped_nll_argmax, tapped_span_nll_argmax)
    }
    return Scored(
        label=label,
        nll_fn=fns[tapped_token_nll],
        nll_argmax_fn=fns[tapped_nll_argmax],
        tokenizer=tokenizer,
        max_length=cfg.max_position_embeddings - len(prefix),
        report=report,
        span_nll_argmax_fn=fns[tapped_span_nll_argmax],
    )


def zero_shot_report(
    scored: Scored,
    tasks: Sequence[str],
    *,
    limit: int | None,
    seed: int,
    batch_size: int,
    progress: bool,
    data_dir: Path | str | None = None,
) -> dict[str, Any]:
    """The zero-shot part of a `qnpu eval` report ("tasks", "limit", "seed", "task_data");
    prints a line per task. Shared with qnpu study compare_methods, so its cells are scored
    exactly so. `data_dir`: the task data, a directory or "hf" (None: $QNPU_DATA_DIR;
    `task_source`)."""

    scorer = LmScorer(
        nll_fn=scored.nll_fn,
        nll_argmax_fn=scored.nll_argmax_fn,
        max_length=scored.max_length,
        span_nll_argmax_fn=scored.span_nll_argmax_fn,
    )
    results = evaluate_tasks(
        scorer,
        scored.tokenizer,
        tasks,
        limit=limit,
        seed=seed,
        batch_size=batch_size,
        data_dir=data_dir,
        progress=progress,
    )
    for name, r in results.items():
        metrics = r["metrics"]
        shown = ", ".join(
            f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and k != "n"
        )
        print(f"{name} (n={r['n']}): {shown}")
    source = task_source(tasks, data_dir)
    return {"tasks": results, "limit": limit, "seed": seed, "task_data": str(source)}


def finish_eval_report(
    report: dict[str, Any], *, command: str, started: float, path: Path | None
) -> None:
    """Add the total time, the environment and the command to a `qnpu eval` report and write
    it (atomically) to `path`, if given."""

    report["seconds_total"] = time.perf_counter() - started
    report["environment"] = environment_info()
    report["command"] = command
    if path is not None:
        write_json_atomic(path, report)
