"""Which tensors cost accuracy at 16 (or --bits) bits? One tensor at a time -> JSON report.

Every tensor of the uniform plan is fake-quantized alone (all others float), on the original
and on the randomized-Hadamard-rotated model, and its perplexity change against float on the
`wiki` eval split is recorded with the calibrated range (max |x| over layers) of activations.

    qnpu study ablate_16bit --seq-len 256 --calib-windows 8 --eval-windows 8 \
        --json reports/ablate_16bit.json

`--prefix bos` runs everything after the BOS sink prefix (the float reference too).
`--bits 8` asks the same question at 8 bits (weights, embedding and lm_head too);
`--rotations hadamard` skips the unrotated model.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import eval_windows, load_documents, sample_windows, tokenize_documents
from qnpu_jax.environment import study_command
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import FakeQuantTaps, sink_prefix, tapped_token_nll
from qnpu_jax.pipeline import calibrate
from qnpu_jax.quant import QuantPlan, uniform_plan
from qnpu_jax.quant.state import get_entry
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import (
    add_model_arg,
    add_prefix_arg,
    add_seed_arg,
    add_window_args,
    write_study_json,
)
from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations


def _mean_nll(values: list[Any]) -> float:
    return float(np.mean(np.concatenate([np.asarray(v, np.float64).ravel() for v in values])))


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, eval_windows=8, json=True)
    add_model_arg(parser)
    add_window_args(parser, seq_len=256, calib_windows=8)
    add_seed_arg(parser)
    add_prefix_arg(parser, "none")
    parser.add_argument(
        "--bits",
        type=int,
        default=16,
        help="bits of the one tensor quantized at a time (weights, embedding and lm_head too)",
    )
    parser.add_argument(
        "--rotations",
        choices=("both", "none", "hadamard"),
        default="both",
        help="the model(s) measured: none (the original), hadamard (randomized Hadamard R1+R2 "
        "fused) or both",
    )
    args = parser.parse_args(argv)
    model = load_model(args.model)
    cfg = model.config
    calib_key, rotation_key = jax.random.split(jax.random.key(args.seed))
    calib = sample_windows(
        tokenize_documents(load_documents("wiki", "calib"), model.tokenizer),
        args.seq_len,
        args.calib_windows,
        calib_key,
    )
    windows = eval_windows(
        tokenize_documents(load_documents("wiki", "eval"), model.tokenizer),
        args.seq_len,
        args.eval_windows,
    )
    batches = [jnp.asarray(windows[i : i + 1]) for i in range(len(windows))]
    prefix = sink_prefix(args.prefix, model.tokenizer)
    float_nll = _mean_nll(
        [
            tapped_token_nll(model.params, None, b, cfg=cfg, taps=None, prefix=prefix)
            for b in batches
        ]
    )
    rotations = randomized_hadamard_rotations(cfg, rotation_key)
    rotated = apply_rotations(fuse_norms(model.params, cfg), cfg, *rotations)
    full = uniform_plan(cfg.num_layers, args.bits)
    results: dict[str, Any] = {}
    variants = [("none", model.params), ("randomized Hadamard R1+R2", rotated)]
    if args.rotations != "both":
        variants = variants[:1] if args.rotations == "none" else variants[1:]
    for label, params in variants:
        state = calibrate(params, cfg, full, calib, prefix=prefix)
        rows: list[dict[str, Any]] = []
        for path, tq in full.entries:
            plan = QuantPlan(((path, tq),), cfg.num_layers)
            taps = FakeQuantTaps(plan)
            nll = _mean_nll(
                [
                    tapped_token_nll(params, state, b, cfg=cfg, taps=taps, prefix=prefix)
                    for b in batches
                ]
            )
            entry = get_entry(state, path)
            max_abs = float(np.max(np.asarray(entry.scale) * np.asarray(entry.qmax)))
            rows.append(
                {
                    "tensor": path,
                    "ppl_change": math.exp(nll - float_nll) - 1,
                    "max_abs_range": max_abs,
                }
            )
            print(f"{label} {path}: {100 * rows[-1]['ppl_change']:+.3f}%", flush=True)
        results[label] = sorted(rows, key=lambda r: -r["ppl_change"])
    write_study_json(
        args.json,
        {
            "model": args.model,
            "data": "wiki eval split; calibration on the calib split",
            "seq_len": args.seq_len,
            "eval_windows": len(windows),
            "calibration_windows": len(calib),
            "prefix": args.prefix,
            "bits": args.bits,
            "float_ppl": math.exp(float_nll),
            "rows_by_rotation": results,
        },
        command=study_command("ablate_16bit", argv),
    )
    return 0
