"""Channel smoothing between up_proj and down_proj (SmoothQuant-Edge, MobileQuant §3.2/§5.1).

The down_proj input d = silu(gate) ⊙ up is per-tensor quantized and not rotated, so a few
channels with a wide range set its scale. For a per-channel vector s > 0

    d' = d / s  (up_proj's output rows divided by s: W_up ← diag(1/s) W_up)
    W_down ← W_down diag(s)                  (down_proj's input columns multiplied by s)

leaves the float model unchanged (silu(gate) ⊙ (up / s) = d / s) and moves range from the
activation into the weight columns. Both factors fuse offline into the weights; nothing runs at
inference. s follows SmoothQuant (`equalize.smoothing_scales`). It is the down_in pair of
`equalize`, fixed offline; it acts on the intermediate axis only, so it commutes with the
residual rotation R1 and with R2.
"""

from __future__ import annotations

from typing import Any

from jax.typing import ArrayLike

from qnpu_jax.ir.graph import UNROTATED_INPUT
from qnpu_jax.transforms.equalize import fold_pair

Params = dict[str, Any]


def smooth_mlp(params: Params, scales: ArrayLike) -> Params:
    """Fold s [L, I] into up_proj (rows / s) and down_proj (columns * s); model-equivalent."""
    return fold_pair(params, UNROTATED_INPUT, scales, None)
