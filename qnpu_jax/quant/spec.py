"""QuantSpec: bit-width, signedness, symmetry and granularity of one quantizer.

Integer contract (docs/artifact.md): signed b-bit codes span [-2^(b-1), 2^(b-1) - 1], unsigned codes
[0, 2^b - 1]; zero points are integers. The full signed range is used (no "narrow" range
that would drop -2^(b-1)), so the grid matches what int8/int16 NPU kernels store.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError

MIN_BITS = 2
MAX_BITS = 16


def _check_bits(bits: object) -> int:
    # bool is an int subclass: `bits=True` is a bug, not 1 bit.
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise QnpuError(f"bits must be an integer, got {bits!r}")
    if not MIN_BITS <= int(bits) <= MAX_BITS:
        raise QnpuError(f"bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
    return int(bits)


def qrange(bits: int, signed: bool = True) -> tuple[int, int]:
    """(qmin, qmax) of b-bit codes: signed [-2^(b-1), 2^(b-1)-1], unsigned [0, 2^b-1]."""
    b = _check_bits(bits)
    if signed:
        return -(1 << (b - 1)), (1 << (b - 1)) - 1
    return 0, (1 << b) - 1


def code_dtype(qmin: int, qmax: int) -> np.dtype:
    """Smallest numpy integer dtype holding [qmin, qmax]; int4 codes live in int8 storage."""
    if qmin > qmax:
        raise QnpuError(f"empty code range [{qmin}, {qmax}]")
    candidates = (np.uint8, np.uint16) if qmin >= 0 else ()
    for dt in (*candidates, np.int8, np.int16, np.int32):
        info = np.iinfo(dt)
        if info.min <= qmin and qmax <= info.max:
            return np.dtype(dt)
    raise QnpuError(f"code range [{qmin}, {qmax}] does not fit in int32")


def resolve_axis(axis: int | None, ndim: int) -> int | None:
    """Normalize a (possibly negative) channel axis against `ndim`, with a clear error."""
    if axis is None:
        return None
    if not -ndim <= axis < ndim:
        raise QnpuError(f"channel axis {axis} is out of range for a {ndim}-d tensor")
    return axis % ndim


def reduced_shape(shape: tuple[int, ...], axis: int | None) -> tuple[int, ...]:
    """Keepdims shape of a per-tensor (axis=None: `()`) or per-channel statistic."""
    ax = resolve_axis(axis, len(shape))
    if ax is None:
        return ()
    return tuple(d if i == ax else 1 for i, d in enumerate(shape))


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """How one tensor is quantized. Hashable, so it can be a static argument of `jax.jit`.

    - `symmetric=True`: the zero point is 0. With `signed=False` this is the quantizer for
      non-negative tensors such as softmax probabilities (codes >= 0, negatives clamp to 0).
    - `symmetric=False`: an integer zero point shifts the grid; signed or unsigned codes are
      equivalent up to the zero point, both are allowed so the storage dtype can be chosen.
    - `axis=None`: one scale for the tensor; otherwise one scale per index of `axis`.

    Every (symmetric, signed) combination is meaningful, so only the types and the bit range
    are validated; what is impossible is a bit-width outside [2, 16] (1-bit codes cannot hold
    both signs and a zero, and > 16 bits has no LUT or int16 storage in the integer contract).
    """

    bits: int
    symmetric: bool = True
    signed: bool = True
    axis: int | None = None

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        for name in ("symmetric", "signed"):
            if not isinstance(getattr(self, name), bool):
                raise QnpuError(f"QuantSpec.{name} must be a bool, got {getattr(self, name)!r}")
        if self.axis is not None and (
            isinstance(self.axis, bool) or not isinstance(self.axis, int)
        ):
            raise QnpuError(f"QuantSpec.axis must be an int or None, got {self.axis!r}")

    @property
    def qmin(self) -> int:
        return qrange(self.bits, self.signed)[0]

    @property
    def qmax(self) -> int:
        return qrange(self.bits, self.signed)[1]

    @property
    def storage_dtype(self) -> np.dtype:
        """numpy dtype of the integer codes (int4 codes are stored one per int8 here)."""
        return code_dtype(self.qmin, self.qmax)


# ------------------------------------------------------------------ per-block weights
# A per-block weight [..., out, in] has one scale per (output row, block of `block` inputs):
# scales [..., out, in // block]. Quantizing it is per-row quantization of the blocked view
# [..., out, in // block, block], so the per-channel code paths serve it unchanged.


def check_block(block: int, in_features: int, what: str) -> int:
    """The number of blocks of `block` inputs in a row of `in_features`; QnpuError unless
    the row splits into whole blocks."""
    if in_features % block:
        raise QnpuError(f"{what}: {in_features} input features do not split into blocks of {block}")
    return in_features // block


def block_view(w: Any, block: int) -> Any:
    """[..., out, in] -> [..., out, in // block, block] (numpy or jax; a view, no copy)."""
    return w.reshape(*w.shape[:-1], w.shape[-1] // block, block)


def lpbq_split(scale: Any, scale_bits: int, xp: Any = np, round_: Any = None) -> tuple[Any, Any]:
    """AIMET's low-power blockwise quantization (LPBQ) of per-block scales [..., out, nb]:
    (per-channel float scales [..., out, 1], integer block scales [..., out, nb] in
    [1, 2^scale_bits]) with block scale ≈ per-channel · integer. The rule of aimet_onnx's
    `lpbq_utils.grouped_dynamic_quantize` (equal but at exact .5 ties of the ratio):
    per-channel = max over blocks / 2^scale_bits,
    integer = clip(round(scale / per-channel), 1, 2^scale_bits), the division written as a
    product with fl(1/per-channel), which is what XLA computes under jit, so numpy and jax
    agree. `xp` is numpy or jax.numpy; `round_` replaces the rounding (a straight-through
    round while scales are learned)."""
    channel = xp.max(scale, axis=-1, keepdims=True) * (1.0 / float(1 << scale_bits))
    rounded = (round_ or xp.round)(scale * (1.0 / channel))
    return channel, xp.clip(rounded, 1, 1 << scale_bits)
