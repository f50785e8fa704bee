"""Where a run's perplexity goes: the run with one group of tensors back in float -> JSON.

Each row drops one group from the run's plan (those tensors stay float, every other encoding
is the run's) and evaluates the fake-quant model on the `wiki` eval split (`--eval-data`:
another eval set, as `eval_data` names it, e.g. `wikitext2`): the closer a row
comes to float, the more that group costs. Groups: all weights (activations only), all
activations (weights only), the down_proj input, the linear outputs, the rotated linear
inputs, the K/V cache, the residual stream (each add's output: 16-bit, its range set by the
largest channel; on Gemma 3 its rounding held 47% of W8A8's WikiText-2 gap on one seed,
docs/results.md); `--rows outputs`: each linear output alone; `--rows inputs`: each
rotated linear input alone; `--rows weights`: each layer weight alone (with Gemma 3's rotation
linears, `attn_in_proj` and `mlp_in_proj`, which hold R1).

    qnpu study error_budget --run runs/smollm2-135m-quantnpu-w4a8 --eval-windows 32 \
        --json reports/error_budget.json
    qnpu study error_budget --run RUN --eval-data wikitext2 --eval-windows 8  # QNPU_DATA_DIR
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from qnpu_jax.environment import study_command
from qnpu_jax.ir.graph import GRAPH, KV_TENSORS, UNROTATED_INPUT, Graph, rotated_inputs_of
from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.quant.plan import is_weight
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import StudyRun, add_eval_data_arg, open_run, write_study_json


def _name(path: str) -> str:
    return path.removeprefix("layers/")


def _is_path(target: str) -> Callable[[str], bool]:
    return lambda p: p == target


def groups(graph: Graph = GRAPH) -> dict[str, tuple[str, Callable[[str], bool]]]:
    """key -> (label, predicate on a plan path: True = this tensor goes back to float), for a
    plan over `graph` (its linear outputs and rotated inputs: Gemma 3's rotation linears)."""
    rows = group_sets(graph)  # the per-tensor rows' names, one source for both
    outputs, inputs = rows["outputs"], rows["inputs"]
    return {
        "weights": (
            "linear weights float (activations only)",
            lambda p: is_weight(p) and p.startswith("layers/"),
        ),
        "activations": ("activations float (weights only)", lambda p: not is_weight(p)),
        UNROTATED_INPUT: ("down_proj input float", _is_path(f"layers/{UNROTATED_INPUT}")),
        "linear_outputs": ("linear outputs float", lambda p: _name(p) in outputs),
        "rotated_inputs": ("rotated linear inputs float", lambda p: _name(p) in inputs),
        "kv": ("K/V cache float", lambda p: _name(p) in KV_TENSORS and p.startswith("layers/")),
        "residual": (
            "residual stream float",
            lambda p: p.startswith("layers/") and _name(p) in graph.stream_values,
        ),
        **{  # each linear output, rotated input or weight alone (their groups split up)
            name: (f"{name} float", _is_path(f"layers/{name}"))
            for name in (*outputs, *inputs, *rows["weights"])
        },
    }


def group_sets(graph: Graph = GRAPH) -> dict[str, tuple[str, ...]]:
    """The `--rows` choices: which of `groups(graph)` each evaluates."""
    return {
        "groups": (
            "weights", "activations", UNROTATED_INPUT, "linear_outputs", "rotated_inputs", "kv",
            "residual",
        ),
        "outputs": graph.linear_outputs,
        "inputs": rotated_inputs_of(graph),
        "weights": tuple(t.name for t in graph.layer_weights),
    }  # fmt: skip


def without(plan: Any, state: Any, drop: Callable[[str], bool]) -> tuple[Any, Any]:
    """The plan and state with the tensors `drop` selects removed (kept in float)."""
    kept = plan.with_entries(e for e in plan.entries if not drop(e[0]))
    return kept, {
        "layers": {k: v for k, v in state["layers"].items() if kept.get(f"layers/{k}")},
        "outer": {k: v for k, v in state["outer"].items() if kept.get(k)},
    }


def float_row_ppl(run: StudyRun, drop: Callable[[str], bool], windows: np.ndarray) -> float:
    """The run's perplexity on `windows` with the tensors `drop` selects back in float (every
    other encoding the run's)."""
    kept_plan, kept_state = without(run.plan, run.state, drop)
    # a dropped weight leaves GPTQ's grid too: the model keeps only the planned codes
    codes = {
        n: c for n, c in (run.model.weight_codes or {}).items() if kept_plan.get(f"layers/{n}")
    }
    row = run.model.replace(plan=kept_plan, state=kept_state, weight_codes=codes or None)
    return float(
        evaluate(
            row.params(), kept_state, kept_plan, run.cfg, windows, run.prefix,
            prefix_params=row.prefix_params(),
        )["ppl"]
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, run=True, eval_windows=32, json=True)
    parser.add_argument(
        "--rows",
        choices=sorted(group_sets()),
        default="groups",
        help="groups: the tensor groups; outputs: each linear output alone; inputs: each "
        "rotated linear input alone; weights: each layer weight alone",
    )
    add_eval_data_arg(parser)
    args = parser.parse_args(argv)

    command = study_command("error_budget", argv)
    run = open_run(args.run)
    plan, state, cfg, prefix = run.plan, run.state, run.cfg, run.prefix
    windows = run.eval_windows(args.eval_windows, args.eval_data)
    float_ppl = run.float_ppl(windows)
    run_ppl = evaluate(
        run.params, state, plan, cfg, windows, prefix, prefix_params=run.prefix_params
    )["ppl"]
    print(f"float {float_ppl:.3f}, run {run_ppl:.3f}", flush=True)
    rows = []
    by_key = groups(plan.graph)
    for key in group_sets(plan.graph)[args.rows]:
        label, drop = by_key[key]
        dropped = [p for p, _ in plan.entries if drop(p)]
        if not dropped:
            continue
        ppl = float_row_ppl(run, drop, windows)
        rows.append({"group": key, "label": label, "dropped": dropped, "ppl": ppl})
        print(f"{label}: {ppl:.3f}", flush=True)
    write_study_json(
        args.json,
        {
            **run.summary(windows, args.eval_data),
            "float_ppl": float_ppl,
            "run_ppl": run_ppl,
            "rows": rows,
        },
        command=command,
    )
    return 0
