"""Exact integer matmuls on float BLAS, for both integer engines (numpy and JAX; no import
of either here, so the emulator stays free of JAX).

An integer matmul is exact in floating point when every partial sum is an integer the float
type holds (below 2^24 in float32, 2^53 in float64): then no summation order can round.
`dot_plan` finds, from bounds on the operands, the cheapest way to stay below that in float32,
splitting the left operand into balanced digits (and, failing that, the contraction into
chunks); `run_dot_plan` carries a plan out with the caller's array module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from qnpu_jax.errors import QnpuError

EXACT = {"float32": 1 << 24, "float64": 1 << 53, "int64": 1 << 63}  # |sums| held exactly
MAX_DIGITS = 3
MAX_CHUNKS = 8


@dataclasses.dataclass(frozen=True)
class DotPlan:
    """How an integer matmul runs exactly on float BLAS: the left operand split into `digits`
    balanced base-2^`digit_bits` digits (`balanced_digits`), the contraction split
    into slices of `chunk_len` (the last one shorter), each slice of each digit one
    matmul of `dtype` whose every partial sum is an integer below 2^24 (float32), 2^53
    (float64) or 2^63 (int64), so any summation order is exact; the pieces are summed in
    int64."""

    dtype: str
    digit_bits: int
    digits: int
    chunk_len: int

    def chunks(self, k: int) -> int:
        return -(-k // self.chunk_len)


def dot_plan(a_max: int, b_max: int, k: int, a_sum: int | None = None) -> DotPlan:
    """The cheapest exact plan for Σ_k a·b with |a| <= a_max, |b| <= b_max and, when given,
    Σ_k |a| <= a_sum (softmax probabilities sum to about one): one float32 matmul when
    min(a_max·k, a_sum)·b_max < 2^24; else the fewest digits (at most MAX_DIGITS) that bring
    every float32 partial sum below 2^24, whole, then with the contraction in chunks (at most
    MAX_CHUNKS: slicing the weights costs more than a digit on XLA:CPU); else one float64
    matmul (sums below 2^53), else one int64 matmul (below 2^63), else QnpuError."""
    a_max, b_max, k = int(a_max), int(b_max), int(k)
    mass = a_max * k if a_sum is None else min(a_max * k, int(a_sum))
    if min(a_max, b_max, k, mass) < 0:
        raise QnpuError(f"dot_plan needs non-negative bounds, got {a_max}, {b_max}, {k}")
    if mass * b_max >= EXACT["int64"]:  # the digits' recombination would wrap in int64 too
        raise QnpuError(
            f"integer matmul bound {a_max}·{b_max}·{k} = {mass * b_max:.3g} overflows int64"
        )
    limit = EXACT["float32"]
    if mass * b_max < limit:
        return DotPlan("float32", 0, 1, max(k, 1))
    for max_chunks in (1, MAX_CHUNKS):
        for digits in range(2, MAX_DIGITS + 1):
            bits, digit_max = min(
                ((b, _digit_max(a_max, b, digits)) for b in range(1, a_max.bit_length() + 1)),
                key=lambda bd: bd[1],
            )
            per = (limit - 1) // (digit_max * b_max)
            chunks = -(-k // per) if per else max_chunks + 1
            if chunks <= max_chunks:
                return DotPlan("float32", bits, digits, -(-k // chunks))
    dtype = "float64" if mass * b_max < EXACT["float64"] else "int64"
    return DotPlan(dtype, 0, 1, max(k, 1))


def _digit_max(a_max: int, bits: int, digits: int) -> int:
    """The largest |digit| of |a| <= a_max in balanced base-2^bits digits: the low ones in
    [−2^(bits−1), 2^(bits−1)), the top one what remains."""
    low = 1 << (bits * (digits - 1))
    half = 1 << (bits - 1)
    low_min = half * (low - 1) // ((1 << bits) - 1)  # the low digits' sum reaches −low_min
    return max(half, (a_max + low_min) // low)


def balanced_digits(a: Any, bits: int, digits: int, xp: Any) -> list[Any]:
    """Integer `a` as `digits` balanced base-2^bits digits, lowest first: a = Σ d_i·2^(bits·i)
    (see `_digit_max` for their ranges)."""
    half, mask = 1 << (bits - 1), (1 << bits) - 1
    out = []
    for _ in range(digits - 1):
        d = xp.bitwise_and(a + half, mask) - half
        out.append(d)
        a = xp.right_shift(a - d, bits)
    return [*out, a]


def _contracted(subscripts: str) -> tuple[str, str, str, str]:
    """(a's subscripts, b's, the output's, the contracted letter: a's last, absent from the
    output, once in b, which has no ellipsis)."""
    ins, out = subscripts.replace(" ", "").split("->")
    sa, sb = ins.split(",")
    c = sa[-1]
    if "..." in sb or c in out or c not in sb or sb.count(c) != 1:
        raise QnpuError(f"{subscripts!r}: a's last index must be contracted against b")
    return sa, sb, out, c


def run_dot_plan(
    plan: DotPlan,
    subscripts: str,
    a: Any,
    b: Any,
    xp: Any,
    einsum: Callable[[str, Any, Any], Any],
) -> Any:
    """Σ over a's last index of a·b as `subscripts` says, exact, in int64, following `plan`:
    `a` holds integers (int64), `b` integers in any dtype (float ones of `plan.dtype` are used
    as they are). `xp` is numpy or jax.numpy and `einsum(subscripts, x, y)` its matmul, so the
    emulator and the JAX forward share this one description of the split. Digits are stacked
    on a new leading axis (one matmul reads `b` once for all of them); chunks are slices."""
    sa, sb, out, c = _contracted(subscripts)
    ftype = getattr(xp, plan.dtype)
    bf = b if b.dtype == ftype else b.astype(ftype)
    if plan.digits > 1:
        parts = balanced_digits(a, plan.digit_bits, plan.digits, xp)
        free = next(ch for ch in "ZYXWVUTSRQPONMLKJIHGFEDCBA" if ch not in subscripts)
        subscripts = f"{free}{sa},{sb}->{free}{out}"
        a = xp.stack([d.astype(ftype) for d in parts])
    else:
        a = a.astype(ftype)
    k, ax = a.shape[-1], sb.index(c)
    parts_sum: Any = 0
    for lo in range(0, max(k, 1), plan.chunk_len):
        hi = min(k, lo + plan.chunk_len)
        b_part = bf if (lo, hi) == (0, k) else bf[(slice(None),) * ax + (slice(lo, hi),)]
        parts_sum = parts_sum + einsum(subscripts, a[..., lo:hi], b_part).astype(xp.int64)
    if plan.digits == 1:
        return parts_sum
    total = parts_sum[0]
    for i in range(1, plan.digits):
        total = total + xp.left_shift(parts_sum[i], plan.digit_bits * i)
    return total
