"""Channel smoothing between up_proj and down_proj (SmoothQuant-Edge, MobileQuant §3.2/§5.1).

The down_proj input d = silu(gate) ⊙ up is per-tensor quantized and not rotated, so a few
channels with a wide range set its scale. For a per-channel vector s > 0

    d' = d / s  (up_proj's output rows divided by s: W_up ← diag(1/s) W_up)
    W_down ← W_down diag(s)                  (down_proj's input columns multiplied by s)

leaves the float model unchanged (silu(gate) ⊙ (up / s) = d / s) and moves range from the
activation into the weight columns. Both factors fuse offline into the weights; nothing runs at
inference. s follows SmoothQuant: s_j = max|d_j|^α / max|W_down[:, j]|^(1-α).

Row-vector convention as in `rotate.py`: W is stored [out, in]. The smoothing acts on the
intermediate axis only, so it commutes with the residual rotation R1 and with R2.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.graph import SMOOTHED_LINEARS

Params = dict[str, Any]


def smoothing_scales(act_absmax: ArrayLike, down_proj: ArrayLike, alpha: float) -> jax.Array:
    """s [L, I] from the down_proj inputs' per-channel max |x| [L, I] and the down_proj
    weights [L, D, I] (as they will be quantized, i.e. after any rotation). Channels that are
    never active or whose weights are all zero keep s = 1."""
    if not 0.0 < alpha < 1.0:
        raise QnpuError(f"smoothing alpha must be in (0, 1), got {alpha!r}")
    act = jnp.asarray(act_absmax, jnp.float32)
    w = jnp.max(jnp.abs(jnp.asarray(down_proj, jnp.float32)), axis=-2)  # [L, I]
    if act.shape != w.shape:
        raise QnpuError(
            f"activation ranges of shape {act.shape} do not match the down_proj input "
            f"channels {w.shape}"
        )
    if not bool(jnp.all(jnp.isfinite(act))):
        raise QnpuError("the down_proj input ranges are not finite (NaN/inf in calibration)")
    live = (act > 0) & (w > 0)
    safe_act = jnp.where(live, act, 1.0)
    safe_w = jnp.where(live, w, 1.0)
    return jnp.where(live, safe_act**alpha / safe_w ** (1.0 - alpha), 1.0)


def smooth_mlp(params: Params, scales: ArrayLike) -> Params:
    """Fold s [L, I] into up_proj (rows / s) and down_proj (columns * s); model-equivalent."""
    layers = dict(params["layers"])
    s = jnp.asarray(scales, jnp.float32)
    up_name, down_name = SMOOTHED_LINEARS
    up, down = layers[up_name], layers[down_name]  # [L, I, D], [L, D, I]
    if s.shape != up.shape[:2] or s.shape != (down.shape[0], down.shape[2]):
        raise QnpuError(
            f"smoothing scales of shape {s.shape} do not match up_proj {up.shape} / "
            f"down_proj {down.shape}"
        )
    if not bool(jnp.all(jnp.isfinite(s) & (s > 0))):
        raise QnpuError("smoothing scales must be finite and positive")
    layers[up_name] = (up / s[:, :, None]).astype(up.dtype)
    layers[down_name] = (down * s[:, None, :]).astype(down.dtype)
    out = dict(params)
    out["layers"] = layers
    return out
