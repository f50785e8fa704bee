"""Per-block (float and LPBQ) against per-channel weights, and ExecuTorch's rows of Table 1.

The cells run `qnpu quantize` exactly as `qnpu study compare_methods` runs its grid (one
calibration set, one evaluation protocol: the `wiki` eval split and WikiText-2 test, seq_len
512, the first `--eval-windows` windows of each; the FP32 row measured once and reused), with
the decoder linears' weights per channel, per block of `--block` inputs with float scales, or
per block with AIMET's LPBQ integer block scales (`--block-scale-bits`):

    executorch-lpbq   ExecuTorch's QNN W4A16 row of Table 1: RTN, 16-bit activations (per
                      tensor, Max-Min), 4-bit LPBQ weights, KV 8
    rtn-*             RTN at W4A16 and W4A8 (down_proj inputs 16 bits, Table 1's setting),
                      per channel, per block, LPBQ; at W4A16 KV16 the weights' granularity
                      on its own (nothing else quantized below 16 bits)
    executorch-8a8w   ExecuTorch's per-channel RTN at W8A8 (Table 1's 8-8-8 row)
    executorch-smollm2  ExecuTorch's own SmolLM2 recipe (QNN 16a8w): 16-bit activations and
                      KV with per-tensor Max-Min ranges, 8-bit per-channel weights
    quantnpu-*        Quant.npu at W4A8, setting (b), per-channel and with LPBQ weights
                      learned in stage 1 (`--with-quantnpu`; stage-1 runs, much slower)

Run directories: RUNS/<row>/ (`--runs-dir`, default runs/weight_granularity); finished rows
are read back, so the study can be killed and restarted. Writes `--json` (default
reports/weight_granularity.json) and a markdown table beside it.

    qnpu study weight_granularity --prefix bos --eval-windows 32
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from qnpu_jax.files import write_bytes_atomic
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.recipes import for_config
from qnpu_jax.pipeline.stage1 import Stage1Config
from qnpu_jax.studies import compare_methods as cm
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.compare_methods import add_protocol_args, add_run_args
from qnpu_jax.studies.harness import add_model_arg, write_study_json

# (row, label, QuantizeConfig overrides); block fields filled from the arguments
ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("rtn-w4a16-channel", "RTN W4A16 per-channel", {"w_bits": 4, "a_bits": 16}),
    ("rtn-w4a16-block", "RTN W4A16 per-block", {"w_bits": 4, "a_bits": 16, "block": "float"}),
    (
        "executorch-lpbq",
        "ExecuTorch W4A16 LPBQ (Table 1)",
        {"w_bits": 4, "a_bits": 16, "block": "lpbq"},
    ),
    # the weights' granularity alone: every activation and the KV cache at 16 bits
    (
        "rtn-w4a16kv16-channel",
        "RTN W4A16 KV16 per-channel",
        {"w_bits": 4, "a_bits": 16, "kv_bits": 16},
    ),
    (
        "rtn-w4a16kv16-block",
        "RTN W4A16 KV16 per-block",
        {"w_bits": 4, "a_bits": 16, "kv_bits": 16, "block": "float"},
    ),
    (
        "rtn-w4a16kv16-lpbq",
        "RTN W4A16 KV16 LPBQ",
        {"w_bits": 4, "a_bits": 16, "kv_bits": 16, "block": "lpbq"},
    ),
    ("rtn-w4a8-channel", "RTN W4A8 per-channel", {"w_bits": 4, "a_bits": 8}),
    ("rtn-w4a8-block", "RTN W4A8 per-block", {"w_bits": 4, "a_bits": 8, "block": "float"}),
    ("rtn-w4a8-lpbq", "RTN W4A8 LPBQ", {"w_bits": 4, "a_bits": 8, "block": "lpbq"}),
    ("executorch-8a8w", "ExecuTorch W8A8 per-channel (Table 1)", {"w_bits": 8, "a_bits": 8}),
    (
        "executorch-smollm2",
        "ExecuTorch SmolLM2 recipe (16a8w, KV16)",
        {"w_bits": 8, "a_bits": 16, "kv_bits": 16},
    ),
)
QUANTNPU_ROWS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (
        "quantnpu-channel",
        "Quant.npu W4A8 per-channel, setting (b)",
        {"w_bits": 4, "a_bits": 8, "method": "quantnpu"},
    ),
    (
        "quantnpu-lpbq",
        "Quant.npu W4A8 LPBQ, setting (b)",
        {"w_bits": 4, "a_bits": 8, "block": "lpbq", "method": "quantnpu"},
    ),
)


def row_config(
    base: QuantizeConfig, over: dict[str, Any], args: argparse.Namespace
) -> QuantizeConfig:
    """The QuantizeConfig of one row: RTN with all down_proj inputs at 16 bits (Table 1's
    setting), or Quant.npu's setting (b) for the Quant.npu row."""

    over = dict(over)
    block = over.pop("block", None)
    method = over.pop("method", "rtn")
    if method == "quantnpu":
        setting = {"down_in_bits": 8, "mixed_precision": args.mixed_fraction}
    else:
        setting = {"down_in_bits": 16, "mixed_precision": 0.0, "stage1": Stage1Config()}
    return base.replace(
        method=method,
        **setting,
        **over,
        weight_block=args.block if block else None,
        weight_block_scale_bits=args.block_scale_bits if block == "lpbq" else None,
    )


def _table(rows: list[dict[str, Any]], floats: dict[str, float]) -> list[str]:
    lines = [
        "| Row | W-A-KV | Weights | PPL wiki | PPL WikiText-2 | × float (wiki) | "
        "× float (WikiText-2) |",
        "|---|---|---|---|---|---|---|",
        "| FP32 | – | – | "
        + " | ".join(f"{floats[n]:.2f}" for n in ("wiki", "wikitext2"))
        + " | 1.000 | 1.000 |",
    ]
    for r in rows:
        if r["status"] not in ("ran", "reused"):
            lines.append(f"| {r['label']} | {r['bits']} | {r['weights']} | {r['status']} ||||")
            continue
        ppl, ratio = r["ppl"], r["ratio"]
        lines.append(
            f"| {r['label']} | {r['bits']} | {r['weights']} | {ppl['wiki']:.2f} | "
            f"{ppl['wikitext2']:.2f} | {ratio['wiki']:.3f} | {ratio['wikitext2']:.3f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:

    args = parse_args(argv)
    command = "qnpu study weight_granularity " + " ".join(argv or sys.argv[1:])
    specs = cm.eval_specs(args)
    t0 = time.perf_counter()
    float_report = cm.float_cell(args, specs, command)
    floats = {n: float_report["perplexity"][n]["ppl"] for n in specs}
    base = cm.base_config(args)
    rows = [*ROWS, *(QUANTNPU_ROWS if args.with_quantnpu else ())]
    if args.rows:
        unknown = sorted(set(args.rows) - {key for key, _, _ in rows})
        if unknown:
            print(f"weight_granularity: unknown rows {unknown}", file=sys.stderr)
            return 2
        rows = [row for row in rows if row[0] in args.rows]
    out: list[dict[str, Any]] = []
    for key, label, over in rows:
        config = row_config(base, over, args)
        run_dir = Path(args.runs_dir) / f"{key}{cm._suffix(args)}"
        cell = cm.Cell(config.method, key, config, for_config(config), run_dir, label)
        status, payload = cm.run_cell(cell, args, command, cm.float_reference(float_report, specs))
        entry = cm.grid_entry(cell, status, payload, specs)
        entry["bits"] = f"{config.bits.w}-{config.bits.a}-{config.bits.kv}"
        entry["weights"] = _weights_text(config)
        out.append(entry)
        print(f"{label}: {status} {entry.get('ppl', payload if status == 'error' else '')}")
    doc = {"float": floats, "rows": out, "block": args.block}
    write_study_json(Path(args.json), doc, command=command, started=t0)
    md = [f"Command: `{command}`", "", *_table(out, floats), ""]
    write_bytes_atomic(Path(args.json).with_suffix(".md"), "\n".join(md).encode())
    return 0 if all(r["status"] in ("ran", "reused") for r in out) else 1


def _weights_text(config: QuantizeConfig) -> str:
    w = config.weights
    if w.block is None:
        return "per-channel"
    if w.block_scale_bits is None:
        return f"per-block {w.block}"
    return f"LPBQ {w.block} ({w.block_scale_bits}-bit block scales)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:

    parser = study_parser(__name__, __doc__, json=True)
    add_model_arg(parser)
    parser.add_argument("--block", type=int, default=64, help="inputs per weight block")
    parser.add_argument("--block-scale-bits", type=int, default=4, help="LPBQ integer scales")
    parser.add_argument("--with-quantnpu", action="store_true", help="add the stage-1 rows")
    parser.add_argument(
        "--rows", type=lambda t: t.split(","), default=None, help="only these rows (keys)"
    )
    add_protocol_args(parser, eval_windows=32, prefix="bos")
    add_run_args(parser, runs_dir="runs/weight_granularity")
    return parser.parse_args(argv)
