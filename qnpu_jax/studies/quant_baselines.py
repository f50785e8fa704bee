"""Baseline rows for the static quantization pipeline -> JSON report.

Perplexity on the `wiki` eval split of: the float model; every tensor of the integer graph
fake-quantized at 16 bits; and static round-to-nearest W8A8 / W4A8 / W4A4 (KV8; per-channel
Max-Min weights, per-tensor Max-Min activations, the rest of docs/design.md §3's table), each with
and without randomized-Hadamard R1/R2 rotations (QuaRot-style, fused offline). Calibration
windows come from the `wiki` calib split only.

`--prefixes none,bos` repeats every row without and with the BOS sink prefix (PrefixQuant:
the model's first position carries massive "attention sink" activations; computing it offline
in float and keeping only its quantized K/V takes the sink out of every static range). Each
row is compared with the float model under the same prefix.

    qnpu study quant_baselines --seq-len 512 --calib-windows 16 --eval-windows 32 \
        --prefixes none,bos --json reports/quant_baselines.json
"""

from __future__ import annotations

import math
import time
from typing import Any

import jax

from qnpu_jax.data import eval_windows, load_documents, sample_windows, tokenize_documents
from qnpu_jax.environment import study_command
from qnpu_jax.eval import perplexity
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import FakeQuantTaps, sink_prefix, tapped_token_nll
from qnpu_jax.pipeline import calibrate
from qnpu_jax.quant import QuantPlan, default_plan, uniform_plan
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import (
    add_model_arg,
    add_seed_arg,
    add_window_args,
    write_study_json,
)
from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, eval_windows=32, json=True)
    add_model_arg(parser)
    add_window_args(parser)
    parser.add_argument(
        "--batch-size", type=int, default=1, help="windows per batch, calibrating and scoring"
    )
    add_seed_arg(parser)
    parser.add_argument("--prefixes", default="none,bos", help="comma list of none | bos")
    args = parser.parse_args(argv)

    model = load_model(args.model)
    cfg = model.config
    calib_ids = tokenize_documents(load_documents("wiki", "calib"), model.tokenizer)
    eval_ids = tokenize_documents(load_documents("wiki", "eval"), model.tokenizer)
    calib_key, rotation_key = jax.random.split(jax.random.key(args.seed))
    calib = sample_windows(calib_ids, args.seq_len, args.calib_windows, calib_key)
    windows = eval_windows(eval_ids, args.seq_len, args.eval_windows)

    rotations = randomized_hadamard_rotations(cfg, rotation_key)
    rotated = apply_rotations(fuse_norms(model.params, cfg), cfg, *rotations)
    n = cfg.num_layers
    plans: list[tuple[str, QuantPlan]] = [
        ("all tensors 16-bit", uniform_plan(n, 16)),
        ("RTN W8A8 KV8", default_plan(n, w_bits=8, a_bits=8)),
        ("RTN W4A8 KV8", default_plan(n, w_bits=4, a_bits=8)),
        ("RTN W4A4 KV8", default_plan(n, w_bits=4, a_bits=4)),
    ]

    def run(nll_fn: Any) -> dict[str, Any]:
        r = perplexity(nll_fn, windows, batch_size=args.batch_size, progress=False)
        return {"ppl": r.ppl, "eval_seconds": r.seconds}

    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    for prefix_name in args.prefixes.split(","):
        prefix = sink_prefix(prefix_name, model.tokenizer)
        float_row = run(
            lambda t, pf=prefix: tapped_token_nll(
                model.params, None, t, cfg=cfg, taps=None, prefix=pf
            )
        )
        rows.append({"method": "float", "rotation": None, "prefix": prefix_name, **float_row})
        print(f"float / prefix {prefix_name}: {float_row['ppl']:.3f}", flush=True)
        for rotation, params in (("none", model.params), ("randomized Hadamard R1+R2", rotated)):
            for name, plan in plans:
                t0 = time.perf_counter()
                state = calibrate(
                    params, cfg, plan, calib, batch_size=args.batch_size, prefix=prefix
                )
                calib_s = time.perf_counter() - t0
                taps = FakeQuantTaps(plan)
                row = run(
                    lambda t, p=params, s=state, tp=taps, pf=prefix: tapped_token_nll(
                        p, s, t, cfg=cfg, taps=tp, prefix=pf
                    )
                )
                row = {
                    "method": name,
                    "rotation": rotation,
                    "prefix": prefix_name,
                    **row,
                    "ppl_vs_float": row["ppl"] / float_row["ppl"] - 1,
                    "calibration_seconds": calib_s,
                }
                rows.append(row)
                print(
                    f"{name} / {rotation} / prefix {prefix_name}: {row['ppl']:.3f} "
                    f"({100 * row['ppl_vs_float']:+.2f}%)",
                    flush=True,
                )
    report = {
        "model": args.model,
        "data": {"eval": "wiki (eval split)", "calibration": "wiki (calib split)"},
        "seq_len": args.seq_len,
        "eval_windows": len(windows),
        "eval_tokens": int(len(windows) * (args.seq_len - 1)),
        "calibration_windows": len(calib),
        "seed": args.seed,
        "granularity": "weights per-channel symmetric (embedding/lm_head per row, 8-bit); "
        "activations per-tensor static symmetric; softmax probabilities fixed 1/65535",
        "activation_init": "max_min",
        "rows": rows,
    }
    assert all(math.isfinite(r["ppl"]) for r in rows)
    write_study_json(
        args.json, report, command=study_command("quant_baselines", argv), started=start
    )
    return 0
