"""Model-equivalent rewrites: fused and rotated models give the original logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.models.llama import forward
from qnpu_jax.transforms import (
    apply_rotations,
    fuse_norms,
    norms_are_fused,
    randomized_hadamard_rotations,
)


def _orthogonal(key, n, batch=()):
    q, r = jnp.linalg.qr(jax.random.normal(key, (*batch, n, n)))
    return q * jnp.sign(jnp.diagonal(r, axis1=-2, axis2=-1))[..., None, :]


@pytest.fixture(scope="module")
def tiny_tokens(tiny_cfg):
    return jax.random.randint(jax.random.key(11), (2, 16), 0, tiny_cfg.vocab_size)


def test_fuse_norms_is_equivalent(tiny_cfg, tiny_params, tiny_tokens):
    fused = fuse_norms(tiny_params, tiny_cfg)
    assert norms_are_fused(fused, tiny_cfg) and not norms_are_fused(tiny_params, tiny_cfg)
    np.testing.assert_allclose(
        forward(fused, tiny_tokens, cfg=tiny_cfg),
        forward(tiny_params, tiny_tokens, cfg=tiny_cfg),
        atol=1e-5,
    )


def test_rotations_are_equivalent_and_change_weights(tiny_cfg, tiny_params, tiny_tokens):
    fused = fuse_norms(tiny_params, tiny_cfg)
    k1, k2 = jax.random.split(jax.random.key(3))
    r1 = _orthogonal(k1, tiny_cfg.hidden_size)
    r2 = _orthogonal(k2, tiny_cfg.head_dim, (tiny_cfg.num_layers,))
    rotated = apply_rotations(fused, tiny_cfg, r1, r2)
    ref = forward(tiny_params, tiny_tokens, cfg=tiny_cfg)
    np.testing.assert_allclose(forward(rotated, tiny_tokens, cfg=tiny_cfg), ref, atol=1e-4)
    for name in ("q_proj", "v_proj", "o_proj", "down_proj"):
        assert not np.allclose(rotated["layers"][name], fused["layers"][name])
    # each rotation alone is equivalent too
    for kwargs in ({"r1": r1}, {"r2": r2}):
        alone = apply_rotations(fused, tiny_cfg, **kwargs)
        np.testing.assert_allclose(forward(alone, tiny_tokens, cfg=tiny_cfg), ref, atol=1e-4)


def test_r2_rotates_v_bias(tiny_cfg, tiny_tokens):
    import dataclasses

    from qnpu_jax.models.llama import init_random_params

    cfg = dataclasses.replace(tiny_cfg, attention_bias=True)
    params = init_random_params(cfg, jax.random.key(9))
    params["layers"]["v_bias"] = params["layers"]["v_bias"] + 0.5
    fused = fuse_norms(params, cfg)
    r2 = _orthogonal(jax.random.key(4), cfg.head_dim, (cfg.num_layers,))
    np.testing.assert_allclose(
        forward(apply_rotations(fused, cfg, None, r2), tiny_tokens, cfg=cfg),
        forward(params, tiny_tokens, cfg=cfg),
        atol=1e-4,
    )


def test_rotation_shape_errors(tiny_cfg, tiny_params):
    fused = fuse_norms(tiny_params, tiny_cfg)
    with pytest.raises(QnpuError, match=r"R1 must have shape \(32, 32\)"):
        apply_rotations(fused, tiny_cfg, jnp.eye(16))
    with pytest.raises(QnpuError, match="R2 must have shape"):
        apply_rotations(fused, tiny_cfg, None, jnp.eye(8))
    unfused = {k: v for k, v in tiny_params.items() if k != "lm_head"}
    with pytest.raises(QnpuError, match="fuse_norms"):
        apply_rotations(unfused, tiny_cfg, jnp.eye(32))
    assert "lm_head" in tiny_params  # untied, but its norms are not folded yet
    with pytest.raises(QnpuError, match="norm weights of one"):
        apply_rotations(tiny_params, tiny_cfg, jnp.eye(32))


def test_real_model_fused_and_rotated_matches_original(smollm):
    """Full depth SmolLM2-135M (tied embeddings, GQA 9/3): max |logit diff| < 1e-3 in float32."""
    cfg = smollm.config
    fused = fuse_norms(smollm.params, cfg)
    k1, k2 = jax.random.split(jax.random.key(0))
    rotated = apply_rotations(
        fused,
        cfg,
        _orthogonal(k1, cfg.hidden_size),
        _orthogonal(k2, cfg.head_dim, (cfg.num_layers,)),
    )
    tokens = jnp.asarray([smollm.tokenizer.encode("The capital of France is Paris, and the river")])
    diff = jnp.abs(forward(rotated, tokens, cfg=cfg) - forward(smollm.params, tokens, cfg=cfg))
    assert float(diff.max()) < 1e-3


def test_randomized_hadamard_rotations_are_orthogonal_and_equivalent(
    tiny_cfg, tiny_params, tiny_tokens
):
    r1, r2 = randomized_hadamard_rotations(tiny_cfg, jax.random.key(2))
    assert r1.shape == (32, 32) and r2.shape == (tiny_cfg.num_layers, 8, 8)
    np.testing.assert_allclose(r1 @ r1.T, np.eye(32), atol=1e-6)
    np.testing.assert_allclose(np.abs(np.asarray(r1)) * np.sqrt(32), 1.0, atol=1e-6)  # ±1/√n
    assert not np.allclose(r2[0], r2[1])  # each layer draws its own signs
    rotated = apply_rotations(fuse_norms(tiny_params, tiny_cfg), tiny_cfg, r1, r2)
    np.testing.assert_allclose(
        forward(rotated, tiny_tokens, cfg=tiny_cfg),
        forward(tiny_params, tiny_tokens, cfg=tiny_cfg),
        atol=1e-4,
    )
