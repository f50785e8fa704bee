"""Perplexity cost of the embedding and lm_head precisions of a finished run -> JSON + markdown.

docs/design.md §3 quantizes the embedding table at 8 bits per row and lm_head at W8 per row with a
16-bit input (final_norm_out); the embedding's output (embed_out) is 16-bit. This script
re-evaluates one finished `qnpu quantize` run with only those tensors changed: each of them
back in float, all of them in float, and each table at 4 and 16 bits per row (Max-Min from
the run's rotated weights). Every other encoding stays as the run learned/calibrated it, on
the same `wiki` eval windows, so each row's difference to the run's row is the cost (or the
saving) of that one choice. The tables' storage in bytes is listed beside (codes + one
float32 scale per row), because they are 21% of SmolLM2-135M's parameters.

    qnpu study table_cost --run runs/smollm2-135m-quantnpu-w4a8 --eval-windows 32 \
        --json reports/table_cost.json --md reports/table_cost.md
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from qnpu_jax.environment import study_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_bytes_atomic
from qnpu_jax.ir.graph import EMBED_TABLE, GRAPH, LM_HEAD
from qnpu_jax.pipeline.calibrate import reencode_weight
from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import open_run, write_study_json

TABLES = (EMBED_TABLE, LM_HEAD)
# the tensors around the tables whose precision docs/design.md §3 fixes
TABLE_TENSORS = tuple(t.name for t in GRAPH.global_tensors)
TABLE_BITS = (4, 16)


@dataclasses.dataclass(frozen=True)
class Variant:
    key: str
    label: str
    plan: Any  # QuantPlan
    state: Any  # QuantState


def table_variants(plan: Any, state: Any, params: Any, cfg: Any) -> list[Variant]:
    """The run itself, then one change of the table tensors per variant (pure)."""

    missing = [p for p in TABLE_TENSORS if plan.get(p) is None]
    if missing:
        raise QnpuError(f"the run keeps {', '.join(missing)} in float: nothing to measure")

    def without(*paths: str) -> tuple[Any, Any]:
        kept = plan.with_entries(e for e in plan.entries if e[0] not in paths)
        outer = {k: v for k, v in state["outer"].items() if k not in paths}
        return kept, {"layers": state["layers"], "outer": outer}

    def with_bits(path: str, bits: int) -> tuple[Any, Any]:
        tq = dataclasses.replace(plan.get(path), bits=bits, init="max_min")
        changed = plan.with_entries((p, tq if p == path else t) for p, t in plan.entries)
        return changed, reencode_weight(params, cfg, state, path, tq)

    # the four table tensors in graph order: embedding table and output, lm_head input, weight
    names = dict(
        zip(
            TABLE_TENSORS,
            ("embedding table", "embedding output", "lm_head input", "lm_head weight"),
            strict=True,
        )
    )
    out = [Variant("run", "as the run (docs/design.md §3)", plan, state)]
    for path in TABLE_TENSORS:
        out.append(Variant(f"float-{path}", f"{names[path]} in float", *without(path)))
    out.append(Variant("float-all", "all four in float", *without(*TABLE_TENSORS)))
    for path in TABLES:
        for bits in TABLE_BITS:
            label = f"{names[path]} at {bits} bits per row"
            out.append(Variant(f"{path}-w{bits}", label, *with_bits(path, bits)))
    return out


def table_bytes(rows: int, cols: int, bits: int | None) -> int:
    """Storage of a [rows, cols] table: float32, or `bits`-bit codes + a float32 scale a row."""
    if bits is None:
        return 4 * rows * cols
    return (rows * cols * bits + 7) // 8 + 4 * rows


def render_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Cost of the embedding / lm_head precisions: {report['run']}",
        "",
        f"{report['method']} {report['bits']}, prefix {report['prefix']}, wiki eval split, "
        f"{report['eval']['windows']} windows of {report['seq_len']} tokens. Float model: "
        f"{report['float_ppl']:.3f}.",
        "",
        "| variant | embedding | lm_head | PPL | vs run | vs float |",
        "|---|---|---|---|---|---|",
    ]
    run_ppl = report["rows"][0]["ppl"]
    for row in report["rows"]:
        diff = "" if row["key"] == "run" else f"{100 * (row['ppl'] / run_ppl - 1):+.2f}%"
        mb = [f"{row['table_bytes'][t] / 2**20:.1f} MiB" for t in TABLES]
        lines.append(
            f"| {row['label']} | {mb[0]} | {mb[1]} | {row['ppl']:.3f} | {diff} | "
            f"{row['ppl'] / report['float_ppl']:.3f}× |"
        )
    lines += ["", f"`{report['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, run=True, eval_windows=32, json=True, md=True)
    args = parser.parse_args(argv)

    command = study_command("table_cost", argv)
    try:
        run = open_run(args.run)
        variants = table_variants(run.plan, run.state, run.params, run.cfg)
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    params, cfg, prefix = run.params, run.cfg, run.prefix
    windows = run.eval_windows(args.eval_windows)
    float_ppl = run.float_ppl(windows)
    print(f"float: {float_ppl:.3f}", flush=True)
    rows = []
    for v in variants:
        ppl = evaluate(
            params, v.state, v.plan, cfg, windows, prefix, prefix_params=run.prefix_params
        )["ppl"]
        sizes = {}
        for t in TABLES:
            tq = v.plan.get(t)
            sizes[t] = table_bytes(cfg.vocab_size, cfg.hidden_size, tq.bits if tq else None)
        rows.append({"key": v.key, "label": v.label, "ppl": ppl, "table_bytes": sizes})
        print(f"{v.label}: {ppl:.3f}", flush=True)
    doc = {**run.summary(windows), "float_ppl": float_ppl, "rows": rows}
    report = write_study_json(args.json, doc, command=command)
    write_bytes_atomic(Path(args.md), render_markdown(report).encode())
    return 0
