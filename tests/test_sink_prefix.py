"""The sink prefix: float semantics unchanged, calibration ranges exclude the sink."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.data import sample_windows
from qnpu_jax.models.llama import token_nll
from qnpu_jax.models.taps import FakeQuantTaps, sink_prefix, tapped_token_nll
from qnpu_jax.pipeline import calibrate, collect_activation_stats
from qnpu_jax.quant import QuantRule, default_plan, uniform_plan


@pytest.fixture(scope="module")
def windows(tiny_cfg):
    ids = np.asarray(jax.random.randint(jax.random.key(11), (3000,), 0, tiny_cfg.vocab_size))
    return sample_windows(ids, 24, 3, jax.random.key(12))


def _with_prefix(windows, prefix):
    return jnp.concatenate(
        [jnp.broadcast_to(jnp.asarray(prefix, jnp.int32), (len(windows), len(prefix))), windows],
        axis=1,
    )


def test_float_with_prefix_is_the_float_model_on_the_longer_sequence(
    tiny_cfg, tiny_params, windows
):
    tokens = jnp.asarray(windows)
    prefix = (3, 7)
    got = tapped_token_nll(tiny_params, None, tokens, cfg=tiny_cfg, taps=None, prefix=prefix)
    full = token_nll(tiny_params, _with_prefix(tokens, prefix), cfg=tiny_cfg)
    np.testing.assert_allclose(got, full[:, len(prefix) :], rtol=1e-5, atol=1e-5)
    assert got.shape == (len(windows), windows.shape[1] - 1)


def test_calibration_skips_the_prefix_except_its_kv_cache(tiny_cfg, tiny_params, windows):
    plan = default_plan(tiny_cfg.num_layers)
    prefix = (5,)
    tokens = np.asarray(windows)
    with_prefix = collect_activation_stats(tiny_params, tiny_cfg, plan, tokens, prefix=prefix)
    # reference: observe the whole [prefix, tokens] sequence, one position at a time
    longer = np.asarray(_with_prefix(jnp.asarray(tokens), prefix))
    whole = collect_activation_stats(tiny_params, tiny_cfg, plan, longer)
    t = tokens.shape[1]
    for name in ("resid_mlp", "down_in", "attn_in"):  # device tensors: prefix position excluded
        ratio = np.asarray(with_prefix["layers"][name].count) / whole["layers"][name].count
        np.testing.assert_allclose(ratio, t / (t + 1))
    for name in ("k_rope", "v_out"):  # the prefix's K/V live in the device cache
        np.testing.assert_array_equal(
            with_prefix["layers"][name].count, whole["layers"][name].count
        )
        np.testing.assert_allclose(
            with_prefix["layers"][name].max, whole["layers"][name].max, rtol=1e-5
        )


def test_fake_quant_with_prefix_quantizes_the_prefix_kv(tiny_cfg, tiny_params, windows):
    plan = uniform_plan(tiny_cfg.num_layers, 16)
    tokens = jnp.asarray(windows)
    state = calibrate(tiny_params, tiny_cfg, plan, windows, prefix=(5,))
    fq = tapped_token_nll(
        tiny_params, state, tokens, cfg=tiny_cfg, taps=FakeQuantTaps(plan), prefix=(5,)
    )
    ref = tapped_token_nll(tiny_params, None, tokens, cfg=tiny_cfg, taps=None, prefix=(5,))
    np.testing.assert_allclose(fq, ref, atol=2e-3)
    # a 2-bit K/V cache must change the result through the prefix's cached K/V as well
    two = uniform_plan(tiny_cfg.num_layers, 16).apply(
        [QuantRule(pattern="layers/(k_rope|v_out)", bits=2)]
    )
    state2 = calibrate(tiny_params, tiny_cfg, two, windows, prefix=(5,))
    assert not np.allclose(
        tapped_token_nll(
            tiny_params, state2, tokens, cfg=tiny_cfg, taps=FakeQuantTaps(two), prefix=(5,)
        ),
        ref,
        atol=1e-3,
    )


def test_sink_prefix_names(smollm):
    assert sink_prefix("none", smollm.tokenizer) == ()
    assert sink_prefix("bos", smollm.tokenizer) == (smollm.tokenizer.bos_token_id,)
    with pytest.raises(QnpuError, match="unknown sink prefix"):
        sink_prefix("eos", smollm.tokenizer)


def test_bos_prefix_takes_the_attention_sink_out_of_real_model_ranges(smollm):
    from qnpu_jax.data import load_documents, tokenize_documents

    cfg = smollm.config
    calib = tokenize_documents(load_documents("wiki", "calib"), smollm.tokenizer)
    windows = sample_windows(calib, 64, 2, jax.random.key(0))
    plan = uniform_plan(cfg.num_layers, 16)
    plain = collect_activation_stats(smollm.params, cfg, plan, windows)
    bos = sink_prefix("bos", smollm.tokenizer)
    prefixed = collect_activation_stats(smollm.params, cfg, plan, windows, prefix=bos)
    for name in ("resid_mlp", "down_in"):
        before = float(np.max(np.maximum(-plain["layers"][name].min, plain["layers"][name].max)))
        after = float(
            np.max(np.maximum(-prefixed["layers"][name].min, prefixed["layers"][name].max))
        )
        assert after < before / 10, (name, before, after)


def test_sixteen_bit_fake_quant_equals_float_with_rotation_and_bos_prefix(smollm):
    """The 16-bit equivalence on the real model: every tensor of the integer graph at 16 bits,
    R1/R2 Hadamard, BOS sink prefix -> perplexity within 0.1% of float.

    Calibrated and evaluated on the same (calib split) windows, so that no value falls outside
    its range: this isolates the 16-bit rounding. On held-out text, values beyond a small
    calibration set's ranges are clipped (+1.0% with 2 windows of 128 here); the 32-window
    report, calibrated on 16 windows of 512, measures +0.02%.
    """
    import math

    from qnpu_jax.data import load_documents, tokenize_documents
    from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations

    cfg, tok = smollm.config, smollm.tokenizer
    windows = sample_windows(
        tokenize_documents(load_documents("wiki", "calib"), tok), 128, 2, jax.random.key(0)
    )
    rotations = randomized_hadamard_rotations(cfg, jax.random.key(1))
    rotated = apply_rotations(fuse_norms(smollm.params, cfg), cfg, *rotations)
    plan = uniform_plan(cfg.num_layers, 16)
    bos = sink_prefix("bos", tok)
    state = calibrate(rotated, cfg, plan, windows, prefix=bos)
    tokens = jnp.asarray(windows)
    ref = tapped_token_nll(smollm.params, None, tokens, cfg=cfg, taps=None, prefix=bos)
    fq = tapped_token_nll(rotated, state, tokens, cfg=cfg, taps=FakeQuantTaps(plan), prefix=bos)
    change = math.exp(float(jnp.mean(fq)) - float(jnp.mean(ref))) - 1
    assert abs(change) < 1e-3, change
    # Without the prefix the rotated model's sink still widens the residual and down_proj
    # ranges 10-35x. On 2 windows of 128 its perplexity cost at 16 bits is ~2e-4, the size of
    # the prefixed run's own rounding (and of its spread across CPUs), so compare the ranges.
    plain = calibrate(rotated, cfg, plan, windows)
    for name in ("resid_attn", "resid_mlp", "down_in", "down_out"):
        wide = float(jnp.max(plain["layers"][name].scale))
        narrow = float(jnp.max(state["layers"][name].scale))
        assert wide > 5 * narrow, (name, wide, narrow)


def test_bos_newline_names_bos_then_the_newline_tokens(smollm):
    from qnpu_jax.models.taps import prefix_name

    tok = smollm.tokenizer
    ids = sink_prefix("bos_newline", tok)
    assert ids == (tok.bos_token_id, *tok.encode("\n", add_bos=False)) and len(ids) == 2
    assert [prefix_name(sink_prefix(n, tok), tok) for n in ("none", "bos", "bos_newline")] == [
        "none",
        "bos",
        "bos_newline",
    ]
    assert prefix_name((5, 6), tok) == "tokens [5, 6]"


def test_a_newline_after_bos_keeps_a_first_token_from_becoming_a_second_sink(smollm):
    """Some first tokens after BOS become a second attention sink: " Salem" (a calibration
    window's first token under seed 0) puts |down_proj output| above 10,000 where every other
    token stays near 1,000, and Max-Min ranges then follow it. After BOS + newline it is an
    ordinary token (docs/results.md, "Seed stability")."""
    from qnpu_jax.models.taps import CaptureTaps, tapped_forward

    tok = smollm.tokenizer
    ids = jnp.asarray([tok.encode(" Salem, Illinois. Although the town", add_bos=False)])
    taps = CaptureTaps(frozenset({"down_out"}))

    def peak(name):
        _, aux = tapped_forward(
            smollm.params,
            {"layers": None, "outer": None},
            ids,
            cfg=smollm.config,
            taps=taps,
            prefix=sink_prefix(name, tok),
        )
        return float(jnp.max(jnp.abs(aux["layers"]["down_out"])))

    assert peak("bos") > 5000
    assert peak("bos_newline") < 2000


def test_a_two_token_prefix_goes_through_save_load_the_artifact_and_both_engines(
    two_layer_dir, tmp_path
):
    from conftest import engines_agree_with_fake_quant  # tests/ is on sys.path

    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.models.load import load_model
    from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps

    fp = load_model(str(two_layer_dir))
    data = Calibration.from_text("wiki", fp.tokenizer, seq_len=32, windows=2, key=jax.random.key(0))
    model = chain(
        steps.fuse_norms(),
        steps.hadamard_rotations(jax.random.key(1)),
        steps.plan(w_bits=8, a_bits=8),
        steps.calibrate(),
    )(QuantizedModel.from_float(fp, prefix="bos_newline"), data)
    assert model.prefix == sink_prefix("bos_newline", fp.tokenizer)
    model.save(tmp_path / "run")
    assert QuantizedModel.load(tmp_path / "run").prefix == model.prefix
    art = load_int_model(export_quantized(model, tmp_path / "art", fp.tokenizer))
    assert [int(t) for t in art.graph["prefix_tokens"]] == list(model.prefix)
    engines_agree_with_fake_quant(art, model, np.asarray(data.windows[:1]))
