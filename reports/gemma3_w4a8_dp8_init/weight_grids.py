"""How far each linear's stored weights sit from the transformed float weights in a finished
run, and how much of each row its grid clips (session 66). Usage: python3 weight_grids.py RUN
OUT.json"""

import json
import sys
from pathlib import Path

import numpy as np

from qnpu_jax.pipeline.quantized_model import QuantizedModel

model = QuantizedModel.load(Path(sys.argv[1]))
float_w, stored_w = model.unrounded_params()["layers"], model.params()["layers"]
state = model.require_state()["layers"]
rows = {}
for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
    w, q, enc = np.asarray(float_w[name]), np.asarray(stored_w[name]), state[name]
    step = np.asarray(enc.scale)[..., 0]  # [L, out]
    top = step * np.asarray(enc.qmax)[:, None]
    ratio = np.abs(w).max(-1) / top  # > 1: the row's largest weight is clipped
    rows[name] = {
        "qmax": float(np.asarray(enc.qmax)[0]),
        "relative_error_per_layer": (
            np.linalg.norm(q - w, axis=(1, 2)) / np.linalg.norm(w, axis=(1, 2))
        ).tolist(),
        "clipped_weight_share": float((np.abs(w) > (top + step / 2)[..., None]).mean()),
        "row_max_over_grid_top_median": float(np.median(ratio)),
        "row_max_over_grid_top_max": float(ratio.max()),
    }
Path(sys.argv[2]).write_text(json.dumps({"run": sys.argv[1], "weights": rows}, indent=1))
for name, r in rows.items():
    e = r["relative_error_per_layer"]
    print(
        f"{name}: qmax {r['qmax']:.0f}, relative error {min(e):.3f}-{max(e):.3f}, clipped "
        f"{r['clipped_weight_share']:.2%}, "
        f"row max / grid top median {r['row_max_over_grid_top_median']:.2f} "
        f"max {r['row_max_over_grid_top_max']:.2f}"
    )
