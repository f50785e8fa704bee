"""Hadamard constructions and random rotations: exactness, coverage, determinism, errors."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.rotation import (
    hadamard_construction,
    hadamard_matrix,
    normalized_hadamard,
    random_hadamard,
    random_orthogonal,
    supported_hadamard_sizes,
)
from qnpu_jax.rotation.hadamard import _hadamard_factors

# Hidden sizes / head dims (R1, R2) of the target models, then FFN widths of popular small LLMs.
MODEL_WIDTHS = [64, 128, 576, 896, 960, 1024, 1536, 2048, 2560, 3072, 4096]
FFN_WIDTHS = [1536, 2560, 8192, 4864, 8960, 11008, 13824, 14336, 5632, 6912]
ALL_WIDTHS = sorted(set(MODEL_WIDTHS + FFN_WIDTHS))
# Above these a float64 n×n matrix (and an n³ Gram product) is too slow for 2 CI cores.
FULL_GRAM_MAX = 2048
DENSE_MAX = 4096


def _assert_gram(x: np.ndarray, expected_diag: float, atol: float, seed: int = 0) -> None:
    """X Xᵀ == expected_diag · I (exactly when atol == 0); sampled rows + Freivalds above 2048."""
    n = x.shape[0]
    if n <= FULL_GRAM_MAX:
        np.testing.assert_allclose(x @ x.T, expected_diag * np.eye(n), rtol=0, atol=atol)
        return
    rng = np.random.default_rng(seed)
    # Freivalds: a nonzero integer D = HHᵀ − nI has D v = 0 for a random ±1 v with probability
    # <= 1/2, so 24 vectors miss it with probability <= 2⁻²⁴. Exact in float64 for ±1 entries.
    v = rng.choice([-1.0, 1.0], size=(n, 24))
    np.testing.assert_allclose(x @ (x.T @ v), expected_diag * v, rtol=0, atol=atol * n)
    idx = rng.choice(n, size=32, replace=False)
    np.testing.assert_allclose(x[idx] @ x.T, expected_diag * np.eye(n)[idx], rtol=0, atol=atol)


def _assert_hadamard(h: np.ndarray, n: int) -> None:
    assert h.shape == (n, n) and h.dtype == np.float64
    assert np.all(np.abs(h) == 1.0)
    _assert_gram(h, n, atol=0)


def test_all_listed_widths_are_supported() -> None:
    supported = set(supported_hadamard_sizes())
    assert set(ALL_WIDTHS) <= supported


@pytest.mark.parametrize("n", [w for w in ALL_WIDTHS if w <= DENSE_MAX])
def test_hadamard_exact(n: int) -> None:
    _assert_hadamard(hadamard_matrix(n), n)


@pytest.mark.parametrize("n", [w for w in ALL_WIDTHS if w > DENSE_MAX])
def test_hadamard_exact_large(n: int) -> None:
    # hadamard_matrix(n) is exactly the Kronecker product of these factors (checked end to end
    # for 4864 below), and AAᵀ = aI, BBᵀ = bI imply (A⊗B)(A⊗B)ᵀ = ab I; so checking each factor
    # exactly proves the 1.6 GB float64 matrix without materializing it on every CI run.
    factors = _hadamard_factors(n)
    assert int(np.prod([f.shape[0] for f in factors])) == n
    for f in factors:
        _assert_hadamard(f.astype(np.float64), f.shape[0])


def test_large_end_to_end() -> None:
    n = 4864  # paley2(q=37) ⊗ sylvester(64)
    h = hadamard_matrix(n)
    np.testing.assert_array_equal(h, functools.reduce(np.kron, _hadamard_factors(n)))
    _assert_hadamard(h, n)


def test_every_small_supported_order_is_exact() -> None:
    # Exercises every Paley I/II order (prime and prime-power q) up to 256 and their products.
    sizes = supported_hadamard_sizes(256)
    assert sizes[:8] == [1, 2, 4, 8, 12, 16, 20, 24]
    for n in sizes:
        _assert_hadamard(hadamard_matrix(n), n)


@pytest.mark.parametrize(
    ("n", "recipe"),
    [
        (344, "paley1(q=343)"),  # GF(7³): needed for 11008 = 344 · 32
        (100, "paley2(q=49)"),  # GF(7²), type II
        (1904, "paley1(q=27) ⊗ paley1(q=67)"),  # only reachable as a product of two Paley orders
        (576, "paley2(q=17) ⊗ sylvester(16)"),
        (11008, "paley1(q=343) ⊗ sylvester(32)"),
    ],
)
def test_constructions(n: int, recipe: str) -> None:
    assert hadamard_construction(n) == recipe
    if n <= FULL_GRAM_MAX:
        _assert_hadamard(hadamard_matrix(n), n)


def test_supported_sizes_shape() -> None:
    sizes = supported_hadamard_sizes(4096)
    assert sizes == sorted(sizes)
    assert all(n in (1, 2) or n % 4 == 0 for n in sizes)
    assert all(1 << k in sizes for k in range(13))
    assert 172 not in sizes and 92 not in sizes  # no Paley / product construction for these


def test_unsupported_size_error() -> None:
    with pytest.raises(QnpuError) as err:
        hadamard_matrix(172)
    msg = str(err.value)
    assert "172" in msg and "168, 176" in msg and "Paley" in msg and "Sylvester" in msg
    with pytest.raises(QnpuError, match="divisible by 4"):
        hadamard_matrix(102)
    with pytest.raises(QnpuError, match="positive"):
        hadamard_matrix(0)


@pytest.mark.parametrize("n", [w for w in ALL_WIDTHS if w <= DENSE_MAX])
def test_normalized_and_random_hadamard(n: int) -> None:
    norm = normalized_hadamard(n)
    _assert_gram(norm, 1.0, atol=1e-12)
    rh = np.asarray(random_hadamard(n, jax.random.key(3)))
    assert rh.dtype == np.float32
    _assert_gram(rh.astype(np.float64), 1.0, atol=1e-5)
    # H · diag(±1): every column is ± the same column of H/√n.
    signs = np.sign(rh[0] * norm[0])
    np.testing.assert_allclose(rh, norm * signs[None, :], rtol=1e-6, atol=0)


def test_random_hadamard_key_dependence() -> None:
    a = random_hadamard(576, jax.random.key(0))
    np.testing.assert_array_equal(a, random_hadamard(576, jax.random.key(0)))
    assert not np.array_equal(a, random_hadamard(576, jax.random.key(1)))


@pytest.mark.parametrize("n", [64, 128, 576, 960])  # JAX CPU QR is slow on 2 cores
def test_random_orthogonal(n: int) -> None:
    q = np.asarray(random_orthogonal(n, jax.random.key(7)))
    assert q.dtype == np.float32
    _assert_gram(q.T.astype(np.float64), 1.0, atol=1e-5)  # QᵀQ = I


def test_random_orthogonal_key_dependence() -> None:
    a = random_orthogonal(64, jax.random.key(0))
    np.testing.assert_array_equal(a, random_orthogonal(64, jax.random.key(0)))
    assert not np.array_equal(a, random_orthogonal(64, jax.random.key(1)))


def test_random_orthogonal_is_haar_like() -> None:
    # Sign correction makes the distribution Haar: E[Q] = 0 and E[Q_ij²] = 1/n. Without it
    # LAPACK's QR convention biases the diagonal.
    keys = jax.random.split(jax.random.key(0), 400)
    qs = np.asarray(jax.vmap(lambda k: random_orthogonal(4, k))(keys))
    assert abs(qs[:, 0, 0].mean()) < 0.1
    np.testing.assert_allclose((qs**2).mean(axis=0), np.full((4, 4), 0.25), atol=0.05)
