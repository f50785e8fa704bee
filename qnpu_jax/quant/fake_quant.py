"""Fake quantization x -> s * (clamp(round(x/s + round(z)), qmin, qmax) - round(z)) and its
LSQ/LSQ+ straight-through gradients (paper §4.3.1, eqs. (1) and (2)).

Conventions shared by every function here:
- `scale` and `zero_point` broadcast to `x`: shape `()` per tensor, keepdims shape per channel.
- `qmin`/`qmax` are numbers or arrays broadcastable to `x`, so layers stacked on a leading axis
  can carry different bit-widths through one `vmap`/`scan` without recompiling.
- The zero point is rounded half-to-even in the forward pass and passes gradients straight
  through (docs/artifact.md: zero points are integers).
- Arithmetic runs in at least float32 (bfloat16 cannot hold 16-bit codes); the output has the
  dtype of `x` when `x` is floating.

Exact float form of the codes (the integer contract; `integer.quantize_to_int` repeats it):

    u = x · fl(1/s);   q = clamp(round_half_even(u) + ẑ, qmin, qmax)

Why not round(x/s + ẑ) literally: XLA rewrites `x / broadcast(s)` into `x · (1/s)` under jit,
so a literal division gives different codes eagerly, jitted and in numpy. Multiplying by the
reciprocal is what XLA computes anyway and leaves no multiply-add to contract into an FMA.
Rounding before adding the integer ẑ keeps u's precision when |ẑ| is large. The two forms
agree except at an exact .5 tie with odd ẑ (the tie goes to the even u, not the even u + ẑ).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant.spec import MAX_BITS, MIN_BITS

# Smallest scale `positive_scale` lets through: far below any useful step, far above 0.
MIN_SCALE = 1e-8


def _compute_dtype(*arrays: jax.Array) -> Any:
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _sum_to_shape(g: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Transpose of broadcasting: sum `g` down to `shape` (a cotangent for a broadcast input)."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, d in enumerate(shape) if d == 1 and g.shape[lead + i] != 1
    )
    return jnp.sum(g, axis=axes).reshape(shape)


@jax.custom_jvp
def round_ste(x: jax.Array) -> jax.Array:
    """Round half to even in the forward pass, identity gradient (straight-through)."""
    return jnp.round(x)


@round_ste.defjvp
def _round_ste_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> Any:
    (x,), (t,) = primals, tangents
    return jnp.round(x), t


def _codes_float(
    x: jax.Array, scale: jax.Array, zq: jax.Array, qmin: jax.Array, qmax: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(clamped codes as floats, u = x·fl(1/s)): the one place for these float ops."""
    u = x * (1.0 / scale)
    return jnp.clip(jnp.round(u) + zq, qmin, qmax), u


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fake_quant(
    x_meta: tuple[tuple[int, ...], Any],
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array,
    qmin: jax.Array,
    qmax: jax.Array,
    grad_scale: jax.Array,
) -> jax.Array:
    zq = jnp.round(zero_point)
    q, _ = _codes_float(x, scale, zq, qmin, qmax)
    return scale * (q - zq)


def _fake_quant_fwd(
    x_meta: tuple[tuple[int, ...], Any],
    x: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array,
    qmin: jax.Array,
    qmax: jax.Array,
    grad_scale: jax.Array,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    zq = jnp.round(zero_point)
    q, u = _codes_float(x, scale, zq, qmin, qmax)
    # Only u is full-size; everything else saved is as small as the quantizer parameters.
    return scale * (q - zq), (u, scale, zero_point, qmin, qmax, grad_scale)


def _fake_quant_bwd(
    x_meta: tuple[tuple[int, ...], Any], res: tuple[jax.Array, ...], g: jax.Array
) -> tuple[jax.Array, ...]:
    u, scale, zero_point, qmin, qmax, grad_scale = res
    x_shape, x_dtype = x_meta
    zq = jnp.round(zero_point)
    # v = u + ẑ. Paper eqs. (1)-(2) use the strict interior qmin < v < qmax (as LSQ does): a
    # value exactly on the edge of the grid counts as clipped (dx = 0, ds = q_edge − ẑ,
    # dz = −s). Comparing u with the integers qmin − ẑ, qmax − ẑ avoids rounding u + ẑ.
    below, above = u <= qmin - zq, u >= qmax - zq
    inside = ~(below | above)
    # round(v) − v = round(u) − u for integer ẑ.
    ds_elem = jnp.where(inside, jnp.round(u) - u, jnp.where(below, qmin - zq, qmax - zq))
    dz_elem = jnp.where(inside, 0.0, -scale)
    dx = _sum_to_shape(jnp.where(inside, g, 0.0), x_shape).astype(x_dtype)
    ds = _sum_to_shape(g * ds_elem * grad_scale, scale.shape)
    dz = _sum_to_shape(g * dz_elem * grad_scale, zero_point.shape)
    # qmin/qmax are bit-width choices and grad_scale a constant: no gradient flows to them.
    return (
        dx,
        ds,
        dz,
        jnp.zeros_like(qmin),
        jnp.zeros_like(qmax),
        jnp.zeros_like(grad_scale),
    )


_fake_quant.defvjp(_fake_quant_fwd, _fake_quant_bwd)


def fake_quant(
    x: ArrayLike,
    scale: ArrayLike,
    zero_point: ArrayLike,
    qmin: ArrayLike,
    qmax: ArrayLike,
    *,
    grad_scale: float | ArrayLike = 1.0,
) -> jax.Array:
    """x̂ = s·(clamp(round(x/s) + ẑ, qmin, qmax) − ẑ), ẑ = round(z), with LSQ+ gradients.

    (x/s is computed as x·fl(1/s), see the module docstring.) With v = x/s + ẑ and "inside"
    meaning qmin < v < qmax (strict, as in the paper):
      dx̂/dx = 1 inside, 0 outside (straight-through estimator);
      dx̂/ds = round(v) − v inside, qmin − ẑ below, qmax − ẑ above        (eq. 1);
      dx̂/dz = 0 inside, −s outside (ẑ passes the gradient straight through) (eq. 2).
    The s and z cotangents are summed to the shapes of `scale`/`zero_point` and multiplied by
    `grad_scale` (see `lsq_grad_scale`); the x cotangent is not scaled. qmin, qmax and
    grad_scale get zero cotangents.
    """
    x = jnp.asarray(x)
    scale, zero_point = jnp.asarray(scale), jnp.asarray(zero_point)
    ct = _compute_dtype(x, scale, zero_point)
    out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else ct
    out = _fake_quant(
        (x.shape, ct),
        x.astype(ct),
        scale.astype(ct),
        zero_point.astype(ct),
        jnp.asarray(qmin, dtype=ct),
        jnp.asarray(qmax, dtype=ct),
        jnp.asarray(grad_scale, dtype=ct),
    )
    return out.astype(out_dtype)


def lsq_grad_scale(elements_per_scale: int, qmax: int) -> float:
    """LSQ gradient scale g = 1/sqrt(N·Qmax).

    N counts the elements sharing one scale *within one sample* (e.g. hidden size for a
    per-tensor activation of one token, `in` features for a per-channel weight row), so the
    factor does not change with the batch size. The paper's "1/sqrt(N)·Qmax" is LSQ's
    1/sqrt(N·Qmax) (its reference [12]).
    """
    if elements_per_scale < 1:
        raise QnpuError(f"elements_per_scale must be >= 1, got {elements_per_scale}")
    if qmax < 1:
        raise QnpuError(f"qmax must be >= 1 for a gradient scale, got {qmax}")
    return 1.0 / math.sqrt(elements_per_scale * qmax)


def quantize(
    x: ArrayLike, scale: ArrayLike, zero_point: ArrayLike, qmin: ArrayLike, qmax: ArrayLike
) -> jax.Array:
    """Integer codes clamp(round(x·fl(1/s)) + round(z), qmin, qmax) as int32 (no gradient)."""
    x, scale, zero_point = jnp.asarray(x), jnp.asarray(scale), jnp.asarray(zero_point)
    ct = _compute_dtype(x, scale, zero_point)
    q, _ = _codes_float(
        x.astype(ct),
        scale.astype(ct),
        jnp.round(zero_point.astype(ct)),
        jnp.asarray(qmin, dtype=ct),
        jnp.asarray(qmax, dtype=ct),
    )
    return q.astype(jnp.int32)


def dequantize(q: ArrayLike, scale: ArrayLike, zero_point: ArrayLike) -> jax.Array:
    """s·(q − round(z)); `dequantize(quantize(x, ...), ...)` equals `fake_quant(x, ...)`."""
    scale, zero_point = jnp.asarray(scale), jnp.asarray(zero_point)
    ct = _compute_dtype(scale, zero_point)
    zq = jnp.round(zero_point.astype(ct))
    return scale.astype(ct) * (jnp.asarray(q).astype(ct) - zq)


def dynamic_fake_quant(x: ArrayLike, bits: int | ArrayLike, *, axis: int = -1) -> jax.Array:
    """Symmetric per-token dynamic fake quantization (the SpinQuant-style baseline).

    s = max|x| / (2^(b−1) − 1) over `axis`, computed on the fly and treated as a constant
    (stop-gradient); the rounding passes gradients straight through to x. All-zero rows get
    s = 1 (any positive value reproduces the zeros). Codes stay in [−qmax, qmax] by
    construction, so no clamp (and no clamp gradient) is needed. `bits` may be a traced
    array (per-layer bit-widths under vmap).
    """
    x = jnp.asarray(x)
    if isinstance(bits, int | np.integer) and not MIN_BITS <= int(bits) <= MAX_BITS:
        raise QnpuError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
    ct = _compute_dtype(x)
    xc = x.astype(ct)
    # Integer shift, not exp2: qmax must be exact so the largest |x| maps onto ±qmax exactly.
    qmax = (jnp.left_shift(1, jnp.asarray(bits, jnp.int32) - 1) - 1).astype(ct)
    amax = jax.lax.stop_gradient(jnp.max(jnp.abs(xc), axis=axis, keepdims=True))
    scale = jnp.where(amax > 0, amax / qmax, jnp.ones_like(amax))
    out = round_ste(xc * (1.0 / scale)) * scale
    return out.astype(x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else ct)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def check_scales(tree: Any, what: str = "scale") -> None:
    """Eager check (outside jit) that every leaf of `tree` is finite and > 0.

    Raises QnpuError naming the pytree path, the first bad index and its value.
    """
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(leaf, jax.core.Tracer):
            raise QnpuError(f"check_scales must run outside jit ({what} at {_path_str(path)})")
        a = np.asarray(leaf)
        if not (np.issubdtype(a.dtype, np.number) and not np.iscomplexobj(a)):
            raise QnpuError(f"{what} at {_path_str(path)} is not a real number array: {a.dtype}")
        a = a.astype(np.float64)
        for bad, why in ((np.isnan(a), "NaN"), (~np.isfinite(a), "not finite")):
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                raise QnpuError(f"{what} at {_path_str(path)} is {why} at index {idx}")
        if (a <= 0).any():
            idx = tuple(int(i) for i in np.argwhere(a <= 0)[0])
            raise QnpuError(f"{what} at {_path_str(path)} must be > 0, got {a[idx]} at index {idx}")


@jax.custom_jvp
def _clip_below_ste(raw: jax.Array, min_scale: jax.Array) -> jax.Array:
    return jnp.maximum(raw, min_scale)


@_clip_below_ste.defjvp
def _clip_below_ste_jvp(primals: tuple[jax.Array, ...], tangents: tuple[jax.Array, ...]) -> Any:
    raw, min_scale = primals
    return jnp.maximum(raw, min_scale), tangents[0]


def positive_scale(raw: ArrayLike, min_scale: float = MIN_SCALE) -> jax.Array:
    """max(raw, min_scale) with a straight-through gradient (jittable).

    Default parameterization: the learned parameter *is* the scale, so the paper's eq. (1)
    gradient and the LSQ gradient scale apply unchanged and checkpoints hold exportable scales.
    The clip only guards a rare step past zero; its gradient passes straight through so a
    clipped scale can still recover instead of being frozen by a zero gradient. For a
    multiplicative parameterization use `scale_to_log` / `log_to_scale` instead.
    """
    raw = jnp.asarray(raw)
    return _clip_below_ste(raw, jnp.asarray(min_scale, dtype=raw.dtype))


def scale_to_log(scale: ArrayLike) -> jax.Array:
    """log(s): the unconstrained parameter of the log parameterization."""
    return jnp.log(jnp.asarray(scale))


def log_to_scale(log_scale: ArrayLike) -> jax.Array:
    """exp(log s): always positive; gradients w.r.t. log s are s·(dL/ds)."""
    return jnp.exp(jnp.asarray(log_scale))
