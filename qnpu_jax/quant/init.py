"""Static-range initializers: calibration statistics streamed over many batches, then scales.

`RangeStats` is a pytree of float32/int32 arrays updated by the jittable `update_range_stats`
(vmap it over stacked layers, fold it over batches with a loop or `lax.scan`).
`scale_from_stats` turns it into (scale, zero_point) eagerly, because it validates the data
(NaN, empty channels) and must be able to raise.

Design choices:
- Mean/variance are merged with Chan's parallel algorithm (count, mean, M2) rather than as raw
  sum / sum of squares: for a tensor whose mean is large against its spread (gate_proj output,
  paper D.2) E[x²] − μ² cancels catastrophically in float32. `sum` and `sum_sq` are still
  available as properties.
- Percentiles come from a signed histogram with a fixed number of bins per sign over
  |x| < 2^e. When a batch exceeds the range, e grows to the smallest sufficient power of two
  and old bins merge in groups of 2^k. Because all bin edges are powers of two times integers,
  this rebinning is exact: streaming gives the same histogram as one pass over the
  concatenation, and no first pass over the data is needed. The error of a percentile is at
  most about one bin width (2^e / num_bins <= 2·max|x| / num_bins).
- MSE is *not* derived from the histogram: the fake-quant error depends on where values fall
  on the rounding grid, which bins much wider than the quantization step (8-16 bits) cannot
  resolve. `mse_scale(x, spec)` searches on sample data instead; `scale_from_stats(...,
  "mse", ...)` raises and points there.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant.fake_quant import MIN_SCALE, fake_quant
from qnpu_jax.quant.spec import QuantSpec, reduced_shape, resolve_axis

# the range initializers computed from calibration data (`quant.plan.INIT_METHODS` adds "fixed")
RANGE_INITS = ("max_min", "mean_std", "percentile", "mse")

# Histogram ranges start at 2^HIST_MIN_EXP: values below it all land in bin 0.
HIST_MIN_EXP = -64
DEFAULT_NUM_BINS = 2048
# Asymmetric ranges far from zero would need |x/s| or |z| beyond what float32 resolves; the
# scale is floored at max(|lo|, |hi|) * 2^-20 so codes and zero points stay below ~2^20.
REL_SCALE_FLOOR = 2.0**-20


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class RangeStats:
    """Running calibration statistics, reduced over every axis but the optional channel axis.

    A pytree (every field is a leaf). All per-channel fields have the keepdims shape of the
    statistic (`()` per tensor), so scales computed from them broadcast against the data.
    """

    # float32 never overflows; exact up to 2^24 elements per channel, 6e-8 relative beyond.
    count: jax.Array  # float32: finite elements seen (per channel)
    mean: jax.Array  # float32
    m2: jax.Array  # float32: sum of squared deviations from the mean (Chan/Welford)
    min: jax.Array  # float32: +inf until data arrives
    max: jax.Array  # float32: -inf until data arrives
    nan_count: jax.Array  # int32 scalar
    inf_count: jax.Array  # int32 scalar
    # int32 counts are exact; "percentile" refuses more than 2^31 values per channel.
    hist: jax.Array  # int32 [..., 2, num_bins]: [negatives by |x|, non-negatives by x]
    hist_exp: jax.Array  # int32: the histogram covers |x| < 2^hist_exp

    @property
    def sum(self) -> jax.Array:
        return self.mean * self.count

    @property
    def sum_sq(self) -> jax.Array:
        return self.m2 + self.count * self.mean**2

    @property
    def var(self) -> jax.Array:
        """Population variance (1/N, as the paper's std in Appendix D)."""
        return self.m2 / jnp.maximum(self.count, 1.0)

    @property
    def std(self) -> jax.Array:
        return jnp.sqrt(self.var)


def _check_num_bins(num_bins: int) -> int:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int):
        raise QnpuError(f"num_bins must be an int, got {num_bins!r}")
    if num_bins != 0 and not (2 <= num_bins <= 2**15 and num_bins & (num_bins - 1) == 0):
        raise QnpuError(
            f"num_bins must be 0 (no histogram) or a power of two in [2, 2^15], got {num_bins}"
        )
    return num_bins


def init_range_stats(
    shape: tuple[int, ...], *, axis: int | None = None, num_bins: int = DEFAULT_NUM_BINS
) -> RangeStats:
    """Empty statistics for batches of `shape` (only its rank and channel size matter).

    `num_bins=0` drops the histogram (no "percentile" then): per-channel histograms cost
    channels·2·num_bins int32, which is large for e.g. per-row embedding statistics.
    """
    stat_shape = reduced_shape(tuple(int(d) for d in shape), axis)
    nb = _check_num_bins(num_bins)
    f32 = jnp.float32
    return RangeStats(
        count=jnp.zeros(stat_shape, f32),
        mean=jnp.zeros(stat_shape, f32),
        m2=jnp.zeros(stat_shape, f32),
        min=jnp.full(stat_shape, jnp.inf, f32),
        max=jnp.full(stat_shape, -jnp.inf, f32),
        nan_count=jnp.zeros((), jnp.int32),
        inf_count=jnp.zeros((), jnp.int32),
        hist=jnp.zeros((*stat_shape, 2, nb), jnp.int32),
        hist_exp=jnp.full(stat_shape, HIST_MIN_EXP, jnp.int32),
    )


def _merge_bins(hist: jax.Array, k: jax.Array) -> jax.Array:
    """New bin j = sum of old bins [j·2^k, (j+1)·2^k): the range grew by a factor 2^k."""
    nb = hist.shape[-1]
    cum = jnp.concatenate([jnp.zeros_like(hist[..., :1]), jnp.cumsum(hist, axis=-1)], axis=-1)
    j = jnp.arange(nb, dtype=jnp.int32)
    k = k[..., None, None]
    lo = jnp.minimum(j << k, nb)
    hi = jnp.minimum((j + 1) << k, nb)
    full = (*hist.shape[:-1], nb)
    take = partial(jnp.take_along_axis, cum, axis=-1)
    return take(jnp.broadcast_to(hi, full)) - take(jnp.broadcast_to(lo, full))


def update_range_stats(
    stats: RangeStats, x: ArrayLike, *, axis: int | None = None, where: ArrayLike | None = None
) -> RangeStats:
    """Fold one batch into `stats` (jittable; `axis` must match `init_range_stats`).

    Non-finite values are counted (so `scale_from_stats` can refuse them) and excluded from
    every other statistic. `where` (broadcastable to x) excludes elements entirely, e.g.
    masked attention scores.
    """
    x = jnp.asarray(x).astype(jnp.float32)
    keep = jnp.ones(x.shape, bool) if where is None else jnp.broadcast_to(where, x.shape)
    stat_shape = reduced_shape(x.shape, axis)
    if stat_shape != stats.min.shape:
        raise QnpuError(
            f"batch of shape {x.shape} with axis={axis} gives statistics of shape {stat_shape}, "
            f"but the stats were initialized with shape {stats.min.shape}"
        )
    ax = resolve_axis(axis, x.ndim)
    axes = tuple(i for i in range(x.ndim) if i != ax)

    def red(fn: Any, a: jax.Array) -> jax.Array:
        return fn(a, axis=axes, keepdims=True).reshape(stat_shape)

    finite = jnp.isfinite(x) & keep
    xz = jnp.where(finite, x, 0.0)
    n_b = red(jnp.sum, finite.astype(jnp.float32))
    mean_b = red(jnp.sum, xz) / jnp.maximum(n_b, 1.0)
    # Two-pass within the batch (deviations from the batch mean), Chan merge across batches.
    m2_b = red(jnp.sum, jnp.where(finite, (x - mean_b) ** 2, 0.0))
    n = stats.count + n_b
    delta = mean_b - stats.mean
    safe_n = jnp.maximum(n, 1.0)
    mean = stats.mean + delta * (n_b / safe_n)
    m2 = stats.m2 + m2_b + delta**2 * (stats.count * n_b / safe_n)

    hist, hist_exp = stats.hist, stats.hist_exp
    nb = hist.shape[-1]
    if nb > 0:
        absx = jnp.abs(xz)
        _, e = jnp.frexp(red(jnp.max, absx))  # max|x| < 2^e, the smallest such power of two
        e = jnp.where(red(jnp.max, absx) > 0, e, HIST_MIN_EXP)
        hist_exp = jnp.maximum(stats.hist_exp, e.astype(jnp.int32))
        log2nb = nb.bit_length() - 1
        k = jnp.minimum(hist_exp - stats.hist_exp, log2nb)  # beyond log2nb all is in bin 0
        hist = _merge_bins(hist, k)
        # |x| * nb / 2^hist_exp is exact (power-of-two scaling) and < nb by construction.
        idx = jnp.floor(jnp.ldexp(absx, log2nb - hist_exp)).astype(jnp.int32)
        idx = jnp.clip(idx, 0, nb - 1)
        side = (x >= 0).astype(jnp.int32)
        chan = (
            jnp.zeros((), jnp.int32)
            if ax is None
            else jax.lax.broadcasted_iota(jnp.int32, x.shape, ax)
        )
        flat = ((chan * 2 + side) * nb + idx).ravel()
        n_chan = 1 if ax is None else x.shape[ax]
        batch_hist = jnp.bincount(
            flat, weights=finite.ravel().astype(jnp.int32), length=n_chan * 2 * nb
        )
        hist = hist + batch_hist.reshape(hist.shape)

    return RangeStats(
        count=n,
        mean=mean,
        m2=m2,
        min=jnp.minimum(stats.min, red(jnp.min, jnp.where(finite, x, jnp.inf))),
        max=jnp.maximum(stats.max, red(jnp.max, jnp.where(finite, x, -jnp.inf))),
        nan_count=stats.nan_count + jnp.sum(jnp.isnan(x) & keep).astype(jnp.int32),
        inf_count=stats.inf_count + jnp.sum(jnp.isinf(x) & keep).astype(jnp.int32),
        hist=hist,
        hist_exp=hist_exp,
    )


def _hist_quantile(
    counts: np.ndarray, lo_edge: np.ndarray, width: np.ndarray, q: float
) -> np.ndarray:
    """Value below which a fraction q of the histogram mass lies (linear inside a bin)."""
    cum = np.cumsum(counts, axis=-1)
    t = q * cum[..., -1]
    j = np.minimum(np.sum(cum < t[..., None], axis=-1), counts.shape[-1] - 1)
    cj = np.take_along_axis(counts, j[..., None], axis=-1)[..., 0]
    before = np.take_along_axis(cum, j[..., None], axis=-1)[..., 0] - cj
    frac = np.clip((t - before) / np.maximum(cj, 1.0), 0.0, 1.0)
    return lo_edge + (j + frac) * width


def _range_to_scale(
    lo: np.ndarray, hi: np.ndarray, spec: QuantSpec, *, denom: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(scale float32, zero_point float32) for the real range [lo, hi], computed in float64.

    symmetric signed:   s = max(|lo|, |hi|) / denom, z = 0   (denom defaults to qmax)
    symmetric unsigned: s = max(hi, 0) / denom,      z = 0
    asymmetric:         s = (hi − lo) / (qmax − qmin), z = round_half_even(qmin − lo / s)
    The asymmetric range is the paper's (X_max − X_min)/(2^b − 1) and is not widened to
    contain 0, so z may lie outside [qmin, qmax] for one-signed data (it is an int32 offset).
    Every scale is floored at max(MIN_SCALE, max(|lo|, |hi|)·2^-20): constant or all-zero
    tensors get a positive finite scale, and |x/s|, |z| stay small enough for float32.
    """
    lo, hi = np.asarray(lo, np.float64), np.asarray(hi, np.float64)
    d = float(spec.qmax if denom is None else denom)
    if spec.symmetric:
        s = (np.maximum(np.abs(lo), np.abs(hi)) if spec.signed else np.maximum(hi, 0.0)) / d
    else:
        s = (hi - lo) / float(spec.qmax - spec.qmin)
    floor = np.maximum(MIN_SCALE, np.maximum(np.abs(lo), np.abs(hi)) * REL_SCALE_FLOOR)
    s32 = np.maximum(s, floor).astype(np.float32)
    if spec.symmetric:
        z = np.zeros_like(s32)
    else:
        # Use the float32 scale actually returned, so lo maps onto qmin with that scale.
        z = np.rint(spec.qmin - lo / s32.astype(np.float64)).astype(np.float32)
    return s32, z


def _host_stats(stats: RangeStats) -> dict[str, np.ndarray]:
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(stats)):
        raise QnpuError("scale_from_stats validates the data and must run outside jit")
    host = {f.name: np.asarray(getattr(stats, f.name)) for f in dataclasses.fields(stats)}
    if host["nan_count"].sum() > 0:
        raise QnpuError(f"NaN in calibration data ({int(host['nan_count'].sum())} values)")
    if host["inf_count"].sum() > 0:
        raise QnpuError(
            f"infinite values in calibration data ({int(host['inf_count'].sum())} values)"
        )
    if (host["count"] <= 0).any():
        raise QnpuError("no calibration data: some statistics have seen zero elements")
    return host


def scale_from_stats(
    stats: RangeStats, method: str, spec: QuantSpec, *, percentile: float = 99.99
) -> tuple[jax.Array, jax.Array]:
    """(scale, zero_point), float32 with the shape of the statistics, from calibration stats.

    - "max_min": the observed range [min, max] (symmetric: s = max|x| / qmax).
    - "mean_std": μ ± 3σ. Symmetric, exactly the paper's s = max(|μ−3σ|, |μ+3σ|) / 2^(b−1)
      (2^b for unsigned); asymmetric: the interval [μ−3σ, μ+3σ] as the range.
    - "percentile": symmetric clips |x| at its `percentile`-th percentile (unsigned: x);
      asymmetric uses [P_(100−p)(x), P_p(x)]. Estimated from the histogram, within the
      observed [min, max].
    - "mse": needs samples; use `mse_scale(x, spec)`.
    Raises QnpuError for NaN/inf in the data, empty statistics or an unknown method.
    """
    if method not in RANGE_INITS:
        raise QnpuError(f"unknown initialization method {method!r}; choose from {RANGE_INITS}")
    if method == "mse":
        raise QnpuError(
            "method 'mse' needs sample data, which RangeStats does not keep: "
            "call qnpu_jax.quant.mse_scale(x_samples, spec) instead"
        )
    h = _host_stats(stats)
    mn, mx = h["min"].astype(np.float64), h["max"].astype(np.float64)
    if method == "max_min":
        s, z = _range_to_scale(mn, mx, spec)
    elif method == "mean_std":
        mu = h["mean"].astype(np.float64)
        sigma = np.sqrt(np.maximum(h["m2"].astype(np.float64), 0.0) / h["count"])
        # The paper divides by 2^(b-1) (= qmax + 1), not by qmax.
        s, z = _range_to_scale(mu - 3 * sigma, mu + 3 * sigma, spec, denom=spec.qmax + 1)
    else:
        if not 0.0 < percentile <= 100.0:
            raise QnpuError(f"percentile must be in (0, 100], got {percentile}")
        hist = h["hist"].astype(np.float64)
        nb = hist.shape[-1]
        if nb == 0:
            raise QnpuError(
                "method 'percentile' needs a histogram: init_range_stats(..., num_bins > 0)"
            )
        if (h["count"] >= 2.0**31).any():
            raise QnpuError("more than 2^31 calibration values per channel: histogram overflow")
        hmax = np.ldexp(1.0, h["hist_exp"].astype(np.int64))
        width = hmax / nb
        q = percentile / 100.0
        signed_counts = np.concatenate([hist[..., 0, ::-1], hist[..., 1, :]], axis=-1)
        hi = np.clip(_hist_quantile(signed_counts, -hmax, width, q), mn, mx)
        if spec.symmetric and spec.signed:
            folded = _hist_quantile(
                hist[..., 0, :] + hist[..., 1, :], np.zeros_like(hmax), width, q
            )
            amax = np.maximum(np.abs(mn), np.abs(mx))
            s, z = _range_to_scale(np.zeros_like(hi), np.minimum(folded, amax), spec)
        else:
            lo = np.clip(_hist_quantile(signed_counts, -hmax, width, 1.0 - q), mn, mx)
            s, z = _range_to_scale(lo, hi, spec)
    return jnp.asarray(s), jnp.asarray(z)


@partial(jax.jit, static_argnames=("axes", "stat_shape"))
def _candidate_errors(
    x: jax.Array,
    scales: jax.Array,
    zero_points: jax.Array,
    qmin: jax.Array,
    qmax: jax.Array,
    axes: tuple[int, ...],
    stat_shape: tuple[int, ...],
) -> jax.Array:
    def err(sz: tuple[jax.Array, jax.Array]) -> jax.Array:
        d = fake_quant(x, sz[0], sz[1], qmin, qmax) - x
        return jnp.sum(d * d, axis=axes, keepdims=True).reshape(stat_shape)

    # lax.map keeps memory at one candidate's worth of x instead of num_candidates copies.
    return jax.lax.map(err, (scales, zero_points))


def mse_scale(
    x: ArrayLike, spec: QuantSpec, *, num_candidates: int = 100
) -> tuple[jax.Array, jax.Array]:
    """Clipping-ratio grid search minimizing the fake-quant MSE on sample data.

    Candidates are the Max-Min ranges shrunk by r = i/num_candidates, i = 1..num_candidates
    ([r·min, r·max]; r = 1 is exactly "max_min"), chosen independently per channel when
    `spec.axis` is set. Ties prefer the larger r (less clipping). Hence the result's scale is
    <= the max_min scale and its MSE <= max_min's. Runs eagerly (it validates the data).
    """
    if isinstance(x, jax.core.Tracer):
        raise QnpuError("mse_scale validates the data and must run outside jit")
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int):
        raise QnpuError(f"num_candidates must be an int, got {num_candidates!r}")
    if num_candidates < 1:
        raise QnpuError(f"num_candidates must be >= 1, got {num_candidates}")
    xs = np.asarray(x, dtype=np.float32)
    if np.isnan(xs).any():
        raise QnpuError("NaN in calibration data")
    if not np.isfinite(xs).all():
        raise QnpuError("infinite values in calibration data")
    if xs.size == 0:
        raise QnpuError("no calibration data: mse_scale got an empty array")
    stat_shape = reduced_shape(xs.shape, spec.axis)
    ax = resolve_axis(spec.axis, xs.ndim)
    axes = tuple(i for i in range(xs.ndim) if i != ax)
    lo = xs.min(axis=axes, keepdims=True).reshape(stat_shape).astype(np.float64)
    hi = xs.max(axis=axes, keepdims=True).reshape(stat_shape).astype(np.float64)
    ratios = np.arange(1, num_candidates + 1, dtype=np.float64) / num_candidates
    cands = [_range_to_scale(r * lo, r * hi, spec) for r in ratios]
    scales = np.stack([c[0] for c in cands])
    zps = np.stack([c[1] for c in cands])
    errs = np.asarray(
        _candidate_errors(
            jnp.asarray(xs),
            jnp.asarray(scales),
            jnp.asarray(zps),
            jnp.float32(spec.qmin),
            jnp.float32(spec.qmax),
            axes,
            stat_shape,
        )
    )
    best = num_candidates - 1 - np.argmin(errs[::-1], axis=0)  # ties -> larger ratio
    pick = partial(np.take_along_axis, indices=best[None], axis=0)
    return jnp.asarray(pick(scales)[0]), jnp.asarray(pick(zps)[0])
