"""Sensitivity-guided 8/16-bit mixed precision of the down_proj inputs (paper §4.4, eq. 4).

Every layer's down_proj input is quantized at 8 bits with a static Max-Min scale from the
calibration windows, and its sensitivity is the mean relative error

    ratio = (1/N) Σ |DQ(Q(x_i)) − x_i| / (|x_i| + 1e-8)

over all N calibration elements; the most sensitive `fraction` of layers (rounded up) moves
to 16 bits. The per-layer computation is one `jax.vmap` over the stacked layers.
`tensor_sensitivity` runs the same scan on another linear input or output at its planned bits
(not in the paper): the down_proj output, which carries the layers' massive activations into
the residual stream, or a 4-bit linear input of a W4A4 plan.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import LINEAR_INPUTS, LINEAR_OUTPUTS, UNROTATED_INPUT
from qnpu_jax.mesh import data_size, host_array, put_batch
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params
from qnpu_jax.models.taps import CaptureTaps, tapped_forward
from qnpu_jax.pipeline.calibrate import calibrate
from qnpu_jax.quant.fake_quant import fake_quant
from qnpu_jax.quant.plan import QuantPlan, TensorQuant

SENSITIVITY_EPS = 1e-8  # eq. (4)'s guard against |x| = 0


def relative_error_sum(
    x: jax.Array, scale: jax.Array, qmin: jax.Array, qmax: jax.Array
) -> jax.Array:
    """Σ |DQ(Q(x)) − x| / (|x| + 1e-8) over all elements of one layer's activation (eq. 4)."""
    x = x.astype(jnp.float32)
    err = jnp.abs(fake_quant(x, scale, 0.0, qmin, qmax) - x)
    return jnp.sum(err / (jnp.abs(x) + SENSITIVITY_EPS))


# per-layer tensors whose bits the scan may raise: the linears' inputs and outputs
SCANNED_TENSORS = (*LINEAR_INPUTS, *LINEAR_OUTPUTS)


def check_scanned(name: str) -> None:
    """Refuse a tensor eq. (4)'s scan does not measure (the linears' inputs and outputs)."""
    if name not in SCANNED_TENSORS:
        raise QnpuError(f"no sensitivity scan for {name!r}; known: {SCANNED_TENSORS}")


@partial(jax.jit, static_argnames=("cfg", "prefix", "name"))
def _layer_error_sums(
    params: Params,
    tokens: jax.Array,
    scale: jax.Array,
    qmin: jax.Array,
    qmax: jax.Array,
    *,
    cfg: ModelConfig,
    prefix: tuple[int, ...],
    name: str,
) -> tuple[jax.Array, int]:
    taps = CaptureTaps(frozenset({name}))
    _, aux = tapped_forward(
        params, {"layers": None, "outer": None}, tokens, cfg=cfg, taps=taps, prefix=prefix
    )
    x = aux["layers"][name]
    return jax.vmap(relative_error_sum)(x, scale, qmin, qmax), x[0].size


@dataclasses.dataclass(frozen=True)
class SensitivityReport:
    ratios: tuple[float, ...]  # per layer, eq. (4)
    bits: int  # the precision the ratios were measured at
    scales: tuple[float, ...]  # the static Max-Min scales used


def tensor_sensitivity(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    name: str,
    *,
    bits: int = 8,
    batch_size: int | None = None,
    prefix: tuple[int, ...] = (),
    mesh: Mesh | None = None,
) -> SensitivityReport:
    """Eq. (4) for every layer's tensor `name` at `bits`, static Max-Min over `windows`; on
    `mesh`, the windows split along its data axis (`batch_size` None: its size)."""
    check_scanned(name)
    tq = TensorQuant(bits=bits, init="max_min")
    plan = QuantPlan(((f"layers/{name}", tq),), cfg.num_layers)
    batch_size = batch_size or data_size(mesh)
    entry = calibrate(params, cfg, plan, windows, batch_size=batch_size, prefix=prefix, mesh=mesh)[
        "layers"
    ][name]
    total = jnp.zeros((cfg.num_layers,), jnp.float32)
    count = 0
    for i in range(0, len(windows), batch_size):
        batch = put_batch(mesh, windows[i : i + batch_size])
        sums, size = _layer_error_sums(
            params,
            batch,
            entry.scale,
            entry.qmin,
            entry.qmax,
            cfg=cfg,
            prefix=prefix,
            name=name,
        )
        total = total + sums
        count += int(size)
    ratios = np.asarray(host_array(total), np.float64) / count
    if not np.isfinite(ratios).all():
        raise QnpuError(f"{name} sensitivity: non-finite ratio (NaN in calibration data?)")
    return SensitivityReport(
        ratios=tuple(float(r) for r in ratios),
        bits=bits,
        scales=tuple(float(s) for s in np.asarray(host_array(entry.scale)).ravel()),
    )


def down_proj_sensitivity(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    *,
    bits: int = 8,
    batch_size: int = 1,
    prefix: tuple[int, ...] = (),
) -> SensitivityReport:
    """Eq. (4) for every layer's down_proj input (the paper's scan)."""
    return tensor_sensitivity(
        params, cfg, windows, UNROTATED_INPUT, bits=bits, batch_size=batch_size, prefix=prefix
    )


def promoted_layers(ratios: tuple[float, ...] | list[float], fraction: float) -> tuple[int, ...]:
    """Indices of the ceil(fraction·L) most sensitive layers (ties: lower index first)."""
    if not 0.0 <= fraction <= 1.0:
        raise QnpuError(f"mixed-precision fraction must be in [0, 1], got {fraction}")
    count = math.ceil(round(fraction * len(ratios), 9))  # 0.1·30 is 3, not 4
    order = sorted(range(len(ratios)), key=lambda i: (-ratios[i], i))
    return tuple(sorted(order[:count]))


def mixed_layer_bits(
    ratios: tuple[float, ...] | list[float], fraction: float, base_bits: int = 8
) -> tuple[int, ...]:
    """Per-layer bits of a scanned tensor: 16 for the promoted layers, `base_bits` elsewhere."""
    promoted = set(promoted_layers(ratios, fraction))
    return tuple(16 if i in promoted else base_bits for i in range(len(ratios)))
