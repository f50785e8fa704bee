"""Static-range initializers: streaming statistics and scales from known data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant import (
    QuantSpec,
    RangeStats,
    fake_quant,
    init_range_stats,
    mse_scale,
    scale_from_stats,
    update_range_stats,
)

update = jax.jit(update_range_stats, static_argnames="axis")


def _stats(x: np.ndarray, axis: int | None = None, num_bins: int = 2048) -> RangeStats:
    return update(init_range_stats(x.shape, axis=axis, num_bins=num_bins), x, axis=axis)


def _mse(x: np.ndarray, s: jax.Array, z: jax.Array, spec: QuantSpec) -> float:
    return float(jnp.mean((fake_quant(x, s, z, spec.qmin, spec.qmax) - x) ** 2))


@pytest.mark.parametrize("axis", [None, -1])
def test_streaming_equals_one_pass(axis: int | None) -> None:
    rng = np.random.default_rng(0)
    # Growing ranges force the histogram to rebin twice; the mean is far from zero.
    batches = [(rng.normal(size=(16, 8)) * sc + 3.0).astype(np.float32) for sc in (0.1, 1.0, 50.0)]
    st = init_range_stats((16, 8), axis=axis)
    for b in batches:
        st = update(st, b, axis=axis)
    full = np.concatenate(batches)
    one = _stats(full, axis)
    red = None if axis is None else 0
    np.testing.assert_array_equal(st.min, full.min(axis=red, keepdims=axis is not None))
    np.testing.assert_array_equal(st.max, full.max(axis=red, keepdims=axis is not None))
    np.testing.assert_array_equal(st.count, one.count)
    np.testing.assert_array_equal(st.hist_exp, one.hist_exp)
    np.testing.assert_array_equal(st.hist, one.hist)  # power-of-two rebinning is exact
    f64 = full.astype(np.float64)
    keep = axis is not None
    std = f64.std(axis=red, keepdims=keep)
    # float32 tolerance, measured against the spread (a mean near 0 has no relative accuracy)
    tol = {"rtol": 1e-6, "atol": 1e-6 * float(std.max())}
    np.testing.assert_allclose(st.mean, f64.mean(axis=red, keepdims=keep), **tol)
    np.testing.assert_allclose(st.std, std, rtol=1e-6)
    np.testing.assert_allclose(st.mean, one.mean, **tol)
    np.testing.assert_allclose(st.std, one.std, rtol=1e-6)
    n = full.size if axis is None else full.shape[0]  # elements per statistic
    np.testing.assert_allclose(
        st.sum, f64.sum(axis=red, keepdims=keep), rtol=1e-5, atol=n * tol["atol"]
    )
    np.testing.assert_allclose(st.sum_sq, (f64**2).sum(axis=red, keepdims=keep), rtol=1e-5)
    assert int(st.hist.sum()) == full.size


def test_vmapped_update_over_stacked_layers() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 10, 4)).astype(np.float32) * np.array([[[1.0]], [[5.0]]], np.float32)
    init = jax.vmap(lambda _: init_range_stats((10, 4)))(jnp.arange(2))
    st = jax.jit(jax.vmap(update_range_stats))(init, x)
    for i in range(2):
        one = _stats(x[i])
        for name in ("min", "max", "count", "hist", "hist_exp"):
            np.testing.assert_array_equal(getattr(st, name)[i], getattr(one, name))


@pytest.mark.parametrize("axis", [None, 0])
def test_max_min_exact(axis: int | None) -> None:
    rng = np.random.default_rng(2)
    x = rng.uniform(-0.7, 2.3, size=(6, 300)).astype(np.float32)
    st = _stats(x, axis)
    keep = axis is not None
    red = None if axis is None else 1
    mn = x.min(axis=red, keepdims=keep).astype(np.float64)
    mx = x.max(axis=red, keepdims=keep).astype(np.float64)
    s, z = scale_from_stats(st, "max_min", QuantSpec(bits=8, axis=axis))
    assert s.shape == st.min.shape
    # s = max|x| / (2^(b-1) - 1) in float64, rounded once to float32
    np.testing.assert_array_equal(s, (np.maximum(np.abs(mn), np.abs(mx)) / 127).astype(np.float32))
    np.testing.assert_array_equal(z, 0.0)
    spec = QuantSpec(bits=8, symmetric=False, axis=axis)
    s, z = scale_from_stats(st, "max_min", spec)
    s_ref = ((mx - mn) / 255).astype(np.float32)
    np.testing.assert_array_equal(s, s_ref)
    np.testing.assert_array_equal(z, np.rint(-128 - mn / s_ref.astype(np.float64)))
    # The whole observed range is covered: min and max quantize within half a step.
    for v in (mn, mx):
        err = np.abs(np.asarray(fake_quant(v.astype(np.float32), s, z, -128, 127)) - v)
        assert np.all(err <= s_ref * 0.5 + 1e-6)


def test_unsigned_symmetric_max_min() -> None:
    x = np.random.default_rng(3).uniform(0, 1, size=(4, 50)).astype(np.float32)
    s, z = scale_from_stats(_stats(x), "max_min", QuantSpec(bits=16, signed=False))
    assert float(s) == np.float32(float(x.max()) / 65535) and float(z) == 0.0


def test_mean_std_is_the_paper_formula() -> None:
    rng = np.random.default_rng(4)
    x = (rng.normal(size=(40, 500)) * 2.0 + 0.3).astype(np.float32)
    st = _stats(x)
    mu, sigma = x.astype(np.float64).mean(), x.astype(np.float64).std()
    for bits in (4, 8):
        s, z = scale_from_stats(st, "mean_std", QuantSpec(bits=bits))
        paper = max(abs(mu - 3 * sigma), abs(mu + 3 * sigma)) / 2 ** (bits - 1)
        assert float(s) == pytest.approx(paper, rel=1e-6) and float(z) == 0.0
    s, z = scale_from_stats(st, "mean_std", QuantSpec(bits=4, symmetric=False))
    assert float(s) == pytest.approx(6 * sigma / 15, rel=1e-6)
    assert float(z) == np.rint(-8 - (mu - 3 * sigma) / float(s))


def test_percentile_close_to_numpy() -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_t(4, size=(50, 4000)) + 0.5).astype(np.float32)
    st = _stats(x)
    width = 2.0 ** int(st.hist_exp) / st.hist.shape[-1]
    for p in (99.0, 99.9, 99.99):
        s, _ = scale_from_stats(st, "percentile", QuantSpec(bits=8), percentile=p)
        ref = np.percentile(np.abs(x), p)
        assert abs(float(s) * 127 - ref) <= 2 * width
        s, z = scale_from_stats(st, "percentile", QuantSpec(bits=8, symmetric=False), percentile=p)
        lo, hi = np.percentile(x, 100 - p), np.percentile(x, p)
        assert abs(float(s) * 255 - (hi - lo)) <= 4 * width
        assert abs(-(float(z) + 128) * float(s) - lo) <= float(s) + 2 * width
    # 100th percentile is exactly max_min.
    s100, _ = scale_from_stats(st, "percentile", QuantSpec(bits=8), percentile=100.0)
    smm, _ = scale_from_stats(st, "max_min", QuantSpec(bits=8))
    assert float(s100) == float(smm)


@pytest.mark.parametrize(
    "spec",
    [QuantSpec(bits=4), QuantSpec(bits=4, symmetric=False), QuantSpec(bits=4, axis=0)],
    ids=["sym", "asym", "per-channel"],
)
def test_mse_beats_max_min_on_heavy_tails(spec: QuantSpec) -> None:
    x = np.random.default_rng(6).standard_t(2, size=(4, 3000)).astype(np.float32)
    s, z = mse_scale(x, spec)
    s_mm, z_mm = scale_from_stats(_stats(x, spec.axis), "max_min", spec)
    assert s.shape == s_mm.shape
    assert bool(jnp.all(s <= s_mm))
    assert _mse(x, s, z, spec) < 0.9 * _mse(x, s_mm, z_mm, spec)


@pytest.mark.parametrize("method", ["max_min", "mean_std", "percentile"])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("value", [0.0, 3.0, -1e4])
def test_constant_data_gives_positive_finite_scale(
    method: str, symmetric: bool, value: float
) -> None:
    x = np.full((8, 16), value, np.float32)
    spec = QuantSpec(bits=8, symmetric=symmetric)
    s, z = scale_from_stats(_stats(x), method, spec)
    assert np.isfinite(float(s)) and float(s) > 0 and np.isfinite(float(z))
    if not symmetric:  # an asymmetric grid reproduces the constant
        xh = fake_quant(x, s, z, spec.qmin, spec.qmax)
        np.testing.assert_allclose(xh, x, atol=float(s))


def test_mse_scale_on_constant_data() -> None:
    s, _ = mse_scale(np.zeros((4, 4), np.float32), QuantSpec(bits=8))
    assert float(s) > 0 and np.isfinite(float(s))


def test_nan_in_calibration_data_raises() -> None:
    x = np.ones((4, 8), np.float32)
    x[2, 3] = np.nan
    st = _stats(x)  # the jitted update does not raise...
    with pytest.raises(QnpuError, match="NaN in calibration data"):
        scale_from_stats(st, "max_min", QuantSpec(bits=8))  # ...the scale computation does
    with pytest.raises(QnpuError, match="NaN in calibration data"):
        mse_scale(x, QuantSpec(bits=8))
    x[2, 3] = np.inf
    with pytest.raises(QnpuError, match="infinite values"):
        scale_from_stats(_stats(x), "mean_std", QuantSpec(bits=8))


def test_scale_from_stats_errors() -> None:
    x = np.ones((4, 8), np.float32)
    spec = QuantSpec(bits=8)
    with pytest.raises(QnpuError, match="mse_scale"):
        scale_from_stats(_stats(x), "mse", spec)
    with pytest.raises(QnpuError, match="unknown initialization method"):
        scale_from_stats(_stats(x), "minmax", spec)
    with pytest.raises(QnpuError, match="no calibration data"):
        scale_from_stats(init_range_stats((4, 8)), "max_min", spec)
    with pytest.raises(QnpuError, match="needs a histogram"):
        scale_from_stats(_stats(x, num_bins=0), "percentile", spec)
    with pytest.raises(QnpuError, match="percentile must be"):
        scale_from_stats(_stats(x), "percentile", spec, percentile=0.0)
    with pytest.raises(QnpuError, match="initialized with shape"):
        update_range_stats(init_range_stats((4, 8), axis=-1), x, axis=0)
    with pytest.raises(QnpuError, match="num_bins"):
        init_range_stats((4, 8), num_bins=1000)
    with pytest.raises(QnpuError, match="axis 2 is out of range"):
        init_range_stats((4, 8), axis=2)


@pytest.mark.parametrize("num_bins", [0, 2048])
def test_weight_statistics_as_one_program_equal_the_eager_ops(num_bins: int) -> None:
    """Calibration folds a weight in one jitted program (eager ops on a sharded weight can
    deadlock XLA:CPU's host devices); it must give the eager statistics bit for bit."""
    from qnpu_jax.pipeline.calibrate import _weight_range_stats

    w = jnp.asarray(np.random.default_rng(0).standard_t(3, size=(192, 576)), jnp.float32)
    eager = update_range_stats(init_range_stats(w.shape, axis=-1, num_bins=num_bins), w, axis=-1)
    one = _weight_range_stats(w, axis=-1, num_bins=num_bins)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(one), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
