"""How far stage 1 moved a finished run's learned scales from their initializers -> JSON.

Every encoding stage 1 learned (`stage1_plan`'s learnable tensors) is compared with the one
the plan's initializer gives on the run's final, rotated model: weights re-encoded from the
final weights, activations recalibrated on the run's calibration windows (`calibrate`, as
stage 2 does for the other tensors). A ratio learned / rule of 1 means stage 1 left that scale
where the rule would put it for the same model, so whatever stage 1 gained there came from the
rotations. Scales at stage 1's positivity floor (1e-8) are counted apart and left out of the
ratios.

    qnpu study scale_drift --run runs/smollm2-135m-quantnpu-w4a8 \
        --json reports/scale_drift_quantnpu_w4a8.json
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

from qnpu_jax.environment import study_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.pipeline.calibrate import calibrate
from qnpu_jax.pipeline.recipes import config_stage1_plan as stage1_plan
from qnpu_jax.quant.state import get_entry
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import open_run, write_study_json

# stage 1 keeps learned scales at max(raw, 1e-8) (`positive_scale`); below this is that floor
FLOOR = 1e-7


def learnable_plan(plan: Any, config: Any) -> Any:
    """The sub-plan of the tensors stage 1 learned in a run with `config` (pure)."""

    entries = tuple((p, tq) for p, tq in stage1_plan(plan, config).entries if tq.learnable)
    if not entries:
        raise QnpuError(f"a {config.method} run learns no encoding in stage 1: nothing to compare")
    return plan.with_entries(entries)


def state_scale(state: Any, path: str) -> np.ndarray:

    return np.asarray(get_entry(state, path).scale, np.float64)


def drift_rows(learned: Any, reference: Any, paths: list[str]) -> list[dict[str, Any]]:
    """Per path: how many scales, how many at the floor, and |ln(learned / reference)| of the
    others (median, 90th percentile, max) with the median ratio (pure)."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        a, b = state_scale(learned, path), state_scale(reference, path)
        if a.shape != b.shape:
            raise ValueError(f"{path}: learned scales {a.shape} vs reference {b.shape}")
        live = (a > FLOOR) & (b > FLOOR)
        ratio = a[live] / b[live]
        log = np.abs(np.log(ratio))
        rows.append(
            {
                "path": path,
                "scales": int(a.size),
                "at_floor": int((a <= FLOOR).sum()),
                "median_abs_log_ratio": float(np.median(log)) if log.size else None,
                "p90_abs_log_ratio": float(np.percentile(log, 90)) if log.size else None,
                "max_abs_log_ratio": float(log.max()) if log.size else None,
                "median_ratio": float(np.median(ratio)) if ratio.size else None,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, run=True, json=True)
    args = parser.parse_args(argv)

    command = study_command("scale_drift", argv)
    try:
        # the reference calibrates the rotated float model: the weights before GPTQ's rounding
        run = open_run(args.run, rounded=False)
        config = run.config
        sub = learnable_plan(run.plan, config)
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    reference = calibrate(run.params, run.cfg, sub, run.calib_windows(), prefix=run.prefix)
    rows = drift_rows(run.state, reference, [p for p, _ in sub.entries])
    for r in rows:
        med = r["median_abs_log_ratio"]
        print(
            f"{r['path']}: median |ln ratio| {med:.4f}, max {r['max_abs_log_ratio']:.3f}, "
            f"{r['at_floor']} of {r['scales']} at the floor",
            flush=True,
        )
    write_study_json(
        args.json,
        {
            "run": str(args.run),
            **config.summary(),
            "stage1": dataclasses.asdict(config.stage1),
            "reference": "the plan's initializer on the run's final rotated model "
            f"(calibration: {config.data.calib}, {config.data.windows} windows)",
            "rows": rows,
        },
        command=command,
    )
    return 0
