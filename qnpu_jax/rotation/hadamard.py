"""Hadamard matrices built by construction, plus the random rotations seeded from them.

A Hadamard matrix of order n (entries ±1, H Hᵀ = n I) can only exist for n = 1, 2 or a multiple
of 4. We build the orders n = P₁ · P₂ · … · 2^k as Kronecker products of

* Sylvester matrices of order 2^k,
* Paley type I matrices of order q + 1 (q ≡ 3 mod 4 a prime power),
* Paley type II matrices of order 2(q + 1) (q ≡ 1 mod 4 a prime power),

all derived from the quadratic character of GF(q) (the Jacobsthal matrix). Prime powers, not just
primes, matter in practice: Llama-2's FFN width 11008 = 344 · 32 needs q = 343 = 7³.

Nothing is cached except the factorization search (immutable tuples); a 14336² float64 matrix
is 1.6 GB, so callers that reuse a matrix should keep it themselves.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError

_CONSTRUCTIONS = (
    "Sylvester (2^k), Paley I (q+1 for a prime power q ≡ 3 mod 4), "
    "Paley II (2(q+1) for a prime power q ≡ 1 mod 4), and Kronecker products of these"
)


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, m) with q = p^m and p prime, or None."""
    if q < 2:
        return None
    # Smallest prime factor (q itself when nothing up to √q divides it).
    p = next((d for d in range(2, math.isqrt(q) + 1) if q % d == 0), q)
    m = 0
    while q % p == 0:
        q //= p
        m += 1
    return (p, m) if q == 1 else None


def _paley_field(order: int) -> tuple[str, int] | None:
    """("I" | "II", q) when `order` is a Paley order that is not itself a power of two."""
    if order % 4 or order & (order - 1) == 0:
        return None
    q = order - 1
    if q % 4 == 3 and _prime_power(q) is not None:
        return ("I", q)
    q = order // 2 - 1
    if q % 4 == 1 and _prime_power(q) is not None:
        return ("II", q)
    return None


def _two_adic(n: int) -> tuple[int, int]:
    """n = 2^a · m with m odd -> (a, m)."""
    a = (n & -n).bit_length() - 1
    return a, n >> a


@functools.lru_cache(maxsize=4096)
def _paley_factors(n: int) -> tuple[int, ...] | None:
    """Paley orders P₁ ≤ P₂ ≤ … with n = ∏ Pᵢ · 2^k, or None when our constructions miss n.

    Every Paley order carries at least a factor 4, so among the factorizations we take the one
    using the fewest powers of two (leaving the largest Sylvester factor), then the fewest
    Paley factors, then the lexicographically smallest. The choice only fixes *which* Hadamard
    matrix is returned; any of them is valid.
    """
    if n < 1:
        return None
    a, odd = _two_adic(n)
    if odd == 1:
        return ()

    def cheapest_order(d: int) -> tuple[int, int] | None:
        # Smallest j >= 2 with d · 2^j a Paley order (within the power of two n offers).
        for j in range(2, a + 1):
            if _paley_field(d << j) is not None:
                return j, d << j
        return None

    @functools.cache
    def best(m: int) -> tuple[int, int, tuple[int, ...]] | None:
        # (sum of 2-adic valuations, #factors, sorted orders) covering the odd part m.
        if m == 1:
            return (0, 0, ())
        found: tuple[int, int, tuple[int, ...]] | None = None
        for d in range(3, m + 1, 2):
            if m % d:
                continue
            head = cheapest_order(d)
            tail = best(m // d)
            if head is None or tail is None:
                continue
            cand = (head[0] + tail[0], tail[1] + 1, tuple(sorted((head[1], *tail[2]))))
            if found is None or cand < found:
                found = cand
        return found

    result = best(odd)
    if result is None or result[0] > a:
        return None
    return result[2]


def _is_supported(n: int) -> bool:
    return n in (1, 2) or (n % 4 == 0 and _paley_factors(n) is not None)


def _factors(n: int) -> tuple[int, ...]:
    """Paley orders of a supported n (after `_require_supported`)."""
    factors = _paley_factors(n)
    if factors is None:
        raise AssertionError(f"order {n} is not supported")  # callers check first
    return factors


def supported_hadamard_sizes(limit: int = 16384) -> list[int]:
    """Every order n <= limit that `hadamard_matrix` can build, ascending."""
    return [n for n in range(1, limit + 1) if _is_supported(n)]


def hadamard_construction(n: int) -> str:
    """Human-readable recipe used for order n, e.g. "paley2(q=17) ⊗ sylvester(16)"."""
    _require_supported(n)
    parts = []
    for order in _factors(n):
        kind, q = _paley_field(order) or ("?", 0)
        parts.append(f"paley{len(kind)}(q={q})")
    sylvester = n // math.prod(_factors(n))
    if sylvester > 1 or not parts:
        parts.append(f"sylvester({sylvester})")
    return " ⊗ ".join(parts)


def _nearest_supported(n: int) -> list[int]:
    below = next((k for k in range(n, 0, -1) if _is_supported(k)), None)
    above = next(k for k in range(max(n, 1), 2 * max(n, 1) + 1) if _is_supported(k))
    return sorted({k for k in (below, above) if k is not None})


def _require_supported(n: int) -> None:
    if not isinstance(n, int | np.integer) or isinstance(n, bool):
        raise QnpuError(f"Hadamard order must be an integer, got {n!r}")
    if n < 1:
        raise QnpuError(f"Hadamard order must be positive, got {n}")
    if _is_supported(int(n)):
        return
    why = (
        "a Hadamard matrix of order > 2 needs n divisible by 4"
        if n % 4
        else "no construction available for this order"
    )
    nearest = ", ".join(str(k) for k in _nearest_supported(int(n)))
    raise QnpuError(
        f"no Hadamard matrix of order {n}: {why}. Nearest supported orders: {nearest}. "
        f"Constructions: {_CONSTRUCTIONS}."
    )


def _irreducible_poly(p: int, m: int) -> np.ndarray:
    """Coefficients (lowest degree first, monic) of an irreducible degree-m polynomial over GF(p).

    Brute force is fine: p^m <= the Hadamard order, and a polynomial of degree m is irreducible
    iff it has no monic factor of degree 1..m//2.
    """

    def digits(value: int, length: int) -> list[int]:
        return [(value // p**i) % p for i in range(length)]

    def divides(div: list[int], poly: list[int]) -> bool:
        rem = list(poly)
        for top in range(len(rem) - 1, len(div) - 2, -1):
            c = rem[top]
            if c:
                shift = top - (len(div) - 1)
                for i, dc in enumerate(div):
                    rem[shift + i] = (rem[shift + i] - c * dc) % p
        return not any(rem)

    for low in range(p**m):
        poly = [*digits(low, m), 1]
        if poly[0] == 0:
            continue
        if not any(
            divides([*digits(dl, deg), 1], poly)
            for deg in range(1, m // 2 + 1)
            for dl in range(p**deg)
        ):
            return np.array(poly, dtype=np.int64)
    raise AssertionError(f"no irreducible polynomial of degree {m} over GF({p})")  # unreachable


def _field_digits(p: int, m: int) -> np.ndarray:
    """[q, m] base-p digits of the elements 0..q-1 of GF(p^m) (digit i = coefficient of x^i)."""
    q = p**m
    return (np.arange(q)[:, None] // p ** np.arange(m)[None, :]) % p


def _quadratic_character(p: int, m: int) -> np.ndarray:
    """chi[a] for every a in GF(p^m) (elements encoded as base-p integers): 0, +1 or -1."""
    q = p**m
    digits = _field_digits(p, m)
    if m == 1:
        squares = (np.arange(1, q) ** 2) % q
    else:
        poly = _irreducible_poly(p, m)
        prod = np.zeros((q, 2 * m - 1), dtype=np.int64)
        for i in range(m):
            prod[:, i : i + m] += digits[:, i : i + 1] * digits
        # Reduce modulo the monic irreducible, from the top degree down.
        for top in range(2 * m - 2, m - 1, -1):
            c = prod[:, top : top + 1] % p
            prod[:, top - m : top + 1] -= c * poly[None, :]
        squares = ((prod[:, :m] % p) * p ** np.arange(m)[None, :]).sum(axis=1)[1:]
    chi = -np.ones(q, dtype=np.int64)
    chi[squares] = 1
    chi[0] = 0
    return chi


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = chi(x_i - x_j) over GF(q), int8: symmetric for q ≡ 1 (4), skew for q ≡ 3 (4)."""
    p, m = _prime_power(q) or (0, 0)
    chi = _quadratic_character(p, m)
    if m == 1:
        diff = (np.arange(q)[:, None] - np.arange(q)[None, :]) % q
    else:
        # Field subtraction is digit-wise mod p; accumulate the encoded index digit by digit.
        digits = _field_digits(p, m)
        diff = np.zeros((q, q), dtype=np.int64)
        for i in range(m):
            diff += ((digits[:, None, i] - digits[None, :, i]) % p) * p**i
    return chi[diff].astype(np.int8)


def _paley(order: int) -> np.ndarray:
    """Paley matrix of the given order, int8."""
    kind, q = _paley_field(order) or ("", 0)
    jac = _jacobsthal(q)
    ones = np.ones((q, 1), dtype=np.int8)
    zero = np.zeros((1, 1), dtype=np.int8)
    if kind == "I":
        # I + S with S the skew conference matrix [[0, 1ᵀ], [-1, Q]]: (I+S)(I+S)ᵀ = I + S Sᵀ.
        skew = np.block([[zero, ones.T], [-ones, jac]])
        return np.eye(q + 1, dtype=np.int8) + skew
    # Symmetric conference matrix C (C² = qI), doubled: C ⊗ [[1,1],[1,-1]] + I ⊗ [[1,-1],[-1,-1]].
    conf = np.block([[zero, ones.T], [ones, jac]])
    corner = np.array([[1, -1], [-1, -1]], dtype=np.int8)
    return np.kron(conf, _sylvester(2)) + np.kron(np.eye(q + 1, dtype=np.int8), corner)


def _sylvester(n: int) -> np.ndarray:
    """Sylvester matrix of order n (a power of two), int8."""
    h = np.ones((1, 1), dtype=np.int8)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def _hadamard_factors(n: int) -> list[np.ndarray]:
    """int8 Hadamard matrices whose Kronecker product (in order) is the order-n matrix."""
    _require_supported(n)
    factors = _factors(int(n))
    return [*(_paley(order) for order in factors), _sylvester(int(n) // math.prod(factors))]


def hadamard_matrix(n: int) -> np.ndarray:
    """A Hadamard matrix of order n: float64, entries ±1, H Hᵀ = n I.

    Raises QnpuError (listing the nearest supported orders) when no construction covers n.
    """
    # Kronecker products of Hadamard matrices are Hadamard: (A⊗B)(A⊗B)ᵀ = AAᵀ ⊗ BBᵀ.
    # Built in int8 (8× less memory traffic for the 10k+ widths), converted to float64 once.
    return functools.reduce(np.kron, _hadamard_factors(n)).astype(np.float64)


def normalized_hadamard(n: int) -> np.ndarray:
    """H / √n: an orthogonal float64 matrix."""
    return hadamard_matrix(n) / math.sqrt(n)


def random_hadamard(n: int, key: jax.Array) -> jax.Array:
    """QuaRot's randomized Hadamard: (H / √n) · diag(s), s uniform ±1 from `key`; float32 [n, n]."""
    h = jnp.asarray(normalized_hadamard(n), dtype=jnp.float32)
    signs = jax.random.rademacher(key, (h.shape[0],), dtype=jnp.float32)
    return h * signs[None, :]


def random_orthogonal(n: int, key: jax.Array) -> jax.Array:
    """Haar-distributed orthogonal float32 [n, n]: QR of a Gaussian with sign(diag R) folded in.

    Without the sign correction QR's convention (diag R > 0 or not) biases the distribution.
    """
    if n < 1:
        raise QnpuError(f"rotation size must be positive, got {n}")
    z = jax.random.normal(key, (n, n), dtype=jnp.float32)
    q, r = jnp.linalg.qr(z)
    d = jnp.diagonal(r)
    return q * jnp.where(d < 0, -1.0, 1.0).astype(q.dtype)[None, :]
