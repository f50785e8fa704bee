"""Integer primitives: quantize_to_int, fixed-point multipliers, requantization, LUTs."""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant import (
    QuantSpec,
    build_lut,
    fixed_point_multiplier,
    quantize,
    quantize_to_int,
    requantize_jax,
    requantize_np,
)


@pytest.mark.parametrize(
    ("spec", "dtype"),
    [
        (QuantSpec(bits=4, axis=-1), np.int8),
        (QuantSpec(bits=8), np.int8),
        (QuantSpec(bits=8, symmetric=False, signed=False, axis=-1), np.uint8),
        (QuantSpec(bits=16, symmetric=False), np.int16),
        (QuantSpec(bits=16, signed=False), np.uint16),
    ],
)
def test_quantize_to_int_matches_jax_quantize(spec: QuantSpec, dtype: type) -> None:
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 16)) * 2).astype(np.float32)
    shape = (1, 16) if spec.axis is not None else ()
    s = rng.uniform(1e-3, 0.3, size=shape).astype(np.float32)
    z = np.zeros(shape, np.float32)
    if not spec.symmetric:
        z = np.round(rng.uniform(spec.qmin, spec.qmax, size=shape)).astype(np.float32)
    q = quantize_to_int(x, s, z, spec)
    assert q.dtype == dtype
    want = jax.jit(quantize)(x, s, z, spec.qmin, spec.qmax)  # jitted: must still agree
    np.testing.assert_array_equal(q.astype(np.int32), want)


def test_quantize_to_int_errors() -> None:
    x = np.ones((4, 3), np.float32)
    spec = QuantSpec(bits=8, axis=-1)
    with pytest.raises(QnpuError, match="NaN or infinite"):
        quantize_to_int(np.array([np.nan], np.float32), 1.0, 0.0, QuantSpec(bits=8))
    with pytest.raises(QnpuError, match="must be > 0"):
        quantize_to_int(x, np.array([[1.0, 0.0, 1.0]]), 0.0, spec)
    with pytest.raises(QnpuError, match="does not broadcast"):
        quantize_to_int(x, np.ones((4, 1, 1)), 0.0, spec)
    with pytest.raises(QnpuError, match="per-tensor spec"):
        quantize_to_int(x, np.ones((1, 3)), 0.0, QuantSpec(bits=8))
    with pytest.raises(QnpuError, match="zero_point 0"):
        quantize_to_int(x, 1.0, 3.0, QuantSpec(bits=8))


def test_fixed_point_multiplier_reconstructs() -> None:
    rng = np.random.default_rng(1)
    edges = [2.0**-32, 2.0**30 * (1 - 2**-31), 1.0, 0.5, 0.75, (2**31 - 0.4) / 2**31, 1e-4]
    real = np.concatenate([np.exp(rng.uniform(np.log(2.0**-32), np.log(2.0**30), 2000)), edges])
    m, sh = fixed_point_multiplier(real)
    assert m.dtype == np.int32 and sh.dtype == np.int32
    assert np.all((m >= 2**30) & (m.astype(np.int64) < 2**31))
    assert np.all((sh >= 1) & (sh <= 62))
    approx = m.astype(np.float64) * np.ldexp(1.0, -sh.astype(np.int64))
    assert np.all(np.abs(approx - real) / real <= 2.0**-30)
    m0, sh0 = fixed_point_multiplier(0.75)
    assert m0.shape == () and (int(m0), int(sh0)) == (3 << 29, 31)


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf, 2.0**30, 2.0**-33])
def test_fixed_point_multiplier_rejects(bad: float) -> None:
    with pytest.raises(QnpuError, match="multiplier"):
        fixed_point_multiplier(np.array([0.5, bad]))


def _reference(acc: int, m: int, sh: int, z: int, lo: int, hi: int) -> int:
    # Exact rational arithmetic: floor(acc·M / 2^sh + 1/2), i.e. round half up (toward +inf).
    y = math.floor(Fraction(acc * m, 2**sh) + Fraction(1, 2)) + z
    return min(max(y, lo), hi)


def _random_requant_case(seed: int, n: int = 3000):
    rng = np.random.default_rng(seed)
    acc = rng.integers(-(3 << 30), 3 << 30, size=n, dtype=np.int64)
    acc[:8] = [0, 1, -1, 2**31, -(2**31), 3 * 2**30 - 1, -(3 * 2**30 - 1), 12345]
    real = np.exp(rng.uniform(np.log(1e-6), np.log(2.0), size=n))
    m, sh = fixed_point_multiplier(real)
    z = rng.integers(-20, 20, size=n)
    return acc, m, sh, z


def test_requantize_np_matches_exact_reference() -> None:
    acc, m, sh, z = _random_requant_case(2)
    lo, hi = -32768, 32767
    got = requantize_np(acc, m, sh, z, lo, hi)
    assert got.dtype == np.int32
    want = [
        _reference(int(a), int(mm), int(s), int(zz), lo, hi)
        for a, mm, s, zz in zip(acc, m, sh, z, strict=True)
    ]
    np.testing.assert_array_equal(got, want)


def test_requantize_ties_round_half_up() -> None:
    # M = 2^30, sh = 31: y = acc / 2 exactly, so odd accumulators are .5 ties.
    acc = np.array([5, 3, 1, -1, -3, -5, 4, -4])
    got = requantize_np(acc, 1 << 30, 31, 0, -128, 127)
    np.testing.assert_array_equal(got, [3, 2, 1, 0, -1, -2, 2, -2])
    # zero point and clamp
    np.testing.assert_array_equal(
        requantize_np([1000, -1000], 1 << 30, 31, 10, -128, 127), [127, -128]
    )


def test_requantize_np_overflow_and_parameter_errors() -> None:
    m, sh = 2**31 - 1, 62
    limit = (2**63 - 1 - 2 ** (sh - 1)) // m
    requantize_np([limit, -limit], m, sh, 0, -128, 127)  # the exact bound is accepted
    with pytest.raises(QnpuError, match="overflows int64"):
        requantize_np([limit + 1], m, sh, 0, -128, 127)
    with pytest.raises(QnpuError, match="overflows int64"):
        requantize_np([-(2**40)], 1 << 30, 1, 0, -128, 127)
    with pytest.raises(QnpuError, match="M must be"):
        requantize_np([1], 1 << 29, 5, 0, -128, 127)
    with pytest.raises(QnpuError, match="shift must be"):
        requantize_np([1], 1 << 30, 0, 0, -128, 127)
    with pytest.raises(QnpuError, match="must be integers"):
        requantize_np([1.5], 1 << 30, 3, 0, -128, 127)


def test_requantize_jax_bit_identical_to_numpy() -> None:
    acc, m, sh, z = _random_requant_case(3)
    lo = np.where(np.arange(acc.size) % 2 == 0, -128, -32768)  # per-element ranges broadcast
    hi = np.where(np.arange(acc.size) % 2 == 0, 127, 32767)
    want = requantize_np(acc, m, sh, z, lo, hi)
    with jax.enable_x64(True):
        got = jax.jit(requantize_jax)(acc, m, sh, z, lo, hi)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(requantize_jax([5, -5], 1 << 30, 31, 0, -8, 7), [3, -2])


def test_requantize_jax_requires_x64() -> None:
    with pytest.raises(QnpuError, match=r"jax.enable_x64\(True\)"):
        requantize_jax(np.array([1]), 1 << 30, 3, 0, -128, 127)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def test_build_lut_silu_16bit() -> None:
    s_in, s_out = 12.0 / 32767, 12.0 / 32767
    lut = build_lut(_silu, s_in, -32768, 32767, s_out, -32768, 32767)
    assert lut.shape == (65536,) and lut.dtype == np.int16
    q = np.arange(-32768, 32768)
    direct = _silu(s_in * q.astype(np.float64))
    np.testing.assert_array_equal(lut, np.clip(np.rint(direct / s_out), -32768, 32767))
    # dequantized entries are within half an output step of float64 SiLU
    assert np.all(np.abs(lut * s_out - direct) <= s_out / 2 + 1e-12)
    assert lut[32768] == 0  # q = 0 is indexed at 0 - qmin_in


def test_build_lut_exp_for_softmax() -> None:
    # Softmax LUT over d = rowmax - score in [0, 2^16 - 1], unsigned 16-bit probabilities.
    s_in, s_out = 16.0 / 65535, 1.0 / 65535
    lut = build_lut(lambda d: np.exp(-d), s_in, 0, 65535, s_out, 0, 65535)
    assert lut.dtype == np.uint16 and lut[0] == 65535
    assert np.all(np.diff(lut.astype(np.int64)) <= 0)
    direct = np.exp(-s_in * np.arange(65536, dtype=np.float64))
    assert np.all(np.abs(lut * s_out - direct) <= s_out / 2 + 1e-12)
    np.testing.assert_array_equal(lut[[0, 1000, 65535]], np.rint(direct[[0, 1000, 65535]] / s_out))


def test_build_lut_errors() -> None:
    with pytest.raises(QnpuError, match="at most 16 bits"):
        build_lut(np.exp, 0.1, 0, 65536, 0.1, 0, 255)
    with pytest.raises(QnpuError, match="NaN for input code -1"), np.errstate(invalid="ignore"):
        build_lut(np.sqrt, 1.0, -1, 4, 1.0, 0, 255)
    with pytest.raises(QnpuError, match="LUT scale"):
        build_lut(np.exp, 0.0, 0, 4, 1.0, 0, 255)
    # +inf clamps to qmax
    with np.errstate(over="ignore"):
        assert build_lut(np.exp, 100.0, 0, 10, 1.0, 0, 255)[-1] == 255


def test_the_emulators_requantize_equals_requantize_np() -> None:
    """The emulator's in-place kernel: any broadcast of acc against per-channel constants,
    scalars included, gives requantize_np's codes."""
    from qnpu_jax.runtime.emulator import requantize

    rng = np.random.default_rng(3)
    m = rng.integers(1 << 30, 1 << 31, (5,)).astype(np.int32)
    sh = rng.integers(20, 40, (5,)).astype(np.int32)
    for acc in (rng.integers(-(2**30), 2**30, (3, 5)), rng.integers(-(2**30), 2**30, (3, 1))):
        want = requantize_np(acc, m, sh, 3, -128, 127)
        assert np.array_equal(requantize(acc, m, sh, 3, -128, 127), want)
    scalar = requantize(np.int64(12345678), m[0], sh[0], 0, -(2**15), 2**15 - 1)
    assert int(scalar) == int(
        requantize_np(np.int64(12345678), m[0], sh[0], 0, -(2**15), 2**15 - 1)
    )
