import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.models.config import RopeConfig
from qnpu_jax.models.llama import (
    forward,
    forward_cached,
    generate,
    init_cache,
    next_token_nll,
    rope_inv_freq,
    token_nll,
)


def test_prefill_then_decode_matches_full_forward(tiny_cfg, tiny_params):
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, tiny_cfg.vocab_size)
    full = forward(tiny_params, tokens, cfg=tiny_cfg)
    cache = init_cache(tiny_cfg, 2, 16)
    logits, cache = forward_cached(tiny_params, tokens[:, :7], cache, jnp.int32(0), cfg=tiny_cfg)
    steps = [logits]
    for pos in range(7, 12):
        step, cache = forward_cached(
            tiny_params, tokens[:, pos : pos + 1], cache, jnp.int32(pos), cfg=tiny_cfg
        )
        steps.append(step)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5, rtol=1e-5)


def test_forward_is_causal(tiny_cfg, tiny_params):
    tokens = jax.random.randint(jax.random.key(2), (1, 10), 0, tiny_cfg.vocab_size)
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % tiny_cfg.vocab_size)
    a = forward(tiny_params, tokens, cfg=tiny_cfg)
    b = forward(tiny_params, changed, cfg=tiny_cfg)
    np.testing.assert_allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert np.abs(np.asarray(a[:, 6:] - b[:, 6:])).max() > 1e-4


def test_greedy_generate_matches_repeated_full_forward(tiny_cfg, tiny_params):
    prompt = [5, 17, 3, 44, 9]
    new = generate(tiny_params, prompt, cfg=tiny_cfg, max_new_tokens=6)
    seq = list(prompt)
    for _ in range(6):
        logits = forward(tiny_params, jnp.asarray([seq]), cfg=tiny_cfg)
        seq.append(int(jnp.argmax(logits[0, -1])))
    assert new == seq[len(prompt) :]


def test_generate_stops_at_eos(tiny_cfg, tiny_params):
    prompt = [5, 17, 3]
    free = generate(tiny_params, prompt, cfg=tiny_cfg, max_new_tokens=5)
    stopped = generate(tiny_params, prompt, cfg=tiny_cfg, max_new_tokens=5, eos_token_id=free[1])
    assert stopped == free[: free.index(free[1]) + 1]


def test_token_nll_is_cross_entropy(tiny_cfg, tiny_params):
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, tiny_cfg.vocab_size)
    logits = np.asarray(forward(tiny_params, tokens, cfg=tiny_cfg), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    t = np.asarray(tokens)
    expected = -np.take_along_axis(logp[:, :-1], t[:, 1:, None], -1)[..., 0]
    np.testing.assert_allclose(token_nll(tiny_params, tokens, cfg=tiny_cfg), expected, atol=1e-5)
    np.testing.assert_allclose(next_token_nll(jnp.asarray(logits), tokens), expected, atol=1e-5)


@pytest.mark.parametrize(("prompt_len", "max_new"), [(31, 1), (32, 3), (33, 3)])
def test_generate_at_padding_bucket_edges(tiny_cfg, tiny_params, prompt_len, max_new):
    prompt = [int(t) for t in jax.random.randint(jax.random.key(prompt_len), (prompt_len,), 0, 96)]
    new = generate(tiny_params, prompt, cfg=tiny_cfg, max_new_tokens=max_new)
    seq = list(prompt)
    for _ in range(max_new):
        logits = forward(tiny_params, jnp.asarray([seq]), cfg=tiny_cfg)
        seq.append(int(jnp.argmax(logits[0, -1])))
    assert new == seq[prompt_len:]


def test_linear_rope_scaling_divides_frequencies():
    base = RopeConfig(theta=10000.0)
    scaled = RopeConfig(theta=10000.0, rope_type="linear", factor=4.0)
    np.testing.assert_allclose(rope_inv_freq(scaled, 64), rope_inv_freq(base, 64) / 4.0)
