"""Exact integer matmuls on float BLAS (`ir.exact_dot`), the engines' shared kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.exact_dot import (
    DotPlan,
    _digit_max,
    balanced_digits,
    dot_plan,
    run_dot_plan,
)
from qnpu_jax.runtime.emulator import exact_matmul


def _np_einsum(s, a, b):
    return np.einsum(s, a, b, optimize=True)


def _jnp_einsum(s, a, b):
    if a.dtype == jnp.int64:
        return jnp.einsum(s, a, b.astype(jnp.int64), preferred_element_type=jnp.int64)
    hi = jax.lax.Precision.HIGHEST
    return jnp.einsum(s, a, b, precision=hi, preferred_element_type=a.dtype)


def _reference(subscripts, a, b):
    return np.einsum(subscripts, a.astype(object), b.astype(object)).astype(np.int64)


def test_balanced_digits_rebuild_every_value_within_their_bounds():
    for a_max in (1, 2, 3, 7, 128, 255, 1000, 32768, 65535):
        a = np.arange(-a_max, a_max + 1, dtype=np.int64)
        for bits in range(1, a_max.bit_length() + 1):
            for n in (2, 3):
                digits = balanced_digits(a, bits, n, np)
                assert np.array_equal(sum(d << (bits * i) for i, d in enumerate(digits)), a)
                assert max(int(np.abs(d).max()) for d in digits) <= _digit_max(a_max, bits, n)


def test_plans_choose_the_fewest_passes():
    # one float32 matmul below 2^24: 8-bit codes times 4-bit weights over 576
    assert dot_plan(128, 8, 576) == DotPlan("float32", 0, 1, 576)
    # SmolLM2's lm_head: 16-bit codes times 8-bit weights over 576 → two balanced bytes
    assert dot_plan(32768, 127, 576) == DotPlan("float32", 8, 2, 576)
    # a promoted down_proj: 16-bit codes times 4-bit weights over 1536
    assert dot_plan(32768, 8, 1536).digits == 2
    # probabilities sum to about one: P·V is one pass although 65535·128·2049 >> 2^24
    assert dot_plan(65535, 128, 2049, a_sum=65535 + 1024) == DotPlan("float32", 0, 1, 2049)
    assert dot_plan(65535, 128, 2049).digits == 3
    # beyond three digits, chunks of the contraction; then float64; then int64
    chunked = dot_plan(2**20, 127, 4096)
    assert chunked.dtype == "float32" and chunked.chunk_len < 4096
    assert dot_plan(2**15, 2**15, 300).dtype == "float64"
    assert dot_plan(2**31, 2**15, 2**16).dtype == "int64"
    with pytest.raises(QnpuError, match="overflows int64"):
        dot_plan(2**31, 2**31, 64)
    with pytest.raises(QnpuError, match="overflows int64"):  # digits would wrap when recombined
        dot_plan(2**62, 1, 8)
    with pytest.raises(QnpuError, match="non-negative"):
        dot_plan(-1, 1, 1)


CASES = [
    # (a_max, b_max, k, subscripts): linears and both attention matmuls
    (128, 8, 576, "...i,oi->...o"),
    (32768, 127, 576, "...i,oi->...o"),
    (32768, 8, 1536, "...i,oi->...o"),
    (128, 127, 1537, "...i,oi->...o"),
    (2**20, 127, 4096, "...i,oi->...o"),
    (2**15, 2**15, 300, "...i,oi->...o"),
    (2**31, 2**15, 256, "...i,oi->...o"),
    (32768, 32768, 64, "btkgd,bksd->bkgts"),
    (65535, 128, 513, "bkgts,bksd->btkgd"),
]


@pytest.mark.parametrize("a_max,b_max,k,subscripts", CASES)
def test_every_plan_is_exact_at_the_extremes(a_max, b_max, k, subscripts):
    """Operands at ±max (the worst partial sums) and random ones: numpy and JAX both equal
    the exact (Python integer) einsum."""
    rng = np.random.default_rng(k)
    if subscripts.startswith("..."):
        a = rng.integers(-a_max, a_max + 1, (2, 5, k))
        b = rng.integers(-b_max, b_max + 1, (7, k))
        a[0, 0], a[0, 1], b[0], b[1] = -a_max, a_max, -b_max, b_max
    elif subscripts.startswith("btkgd"):
        a = rng.integers(-a_max, a_max + 1, (1, 3, 2, 2, k))
        b = rng.integers(-b_max, b_max + 1, (1, 2, 5, k))
        a[..., 0, :] = a_max
        b[..., 0, :] = b_max
    else:
        a = rng.integers(0, a_max + 1, (1, 2, 2, 3, k))
        b = rng.integers(-b_max, b_max + 1, (1, 2, k, 8))
        a[..., 0, :] = a_max
        b[..., 0] = -b_max
    want = _reference(subscripts, a, b)
    plan = dot_plan(a_max, b_max, k)
    assert np.array_equal(run_dot_plan(plan, subscripts, a, b, np, _np_einsum), want)
    with jax.enable_x64(True):
        got = run_dot_plan(plan, subscripts, jnp.asarray(a), jnp.asarray(b), jnp, _jnp_einsum)
        assert np.array_equal(np.asarray(got), want)


def test_one_float32_matmul_would_round_where_the_plan_splits():
    a, b = np.array([[2**24, 1]]), np.array([[1, 1]])
    assert (
        int(np.einsum("...i,oi->...o", a.astype(np.float32), b.astype(np.float32))[0, 0]) == 2**24
    )
    plan = dot_plan(2**24, 1, 2)
    assert plan.digits == 2
    assert int(run_dot_plan(plan, "...i,oi->...o", a, b, np, _np_einsum)[0, 0]) == 2**24 + 1


def test_the_emulator_plans_from_the_values_at_hand(monkeypatch):
    """exact_matmul bounds by the operands themselves: rows of probability codes summing to
    65535 against 8-bit values run as one float32 pass (by the rows' mass, where |a|·K alone
    would need three digits), exactly."""
    from qnpu_jax.runtime import emulator as engine

    rng = np.random.default_rng(0)
    cuts = np.sort(rng.integers(0, 65536, (1, 2, 2, 3, 699)), axis=-1)
    edges = np.concatenate(
        [np.zeros_like(cuts[..., :1]), cuts, np.full_like(cuts[..., :1], 65535)], -1
    )
    probs = np.diff(edges, axis=-1)  # 700 non-negative codes per row, summing to 65535
    probs[0, 0, 0, 0] = 0
    probs[0, 0, 0, 0, 0] = 65535  # one row at a single extreme
    v = rng.integers(-128, 128, (1, 2, 700, 8))
    v[..., 0] = -128
    used = []
    real = engine.run_dot_plan
    monkeypatch.setattr(engine, "run_dot_plan", lambda p, *a: used.append(p) or real(p, *a))
    got = exact_matmul(probs, v, "bkgts,bksd->btkgd")
    assert np.array_equal(got, _reference("bkgts,bksd->btkgd", probs, v))
    assert used == [DotPlan("float32", 0, 1, 700)]
    assert dot_plan(65535, 128, 700).digits == 3


def test_probability_rows_at_their_bound_run_in_one_pass():
    """The JAX forward's P·V plan (a_sum = 65535 + S/2) at its extreme: every row's mass at
    the bound, every value at ±max."""
    k = 2049
    plan = dot_plan(65535, 128, k, a_sum=65535 + k // 2)
    assert plan == DotPlan("float32", 0, 1, k)
    rng = np.random.default_rng(1)
    probs = np.zeros((1, 1, 2, 3, k), np.int64)
    probs[..., : k // 2] = 1  # the rounding excess, spread
    probs[..., k // 2] = 65535
    v = np.where(rng.random((1, 1, k, 4)) < 0.5, -128, 127)
    v[..., 0] = -128
    want = _reference("bkgts,bksd->btkgd", probs, v)
    assert np.array_equal(run_dot_plan(plan, "bkgts,bksd->btkgd", probs, v, np, _np_einsum), want)


def test_subscripts_must_contract_the_left_operands_last_axis():
    a, b = np.ones((2, 3), np.int64), np.ones((2, 4))
    with pytest.raises(QnpuError, match="last index must be contracted"):
        run_dot_plan(dot_plan(1, 1, 3), "ij,ik->jk", a, b, np, _np_einsum)
