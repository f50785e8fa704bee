"""Fake quantization: forward values, LSQ/LSQ+ gradients (paper eqs. 1-2), properties, vmap."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant import (
    QuantSpec,
    check_scales,
    code_dtype,
    dequantize,
    dynamic_fake_quant,
    fake_quant,
    log_to_scale,
    lsq_grad_scale,
    positive_scale,
    qrange,
    quantize,
    round_ste,
    scale_to_log,
)

EPS32 = float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------- spec


def test_qrange_and_spec_properties() -> None:
    assert qrange(8) == (-128, 127)
    assert qrange(8, signed=False) == (0, 255)
    assert qrange(4) == (-8, 7)
    assert qrange(16, signed=False) == (0, 65535)
    spec = QuantSpec(bits=16, signed=False)  # softmax probabilities: symmetric + unsigned
    assert (spec.qmin, spec.qmax, spec.storage_dtype) == (0, 65535, np.dtype(np.uint16))
    assert QuantSpec(bits=4).storage_dtype == np.dtype(np.int8)  # int4 in int8 storage
    assert QuantSpec(bits=8, symmetric=False, axis=-1).qmin == -128
    assert code_dtype(-40000, 5) == np.dtype(np.int32)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bits": 1}, "bits must be in"),
        ({"bits": 17}, "bits must be in"),
        ({"bits": 8.0}, "bits must be an integer"),
        ({"bits": True}, "bits must be an integer"),
        ({"bits": 8, "axis": 1.5}, "axis must be an int"),
        ({"bits": 8, "signed": 1}, "signed must be a bool"),
    ],
)
def test_spec_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(QnpuError, match=match):
        QuantSpec(**kwargs)


# ---------------------------------------------------------------- forward


def test_forward_rounds_half_to_even_and_rounds_zero_point() -> None:
    x = jnp.array([0.5, 1.5, 2.5, -0.5, -1.5])
    np.testing.assert_array_equal(fake_quant(x, 1.0, 0.0, -8, 7), [0.0, 2.0, 2.0, 0.0, -2.0])
    # A clipped value exposes the zero point: s·(qmax − ẑ), with ẑ rounded half to even.
    for z, zq in [(1.3, 1.0), (1.6, 2.0), (0.5, 0.0), (1.5, 2.0), (2.5, 2.0)]:
        assert float(fake_quant(100.0, 0.5, z, -8, 7)) == 0.5 * (7 - zq)


def test_codes_are_the_same_eagerly_and_under_jit() -> None:
    # XLA turns x / broadcast(s) into x * (1/s) under jit; the contract's x·fl(1/s) makes
    # eager, jitted and numpy codes identical (see fake_quant's module docstring).
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(256, 32)) * 3).astype(np.float32)
    s = rng.uniform(1e-4, 0.1, size=(1, 32)).astype(np.float32)
    z = np.round(rng.uniform(-50, 50, size=(1, 32))).astype(np.float32)
    eager = quantize(x, s, z, -32768, 32767)
    np.testing.assert_array_equal(jax.jit(quantize)(x, s, z, -32768, 32767), eager)
    np.testing.assert_array_equal(
        jax.jit(fake_quant)(x, s, z, -32768, 32767), fake_quant(x, s, z, -32768, 32767)
    )


def test_quantize_dequantize_equal_fake_quant_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 5)).astype(np.float32) * 3
    s = rng.uniform(0.01, 0.2, size=(6, 1)).astype(np.float32)
    z = rng.uniform(-20, 20, size=(6, 1)).astype(np.float32)
    q = quantize(x, s, z, -128, 127)
    assert q.dtype == jnp.int32
    assert int(q.min()) >= -128 and int(q.max()) <= 127
    np.testing.assert_array_equal(dequantize(q, s, z), fake_quant(x, s, z, -128, 127))


def test_output_dtype_follows_x() -> None:
    x = jnp.ones((3,), jnp.bfloat16)
    assert fake_quant(x, 0.1, 0.0, -128, 127).dtype == jnp.bfloat16


# ---------------------------------------------------------------- gradients, hand-derived

# 4-bit signed asymmetric per-tensor: s = 0.5, z = 1.3 -> ẑ = 1, v = x/s + 1.
#   x      v      region        dx  ds (eq. 1)         dz (eq. 2)  forward s·(q − ẑ)
#   0.8    2.6    inside        1   round(2.6) − 2.6 = 0.4   0     0.5·(3 − 1) = 1.0
#  -5.0   -9.0    below         0   qmin − ẑ = −9           −0.5   0.5·(−8 − 1) = −4.5
#   4.0    9.0    above         0   qmax − ẑ = 6            −0.5   0.5·(7 − 1) = 3.0
#   1.25   3.5    inside (tie)  1   round(u) − u = −0.5      0     0.5·(2 + 1 − 1) = 1.0
#  -4.5   -8.0    edge=qmin     0   −9 (strict interior)    −0.5   −4.5
# The tie: u = x/s = 2.5 rounds half-to-even to 2, then ẑ is added (q = 3); rounding v = 3.5
# directly would give 4. The two forms differ only at exact ties with odd ẑ.
ASYM_X = [0.8, -5.0, 4.0, 1.25, -4.5]
ASYM_OUT = [1.0, -4.5, 3.0, 1.0, -4.5]
ASYM_DX = [1.0, 0.0, 0.0, 1.0, 0.0]
ASYM_DS = [0.4, -9.0, 6.0, -0.5, -9.0]
ASYM_DZ = [0.0, -0.5, -0.5, 0.0, -0.5]


def _fq4(x: jax.Array, s: jax.Array, z: jax.Array) -> jax.Array:
    return fake_quant(x, s, z, -8, 7)


def test_per_tensor_asymmetric_gradients() -> None:
    x = jnp.array(ASYM_X)
    out = _fq4(x, jnp.float32(0.5), jnp.float32(1.3))
    np.testing.assert_allclose(out, ASYM_OUT)
    jx, js, jz = jax.jacrev(_fq4, argnums=(0, 1, 2))(x, jnp.float32(0.5), jnp.float32(1.3))
    np.testing.assert_array_equal(jx, np.diag(ASYM_DX))
    np.testing.assert_allclose(js, ASYM_DS, atol=1e-6)
    np.testing.assert_allclose(jz, ASYM_DZ)


def test_per_tensor_symmetric_gradients() -> None:
    # 8-bit symmetric, s = 0.1, z = 0: v = x / 0.1.
    x = jnp.array([0.26, 20.0, -13.0, 12.7, -12.8])
    # v = 2.6 (inside), 200 (above), -130 (below), 127 (= qmax: clipped), -128 (= qmin: clipped)
    jx, js = jax.jacrev(fake_quant, argnums=(0, 1))(x, jnp.float32(0.1), 0.0, -128, 127)
    np.testing.assert_array_equal(np.diag(jx), [1.0, 0.0, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(js, [0.4, 127.0, -128.0, 127.0, -128.0], atol=1e-5)


@pytest.mark.parametrize("grad_scale", [1.0, 0.1])
def test_per_channel_gradients_are_summed_per_channel_and_scaled(grad_scale: float) -> None:
    x = jnp.array([[0.8, -5.0, 4.0], [0.3, -2.0, 2.3]])
    s = jnp.array([[0.5], [0.25]])
    z = jnp.array([[1.3], [-2.2]])  # ẑ = 1, −2
    # Row 1: v = 0.3/0.25 − 2 = −0.8 (inside: ds = −1 + 0.8 = −0.2), −10 (below: ds = −8 + 2),
    # 7.2 (above: ds = 7 + 2); dz = −0.25 outside.
    g = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    out, vjp = jax.vjp(lambda x, s, z: fake_quant(x, s, z, -8, 7, grad_scale=grad_scale), x, s, z)
    np.testing.assert_allclose(out, [[1.0, -4.5, 3.0], [0.25 * 1, 0.25 * -6, 0.25 * 9]])
    dx, ds, dz = vjp(g)
    assert ds.shape == s.shape and dz.shape == z.shape and dx.shape == x.shape
    np.testing.assert_array_equal(dx, [[1.0, 0.0, 0.0], [4.0, 0.0, 0.0]])  # never scaled
    ds_expected = [[0.4 * 1 - 9 * 2 + 6 * 3], [-0.2 * 4 - 6 * 5 + 9 * 6]]
    dz_expected = [[-0.5 * (2 + 3)], [-0.25 * (5 + 6)]]
    np.testing.assert_allclose(ds, np.array(ds_expected) * grad_scale, rtol=1e-5)
    np.testing.assert_allclose(dz, np.array(dz_expected) * grad_scale, rtol=1e-6)


def test_zero_point_gradient_is_straight_through_round() -> None:
    # ẑ = round(z) in the forward; the gradient ignores the rounding: −s for a clipped
    # value whatever the fractional part of z, 0 inside.
    dz = jax.grad(lambda z, x: jnp.sum(_fq4(x, 0.5, z)))
    for z in (1.0, 1.3, 1.49, 1.7):
        assert float(dz(jnp.float32(z), jnp.array([100.0]))) == -0.5
        assert float(dz(jnp.float32(z), jnp.array([0.3]))) == 0.0
    assert float(jax.grad(lambda z: round_ste(z) * 3.0)(1.3)) == 3.0


def test_qmin_qmax_get_zero_cotangents() -> None:
    grads = jax.grad(
        lambda lo, hi: jnp.sum(fake_quant(jnp.array([-9.0, 0.3, 9.0]), 0.5, 0.0, lo, hi)),
        argnums=(0, 1),
    )(jnp.float32(-8), jnp.float32(7))
    assert [float(g) for g in grads] == [0.0, 0.0]


def test_grad_x_equals_ste_mask_on_random_data() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 8)).astype(np.float32) * 4
    s = rng.uniform(0.05, 0.3, size=(1, 8)).astype(np.float32)
    z = rng.uniform(-10, 10, size=(1, 8)).astype(np.float32)
    dx = jax.grad(lambda x: jnp.sum(fake_quant(x, s, z, -16, 15)))(jnp.asarray(x))
    v = x * (np.float32(1) / s) + np.round(z)
    np.testing.assert_array_equal(dx, ((v > -16) & (v < 15)).astype(np.float32))


# ---------------------------------------------------------------- finite differences


def test_finite_difference_in_x_true_function_is_flat() -> None:
    # The true x -> x̂ is piecewise constant: between rounding steps its derivative is 0,
    # where the STE substitutes 1 inside the range; outside the range both are 0.
    s, z, h = 0.5, 1.0, 1e-3
    for x, ste in ((0.65, 1.0), (-0.35, 1.0), (-7.0, 0.0), (6.0, 0.0)):  # v = 2.3, 0.3, -13, 13
        fd = (float(_fq4(x + h, s, z)) - float(_fq4(x - h, s, z))) / (2 * h)
        assert fd == 0.0
        assert float(jax.grad(_fq4)(jnp.float32(x), s, z)) == ste


def test_finite_difference_in_scale() -> None:
    x = np.array([0.8, -5.0, 4.0, 2.6, -1.15])  # v = 2.6, -9, 9, 6.2, -1.3
    s0, z, lo, hi, h = 0.5, 1.0, -8.0, 7.0, 1e-4
    ds = np.asarray(jax.jacrev(_fq4, argnums=1)(jnp.asarray(x, jnp.float32), jnp.float32(s0), z))
    v0 = x / s0 + z
    # Clipped values: x̂ = s·(q_edge − ẑ) is linear in s, so eq. (1) is the true derivative.
    true = lambda s: s * (np.clip(np.round(x / s + z), lo, hi) - z)  # noqa: E731
    fd_true = (true(s0 + h) - true(s0 - h)) / (2 * h)
    clipped = (v0 <= lo) | (v0 >= hi)
    np.testing.assert_allclose(ds[clipped], fd_true[clipped], rtol=1e-5)
    # Inside, eq. (1) is the derivative of the STE surrogate in which round(v) is replaced by
    # v + c with the rounding residual c = round(v0) − v0 frozen at s0 (clamp kept).
    c = np.round(v0) - v0
    sur = lambda s: s * (np.clip(x / s + z + c, lo, hi) - z)  # noqa: E731
    fd_sur = (sur(s0 + h) - sur(s0 - h)) / (2 * h)
    np.testing.assert_allclose(ds, fd_sur, atol=1e-5)
    # ...and it differs from the true derivative round(v) − ẑ of the flat pieces by −x/s.
    np.testing.assert_allclose(fd_true[~clipped], (np.round(v0) - z)[~clipped], atol=1e-6)


# ---------------------------------------------------------------- properties (hypothesis)


@st.composite
def quantizer_cases(draw: st.DrawFn) -> dict:
    bits = draw(st.integers(2, 16))
    symmetric = draw(st.booleans())
    signed = draw(st.booleans())
    per_channel = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    qmin, qmax = qrange(bits, signed)
    rng = np.random.default_rng(seed)
    shape = (3, 1) if per_channel else ()
    s = np.exp(rng.uniform(np.log(1e-3), np.log(10.0), size=shape)).astype(np.float32)
    if symmetric:
        z = np.zeros(shape, np.float32)
    else:
        z = rng.uniform(qmin - 0.49, qmax + 0.49, size=shape).astype(np.float32)
    return {"qmin": qmin, "qmax": qmax, "s": s, "z": z, "rng": rng}


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(quantizer_cases())
def test_error_at_most_half_step_inside_range(case: dict) -> None:
    s, z, qmin, qmax, rng = case["s"], case["z"], case["qmin"], case["qmax"], case["rng"]
    zq = np.round(z).astype(np.float64)
    u = rng.uniform(qmin, qmax, size=(3, 8))  # v in [qmin, qmax]
    x = (s * (u - zq)).astype(np.float32)
    xh = np.asarray(fake_quant(x, s, z, qmin, qmax), np.float64)
    s64 = s.astype(np.float64)
    tol = 8 * EPS32 * (np.abs(x) + s64 * (np.abs(zq) + np.abs(u)))
    assert np.all(np.abs(x - xh) <= s64 / 2 + tol)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(quantizer_cases())
def test_codes_in_range_and_idempotent(case: dict) -> None:
    s, z, qmin, qmax, rng = case["s"], case["z"], case["qmin"], case["qmax"], case["rng"]
    # Anything, including far outside the range.
    x = (rng.normal(size=(3, 8)) * s * (qmax - qmin)).astype(np.float32)
    q = np.asarray(quantize(x, s, z, qmin, qmax))
    assert q.min() >= qmin and q.max() <= qmax
    xh = fake_quant(x, s, z, qmin, qmax)
    # x̂ is a float32 multiple s·(q − ẑ): relative rounding error EPS32 of |q − ẑ| steps.
    zq = np.round(z).astype(np.float64)
    codes = np.asarray(xh, np.float64) / s + zq
    assert np.all(np.abs(codes - q) <= 4 * EPS32 * (np.abs(q) + np.abs(zq)) + 1e-6)
    np.testing.assert_array_equal(fake_quant(xh, s, z, qmin, qmax), xh)


# ---------------------------------------------------------------- jit / vmap / scan


def _layer_loss(x: jax.Array, s: jax.Array, z: jax.Array, lo: jax.Array, hi: jax.Array):
    y = fake_quant(x, s, z, lo, hi, grad_scale=0.5)
    return jnp.sum((y - x) ** 2) + jnp.sum(y)


def test_vmap_over_layers_with_per_layer_bit_widths_equals_loop() -> None:
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(2, 6, 4)).astype(np.float32))
    s = jnp.array([0.02, 0.02 / 256])  # layer 0: 8 bits, layer 1: 16 bits
    z = jnp.array([0.0, 3.4])
    lo, hi = jnp.array([-128, -32768]), jnp.array([127, 32767])
    fq = jax.jit(jax.vmap(fake_quant))(x, s, z, lo, hi)
    grads = jax.jit(jax.vmap(jax.grad(_layer_loss, argnums=(0, 1, 2))))(x, s, z, lo, hi)
    for i, bits in enumerate((8, 16)):
        qmin, qmax = qrange(bits)
        np.testing.assert_array_equal(fq[i], fake_quant(x[i], s[i], z[i], qmin, qmax))
        g_i = jax.grad(_layer_loss, argnums=(0, 1, 2))(x[i], s[i], z[i], qmin, qmax)
        for got, want in zip(grads, g_i, strict=True):
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6)
    assert float(jnp.max(jnp.abs(fq[1] - x[1]))) < float(jnp.max(jnp.abs(fq[0] - x[0])))

    # The same per-layer arrays through lax.scan (stacked layers) give the same gradients.
    def scanned(s: jax.Array, z: jax.Array) -> jax.Array:
        def body(c, layer):
            return c + _layer_loss(*layer), None

        return jax.lax.scan(body, jnp.float32(0), (x, s, z, lo, hi))[0]

    gs, gz = jax.jit(jax.grad(scanned, argnums=(0, 1)))(s, z)
    # Same codes and same per-element terms; only the order of the float32 sums may differ.
    np.testing.assert_allclose(gs, grads[1], rtol=1e-5)
    np.testing.assert_allclose(gz, grads[2], rtol=1e-5)
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(quantize))(x, s, z, lo, hi)[1], quantize(x[1], s[1], z[1], lo[1], hi[1])
    )


# ---------------------------------------------------------------- helpers


def test_lsq_grad_scale() -> None:
    assert lsq_grad_scale(1536, 127) == pytest.approx(1 / math.sqrt(1536 * 127))
    with pytest.raises(QnpuError, match="elements_per_scale"):
        lsq_grad_scale(0, 127)
    with pytest.raises(QnpuError, match="qmax"):
        lsq_grad_scale(10, 0)


def test_dynamic_fake_quant_per_token() -> None:
    x = jnp.array([[0.3, -1.7, 0.9, 0.05], [0.0, 0.0, 0.0, 0.0], [5.0, -1.0, 2.0, 0.5]])
    y = dynamic_fake_quant(x, 4)
    assert bool(jnp.all(jnp.isfinite(y)))
    np.testing.assert_array_equal(y[1], 0.0)  # all-zero row guarded
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    s = jnp.where(amax > 0, amax / 7, 1.0)
    assert bool(jnp.all(jnp.abs(y - x) <= s / 2 + 1e-6))
    # The largest |x| of a row maps onto ±qmax exactly.
    np.testing.assert_allclose([y[0, 1], y[2, 0]], [-1.7, 5.0], rtol=1e-6)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(dynamic_fake_quant(x, 4)))(x), 1.0)
    # bits as a per-layer array under vmap
    yv = jax.vmap(dynamic_fake_quant)(jnp.stack([x, x]), jnp.array([4, 8]))
    np.testing.assert_allclose(yv[0], y, rtol=1e-6)
    np.testing.assert_allclose(yv[1], dynamic_fake_quant(x, 8), rtol=1e-6)
    with pytest.raises(QnpuError, match="bits"):
        dynamic_fake_quant(x, 1)


def test_check_scales_names_the_path() -> None:
    good = {"layers": {"q_proj": jnp.array([0.1, 0.2])}, "lm_head": jnp.float32(1.0)}
    check_scales(good)
    bad_nan = {"layers": {"q_proj": jnp.array([0.1, jnp.nan])}}
    with pytest.raises(QnpuError, match=r"scale at layers/q_proj is NaN at index \(1,\)"):
        check_scales(bad_nan)
    with pytest.raises(QnpuError, match=r"zero point at a/1 is not finite"):
        check_scales({"a": [jnp.ones(2), jnp.array([jnp.inf])]}, what="zero point")
    with pytest.raises(QnpuError, match=r"scale at w must be > 0, got -0.5"):
        check_scales({"w": np.array([[1.0, -0.5]])})
    with pytest.raises(QnpuError, match="outside jit"):
        jax.jit(check_scales)(jnp.ones(2))


def test_positive_scale_and_log_parameterization() -> None:
    raw = jnp.array([0.5, -1.0, 0.0])
    np.testing.assert_array_equal(positive_scale(raw), np.float32([0.5, 1e-8, 1e-8]))
    # Straight-through: a clipped scale still receives the gradient and can recover.
    np.testing.assert_array_equal(jax.grad(lambda r: jnp.sum(positive_scale(r) * 2.0))(raw), 2.0)
    s = jnp.array([1e-3, 0.5, 7.0])
    np.testing.assert_allclose(log_to_scale(scale_to_log(s)), s, rtol=1e-6)
