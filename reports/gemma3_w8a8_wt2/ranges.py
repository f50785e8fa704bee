"""Each calibrated activation's range on the run's calibration windows against its range on
eval windows (max |x| per layer): which tensors the eval text takes past their grid.

    QNPU_DATA_DIR=../shared/data python3 reports/gemma3_w8a8_wt2/ranges.py RUN DATA WINDOWS OUT
"""

from __future__ import annotations

import json
import sys

import numpy as np

from qnpu_jax.pipeline.calibrate import collect_activation_stats
from qnpu_jax.studies.harness import open_run


def absmax(stats: dict) -> dict[str, np.ndarray]:
    out = {}
    for group in ("layers", "outer"):
        for name, s in stats[group].items():
            path = f"layers/{name}" if group == "layers" else name
            out[path] = np.maximum(np.abs(np.asarray(s.min)), np.abs(np.asarray(s.max))).reshape(-1)
    return out


def main(run_dir: str, data: str, n: int, out: str) -> None:
    run = open_run(run_dir)
    kw = dict(prefix=run.prefix, graph=run.plan.graph, prefix_params=run.prefix_params)
    calib = absmax(
        collect_activation_stats(run.params, run.cfg, run.plan, run.calib_windows(), **kw)
    )
    held = absmax(
        collect_activation_stats(run.params, run.cfg, run.plan, run.eval_windows(n, data), **kw)
    )
    rows = {}
    for path in sorted(calib):
        tq = run.plan.get(path)
        ratio = held[path] / calib[path]
        rows[path] = {
            "bits": tq.bits if tq.layer_bits is None else list(tq.layer_bits),
            "calib_absmax": calib[path].tolist(),
            "eval_absmax": held[path].tolist(),
            "max_ratio": float(ratio.max()),
            "layers_past": int((ratio > 1).sum()),
        }
        print(
            f"{path:24s} bits {tq.bits:2d} eval/calib max {ratio.max():6.3f} "
            f"layers past {int((ratio > 1).sum()):2d}/{ratio.size} "
            f"calib absmax {calib[path].max():10.2f}",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump({"run": run_dir, "data": data, "windows": n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
