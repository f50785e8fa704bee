"""GPTQ against round-to-nearest on the weight grids of a finished run -> JSON.

For each weight grid — the run's own scales ("learned": stage 1's for Quant.npu, stage 2's
for the others), or the per-channel scales recomputed with Max-Min or the MSE search — the
run's fake-quant perplexity on the `wiki` eval split (`--eval-data`: another eval set) with
the linear weights rounded to nearest and with GPTQ codes (`qnpu_jax.quant.gptq`; Hessians
from one pass of the run's fake-quant model over the windows the run's GPTQ took: its
calibration windows, or `gptq_windows` of them). Every activation encoding stays the run's.
`qnpu quantize` with `weight_rounding: gptq` is the "learned" column (in input order; with
`gptq_act_order`, the act-order column). Both start from the weights before rounding, also on
a run with GPTQ's codes (whose "learned" GPTQ column is then the run itself).
`--weights-only` adds both columns with every activation in float (the weight floor: what the
weights alone cost, W4A16 and beyond), so one command shows the floor beside the run.
`--act-order` adds a column of GPTQ rounding the columns by decreasing H_ii (GPTQ's
act-order), from the same Hessians.
`--second-pass` adds a column of GPTQ run again (in the run's column order) on Hessians taken
with the first pass's codes in place, so every linear's Hessian sees the inputs the rounded
layers before it feed it (GPTQ's sequential setting, in one more pass): `gptq_passes: 2`.

    qnpu study gptq_study --run runs/smollm2-135m-quarot-w4a8 \
        --grids learned,mse,max_min --weights-only --json reports/gptq_study.json
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from qnpu_jax.argtypes import comma_choices
from qnpu_jax.environment import study_command
from qnpu_jax.pipeline.calibrate import reencode_weight
from qnpu_jax.pipeline.config_doc import CONFIG_KEYS
from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.pipeline.weight_rounding import (
    collect_hessians,
    gptq_weight_codes,
    hessians_with_codes,
    rounded_weights,
    weights_from_codes,
)
from qnpu_jax.quant.plan import is_weight
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.error_budget import without
from qnpu_jax.studies.harness import add_eval_data_arg, open_run, write_study_json

GRIDS = ("learned", "mse", "max_min")


def main(argv: list[str] | None = None) -> int:

    parser = study_parser(__name__, __doc__, run=True, eval_windows=32, json=True)
    parser.add_argument(
        "--grids",
        type=comma_choices(GRIDS),
        default=",".join(GRIDS),
        help="weight grids: comma list of learned (the run's own scales), mse, max_min "
        "(per-channel scales recomputed by the MSE search or Max-Min)",
    )
    parser.add_argument("--damp", type=float, default=0.01, help=CONFIG_KEYS["gptq_damp"])
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="also both columns with every activation in float (the weight floor)",
    )
    parser.add_argument(
        "--act-order",
        action="store_true",
        help="also GPTQ rounding the columns by decreasing H_ii (GPTQ's act-order)",
    )
    parser.add_argument(
        "--second-pass",
        action="store_true",
        help="also GPTQ again on Hessians taken with the first pass's codes in place",
    )
    add_eval_data_arg(parser)
    args = parser.parse_args(argv)

    command = study_command("gptq_study", argv)
    # the weights before rounding: both columns round them (a GPTQ run's codes are dropped),
    # and the sink prefix runs on them
    run = open_run(args.run, rounded=False)
    plan, state, params, cfg, prefix = run.plan, run.state, run.params, run.cfg, run.prefix
    unrounded = run.prefix_params
    calib = run.gptq_windows()
    windows = run.eval_windows(args.eval_windows, args.eval_data)
    run_order = run.config.weights.gptq_act_order
    t0 = time.perf_counter()
    hessians = collect_hessians(params, state, plan, cfg, calib, prefix=prefix)
    hessian_s = time.perf_counter() - t0
    rows: list[dict[str, Any]] = []
    for grid in args.grids:
        grid_state = state
        if grid != "learned":
            for name in rounded_weights(plan):
                path = f"layers/{name}"
                planned = plan.get(path)
                assert planned is not None  # rounded_weights lists planned tensors only
                tq = dataclasses.replace(planned, init=grid)
                grid_state = reencode_weight(params, cfg, grid_state, path, tq)
        rtn = evaluate(params, grid_state, plan, cfg, windows, prefix, prefix_params=unrounded)[
            "ppl"
        ]
        t0 = time.perf_counter()
        codes = gptq_weight_codes(params, grid_state, plan, hessians, damp=args.damp)
        gptq_s = time.perf_counter() - t0
        gptq_params = weights_from_codes(params, grid_state, codes)
        gptq = evaluate(
            gptq_params, grid_state, plan, cfg, windows, prefix, prefix_params=unrounded
        )["ppl"]
        row = {"grid": grid, "rtn_ppl": rtn, "gptq_ppl": gptq, "gptq_seconds": gptq_s}
        print(f"{grid}: round-to-nearest {rtn:.3f}, GPTQ {gptq:.3f} ({gptq_s:.0f} s)", flush=True)

        def coded_ppl(c: dict[str, Any], state: Any = grid_state) -> float:
            """The run's fake-quant perplexity with the weight codes `c` on this grid."""
            coded = weights_from_codes(params, state, c)
            return evaluate(coded, state, plan, cfg, windows, prefix, prefix_params=unrounded)[
                "ppl"
            ]

        ordered = None
        if args.act_order or (args.second_pass and run_order):
            ordered = gptq_weight_codes(
                params, grid_state, plan, hessians, damp=args.damp, act_order=True
            )
        if args.act_order and ordered is not None:
            row["gptq_act_order_ppl"] = coded_ppl(ordered)
            print(f"{grid}: GPTQ, act-order {row['gptq_act_order_ppl']:.3f}", flush=True)
        if args.second_pass:
            first = ordered if run_order and ordered is not None else codes
            again = hessians_with_codes(params, grid_state, plan, cfg, calib, first, prefix=prefix)
            second = gptq_weight_codes(
                params, grid_state, plan, again, damp=args.damp, act_order=run_order
            )
            row["gptq_second_pass_ppl"] = coded_ppl(second)
            print(f"{grid}: GPTQ, second pass {row['gptq_second_pass_ppl']:.3f}", flush=True)
        if args.weights_only:
            w_plan, w_state = without(plan, grid_state, lambda p: not is_weight(p))
            row["rtn_weights_only_ppl"] = evaluate(
                params, w_state, w_plan, cfg, windows, prefix, prefix_params=unrounded
            )["ppl"]
            row["gptq_weights_only_ppl"] = evaluate(
                gptq_params, w_state, w_plan, cfg, windows, prefix, prefix_params=unrounded
            )["ppl"]
            print(
                f"{grid}, activations float: round-to-nearest {row['rtn_weights_only_ppl']:.3f},"
                f" GPTQ {row['gptq_weights_only_ppl']:.3f}",
                flush=True,
            )
        rows.append(row)
    write_study_json(
        args.json,
        {
            **run.summary(windows, args.eval_data),
            "float_ppl": run.float_ppl(windows),
            "damp": args.damp,
            "gptq_windows": len(calib),
            "hessian_seconds": hessian_s,
            "rows": rows,
        },
        command=command,
    )
    return 0
