"""The forward under a plan: float taps == float forward, 16-bit fake-quant ≈ float, gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.data import sample_windows
from qnpu_jax.models.llama import forward, token_nll
from qnpu_jax.models.taps import FakeQuantTaps, tapped_forward, tapped_token_nll
from qnpu_jax.pipeline import calibrate
from qnpu_jax.quant import QuantRule, check_scales, default_plan, uniform_plan


@pytest.fixture(scope="module")
def tiny_windows(tiny_cfg):
    ids = np.asarray(jax.random.randint(jax.random.key(5), (4000,), 0, tiny_cfg.vocab_size))
    return sample_windows(ids, 32, 6, jax.random.key(6))


def _ppl(nll):
    return math.exp(float(np.mean(np.asarray(nll, np.float64))))


def test_sixteen_bit_fake_quant_matches_float_on_tiny_model(tiny_cfg, tiny_params, tiny_windows):
    plan = uniform_plan(tiny_cfg.num_layers, 16)
    state = calibrate(tiny_params, tiny_cfg, plan, tiny_windows[:4], batch_size=2)
    check_scales(jax.tree.map(lambda s: s, {k: v.scale for k, v in state["layers"].items()}))
    ev = jnp.asarray(tiny_windows[4:])
    float_ppl = _ppl(token_nll(tiny_params, ev, cfg=tiny_cfg))
    fq = tapped_token_nll(tiny_params, state, ev, cfg=tiny_cfg, taps=FakeQuantTaps(plan))
    assert abs(_ppl(fq) / float_ppl - 1) < 1e-3
    w4a4 = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=4)
    state4 = calibrate(tiny_params, tiny_cfg, w4a4, tiny_windows[:4], batch_size=2)
    # the random tiny model is near-uniform, so compare logits: 4 bits moves them far more
    ref = forward(tiny_params, ev, cfg=tiny_cfg)
    d16 = jnp.abs(
        tapped_forward(tiny_params, state, ev, cfg=tiny_cfg, taps=FakeQuantTaps(plan))[0] - ref
    )
    d4 = jnp.abs(
        tapped_forward(tiny_params, state4, ev, cfg=tiny_cfg, taps=FakeQuantTaps(w4a4))[0] - ref
    )
    assert float(d4.max()) > 5 * float(d16.max())


def test_per_layer_bits_become_qmin_qmax_arrays(tiny_cfg, tiny_params, tiny_windows):
    rule = QuantRule(pattern="layers/down_in", layer_bits=(8, 16))
    plan = default_plan(tiny_cfg.num_layers, rules=[rule])
    state = calibrate(tiny_params, tiny_cfg, plan, tiny_windows[:2], batch_size=2)
    np.testing.assert_array_equal(state["layers"]["down_in"].qmax, [127, 32767])
    np.testing.assert_allclose(state["layers"]["probs"].scale, [1 / 65535] * 2, rtol=1e-7)
    assert state["layers"]["q_proj"].scale.shape == (2, tiny_cfg.q_size, 1)
    assert state["outer"]["embed_tokens"].scale.shape == (tiny_cfg.vocab_size, 1)


def test_gradients_reach_learnable_scales_only(tiny_cfg, tiny_params, tiny_windows):
    learn = QuantRule(pattern="layers/(attn_in|q_proj|down_in)", learnable=True)
    plan = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=4, rules=[learn])
    state = calibrate(tiny_params, tiny_cfg, plan, tiny_windows[:2], batch_size=2)
    tokens = jnp.asarray(tiny_windows[4:])
    taps = FakeQuantTaps(plan, lsq_grad_scaling=True, cfg=tiny_cfg)

    def loss(s):
        return jnp.mean(tapped_token_nll(tiny_params, s, tokens, cfg=tiny_cfg, taps=taps))

    grads = jax.grad(loss)(state)
    for name in ("attn_in", "q_proj", "down_in"):
        g = np.asarray(grads["layers"][name].scale)
        assert np.isfinite(g).all() and np.abs(g).max() > 0
    for name in ("mlp_in", "k_proj", "o_out"):  # not learnable: no gradient at all
        assert not np.asarray(grads["layers"][name].scale).any()
    static_logits, _ = tapped_forward(
        tiny_params, state, tokens, cfg=tiny_cfg, taps=FakeQuantTaps(plan)
    )
    dynamic_logits, _ = tapped_forward(
        tiny_params, state, tokens, cfg=tiny_cfg, taps=FakeQuantTaps(plan, mode="dynamic")
    )
    assert not np.allclose(static_logits, dynamic_logits)


def test_nan_in_calibration_is_a_clear_error(tiny_cfg, tiny_params, tiny_windows):
    bad = jax.tree.map(lambda x: x, tiny_params)
    bad["layers"] = dict(bad["layers"])
    bad["layers"]["up_proj"] = bad["layers"]["up_proj"].at[1, 0, 0].set(jnp.nan)
    plan = default_plan(
        tiny_cfg.num_layers,
        rules=[QuantRule(pattern="layers/up_proj", quantize=False)],  # NaN reaches activations
    )
    with pytest.raises(QnpuError, match="NaN in calibration data"):
        calibrate(bad, tiny_cfg, plan, tiny_windows[:2], batch_size=2)


def test_real_model_w8a8_rtn_is_finite_and_worse_than_float(smollm):
    from qnpu_jax.data import eval_windows, load_documents, tokenize_documents

    cfg = smollm.config
    calib = tokenize_documents(load_documents("wiki", "calib"), smollm.tokenizer)
    ev = jnp.asarray(
        eval_windows(tokenize_documents(load_documents("wiki", "eval"), smollm.tokenizer), 64, 2)
    )
    plan = default_plan(cfg.num_layers)
    state = calibrate(smollm.params, cfg, plan, sample_windows(calib, 64, 2, jax.random.key(0)))
    float_ppl = _ppl(token_nll(smollm.params, ev, cfg=cfg))
    q_ppl = _ppl(tapped_token_nll(smollm.params, state, ev, cfg=cfg, taps=FakeQuantTaps(plan)))
    assert math.isfinite(q_ppl) and q_ppl > float_ppl


def test_calibration_counts_visible_scores_and_is_batch_size_invariant(
    tiny_cfg, tiny_params, tiny_windows
):
    from qnpu_jax.pipeline import collect_activation_stats

    plan = default_plan(tiny_cfg.num_layers)
    windows = tiny_windows[:4]
    one = collect_activation_stats(tiny_params, tiny_cfg, plan, windows, batch_size=1)
    three = collect_activation_stats(tiny_params, tiny_cfg, plan, windows, batch_size=3)
    t = windows.shape[1]
    visible = len(windows) * tiny_cfg.num_heads * t * (t + 1) // 2  # causal: no masked scores
    np.testing.assert_array_equal(one["layers"]["scores"].count, [visible] * tiny_cfg.num_layers)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(three), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_headroom_widens_only_the_tensors_it_names(tiny_cfg, tiny_params, tiny_windows):
    """A rule's headroom multiplies the calibrated scale of the tensors it matches (symmetric:
    the zero point stays 0); every other encoding is the plain plan's."""
    plain = default_plan(tiny_cfg.num_layers)
    wide = default_plan(
        tiny_cfg.num_layers, rules=[QuantRule(pattern="layers/(up_out|o_out)", headroom=2)]
    )
    a = calibrate(tiny_params, tiny_cfg, plain, tiny_windows[:2])
    b = calibrate(tiny_params, tiny_cfg, wide, tiny_windows[:2])
    for group in ("layers", "outer"):
        for name, enc in a[group].items():
            factor = 2.0 if name in ("up_out", "o_out") else 1.0
            np.testing.assert_array_equal(np.asarray(b[group][name].scale), factor * enc.scale)
            np.testing.assert_array_equal(b[group][name].zero_point, enc.zero_point)


def test_calibration_on_a_mesh_compiles_its_step_once(tiny_cfg, tiny_params, tiny_windows):
    from qnpu_jax.mesh import make_mesh, place_params
    from qnpu_jax.pipeline.calibrate import _observe_step, collect_activation_stats

    # the statistics start where the step's outputs live, so the second batch reuses the first
    # batch's program (it compiled again when they started unplaced: every calibration twice)
    mesh = make_mesh()
    params = place_params(mesh, tiny_params)
    plan = default_plan(tiny_cfg.num_layers)
    collect_activation_stats(params, tiny_cfg, plan, tiny_windows[:1], mesh=mesh)
    compiled = _observe_step._cache_size()
    collect_activation_stats(params, tiny_cfg, plan, tiny_windows[:3], mesh=mesh)
    assert _observe_step._cache_size() == compiled


def test_dynamic_sixteen_bit_is_close_to_float(tiny_cfg, tiny_params, tiny_windows):
    plan = uniform_plan(tiny_cfg.num_layers, 16)
    state = calibrate(tiny_params, tiny_cfg, plan, tiny_windows[:2], batch_size=2)
    tokens = jnp.asarray(tiny_windows[4:])
    ref = forward(tiny_params, tokens, cfg=tiny_cfg)
    dyn, _ = tapped_forward(
        tiny_params, state, tokens, cfg=tiny_cfg, taps=FakeQuantTaps(plan, mode="dynamic")
    )
    assert float(jnp.abs(dyn - ref).max()) < 1e-3 * float(jnp.abs(ref).max())
