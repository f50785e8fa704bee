"""Cayley SGD with momentum on the Stiefel manifold, as an optax GradientTransformation.

Li, Wang & Zhang (ICLR 2020), "Efficient Riemannian Optimization on the Stiefel Manifold via
the Cayley Transform", Algorithm 1 — the optimizer SpinQuant and Quant.npu use for R1/R2.
Per matrix X (every leaf is a square orthogonal [n, n] or a stack [..., n, n]) and step k:

    M ← β M − G                                  (momentum on the Euclidean gradient)
    Ŵ ← M Xᵀ − ½ X (Xᵀ M Xᵀ);  W ← Ŵ − Ŵᵀ        (skew-symmetric generator)
    M ← W X                                      (momentum projected onto the tangent space)
    α ← min(lr, 2q / (‖W‖₁ + ε))                 (2q = `max_step`, q = ½ in the paper)
    Y ← X + α M;  repeat s times: Y ← X + (α/2) W (X + Y)
    X ← Y

The fixed-point loop converges to the Cayley transform (I − α/2 W)⁻¹ (I + α/2 W) X, which
is exactly orthogonal; α‖W‖₁ ≤ 1 makes the loop a contraction (factor ≤ ½, since ‖W‖₂ ≤ ‖W‖₁
for skew W). But truncating it after s steps changes XᵀX by about 4 (α‖W‖₂/2)⁴ per step for
s = 1 or 2 (the 6th power for s = 3 or 4), and the Cayley map preserves whatever drift there is,
so it accumulates: on a 64×64 Procrustes problem (lr 0.1, β 0.9) the paper's s = 2 ends 1000
float32 steps at max|XᵀX − I| ≈ 5e-3, and its loss stalls near 2e-4 (the drifted XᵀX is
kept, so the orthogonal optimum is out of reach).
Hence `polish` (default on, not in the paper): one Newton–Schulz step Y ← Y (3I − YᵀY) / 2
after the loop, which squares the deviation; the same run then ends at ≈ 1e-7.

optax's contract adds one rounding: `update` returns Y − X, and `apply_updates` computes
X + (Y − X) in float32. That costs ≈ 1e-7 of orthogonality over those 1000 steps (2.4e-7 when
Y is used directly vs 3.6e-7 via the round trip), so it needs no correction.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from qnpu_jax.errors import QnpuError

_HIGHEST = jax.lax.Precision.HIGHEST  # TF32/bf16 matmuls on accelerators would wreck XᵀX = I


class CayleySGDState(NamedTuple):
    step: jax.Array  # int32 step counter, drives learning-rate schedules
    momentum: optax.Updates  # tangent momentum W X per leaf, in the compute dtype


def _mm(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, -1, -2)


def _compute_dtype(dtype: jnp.dtype) -> jnp.dtype:
    # bf16/f16 rotations are stepped in float32: the Cayley map needs the extra mantissa.
    return jnp.promote_types(dtype, jnp.float32)


def _check_leaf(x: jax.Array) -> None:
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise QnpuError(
            f"cayley_sgd expects square matrices [..., n, n], got a leaf of shape {x.shape}"
        )
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise QnpuError(f"cayley_sgd expects floating-point matrices, got {x.dtype}")


def orthogonality_error(x: jax.Array) -> jax.Array:
    """max |XᵀX − I| over every matrix of a [..., n, n] stack (a scalar)."""
    x = jnp.asarray(x)
    gram = _mm(_t(x), x)
    return jnp.max(jnp.abs(gram - jnp.eye(x.shape[-1], dtype=gram.dtype)))


def _newton_schulz(y: jax.Array) -> jax.Array:
    """One Newton–Schulz step toward the polar factor: YᵀY = I + Δ becomes I + O(Δ²)."""
    gram = _mm(_t(y), y)
    return 1.5 * y - 0.5 * _mm(y, gram)


def _cayley_step(
    grad: jax.Array,
    momentum: jax.Array,
    x_param: jax.Array,
    *,
    lr: jax.Array,
    beta: float,
    iterations: int,
    epsilon: float,
    max_step: float,
) -> tuple[jax.Array, jax.Array]:
    """One Algorithm-1 step for a stack of matrices -> (new X in compute dtype, new M)."""
    dtype = _compute_dtype(x_param.dtype)
    x = x_param.astype(dtype)
    m = beta * momentum - grad.astype(dtype)
    mxt = _mm(m, _t(x))
    w_hat = mxt - 0.5 * _mm(x, _mm(_t(x), mxt))
    w = w_hat - _t(w_hat)
    m = _mm(w, x)
    # Induced 1-norm (max column sum), one per matrix of the stack: each is its own manifold point.
    norm = jnp.max(jnp.sum(jnp.abs(w), axis=-2), axis=-1)[..., None, None]
    alpha = jnp.minimum(lr.astype(dtype), max_step / (norm + epsilon))
    y = x + alpha * m
    for _ in range(iterations):
        y = x + (0.5 * alpha) * _mm(w, x + y)
    return y, m


def cayley_sgd(
    learning_rate: float | optax.Schedule,
    momentum: float = 0.9,
    *,
    iterations: int = 2,
    epsilon: float = 1e-8,
    max_step: float | None = None,
    polish: bool = True,
) -> optax.GradientTransformation:
    """Cayley SGD with momentum (Li et al. 2020, Algorithm 1) for orthogonal-matrix leaves.

    Args:
        learning_rate: the paper's l, a float or an optax schedule of the step count.
        momentum: β in [0, 1).
        iterations: s, fixed-point iterations approximating the Cayley transform (paper: 2).
        epsilon: ε guarding the adaptive step against W = 0.
        max_step: bound on α·‖W‖₁ (the paper's 2q); None means the paper's q = ½, i.e. 1.
            Must lie in (0, 2) so the fixed-point iteration contracts.
        polish: follow each step with one Newton–Schulz step toward the polar factor (two
            extra matmuls; not in the paper). Without it the truncated loop lets XᵀX drift.

    `update` needs `params` (the current points). `optax.apply_updates(params, updates)` yields
    the new points; wrap with `optax.multi_transform` to train other leaves with other rules.
    """
    if not 0.0 <= momentum < 1.0:
        raise QnpuError(f"cayley_sgd momentum must be in [0, 1), got {momentum}")
    if iterations < 1:
        raise QnpuError(f"cayley_sgd needs at least one fixed-point iteration, got {iterations}")
    if epsilon <= 0:
        raise QnpuError(f"cayley_sgd epsilon must be positive, got {epsilon}")
    cap = 1.0 if max_step is None else float(max_step)
    if not 0.0 < cap < 2.0:
        raise QnpuError(f"cayley_sgd max_step must be in (0, 2) to contract, got {max_step}")
    if not callable(learning_rate) and learning_rate < 0:
        raise QnpuError(f"cayley_sgd learning_rate must be non-negative, got {learning_rate}")

    def init_fn(params: optax.Params) -> CayleySGDState:
        def zeros(p: jax.Array) -> jax.Array:
            _check_leaf(p)
            return jnp.zeros(p.shape, _compute_dtype(p.dtype))

        return CayleySGDState(step=jnp.zeros([], jnp.int32), momentum=jax.tree.map(zeros, params))

    def update_fn(
        updates: optax.Updates, state: CayleySGDState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, CayleySGDState]:
        if params is None:
            raise QnpuError("cayley_sgd.update needs params (the current orthogonal matrices)")
        lr = jnp.asarray(learning_rate(state.step) if callable(learning_rate) else learning_rate)

        def leaf(g: jax.Array, m: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            _check_leaf(x)
            y, m_new = _cayley_step(
                g, m, x, lr=lr, beta=momentum, iterations=iterations, epsilon=epsilon, max_step=cap
            )
            if polish:
                y = _newton_schulz(y)
            return (y - x.astype(y.dtype)).astype(x.dtype), m_new

        # `updates` fixes the structure; optax.masked hands us MaskedNode()s, which have no leaves.
        pairs = jax.tree.map(leaf, updates, state.momentum, params)
        new_updates = jax.tree.map(lambda _, pair: pair[0], updates, pairs)
        new_momentum = jax.tree.map(lambda _, pair: pair[1], updates, pairs)
        return new_updates, CayleySGDState(
            step=optax.safe_increment(state.step), momentum=new_momentum
        )

    return optax.GradientTransformation(init_fn, update_fn)
