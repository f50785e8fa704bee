"""Cayley SGD on the Stiefel manifold: convergence, orthogonality, optax composition."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.rotation import cayley_sgd, orthogonality_error, random_orthogonal

Loss = Callable[[jax.Array], jax.Array]


def _same_component(x: jax.Array, target: jax.Array) -> jax.Array:
    """Flip x's first column where det differs: a Cayley path never leaves its half of O(n)."""
    flip = jnp.sign(jnp.linalg.det(x)) != jnp.sign(jnp.linalg.det(target))
    return x.at[..., :, 0].multiply(jnp.where(flip, -1.0, 1.0)[..., None])


def _procrustes(shape: tuple[int, ...], seed: int) -> tuple[jax.Array, jax.Array, Loss]:
    """Start X0 and loss ½‖X A − Q* A‖² whose unique orthogonal minimizer is the known Q*."""
    *batch, n = shape[:-1]
    k_target, k_start, k_data = jax.random.split(jax.random.key(seed), 3)
    count = int(np.prod(batch, dtype=np.int64))
    target = jax.vmap(lambda k: random_orthogonal(n, k))(jax.random.split(k_target, count))
    start = jax.vmap(lambda k: random_orthogonal(n, k))(jax.random.split(k_start, count))
    start = _same_component(start, target)
    a = jax.random.normal(k_data, (count, n, 2 * n)) / jnp.sqrt(2.0 * n)  # A Aᵀ ≈ I
    b = target @ a

    def loss(x: jax.Array) -> jax.Array:
        return 0.5 * jnp.sum((x.reshape(count, n, n) @ a - b) ** 2)

    return start.reshape(shape), target.reshape(shape), loss


def _train(
    opt: optax.GradientTransformation, x0: jax.Array, loss: Loss, steps: int
) -> tuple[jax.Array, jax.Array]:
    """`steps` optimizer steps inside one jit; returns the final X and the loss trace."""

    @jax.jit
    def run(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        def body(carry: tuple, _: None) -> tuple[tuple, jax.Array]:
            x, state = carry
            value, grad = jax.value_and_grad(loss)(x)
            updates, state = opt.update(grad, state, x)
            return (optax.apply_updates(x, updates), state), value

        (x, _), losses = jax.lax.scan(body, (x, opt.init(x)), None, length=steps)
        return x, losses

    return run(x0)


@pytest.mark.parametrize("shape", [(64, 64), (3, 16, 16)])
def test_procrustes_converges_and_stays_orthogonal(shape: tuple[int, ...]) -> None:
    x0, target, loss = _procrustes(shape, seed=0)
    x, losses = _train(cayley_sgd(0.1, 0.9), x0, loss, steps=1000)
    assert x.dtype == jnp.float32 and x.shape == shape
    assert float(orthogonality_error(x)) < 1e-4
    assert float(loss(x)) < 1e-6 * float(losses[0])
    np.testing.assert_allclose(x, target, atol=1e-3)


def test_paper_variant_without_polish_drifts() -> None:
    # Documents why `polish` is on by default: the paper's s = 2 loop alone lets XᵀX drift far
    # past 1e-4 on this problem, though the loss still falls.
    x0, _, loss = _procrustes((64, 64), seed=0)
    x, losses = _train(cayley_sgd(0.1, 0.9, polish=False), x0, loss, steps=1000)
    assert 1e-4 < float(orthogonality_error(x)) < 5e-2
    assert float(loss(x)) < 1e-3 * float(losses[0])


def test_stack_is_per_matrix() -> None:
    # Each matrix of a stack takes its own adaptive step, exactly as if trained alone.
    x0, _, loss = _procrustes((3, 16, 16), seed=1)
    grads = jax.grad(loss)(x0)
    opt = cayley_sgd(1.0, 0.9)  # large lr so the per-matrix cap α <= 1/‖W‖₁ binds
    stacked, _ = opt.update(grads, opt.init(x0), x0)
    for i in range(3):
        alone, _ = opt.update(grads[i], opt.init(x0[i]), x0[i])
        np.testing.assert_allclose(stacked[i], alone, rtol=1e-5, atol=1e-7)


def test_multi_transform_with_plain_sgd() -> None:
    k_rot, k_a = jax.random.split(jax.random.key(2))
    target = random_orthogonal(16, jax.random.key(3))
    rot = _same_component(random_orthogonal(16, k_rot), target)
    params = {"rot": rot, "scale": jnp.full((16,), 0.5)}
    a = jax.random.normal(k_a, (16, 32))
    b = 2.0 * (target @ a)

    def loss(p: dict[str, jax.Array]) -> jax.Array:
        # Scaled inputs, rotated: the minimizer is scale = 2, rot = the target rotation.
        return 0.5 * jnp.sum((p["rot"] @ (p["scale"][:, None] * a) - b) ** 2) / a.shape[1]

    labels = {"rot": "rot", "scale": "scale"}
    opt = optax.multi_transform({"rot": cayley_sgd(0.1), "scale": optax.sgd(0.01)}, labels)
    state = opt.init(params)
    grads = jax.grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    # The scale leaf gets exactly plain SGD; the rotation moves and stays on the manifold.
    np.testing.assert_allclose(new["scale"], params["scale"] - 0.01 * grads["scale"], rtol=1e-6)
    assert float(jnp.max(jnp.abs(new["rot"] - params["rot"]))) > 1e-4
    assert float(orthogonality_error(new["rot"])) < 1e-5

    @jax.jit
    def run(p: dict[str, jax.Array], s: optax.OptState) -> dict[str, jax.Array]:
        def body(carry: tuple, _: None) -> tuple[tuple, None]:
            p, s = carry
            u, s = opt.update(jax.grad(loss)(p), s, p)
            return (optax.apply_updates(p, u), s), None

        return jax.lax.scan(body, (p, s), None, length=1000)[0][0]

    final = run(new, state)
    assert float(loss(final)) < 1e-3 * float(loss(params))
    np.testing.assert_allclose(final["scale"], 2.0, atol=0.1)
    np.testing.assert_allclose(final["rot"], target, atol=0.05)
    assert float(orthogonality_error(final["rot"])) < 1e-4


def test_schedule_learning_rate() -> None:
    x0, _, loss = _procrustes((32, 32), seed=4)
    schedule = optax.cosine_decay_schedule(0.1, decay_steps=1000)
    x, losses = _train(cayley_sgd(schedule, 0.9), x0, loss, steps=1000)
    assert float(orthogonality_error(x)) < 1e-4
    assert float(loss(x)) < 1e-4 * float(losses[0])
    # The schedule is read from the step count in the state: once it hits 0 nothing moves.
    stop = cayley_sgd(optax.piecewise_constant_schedule(0.1, {3: 0.0}), momentum=0.0)
    x3, _ = _train(stop, x0, loss, steps=3)
    x10, _ = _train(stop, x0, loss, steps=10)
    assert float(jnp.max(jnp.abs(x3 - x0))) > 1e-3
    np.testing.assert_allclose(x10, x3, atol=1e-6)


def test_chain_and_bfloat16_leaf() -> None:
    x0 = random_orthogonal(16, jax.random.key(5)).astype(jnp.bfloat16)
    opt = optax.chain(optax.clip_by_global_norm(1.0), cayley_sgd(0.05))
    grads = jnp.ones_like(x0)
    updates, _ = opt.update(grads, opt.init(x0), x0)
    assert updates.dtype == jnp.bfloat16
    assert float(jnp.max(jnp.abs(updates.astype(jnp.float32)))) > 0


def test_errors() -> None:
    opt = cayley_sgd(0.1)
    with pytest.raises(QnpuError, match="square"):
        opt.init({"w": jnp.zeros((4, 3))})
    eye = jnp.eye(4)
    with pytest.raises(QnpuError, match="params"):
        opt.update(eye, opt.init(eye))
    with pytest.raises(QnpuError, match="momentum"):
        cayley_sgd(0.1, momentum=1.0)
    with pytest.raises(QnpuError, match="max_step"):
        cayley_sgd(0.1, max_step=2.0)


def test_orthogonality_error() -> None:
    assert float(orthogonality_error(jnp.eye(5))) == 0.0
    assert float(orthogonality_error(2.0 * jnp.eye(5))) == pytest.approx(3.0)
    stack = jnp.stack([jnp.eye(3), jnp.diag(jnp.array([1.0, 1.0, 1.1]))])
    assert float(orthogonality_error(stack)) == pytest.approx(0.21, rel=1e-5)
