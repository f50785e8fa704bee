"""Up→down channel smoothing (`smooth_mlp: α`) across α for a training-free method -> JSON.

One method recipe (`rtn` or `quarot`, no stage 1) with every down_proj input at 8 bits (no
promotion: the tensor smoothing is for), calibrated once per α exactly as `qnpu quantize`
calibrates it (the run's calibration windows, seed, rotations and sink prefix), evaluated on
the first `--eval-windows` windows of the `wiki` eval split. "none" is the method without
smoothing. A stage-1 method is measured with a full run instead
(configs/smollm2-135m-quantnpu-w4a8-smooth.yaml).

    qnpu study smooth_study --method quarot --bits W4A8 \
        --alphas none,0.2,0.3,0.5,0.7 --eval-windows 16 --json reports/smooth_study.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from qnpu_jax.environment import study_command
from qnpu_jax.ir.graph import LINEAR_IO, SMOOTHED_LINEARS, UNROTATED_INPUT
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import sink_prefix
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.quantized_model import QuantizedModel
from qnpu_jax.pipeline.recipes import for_config
from qnpu_jax.pipeline.run import calibration_data, wiki_eval_windows
from qnpu_jax.pipeline.steps import Calibration
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import add_model_arg, add_window_args, w_a_bits, write_study_json


def _alphas(text: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for part in text.split(","):
        if part == "none":
            out.append(None)
            continue
        try:
            alpha = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is neither 'none' nor a number") from None
        if not 0 < alpha < 1:
            raise argparse.ArgumentTypeError(f"alpha {alpha} is not in (0, 1)")
        out.append(alpha)
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, eval_windows=16, json=True)
    add_model_arg(parser)
    parser.add_argument(
        "--method",
        choices=("rtn", "quarot"),
        default="quarot",
        help="the training-free recipe smoothed",
    )
    parser.add_argument(
        "--bits", type=w_a_bits, default="W4A8", help="weight and activation bits, as W4A8"
    )
    parser.add_argument(
        "--alphas",
        type=_alphas,
        default="none,0.2,0.3,0.5,0.7",
        help="comma list of smoothing α in (0, 1), or none (no smoothing)",
    )
    add_window_args(parser)
    args = parser.parse_args(argv)

    command = study_command("smooth_study", argv)


    config = QuantizeConfig.of(
        model=args.model,
        method=args.method,
        w_bits=args.bits[0],
        a_bits=args.bits[1],
        mixed_precision=0.0,
        seq_len=args.seq_len,
        calib_windows=args.calib_windows,
    )
    model = load_model(config.model)
    prefix = sink_prefix(config.prefix, model.tokenizer)
    data = Calibration(*calibration_data(config, model.tokenizer))
    windows = wiki_eval_windows(config, model.tokenizer, args.eval_windows)
    start = QuantizedModel.from_float(model, prefix=prefix)
    rows: list[dict[str, Any]] = []
    for alpha in args.alphas:
        t0 = time.perf_counter()
        quantized = for_config(config.replace(smooth_mlp=alpha))(start, data)
        ppl = quantized.perplexity(windows)["ppl"]
        state = quantized.require_state()
        # smoothing also rescales up_proj's (8-bit) output channels by 1/s
        scale_rows = {
            f"{name}_scale_max": [float(x) for x in state["layers"][name].scale]
            for name in (UNROTATED_INPUT, LINEAR_IO[SMOOTHED_LINEARS[0]][1])
        }
        rows.append({"alpha": alpha, "ppl": ppl, **scale_rows, "seconds": time.perf_counter() - t0})
        print(f"alpha {alpha}: {ppl:.3f}", flush=True)
    write_study_json(
        args.json,
        {
            **config.summary(),
            "down_in_bits": config.bits.down_in,
            "calibration": {"data": config.data.calib, "windows": config.data.windows},
            "eval": {"data": "wiki (eval split)", "windows": len(windows)},
            "rows": rows,
        },
        command=command,
    )
    return 0
