"""Activation distributions of one layer's linear inputs (paper Figures 5–6) -> PNG + JSON.

Captures the inputs of q_proj (`attn_in`), o_proj (`attn_out`), up_proj (`mlp_in`) and
down_proj (`down_in`) of decoder layer L on the first N of the run's own calibration windows
(same seed, same sink prefix), twice: in the float model without rotation, and in the run's
model (norms fused, its final R1/R2; the rotation-free `rtn` method captures the same values
twice). Each panel is a log-count histogram with clipping ranges as vertical lines:
  - "run: learned" / "run: calibrated": the encoding stored in the run (learned scales as the
    forward uses them), drawn on the panels of the model the run quantizes;
  - "init (<method>)": the plan's initializer for that tensor (mean ± 3σ, Max-Min, ...)
    recomputed on the values shown, the way stage 1 / stage 2 initialize a range, and the
    mean-based range μ ± 3σ the paper's Figure 5 draws, when the plan uses another one.
The title gives the share of values inside the first range; the legend that of each.

    qnpu study plot_activations --run runs/NAME --layer 10 --windows 4 \
        --out reports/NAME_acts
writes reports/NAME_acts/layer10.png and layer10.json (ranges and shares).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.argtypes import positive_int
from qnpu_jax.environment import study_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_bytes_atomic
from qnpu_jax.ir.graph import LINEAR_INPUTS, LINEAR_IO, UNROTATED_INPUT
from qnpu_jax.models.taps import effective_state
from qnpu_jax.pipeline.calibrate import capture_activations
from qnpu_jax.pipeline.steps import STAGE1_TENSORS
from qnpu_jax.quant.init import init_range_stats, mse_scale, scale_from_stats, update_range_stats
from qnpu_jax.quant.plan import TensorQuant
from qnpu_jax.quant.state import Encoding
from qnpu_jax.report.plots import (
    ActivationPanel,
    ClipRange,
    clip_range,
    plot_activation_distributions,
    share_inside,
)
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import open_run, write_study_json

# (the first linear reading it, a distinct linear input activation) in graph order: the
# figures' four panels (attention input, o_proj input, MLP input, down_proj input)
PANELS = tuple(
    (next(lin for lin, (i, _) in LINEAR_IO.items() if i == name), name) for name in LINEAR_INPUTS
)


def init_range(values: np.ndarray, tq: TensorQuant, layer: int, method: str) -> ClipRange:
    """Initializer `method` at this tensor's bits on `values` (calibrate's statistics path)."""
    spec = tq.spec(layer)  # per-tensor: statistics of shape ()
    if method == "mse":
        scale, zero_point = mse_scale(values, spec)
    else:
        bins = 2048 if method == "percentile" else 0
        stats = update_range_stats(init_range_stats((1,), num_bins=bins), values)
        scale, zero_point = scale_from_stats(stats, method, spec)
    qmin, qmax = tq.qrange(tq.bits_for_layer(layer))
    label = f"init ({method}, {tq.bits_for_layer(layer)} bits)"
    return clip_range(label, float(np.ravel(scale)[0]), float(np.ravel(zero_point)[0]), qmin, qmax)


def run_range(entry: Encoding, layer: int, label: str) -> ClipRange:
    """The run's clipping range of `layer`. Where the integer range is per channel (shadow
    outliers: the hot channels' is unbounded, they run on the CPU), the ordinary channels'
    range, and the label says how many channels it leaves out."""
    qmin, qmax = np.ravel(entry.qmin[layer]), np.ravel(entry.qmax[layer])
    lo, hi = float(qmin.max()), float(qmax.min())  # the ordinary channels' (the narrowest)
    wider = int(np.sum((qmin < lo) | (qmax > hi)))
    if wider:
        label = f"{label}, {wider} shadow channel{'s' if wider > 1 else ''} unclipped"
    return clip_range(
        label,
        float(np.ravel(entry.scale[layer])[0]),
        float(np.ravel(entry.zero_point[layer])[0]),
        lo,
        hi,
    )


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, run=True)
    parser.add_argument("--layer", type=int, required=True, help="decoder layer (from 0)")
    parser.add_argument("--windows", type=positive_int, default=4, help="calibration windows")
    parser.add_argument(
        "--seq-len", type=positive_int, default=None, help="cut windows (default: the run's)"
    )
    parser.add_argument("--out", type=Path, required=True, help="a directory")
    args = parser.parse_args(argv)
    try:
        return run(args, study_command("plot_activations", argv))
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, command: str) -> int:
    # the run's rotated float model: the weights before GPTQ's rounding, as the prefix's
    run = open_run(args.run, rounded=False)
    config, plan, state, params = run.config, run.plan, run.state, run.params
    cfg, prefix = run.cfg, run.prefix
    if not 0 <= args.layer < cfg.num_layers:
        raise QnpuError(f"--layer {args.layer}: the model has layers 0..{cfg.num_layers - 1}")
    calib = run.calib_windows()
    windows = calib[: args.windows, : args.seq_len or calib.shape[1]]
    names = LINEAR_INPUTS
    captured = {
        "float (no rotation)": capture_activations(
            run.loaded.params, cfg, windows, names, layer=args.layer, prefix=prefix
        ),
        "rotated (the run)" if config.method != "rtn" else "the run (rtn: no rotation)": (
            capture_activations(params, cfg, windows, names, layer=args.layer, prefix=prefix)
        ),
    }
    stored = effective_state(plan, state)["layers"]
    learned = config.method == "quantnpu" and config.stage1.steps > 0
    panels: list[ActivationPanel] = []
    summary: dict[str, Any] = {}
    for i, (model_name, acts) in enumerate(captured.items()):
        for linear, name in PANELS:
            values = acts[name].ravel()
            tq = plan.get(f"layers/{name}")
            ranges: list[ClipRange] = []
            if tq is not None:
                ranges.append(init_range(values, tq, args.layer, tq.init))
                if tq.init != "mean_std":  # the paper's Figure 5 draws the mean-based range
                    ranges.append(init_range(values, tq, args.layer, "mean_std"))
                if i == 1:  # the run's encodings belong to the model it quantizes
                    was_learned = learned and name in STAGE1_TENSORS
                    was_learned &= name != UNROTATED_INPUT or config.learn_down_in
                    label = "run: learned" if was_learned else f"run: calibrated ({tq.init})"
                    ranges.insert(0, run_range(stored[name], args.layer, label))
            title = f"{linear} input ({name}), {model_name}"
            panels.append(ActivationPanel(title, values, tuple(ranges)))
            summary[title] = {
                "values": int(values.size),
                "min": float(values.min()),
                "max": float(values.max()),
                "std": float(values.std()),
                "ranges": [
                    {
                        "label": r.label,
                        "lo": r.lo,
                        "hi": r.hi,
                        "share_inside": share_inside(values, r.lo, r.hi),
                    }
                    for r in ranges
                ],
            }
    t = windows.shape[1]
    title = (
        f"{args.run.name}: layer {args.layer} linear inputs, {len(windows)} calibration "
        f"windows of {t} tokens ({config.method} W{config.bits.w}A{config.bits.a})"
    )
    png = plot_activation_distributions(panels, columns=len(LINEAR_INPUTS), title=title)
    out = Path(args.out)
    write_bytes_atomic(out / f"layer{args.layer}.png", png)
    write_study_json(
        out / f"layer{args.layer}.json",
        {
            "run": str(args.run),
            "layer": args.layer,
            "windows": len(windows),
            "seq_len": t,
            "prefix": config.prefix,
            "panels": summary,
        },
        command=command,
    )
    print(f"wrote {out / f'layer{args.layer}.png'} and {out / f'layer{args.layer}.json'}")
    for name, s in summary.items():
        shares = ", ".join(f"{r['label']} {r['share_inside']:.2%}" for r in s["ranges"])
        print(f"{name}: |x| <= {max(abs(s['min']), abs(s['max'])):.3g}; {shares}")
    return 0
