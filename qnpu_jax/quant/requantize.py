"""Integer primitives of the integer contract (docs/artifact.md), shared by the numpy
exporter, the numpy NPU emulator and the JAX integer forward.

Requantization: y = clamp(z + ((acc·M + 2^(sh−1)) >> sh), qmin, qmax), with M an int32 in
[2^30, 2^31), 1 <= sh <= 62, the product in int64 and an arithmetic right shift. Adding
2^(sh−1) before the floor-shift rounds ties half *up* (toward +inf): -2.5 -> -2, 2.5 -> 3.
Overflow bound: |acc|·M + 2^(sh−1) must stay below 2^63. |acc| < 3·2^30 always suffices
(|acc| < 2^32 suffices when sh <= 32); `requantize_np` checks the exact bound and raises.

64-bit in JAX: `requantize_jax` requires the caller to run with x64 enabled
(`with jax.enable_x64(True): ...`, jax >= 0.9; `jax.experimental.enable_x64` is gone in the
installed jax 0.10). The int64 accumulators come out of the caller's integer matmuls, which
need x64 anyway, so enabling it inside this function would be too late: it raises instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant.fake_quant import check_scales
from qnpu_jax.quant.spec import QuantSpec, code_dtype

M_MIN = 1 << 30
M_MAX = 1 << 31  # exclusive
SHIFT_MIN = 1
SHIFT_MAX = 62
INT64_MAX = np.iinfo(np.int64).max
MAX_LUT_ENTRIES = 1 << 16


def quantize_to_int(
    x: ArrayLike, scale: ArrayLike, zero_point: ArrayLike, spec: QuantSpec
) -> np.ndarray:
    """Codes clamp(round_half_even(x·fl(1/s)) + round(z), qmin, qmax) in `spec.storage_dtype`.

    The float ops and their dtype (float32 for float32 inputs) are those of
    `fake_quant.quantize` (see its module docstring for why x·fl(1/s) and not x/s), so exported
    codes equal the fake-quant codes bit for bit, eagerly or under jit.
    """
    xa = np.asarray(x)
    if not np.issubdtype(xa.dtype, np.floating):
        raise QnpuError(f"quantize_to_int needs a floating tensor, got {xa.dtype}")
    if not np.isfinite(xa).all():
        raise QnpuError("quantize_to_int got NaN or infinite values")
    sa, za = np.asarray(scale), np.asarray(zero_point)
    check_scales(sa)
    for name, a in (("scale", sa), ("zero_point", za)):
        try:
            ok = np.broadcast_shapes(xa.shape, a.shape) == xa.shape
        except ValueError:
            ok = False
        if not ok:
            raise QnpuError(f"{name} of shape {a.shape} does not broadcast to {xa.shape}")
    if spec.axis is None and sa.size != 1:
        raise QnpuError(f"per-tensor spec but scale has shape {sa.shape}")
    if spec.symmetric and np.any(np.rint(za) != 0):
        raise QnpuError("symmetric spec needs zero_point 0")
    ct = np.result_type(xa.dtype, sa.dtype, np.float32)
    # in place on one buffer (an lm_head of 262k rows is 0.6 GB in float32): the same values
    u = np.asarray(np.multiply(xa, ct.type(1) / sa.astype(ct), dtype=ct))
    np.rint(u, out=u)
    u += np.rint(za.astype(ct))
    np.clip(u, spec.qmin, spec.qmax, out=u)
    return u.astype(spec.storage_dtype)


def fixed_point_multiplier(real: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """real ≈ M·2^(−shift), M int32 in [2^30, 2^31), shift int32 in [1, 62] (float64 math).

    The relative error is at most 2^-31. Representable reals: 2^-32 <= real < 2^30 (shift 62
    and 1; a real within 2^-32 relative of 2^30 rounds up to M = 2^31 and is rejected too);
    anything else, and real <= 0 or non-finite, raises QnpuError.
    """
    r = np.asarray(real, dtype=np.float64)
    invalid = ~(np.isfinite(r) & (r > 0))
    if invalid.any():
        raise QnpuError(
            f"fixed-point multipliers must be finite and > 0, got {float(r[invalid][0])!r}"
        )
    m, e = np.frexp(r)  # r = m·2^e, m in [0.5, 1)
    mi = np.rint(m * float(M_MAX)).astype(np.int64)
    carry = mi == M_MAX  # m rounded up to 1.0: renormalize
    mi = np.where(carry, M_MIN, mi)
    shift = 31 - (e.astype(np.int64) + carry)
    bad = (shift < SHIFT_MIN) | (shift > SHIFT_MAX)
    if bad.any():
        raise QnpuError(
            f"multiplier {float(r[bad].ravel()[0])!r} is outside the representable range "
            f"[2^-32, 2^30) (shift must be in [{SHIFT_MIN}, {SHIFT_MAX}])"
        )
    return mi.astype(np.int32), shift.astype(np.int32)


def _check_requant_params(m: np.ndarray, sh: np.ndarray) -> None:
    if not (np.issubdtype(m.dtype, np.integer) and np.issubdtype(sh.dtype, np.integer)):
        raise QnpuError(f"M and shift must be integer arrays, got {m.dtype} and {sh.dtype}")
    if ((m < M_MIN) | (m >= M_MAX)).any():
        raise QnpuError("requantize multiplier M must be in [2^30, 2^31)")
    if ((sh < SHIFT_MIN) | (sh > SHIFT_MAX)).any():
        raise QnpuError(f"requantize shift must be in [{SHIFT_MIN}, {SHIFT_MAX}]")


def requantize_np(
    acc: ArrayLike,
    M: ArrayLike,
    shift: ArrayLike,
    zero_point: ArrayLike,
    qmin: ArrayLike,
    qmax: ArrayLike,
) -> np.ndarray:
    """clamp(z + ((acc·M + 2^(sh−1)) >> sh), qmin, qmax) in int64 numpy, returned as int32."""
    a = np.asarray(acc)
    if not np.issubdtype(a.dtype, np.integer):
        raise QnpuError(f"accumulators must be integers, got {a.dtype}")
    a = a.astype(np.int64)
    m = np.asarray(M)
    sh = np.asarray(shift)
    _check_requant_params(m, sh)
    m, sh = m.astype(np.int64), sh.astype(np.int64)
    half = np.left_shift(np.int64(1), sh - 1)
    limit = (INT64_MAX - half) // m  # |acc|·M + 2^(sh−1) <= 2^63 − 1
    over = (a > limit) | (a < -limit)
    if over.any():
        raise QnpuError(
            f"accumulator {int(np.broadcast_to(a, over.shape)[over][0])} overflows int64 in "
            "acc·M + 2^(sh-1) (|acc| < 3·2^30 is always safe)"
        )
    y = np.right_shift(a * m + half, sh) + np.asarray(zero_point).astype(np.int64)
    return np.clip(y, qmin, qmax).astype(np.int32)


def requantize_jax(
    acc: ArrayLike,
    M: ArrayLike,
    shift: ArrayLike,
    zero_point: ArrayLike,
    qmin: ArrayLike,
    qmax: ArrayLike,
) -> jax.Array:
    """Bit-identical JAX twin of `requantize_np` (jittable; int32 result).

    Needs x64 (`with jax.enable_x64(True):`); raises QnpuError otherwise. No overflow check
    under jit: the exporter guarantees the bound that `requantize_np` checks.
    """
    if not jax.enable_x64.value:
        raise QnpuError(
            "requantize_jax needs 64-bit integers: call it inside `with jax.enable_x64(True):`"
        )
    a = jnp.asarray(acc)
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise QnpuError(f"accumulators must be integers, got {a.dtype}")
    i64 = jnp.int64
    a = a.astype(i64)
    m = jnp.asarray(M).astype(i64)
    sh = jnp.asarray(shift).astype(i64)
    half = jnp.left_shift(jnp.ones_like(sh), sh - 1)
    y = jnp.right_shift(a * m + half, sh) + jnp.asarray(zero_point).astype(i64)
    lo = jnp.asarray(qmin).astype(i64)
    hi = jnp.asarray(qmax).astype(i64)
    return jnp.clip(y, lo, hi).astype(jnp.int32)


def build_lut(
    f: Callable[[np.ndarray], Any],
    s_in: float,
    qmin_in: int,
    qmax_in: int,
    s_out: float,
    qmin_out: int,
    qmax_out: int,
    zero_in: int = 0,
    zero_out: int = 0,
) -> np.ndarray:
    """LUT[q − qmin_in] = clamp(round_half_even(f(s_in·(q − z_in)) / s_out) + z_out, qmin_out,
    qmax_out).

    Built in float64; `f` must be vectorized over a float64 numpy array. The input has at most
    16 bits (2^16 entries). ±inf from `f` clamps to the ends; NaN raises.
    """
    for name, v in (("qmin_in", qmin_in), ("qmax_in", qmax_in)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise QnpuError(f"{name} must be an int, got {v!r}")
    if qmin_in > qmax_in:
        raise QnpuError(f"empty LUT input range [{qmin_in}, {qmax_in}]")
    n = int(qmax_in) - int(qmin_in) + 1
    if n > MAX_LUT_ENTRIES:
        raise QnpuError(
            f"LUT input range [{qmin_in}, {qmax_in}] has {n} codes; at most 16 bits (65536)"
        )
    check_scales({"s_in": np.float64(s_in), "s_out": np.float64(s_out)}, what="LUT scale")
    dtype = code_dtype(int(qmin_out), int(qmax_out))
    q = np.arange(int(qmin_in), int(qmax_in) + 1, dtype=np.int64)
    vals = np.asarray(f(float(s_in) * (q - int(zero_in)).astype(np.float64)), dtype=np.float64)
    if vals.shape != q.shape:
        raise QnpuError(f"LUT function returned shape {vals.shape}, expected {q.shape}")
    if np.isnan(vals).any():
        bad = int(q[np.isnan(vals)][0])
        raise QnpuError(f"LUT function returned NaN for input code {bad}")
    codes = np.rint(vals / float(s_out)) + int(zero_out)
    return np.clip(codes, qmin_out, qmax_out).astype(dtype)
