"""MobileQuant's pieces: equivalent scaling of every linear pair (model-equivalent, with and
without rotations, GQA), SmoothQuant's initialization, learnable weight clipping, activation
range learning, the block-wise objective, and the mobilequant recipe through both integer
engines."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import engines_agree_with_fake_quant  # tests/ is on sys.path (rootdir conftest)

from qnpu_jax.errors import QnpuError
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import forward, init_random_params
from qnpu_jax.models.load import load_model
from qnpu_jax.pipeline import Calibration, QuantizedModel, steps
from qnpu_jax.pipeline.calibrate import channel_absmax
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.recipes import for_config
from qnpu_jax.pipeline.stage1 import (
    CLIP_RANGE,
    Stage1Config,
    clip_logits,
    clipped_weight_scales,
    stage1_loss,
)
from qnpu_jax.quant.plan import QuantRule
from qnpu_jax.transforms import (
    EQUALIZED,
    apply_rotations,
    equalization_widths,
    equalize,
    fuse_norms,
    randomized_hadamard_rotations,
    reader_absmax,
    smoothing_scales,
)


def _random_scales(cfg: ModelConfig, key: jax.Array) -> dict[str, jax.Array]:
    keys = jax.random.split(key, len(EQUALIZED))
    return {
        name: jnp.exp(jax.random.normal(k, (cfg.num_layers, width)))
        for k, (name, width) in zip(keys, equalization_widths(cfg).items(), strict=True)
    }


@pytest.mark.parametrize("bias", [False, True])
def test_equalizing_every_pair_leaves_the_float_logits_unchanged(tiny_cfg, bias):
    cfg = dataclasses.replace(tiny_cfg, attention_bias=bias)  # GQA: 4 heads over 2 KV heads
    params = init_random_params(cfg, jax.random.key(3), scale=0.2)
    tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, cfg.vocab_size)
    scales = _random_scales(cfg, jax.random.key(5))
    ref = forward(params, tokens, cfg=cfg)
    scaled = equalize(params, cfg, scales)
    for name, (_, producer, readers) in EQUALIZED.items():
        for w in (producer, *readers):
            assert not np.allclose(scaled["layers"][w], params["layers"][w]), (name, w)
    np.testing.assert_allclose(forward(scaled, tokens, cfg=cfg), ref, rtol=1e-3, atol=1e-3)
    # in the rotated basis: fused norms, R1/R2, then the scaling; still the float model
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(6))
    rotated = apply_rotations(fuse_norms(params, cfg), cfg, r1, r2)
    both = equalize(rotated, cfg, scales)
    np.testing.assert_allclose(forward(both, tokens, cfg=cfg), ref, rtol=1e-3, atol=1e-3)


def test_equalize_refuses_unknown_pairs_shapes_and_non_positive_factors(tiny_cfg, tiny_params):
    s = _random_scales(tiny_cfg, jax.random.key(0))
    with pytest.raises(QnpuError, match="no equalized pair divides 'q_out'"):
        equalize(tiny_params, tiny_cfg, {"q_out": s["attn_in"]})
    with pytest.raises(QnpuError, match="do not match"):
        equalize(tiny_params, tiny_cfg, {"attn_out": s["attn_out"][:, :-1]})
    with pytest.raises(QnpuError, match="finite and positive"):
        equalize(tiny_params, tiny_cfg, {"mlp_in": s["mlp_in"].at[1, 0].set(-1.0)})
    with pytest.raises(QnpuError, match="needs the model config"):
        equalize(tiny_params, None, {"attn_out": s["attn_out"]})
    with pytest.raises(QnpuError, match="alpha"):
        steps.equalize(alpha=1.0)
    with pytest.raises(QnpuError, match="pairs must be among"):
        steps.equalize(pairs=["o_out"])


@pytest.fixture(scope="module")
def two_layer(two_layer_dir):
    fp = load_model(str(two_layer_dir))
    windows = (np.arange(4 * 48).reshape(4, 48) * 37 + 11) % fp.config.vocab_size
    return fp, Calibration(np.arange(3000) % fp.config.vocab_size, windows)


def test_equalize_step_is_smoothquants_rule_per_v_channel(two_layer):
    fp, data = two_layer
    model = steps.equalize(0.4)(QuantizedModel.from_float(fp, prefix="bos"), data)
    cfg = fp.config
    absmax = channel_absmax(fp.params, cfg, data.windows, tuple(EQUALIZED), prefix=model.prefix)
    group = cfg.num_heads // cfg.num_kv_heads
    for name, s in model.transforms.equalization.items():
        act = absmax[name]
        if name == "attn_out":  # o_proj's input: the max over the heads sharing a V channel
            act = act.reshape(cfg.num_layers, cfg.num_kv_heads, group, cfg.head_dim).max(2)
            act = act.reshape(cfg.num_layers, cfg.kv_size)
        expected = smoothing_scales(act, reader_absmax(fp.params, cfg, name), 0.4)
        np.testing.assert_allclose(s, expected, rtol=1e-5)
    tokens = jnp.asarray(data.windows[:1])
    np.testing.assert_allclose(
        forward(model.params(), tokens, cfg=cfg), forward(fp.params, tokens, cfg=cfg), atol=2e-3
    )
    with pytest.raises(QnpuError, match="equalized already"):
        steps.equalize(0.4)(model, data)


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_logits_start_at_the_calibrated_encoding_and_move_it(two_layer, symmetric):
    fp, data = two_layer
    weights = QuantRule(pattern="layers/.*_proj", symmetric=symmetric, init="mse")
    model = steps.calibrate()(
        steps.plan(w_bits=4, a_bits=8, rules=[weights])(
            QuantizedModel.from_float(fp, prefix="bos"), data
        ),
        data,
    )
    params, state, plan = model.params(), model.state, model.plan
    clip = clip_logits(params, state, plan)
    assert all(("min" in sides) != symmetric for sides in clip.values())
    got = clipped_weight_scales(params, clip, state)["layers"]
    for name, fields in got.items():  # the MSE-searched clip, reproduced from its factors
        # where no factor sits at a bound of CLIP_RANGE (rows the search left unclipped, or
        # whose rounded zero point reaches past the row's max, start at 0.995)
        factors = [np.asarray(jax.nn.sigmoid(v)) for v in clip[name].values()]
        inside = np.all([(f > CLIP_RANGE[0] + 1e-6) & (f < CLIP_RANGE[1] - 1e-6)
                         for f in factors], axis=0)  # fmt: skip
        assert inside.mean() > 0.95, name
        np.testing.assert_allclose(
            np.asarray(fields["scale"])[inside], state["layers"][name].scale[inside], rtol=1e-4
        )
        if not symmetric:
            np.testing.assert_array_equal(
                np.asarray(fields["zero_point"])[inside], state["layers"][name].zero_point[inside]
            )
    tighter = {k: {s: v - 2.0 for s, v in sides.items()} for k, sides in clip.items()}
    smaller = clipped_weight_scales(params, tighter, state)["layers"]
    assert all(float(jnp.max(smaller[k]["scale"] / got[k]["scale"])) < 1.0 for k in clip)


def test_stage1_learns_equalization_and_clipping_and_stays_equivalent(two_layer, tmp_path):
    fp, data = two_layer
    config = QuantizeConfig.of(
        model="two-layer", method="mobilequant", seq_len=48, calib_windows=4,
        stage1=Stage1Config(steps=3, batch_size=1, checkpoint_every=3, lr_equalization=0.05),
    )  # fmt: skip
    recipe = for_config(config)
    assert [s.name for s in recipe] == ["equalize", "plan", "promote", "stage1", "calibrate"]
    start = QuantizedModel.from_float(fp, prefix="bos")
    before = recipe.steps[0](start, data)
    model = recipe(start, data)
    learned, initial = model.transforms.equalization, before.transforms.equalization
    for name in EQUALIZED:  # stage 1 moved every pair's factors
        assert not np.allclose(learned[name], initial[name]), name
    tokens = jnp.asarray(data.windows[:1])
    np.testing.assert_allclose(  # and the float model is still the float model
        forward(model.params(), tokens, cfg=fp.config),
        forward(fp.params, tokens, cfg=fp.config),
        atol=2e-3,
    )
    info = model.step_info("stage1")
    clipped = {k.split(".")[0] for k in info["clip_factor_mean"]}
    assert clipped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                       "down_proj"}  # fmt: skip
    assert "q_proj.min" in info["clip_factor_mean"]  # asymmetric weights: both ends clip
    # every activation is asymmetric and its zero point was learned or calibrated
    plan = model.plan
    assert not plan.get("layers/attn_in").symmetric and not plan.get("layers/down_out").symmetric
    assert plan.get("layers/probs").symmetric  # the softmax's fixed encoding
    zp = np.asarray(model.state["layers"]["attn_in"].zero_point)
    assert np.any(zp != 0)
    # the learned clipped weight scales are the ones the calibrated model keeps
    for name in clipped:
        for field in ("scale", "zero_point"):
            np.testing.assert_array_equal(
                getattr(model.state["layers"][name], field), model.trained["layers"][name][field]
            )
    # saved and loaded, the model is the same value
    model.save(tmp_path / "m")
    meta = json.loads((tmp_path / "m" / "model.json").read_text())
    assert meta["equalized"] == sorted(EQUALIZED)
    loaded = QuantizedModel.load(tmp_path / "m", base=fp)
    for name in EQUALIZED:
        np.testing.assert_array_equal(loaded.transforms.equalization[name], learned[name])
    assert loaded.perplexity(data.windows)["ppl"] == model.perplexity(data.windows)["ppl"]


def test_block_objective_is_the_layers_error_against_the_float_layers(two_layer):
    fp, data = two_layer
    model = steps.calibrate()(
        steps.plan(w_bits=4, a_bits=8)(QuantizedModel.from_float(fp, prefix="bos"), data), data
    )
    from qnpu_jax.models.taps import FakeQuantTaps, tapped_forward

    params, tokens = model.params(), jnp.asarray(data.windows[:2, :32])
    taps = FakeQuantTaps(model.plan)
    _, aux = tapped_forward(
        params, model.state, tokens, cfg=fp.config, taps=taps, prefix=model.prefix,
        teacher=params,
    )  # fmt: skip
    errors = np.asarray(aux["layers"]["block_error"])
    assert errors.shape == (fp.config.num_layers,) and np.all(errors > 0)
    # a teacher equal to the student with nothing quantized: no error but the device
    # simulation's (its softmax and RoPE tables), far below quantization's
    none = FakeQuantTaps(model.plan.with_entries(()))
    _, aux0 = tapped_forward(
        params, model.state, tokens, cfg=fp.config, taps=none, prefix=model.prefix,
        teacher=params,
    )  # fmt: skip
    assert np.all(np.asarray(aux0["layers"]["block_error"]) < 1e-4 * errors)
    # the block loss is the mean of those errors (the cross-entropy is only reported)
    trainable = {"scales": {"layers": {}, "outer": {}}}
    loss, parts = stage1_loss(
        trainable, params, model.state, tokens, jnp.float32(0.0), cfg=fp.config, taps=taps,
        prefix=model.prefix, remat=False, objective="block",
    )  # fmt: skip
    assert float(loss) == pytest.approx(float(np.mean(errors)), rel=1e-5)
    assert float(parts["ce"]) > 0
    with pytest.raises(QnpuError, match="objective"):
        Stage1Config(objective="layerwise")


def test_mobilequant_config_defaults_and_refusals():
    mq = QuantizeConfig(method="mobilequant").mobilequant
    assert (mq.equalize, mq.weight_clipping, mq.asymmetric_activations, mq.selective) == (
        0.5, True, True, False
    )  # fmt: skip
    plain = QuantizeConfig().mobilequant
    assert (plain.equalize, plain.weight_clipping, plain.asymmetric_activations) == (
        None, False, False
    )  # fmt: skip
    assert plain.selective is True
    mq = QuantizeConfig(method="mobilequant")
    assert QuantizeConfig.from_dict(mq.to_dict()) == mq
    with pytest.raises(QnpuError, match="weight_clipping is learned"):
        QuantizeConfig.of(method="quarot", weight_clipping=True)
    with pytest.raises(QnpuError, match="choose one"):
        QuantizeConfig.of(equalize=0.5, smooth_mlp=0.3)
    with pytest.raises(QnpuError, match="equalize must be"):
        QuantizeConfig.of(equalize=1.5)
    with pytest.raises(QnpuError, match="per-block"):
        QuantizeConfig.of(method="mobilequant", weight_block=32)
    with pytest.raises(QnpuError, match="symmetric down_proj input"):
        QuantizeConfig.of(method="mobilequant", muxq_exp=2)
    with pytest.raises(QnpuError, match="per-block weights are symmetric"):
        QuantizeConfig.of(method="mobilequant", weight_clipping=False, weight_block=32)
    assert QuantizeConfig(method="mobilequant").mobilequant.asymmetric_weights
    off = QuantizeConfig.of(method="mobilequant", asymmetric_weights=False)
    assert not off.mobilequant.asymmetric_weights


def test_mobilequant_artifact_runs_bit_exact_on_both_engines(two_layer, tmp_path):
    """Unfused norms with per-channel gains 1/s, scaled V, asymmetric activations and
    learned clipped asymmetric weights: the emulator subtracts z_w·Σx as a device does, the
    JAX forward multiplies centered weights; both agree bit for bit and score as the
    fake-quant model does; onnxruntime's QDQ graph and AIMET's QuantSim load the same
    encodings and score the same."""
    from qnpu_jax.export.artifact import read_artifact
    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model, validate_graph

    fp, data = two_layer
    config = QuantizeConfig.of(
        model="two-layer", method="mobilequant", seq_len=48, calib_windows=4,
        stage1=Stage1Config(steps=2, batch_size=1, checkpoint_every=2),
    )  # fmt: skip
    model = for_config(config)(QuantizedModel.from_float(fp, prefix="bos"), data)
    assert not model.plan.get("layers/q_proj").symmetric
    zp = np.asarray(model.state["layers"]["gate_proj"].zero_point)
    assert zp.shape == (2, fp.config.intermediate_size, 1) and np.any(zp != 0)
    out = export_quantized(model, tmp_path / "art", fp.tokenizer)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graph"]["format"] == "qnpu-llama-int/3"  # a /2 reader would drop z_w
    assert len(manifest["graph"]["weight_zero_points"]) == 7
    entry = manifest["encodings"]["layers.0.gate_proj"]
    assert not entry["symmetric"] and any(entry["zero_point"])
    art = read_artifact(out)
    key = "layers.gate_proj.weight_zero_point"
    bad = {**art.tensors, key: art.tensors[key] + 300}
    with pytest.raises(QnpuError, match="weight_zero_point must lie in"):
        validate_graph(art.manifest, bad, "art")
    unknown = {**art.manifest["graph"], "weight_zero_points": ["layers.gate_proj", "lm_head"]}
    with pytest.raises(QnpuError, match="must list distinct layer linears"):
        validate_graph({**art.manifest, "graph": unknown}, art.tensors, "art")
    int_model = load_int_model(out)
    ids = np.asarray(data.windows[:1, :40])
    engines_agree_with_fake_quant(int_model, model, ids)
    # the ONNX QDQ graph (asymmetric activations, per-channel norm gains) in onnxruntime is
    # the fake-quant model (float ops between QDQ pairs: the "fake" simulation)
    from qnpu_jax.export.onnx_export import export_onnx
    from qnpu_jax.runtime.onnx_run import OnnxModel

    fake_sim = model.replace(plan=dataclasses.replace(model.plan, simulation="fake"))
    graphs = export_onnx(fake_sim, tmp_path / "onnx", fp.tokenizer, chunk=16, max_context=96)
    qdq = OnnxModel(graphs, qdq=True)
    nll_onnx, top_onnx = qdq.token_nll_argmax(ids)
    nll_fake = np.asarray(fake_sim.nll_fn()(jnp.asarray(ids)))
    assert abs(nll_onnx.mean() / nll_fake.mean() - 1) < 0.01
    from qnpu_jax.runtime.onnx_run import aimet_quantsim

    session, _ = aimet_quantsim(graphs)  # every entry on an enabled quantizer of its own
    sim = OnnxModel(graphs, qdq=True, sessions={"prefill": session})
    nll_sim, top_sim = sim.token_nll_argmax(ids)
    assert abs(nll_sim.mean() / nll_onnx.mean() - 1) < 0.01
    assert (top_sim == top_onnx).mean() >= 0.8  # synthetic tokens on 2 layers: chaotic


def test_cost_model_counts_the_weight_zero_point_term(tiny_cfg):
    from qnpu_jax.cost import plan_costs, prefill
    from qnpu_jax.quant.plan import default_plan

    sym = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8)
    asym = default_plan(
        tiny_cfg.num_layers, w_bits=4, a_bits=8,
        rules=[QuantRule(pattern="layers/.*_proj", symmetric=False)],
    )  # fmt: skip
    phase = prefill(10)
    a, s = plan_costs(asym, tiny_cfg, phase), plan_costs(sym, tiny_cfg, phase)
    layers = init_random_params(tiny_cfg, jax.random.key(0))["layers"]
    for x, y in zip(a, s, strict=True):
        extra = sum(x.macs.values()) - sum(y.macs.values())
        if x.kind != "linear" or x.layer is None:
            assert extra == 0
            continue
        out, inp = layers[x.name.replace("_out", "_proj")].shape[1:]
        assert extra == phase.tokens * (inp + out)  # Σx per input, z_w·Σx per output
