"""The pictures of `qnpu report`, as PNG bytes: stage-1 loss (paper Figure 1b), perplexity
against the share of 16-bit down_proj inputs (Figure 4) and activation histograms with their
clipping ranges (Figures 5–6).

Figures are drawn on an explicit Agg canvas (`FigureCanvasAgg`), never through pyplot: no
global backend is switched, no GUI is needed, and importing the package stays free of
matplotlib.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.pipeline.run_dir import RunDir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)  # attaches the Agg canvas: savefig renders with it
    return fig


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


# ------------------------------------------------------------------------------ stage 1


def read_stage1_metrics(run_dir: Path) -> list[dict[str, float]] | None:
    """The per-step metrics of a run's stage 1, sorted by step; None if it had no stage 1."""
    run = RunDir(Path(run_dir))
    path, rows = run.stage1_metrics_path, run.read_stage1_metrics()
    if rows is None:
        return None
    steps: dict[int, dict[str, float]] = {}
    for i, entry in rows:
        step, loss = entry.get("step"), entry.get("loss")
        if not isinstance(step, int) or not _is_number(loss):
            raise QnpuError(f"{path}:{i}: expected an object with an integer 'step' and a 'loss'")
        steps[step] = {k: float(v) for k, v in entry.items() if _is_number(v)}
    return [steps[s] for s in sorted(steps)]


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def moving_average(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing mean over up to `window` steps (the first steps average what there is)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(v)])
    idx = np.arange(1, len(v) + 1)
    start = np.maximum(idx - max(1, window), 0)
    return (c[idx] - c[start]) / (idx - start)


def plot_stage1_losses(curves: Mapping[str, Sequence[Mapping[str, float]]]) -> bytes:
    """Stage-1 training loss per run: every step (faint) and its trailing mean over a tenth
    of the steps (bold), since single steps of 2 windows are noisy; a dotted line marks the
    last step with the eq. (3) local loss on."""
    if not curves:
        raise QnpuError("no stage-1 metrics to plot")
    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    for i, (name, metrics) in enumerate(curves.items()):
        color = f"C{i % 10}"
        steps = [m["step"] for m in metrics]
        loss = [m["loss"] for m in metrics]
        window = max(1, len(steps) // 10)
        ax.plot(steps, loss, color=color, lw=0.7, alpha=0.35)
        label = f"{name} (mean of {window} steps)" if window > 1 else name
        ax.plot(steps, moving_average(loss, window), color=color, lw=2.0, label=label)
        local = [m["step"] for m in metrics if m.get("local_weight", 0.0) > 0]
        if local and local[-1] < steps[-1]:
            ax.axvline(local[-1], color=color, ls=":", lw=1.0)
    ax.set_xlabel("stage-1 step")
    ax.set_ylabel("training loss")
    ax.set_title("Stage-1 loss (paper Figure 1b); dotted: end of the local loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


# ------------------------------------------------------------------------------ Figure 4


def read_sweep(path: Path) -> dict[str, Any]:
    """The JSON of qnpu study mixed_precision_sweep, checked for what the plot needs."""
    path = Path(path)
    if not path.is_file():
        raise QnpuError(f"sweep JSON not found: {path}")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QnpuError(f"{path}: malformed JSON ({e})") from e
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not isinstance(rows, list) or not rows:
        raise QnpuError(f"{path}: not a mixed-precision sweep (no 'rows' list)")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not all(
            _is_number(row.get(k)) for k in ("fraction", "ppl")
        ):
            raise QnpuError(f"{path}: rows[{i}] needs numbers 'fraction' and 'ppl'")
    if doc.get("float_ppl") is not None and not _is_number(doc["float_ppl"]):
        raise QnpuError(f"{path}: 'float_ppl' must be a number")
    return doc


def plot_sweep(sweep: Mapping[str, Any]) -> bytes:
    """Perplexity against the share of down_proj inputs promoted to 16 bits (Figure 4)."""
    rows = sorted(sweep["rows"], key=lambda r: r["fraction"])
    x = [100 * r["fraction"] for r in rows]
    y = [r["ppl"] for r in rows]
    fig = _figure(6.5, 4.2)
    ax = fig.add_subplot()
    ax.plot(x, y, "o-", label=f"{sweep.get('method', 'run')} {sweep.get('bits', '')}".strip())
    if sweep.get("float_ppl") is not None:
        ax.axhline(sweep["float_ppl"], color="gray", ls="--", label="float")
    finite = [v for v in y if math.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) > 10:
        ax.set_yscale("log")  # 8-bit outliers can cost orders of magnitude
    ax.set_xlabel("down_proj inputs at 16 bits (% of layers)")
    ax.set_ylabel("perplexity")
    ev = sweep.get("eval")
    where = f" — {ev.get('data')}, {ev.get('windows')} windows" if isinstance(ev, dict) else ""
    ax.set_title(f"PPL vs 16-bit down_proj share (paper Figure 4){where}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


# ------------------------------------------------------------------------------ Figures 5–6


@dataclasses.dataclass(frozen=True)
class ClipRange:
    """A quantizer's representable range [lo, hi], drawn as two vertical lines."""

    label: str
    lo: float
    hi: float


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationPanel:
    """One histogram: the values of one tensor and the clipping ranges to draw over them."""

    title: str
    values: np.ndarray
    ranges: tuple[ClipRange, ...] = ()


def clip_range(label: str, scale: float, zero_point: float, qmin: float, qmax: float) -> ClipRange:
    """The range a static quantizer represents: s·(qmin − z) … s·(qmax − z), z rounded as in
    `fake_quant`."""
    z = float(np.round(zero_point))
    return ClipRange(label, float(scale) * (float(qmin) - z), float(scale) * (float(qmax) - z))


def share_inside(values: np.ndarray, lo: float, hi: float) -> float:
    """Fraction of `values` within [lo, hi] (what the quantizer does not clip)."""
    v = np.asarray(values).ravel()
    if v.size == 0:
        return float("nan")
    return float(np.count_nonzero((v >= lo) & (v <= hi)) / v.size)


def plot_activation_distributions(
    panels: Sequence[ActivationPanel], *, columns: int = 4, title: str = "", bins: int = 200
) -> bytes:
    """Histograms (log count) of each panel's values with its clipping ranges as vertical
    lines; every panel's title gives the share of values inside its first range, the legend
    that of each range."""
    if not panels:
        raise QnpuError("no activation panels to plot")
    columns = max(1, min(columns, len(panels)))
    rows = -(-len(panels) // columns)
    fig = _figure(4.0 * columns, 3.2 * rows)
    if title:
        fig.suptitle(title)
    # One color per range label across all panels, so rows of the figure read alike.
    labels = dict.fromkeys(r.label for p in panels for r in p.ranges)
    colors = {label: f"C{(k + 1) % 10}" for k, label in enumerate(labels)}
    for i, panel in enumerate(panels):
        ax = fig.add_subplot(rows, columns, i + 1)
        v = np.asarray(panel.values, dtype=np.float64).ravel()
        v = v[np.isfinite(v)]
        if v.size == 0:
            raise QnpuError(f"panel {panel.title!r}: no finite values")
        lo = min([float(v.min()), *(r.lo for r in panel.ranges)])
        hi = max([float(v.max()), *(r.hi for r in panel.ranges)])
        if hi <= lo:
            lo, hi = lo - 0.5, hi + 0.5
        counts, edges = np.histogram(v, bins=bins, range=(lo, hi))
        ax.stairs(counts, edges, fill=True, color="C0", alpha=0.8)
        ax.set_yscale("log")
        heading = panel.title
        for j, r in enumerate(panel.ranges):
            share = share_inside(v, r.lo, r.hi)
            color = colors[r.label]
            ax.axvline(r.lo, color=color, ls="--", lw=1.0)
            ax.axvline(r.hi, color=color, ls="--", lw=1.0, label=f"{r.label}: {share:.2%} in")
            if j == 0:
                heading += f"\n{share:.2%} in [{r.lo:.3g}, {r.hi:.3g}] ({r.label})"
        ax.set_title(heading, fontsize=8)
        ax.tick_params(labelsize=7)
        if panel.ranges:
            ax.legend(fontsize=6, loc="upper right")
    return _png(fig)
