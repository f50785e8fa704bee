"""Perplexity against the share of down_proj inputs promoted to 16 bits (paper Figure 4) -> JSON.

The cheaper sweep the pipeline issue allows: one finished `qnpu quantize` run is reused. Its
rotations and every encoding stay as learned/calibrated; the down_proj inputs are promoted to
16 bits in the order of the run's sensitivity ratios (eq. 4) for p = 0, 10, ..., 100%. A
layer whose down_proj input keeps the run's bit-width keeps the run's (learned) encoding, a
layer that changes bit-width gets a static Max-Min encoding at the new one; so the p of the
run reproduces the run, and the other points have no stage 1 of their own.

    qnpu study mixed_precision_sweep --run runs/w4a8 --eval-windows 32 \
        --json reports/mixed_precision_sweep.json
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.environment import study_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import UNROTATED_INPUT as DOWN_IN
from qnpu_jax.pipeline.calibrate import calibrate
from qnpu_jax.pipeline.mixed_precision import down_proj_sensitivity, mixed_layer_bits
from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.quant.plan import QuantPlan, TensorQuant
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import open_run, write_study_json


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, run=True, eval_windows=32, json=True)
    parser.add_argument(
        "--steps",
        default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0",
        help="comma list of shares p in [0, 1] of layers whose down_proj input is promoted to "
        "16 bits",
    )
    args = parser.parse_args(argv)

    run = open_run(args.run)
    plan, state, params, cfg, prefix = run.plan, run.state, run.params, run.cfg, run.prefix
    # before anything runs
    tq = plan.get(f"layers/{DOWN_IN}")
    if tq is None:
        raise QnpuError(f"{args.run}: the run does not quantize the down_proj inputs")
    if tq.shadow_channels or tq.muxq_channels:
        raise QnpuError(
            f"{args.run}: the run moves outlier channels of the down_proj inputs "
            f"({'shadow outliers' if tq.shadow_channels else 'MUXQ'}), which the sweep's "
            "re-encoding would drop; sweep the run they were added to"
        )
    calib = run.calib_windows()
    scan = RunDir(args.run).read_sensitivity(DOWN_IN)
    if scan is not None:
        ratios = scan["ratios"]
    else:
        ratios = list(down_proj_sensitivity(params, cfg, calib, prefix=prefix).ratios)
    encodings = {}
    for bits in (8, 16):
        single = QuantPlan(((f"layers/{DOWN_IN}", TensorQuant(bits=bits)),), cfg.num_layers)
        encodings[bits] = calibrate(params, cfg, single, calib, prefix=prefix)["layers"][DOWN_IN]
    windows = run.eval_windows(args.eval_windows)
    float_ppl = run.float_ppl(windows)
    rows: list[dict[str, Any]] = []
    for p in (float(x) for x in args.steps.split(",")):
        layer_bits = mixed_layer_bits(ratios, p)
        promoted = np.array([b == 16 for b in layer_bits])
        # a layer at the run's own bit-width keeps the run's (possibly learned) encoding
        keep = np.array([tq.bits_for_layer(i) == b for i, b in enumerate(layer_bits)])
        run_entry = state["layers"][DOWN_IN]
        entry = jax.tree.map(
            lambda run_f, f16, f8, keep=keep, promoted=promoted: jnp.where(
                keep, run_f, jnp.where(promoted, f16, f8)
            ),
            run_entry,
            encodings[16],
            encodings[8],
        )
        swept_state = {"layers": {**state["layers"], DOWN_IN: entry}, "outer": state["outer"]}
        swept_plan = plan.with_entries(
            (path, TensorQuant(bits=8, layer_bits=layer_bits) if path == f"layers/{DOWN_IN}" else t)
            for path, t in plan.entries
        )
        ppl = evaluate(
            params, swept_state, swept_plan, cfg, windows, prefix, prefix_params=run.prefix_params
        )["ppl"]
        rows.append(
            {
                "fraction": p,
                "promoted_layers": [i for i, b in enumerate(layer_bits) if b == 16],
                "ppl": ppl,
                "ratio_to_float": ppl / float_ppl,
            }
        )
        print(f"p = {p:.0%}: ppl {ppl:.3f} ({ppl / float_ppl:.3f}x float)", flush=True)
    write_study_json(
        args.json,
        {
            **run.summary(windows),
            "sweep": "reuses the run; a down_proj input at the run's bit-width keeps its encoding, "
            "one that changes bit-width gets Max-Min at the new one",
            "sensitivity_ratios": ratios,
            "float_ppl": float_ppl,
            "rows": rows,
        },
        command=study_command("mixed_precision_sweep", argv),
    )
    return 0
