"""What a residual stream on two 16-bit grids would give, in fake quantization only: per layer,
the channels whose calibrated max |x| exceeds 1/DIV of the largest (Gemma 3's massive
channels) keep the per-tensor scale, every other channel gets a scale from the others' max.
Not an encoding the integer engines run: an upper bound for one, on the run's own windows.

    QNPU_DATA_DIR=../shared/data python3 reports/gemma3_w8a8_wt2/two_grids.py \
        RUN DATA WINDOWS DIV OUT
"""

from __future__ import annotations

import json
import sys

import jax.numpy as jnp
import numpy as np

from qnpu_jax.pipeline.calibrate import channel_absmax
from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.studies.harness import open_run

RESIDUAL = ("resid_attn", "resid_mlp")


def main(run_dir: str, data: str, n: int, div: float, out: str) -> None:
    run = open_run(run_dir)
    plan, state, cfg, prefix = run.plan, run.state, run.cfg, run.prefix
    windows = run.eval_windows(n, data)
    ch = channel_absmax(
        run.params, cfg, run.calib_windows(), RESIDUAL, prefix=prefix,
        prefix_params=run.prefix_params,
    )  # fmt: skip
    layers = dict(state["layers"])
    split = {}
    for name in RESIDUAL:
        enc = layers[name]
        scale = np.asarray(enc.scale, np.float32).reshape(-1)  # [L]
        qmax = float(np.asarray(enc.qmax).reshape(-1)[0])
        top = ch[name].max(-1)  # [L]
        massive = ch[name] > top[:, None] / div  # [L, C]
        rest = np.where(massive, 0.0, ch[name]).max(-1)  # [L]
        per_channel = np.where(massive, scale[:, None], (rest / qmax)[:, None])
        width = ch[name].shape[-1]
        layers[name] = enc.replace(
            scale=jnp.asarray(per_channel, jnp.float32),
            zero_point=jnp.zeros_like(jnp.asarray(per_channel)),
            qmin=jnp.broadcast_to(jnp.asarray(enc.qmin).reshape(-1, 1), (len(scale), width)),
            qmax=jnp.broadcast_to(jnp.asarray(enc.qmax).reshape(-1, 1), (len(scale), width)),
        )
        split[name] = {
            "massive_channels": [np.flatnonzero(m).tolist() for m in massive],
            "scale_ratio": (scale / (rest / qmax)).tolist(),
        }
        print(name, "massive per layer", massive.sum(-1).tolist(), flush=True)
        print(name, "step ratio", np.round(scale / (rest / qmax), 1).tolist(), flush=True)
    two = {"layers": layers, "outer": state["outer"]}
    res = {"run": run_dir, "data": data, "windows": n, "div": div, "split": split}
    res["float_ppl"] = run.float_ppl(windows)
    res["run_ppl"] = evaluate(
        run.params, state, plan, cfg, windows, prefix, prefix_params=run.prefix_params
    )["ppl"]
    res["two_grids_ppl"] = evaluate(
        run.params, two, plan, cfg, windows, prefix, prefix_params=run.prefix_params
    )["ppl"]
    print(
        f"float {res['float_ppl']:.3f}, run {res['run_ppl']:.3f}, "
        f"residual on two grids {res['two_grids_ppl']:.3f}",
        flush=True,
    )
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
