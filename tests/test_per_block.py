"""Per-block weights (issue 23, part 1): blocks of B inputs with float scales, and AIMET's LPBQ
(integer block scales times a float scale per row) — plan validation, calibration, fake quant
and its gradients, the integer artifact on both engines bit for bit, AIMET 1.0.0 PER_BLOCK /
LPBQ entries loaded by AIMET's own QuantSim, and blocked DequantizeLinear in onnxruntime."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import SHARED_DATA, build_int_source, export_int_source

from qnpu_jax.data import sample_windows
from qnpu_jax.errors import QnpuError
from qnpu_jax.export.aimet import aimet_encodings
from qnpu_jax.export.exporter import export_model, run_encodings
from qnpu_jax.export.int_model import load_int_model, lpbq_weights
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import FakeQuantTaps, tapped_token_nll
from qnpu_jax.pipeline import Calibration, QuantizedModel, calibrate, chain, steps
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.weight_rounding import rounded_weights
from qnpu_jax.quant.plan import WEIGHTS, QuantRule, default_plan
from qnpu_jax.quant.spec import block_view, lpbq_split
from qnpu_jax.runtime.engines import open_engine

ALL_WEIGHTS = f"layers/({'|'.join(WEIGHTS)})"


def _blocks(block: int, bits: int | None = None) -> QuantRule:
    return QuantRule(pattern=ALL_WEIGHTS, block=block, block_scale_bits=bits)


@pytest.fixture(scope="module")
def tiny_windows(tiny_cfg):
    ids = np.asarray(jax.random.randint(jax.random.key(5), (4000,), 0, tiny_cfg.vocab_size))
    return sample_windows(ids, 32, 6, jax.random.key(6))


def _tapped_weight(plan, state, params, name: str, layer: int) -> np.ndarray:
    """The weight the fake-quant forward multiplies in `layer`."""
    entry = jax.tree.map(lambda a: a[layer], state["layers"][name])
    tap, _ = FakeQuantTaps(plan).layer({name: entry})
    return np.asarray(tap(name, params["layers"][name][layer]))


def test_plan_fields_are_validated():
    plan = default_plan(2, w_bits=4, rules=[_blocks(64, 4)])
    tq = plan.get("layers/q_proj")
    assert (tq.block, tq.block_scale_bits, tq.lpbq) == (64, 4, True)
    assert type(plan).from_dict(plan.to_dict()) == plan
    cleared = plan.apply([QuantRule(pattern="layers/q_proj", block=0)]).get("layers/q_proj")
    assert (cleared.block, cleared.block_scale_bits) == (None, None)
    floats = plan.apply([QuantRule(pattern="layers/q_proj", block_scale_bits=0)])
    assert floats.get("layers/q_proj").block_scale_bits is None
    with pytest.raises(QnpuError, match="block must be one of"):
        QuantRule(pattern=ALL_WEIGHTS, block=48)
    with pytest.raises(QnpuError, match="decompresses to 12 bits"):
        default_plan(2, w_bits=8, rules=[_blocks(64, 4)])
    with pytest.raises(QnpuError, match="decoder layers' weights only"):
        default_plan(2, rules=[QuantRule(pattern="lm_head", block=64)])
    with pytest.raises(QnpuError, match="need per-channel scales"):
        default_plan(2, rules=[QuantRule(pattern="layers/attn_in", block=64)])
    with pytest.raises(QnpuError, match="needs a block size"):
        default_plan(2, rules=[QuantRule(pattern="layers/q_proj", block_scale_bits=4)])
    with pytest.raises(QnpuError, match="weight_block"):
        QuantizeConfig.of(weight_block=100)
    with pytest.raises(QnpuError, match="weight_block"):
        QuantizeConfig.of(weight_block_scale_bits=4)
    with pytest.raises(QnpuError, match=r"weight_block must be null or an integer, got 64\.0"):
        QuantizeConfig.of(weight_block=64.0)
    with pytest.raises(QnpuError, match="gptq does not support per-block"):
        QuantizeConfig.of(weight_block=64, weight_rounding="gptq")
    with pytest.raises(QnpuError, match="layers/q_proj: per-block weights need"):
        default_plan(2, rules=[QuantRule(pattern="layers/q_proj", block=64, axis=None)])
    with pytest.raises(QnpuError, match="no 'percentile'"):
        default_plan(2, rules=[_blocks(64), QuantRule(pattern=ALL_WEIGHTS, init="percentile")])
    with pytest.raises(QnpuError, match="GPTQ rounding does not support per-block"):
        rounded_weights(plan)


def test_lpbq_split_is_aimets():
    """Our LPBQ decomposition equals aimet-onnx's own (`lpbq_utils.grouped_dynamic_quantize`)."""
    from aimet_onnx.lpbq_utils import grouped_dynamic_quantize

    rng = np.random.default_rng(0)
    scale = rng.lognormal(-4, 1, size=(48, 9)).astype(np.float32)
    channel, k = lpbq_split(scale, 4)
    theirs_k, theirs_channel = grouped_dynamic_quantize(scale, [1, -1], 4)
    np.testing.assert_array_equal(k, theirs_k)
    np.testing.assert_array_equal(channel, theirs_channel.reshape(channel.shape))
    assert k.min() >= 1 and k.max() == 16
    jc, jk = lpbq_split(jnp.asarray(scale), 4, jnp)
    np.testing.assert_array_equal(np.asarray(jk), k)
    np.testing.assert_array_equal(np.asarray(jc), channel)


def test_block_calibration_and_fake_quant(tiny_cfg, tiny_params, tiny_windows):
    """Max-Min per block: one scale per (row, block), max|w_block| / 7 at 4 bits; the forward's
    weight is that grid's rounding, closer to the weight than per-channel; LPBQ's is the
    per-row scale times the integer block scales times 4-bit codes."""
    per_channel = default_plan(2, w_bits=4)
    per_block = default_plan(2, w_bits=4, rules=[_blocks(16)])
    lpbq = default_plan(2, w_bits=4, rules=[_blocks(16, 4)])
    states = {
        name: calibrate(tiny_params, tiny_cfg, plan, tiny_windows[:2], batch_size=2)
        for name, plan in (("channel", per_channel), ("block", per_block), ("lpbq", lpbq))
    }
    w = np.asarray(tiny_params["layers"]["gate_proj"][1])  # [48, 32]
    s = np.asarray(states["block"]["layers"]["gate_proj"].scale)[1]
    assert s.shape == (48, 2)
    np.testing.assert_allclose(s, np.abs(block_view(w, 16)).max(-1) / 7, rtol=1e-6)
    assert np.asarray(states["lpbq"]["layers"]["gate_proj"].scale).shape == (2, 48, 2)

    got = _tapped_weight(per_block, states["block"], tiny_params, "gate_proj", 1)
    codes = np.clip(np.rint(block_view(w, 16) * (1 / s)[..., None]), -8, 7)
    np.testing.assert_allclose(got, (codes * s[..., None]).reshape(w.shape), rtol=1e-6)
    chan = _tapped_weight(per_channel, states["channel"], tiny_params, "gate_proj", 1)
    assert np.mean((got - w) ** 2) < np.mean((chan - w) ** 2)

    lw = _tapped_weight(lpbq, states["lpbq"], tiny_params, "gate_proj", 1)
    channel, k = lpbq_split(np.asarray(states["lpbq"]["layers"]["gate_proj"].scale)[1], 4)
    step = (channel * k)[..., None]  # [48, 2, 1], the block scales the device uses
    q = np.rint(block_view(lw, 16) / step)
    assert np.abs(q).max() <= 8 and np.all(q == np.clip(q, -8, 7))
    np.testing.assert_allclose(block_view(lw, 16), q * step, rtol=1e-6)


def test_learned_block_scales_get_gradients(tiny_cfg, tiny_params, tiny_windows):
    for bits in (None, 4):
        rules = [_blocks(16, bits), QuantRule(pattern="layers/(q_proj|down_proj)", learnable=True)]
        plan = default_plan(2, w_bits=4, rules=rules)
        state = calibrate(tiny_params, tiny_cfg, plan, tiny_windows[:2], batch_size=2)
        taps = FakeQuantTaps(plan, lsq_grad_scaling=True, cfg=tiny_cfg)
        tokens = jnp.asarray(tiny_windows[4:])

        def loss(s, taps=taps, tokens=tokens):
            return jnp.mean(tapped_token_nll(tiny_params, s, tokens, cfg=tiny_cfg, taps=taps))

        grads = jax.grad(loss)(state)
        for name in ("q_proj", "down_proj"):
            g = np.asarray(grads["layers"][name].scale)
            assert g.shape == np.shape(state["layers"][name].scale)
            assert np.isfinite(g).all() and np.abs(g).max() > 0
        assert not np.asarray(grads["layers"]["k_proj"].scale).any()


@pytest.fixture(scope="module")
def lpbq_source(smollm):
    return build_int_source(smollm, w_bits=4, rules=(_blocks(64, 4),))


@pytest.fixture(scope="module")
def lpbq_artifact(smollm, lpbq_source, tmp_path_factory):
    return export_int_source(smollm, lpbq_source, tmp_path_factory.mktemp("lpbq") / "art")


def test_lpbq_artifact_runs_bit_exact_on_both_engines(smollm, lpbq_source, lpbq_artifact):
    """The artifact holds 4-bit codes (packed) and uint8 block scales; the engines multiply
    k·q (int8) at the per-row scale, bit-exact with each other, and those are the weights the
    fake-quant forward used."""
    manifest = json.loads((lpbq_artifact / "manifest.json").read_text())
    tensors = manifest["tensors"]
    assert tensors["layers.q_proj.weight"]["packing"] == "int4"
    assert tensors["layers.q_proj.block_scale"]["dtype"] == "uint8"
    assert tensors["layers.q_proj.block_scale"]["shape"] == [2, 576, 9]
    entry = manifest["encodings"]["layers.0.q_proj"]
    assert (entry["block"], entry["block_scale_bits"], len(entry["scale"])) == (64, 4, 576)

    model = load_int_model(lpbq_artifact)
    w = model.t("layers.down_proj.weight")  # folded: k·q
    assert w.dtype == np.int8 and np.abs(w).max() > 8
    channel = np.asarray(entry["scale"], np.float32)
    k = np.asarray(entry["block_scale"]).reshape(576, 9)
    params, plan, state = lpbq_source["params"], lpbq_source["plan"], lpbq_source["state"]
    fake = _tapped_weight(plan, state, params, "q_proj", 0)
    folded = model.t("layers.q_proj.weight")[0].astype(np.float32)
    assert np.all(folded % np.repeat(k, 64, axis=1) == 0)
    np.testing.assert_allclose(fake, folded * channel[:, None], rtol=2e-6, atol=1e-9)

    ids = np.asarray(smollm.tokenizer.encode("The tower is 324 metres tall, about as high as")[:24])
    emulator, jax_engine = open_engine("emulator", model), open_engine("jax", model)
    le, ce = emulator.prefill(ids[None])
    lj, cj = jax_engine.prefill(ids[None])
    np.testing.assert_array_equal(np.asarray(le), np.asarray(lj))
    np.testing.assert_array_equal(np.asarray(ce.k), np.asarray(cj.k))
    nll_int = float(np.mean(emulator.token_nll(ids[None])))
    nll_fake = float(
        np.mean(
            tapped_token_nll(
                params,
                state,
                jnp.asarray(ids[None]),
                cfg=lpbq_source["cfg"],
                taps=FakeQuantTaps(plan),
                prefix=lpbq_source["prefix"],
            )
        )
    )
    assert abs(nll_int / nll_fake - 1) < 0.02


def test_lpbq_block_scales_are_checked_on_load(lpbq_artifact):
    from qnpu_jax.export.artifact import read_artifact
    from qnpu_jax.export.int_model import lpbq_blocks

    art = read_artifact(lpbq_artifact)
    raw = dict(art.tensors)  # as stored: q and k apart
    blocks = lpbq_blocks(art.manifest["encodings"], "art")
    assert blocks == {f"layers.{n}": 64 for n in WEIGHTS}
    folded = lpbq_weights(raw, blocks, "art")
    np.testing.assert_array_equal(
        folded["layers.o_proj.weight"], load_int_model(lpbq_artifact).t("layers.o_proj.weight")
    )
    k = raw["layers.o_proj.block_scale"].copy()
    k[0, 0, 0] = 0
    for tensors, match in (
        ({**raw, "layers.o_proj.block_scale": k}, "block scale of 0"),
        ({**raw, "layers.o_proj.block_scale": k.astype(np.int32)}, "must be uint8"),
        ({**raw, "layers.o_proj.block_scale": k[..., :4]}, "must be uint8"),
        (
            {
                **raw,
                "layers.o_proj.weight": np.ones_like(raw["layers.o_proj.weight"]),
                "layers.o_proj.block_scale": np.full_like(k, 200),
            },
            "leaves the int8 range",
        ),
        ({**raw, "lm_head.block_scale": k}, "belongs to no LPBQ linear"),
        ({n: t for n, t in raw.items() if n != "layers.q_proj.block_scale"}, "is missing"),
    ):
        with pytest.raises(QnpuError, match=match):
            lpbq_weights(tensors, blocks, "art")
    with pytest.raises(QnpuError, match="belongs to no LPBQ linear"):  # codes without LPBQ
        lpbq_weights(raw, {}, "art")


def test_float_block_scales_are_no_integer_artifact(lpbq_source):
    plan = lpbq_source["plan"].apply([QuantRule(pattern=ALL_WEIGHTS, block_scale_bits=0)])
    src = lpbq_source
    with pytest.raises(QnpuError, match="not integer-only"):
        export_model(src["params"], src["cfg"], plan, src["state"], prefix=src["prefix"])
    table = run_encodings(plan, src["state"], src["cfg"])  # AIMET / ONNX take them
    entry = table["layers.1.gate_proj"]
    assert entry["block"] == 64 and len(entry["scale"]) == 1536 * 9
    assert "block_scale" not in entry


def test_aimet_entries_per_block_and_lpbq():
    per_block = {
        "bits": 4,
        "signed": True,
        "symmetric": True,
        "axis": 0,
        "block": 64,
        "scale": [0.1, 0.2, 0.3, 0.4],
        "zero_point": [0] * 4,
    }
    lpbq = {**per_block, "scale": [0.01, 0.02], "zero_point": [0, 0], "block_scale_bits": 4,
            "block_scale": [1, 16, 3, 4]}  # fmt: skip
    obj = aimet_encodings({"layers.0.q_proj": per_block, "layers.0.k_proj": lpbq})
    q, k = obj["param_encodings"]
    assert q["enc_type"] == "PER_BLOCK" and q["block_size"] == 64 and q["bw"] == 4
    assert q["offset"] == [-8] * 4 and q["is_sym"] is True
    assert k["enc_type"] == "LPBQ" and (k["bw"], k["compressed_bw"]) == (8, 4)
    assert k["per_block_int_scale"] == [1, 16, 3, 4] and k["offset"] == [-128, -128]
    with pytest.raises(QnpuError, match=r"0\.6\.1 has no per-block"):
        aimet_encodings({"layers.0.k_proj": lpbq}, version="0.6.1")
    for bad, match in (
        ({**lpbq, "block_scale": [1, 17, 3, 4]}, "integers in"),
        ({**lpbq, "block_scale": [1, 2, 3]}, "3 block scales for 2 rows"),
        ({**per_block, "block": 64, "axis": None, "scale": [0.1], "zero_point": [0]}, "axis 0"),
        ({**per_block, "block": None, "block_scale_bits": 4}, "without a block size"),
    ):
        with pytest.raises(QnpuError, match=match):
            aimet_encodings({"layers.0.k_proj": bad})


def test_blocked_dequantize_linear_in_onnxruntime():
    """The QDQ graph's per-block and LPBQ weights (opset 21 `block_size`; LPBQ's block scales
    a DequantizeLinear of the integer ones) dequantize in onnxruntime to the fake-quant grid."""
    from onnx import TensorProto, helper

    from qnpu_jax.export.onnx_export import OPSET, _Builder, _weight

    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 128)).astype(np.float32)  # [out, in]
    s = (np.abs(block_view(w, 64)).max(-1) / 7).astype(np.float32)  # [8, 2]
    channel, k = lpbq_split(s, 4)
    entries = {
        "block": {"bits": 4, "signed": True, "axis": 0, "block": 64,
                  "scale": s.reshape(-1).tolist(), "zero_point": [0] * 16},
        "lpbq": {"bits": 4, "signed": True, "axis": 0, "block": 64, "block_scale_bits": 4,
                 "scale": channel.reshape(-1).tolist(), "zero_point": [0] * 8,
                 "block_scale": k.astype(int).reshape(-1).tolist()},
    }  # fmt: skip
    steps_ = {"block": s, "lpbq": channel * k}
    for name, entry in entries.items():
        b = _Builder()
        out = _weight(b, np.ascontiguousarray(w.T), f"{name}.weight", entry, axis=1)
        graph = helper.make_graph(
            b.nodes,
            name,
            [],
            [helper.make_tensor_value_info(out, TensorProto.FLOAT, [128, 8])],
            [v if isinstance(v, onnx.TensorProto) else onnx.numpy_helper.from_array(v, key)
             for key, v in b.inits.items()],
        )  # fmt: skip
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        onnx.checker.check_model(model)
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        (got,) = session.run(None, {})
        step = steps_[name][..., None]
        want = np.clip(np.rint(block_view(w, 64) * (1 / step)), -8, 7) * step
        np.testing.assert_allclose(got.T, want.reshape(w.shape), rtol=1e-6)


def test_lpbq_onnx_export_and_aimet_quantsim(two_layer_dir, tmp_path):
    """An LPBQ model's ONNX export: onnxruntime's QDQ graph scores as the fake-quant model, and
    AIMET's QuantSim puts every LPBQ entry on a weight quantizer of its own."""
    from qnpu_jax.export.onnx_export import export_onnx
    from qnpu_jax.runtime.onnx_run import OnnxModel, aimet_quantsim

    fp = load_model(str(two_layer_dir))
    data = Calibration.from_text("wiki", fp.tokenizer, seq_len=64, windows=2, key=jax.random.key(0))
    recipe = chain(
        steps.fuse_norms(),
        steps.hadamard_rotations(jax.random.key(1)),
        steps.plan(w_bits=4, a_bits=8, rules=[_blocks(64, 4)]),
        steps.calibrate(),
    )
    model = recipe(QuantizedModel.from_float(fp, prefix="bos"), data)
    out = export_onnx(model, tmp_path / "onnx", fp.tokenizer, chunk=16, max_context=96)
    enc = json.loads((out / "model.encodings").read_text())
    lpbq = [e for e in enc["param_encodings"] if e["enc_type"] == "LPBQ"]
    assert len(lpbq) == 2 * len(WEIGHTS)
    windows = Calibration.from_text(
        "wiki", fp.tokenizer, seq_len=40, windows=2, key=jax.random.key(7)
    ).windows
    windows = np.asarray(windows)
    nll_qdq = OnnxModel(out, qdq=True).token_nll(windows).mean()
    nll_fake = float(np.asarray(model.nll_fn()(jnp.asarray(windows))).mean())
    assert abs(nll_qdq / nll_fake - 1) < 0.01
    session, loaded = aimet_quantsim(out)
    assert loaded["quantizers"] == len(enc["activation_encodings"]) + len(enc["param_encodings"])
    nll_sim = OnnxModel(out, qdq=True, sessions={"prefill": session}).token_nll(windows).mean()
    assert abs(nll_sim / nll_qdq - 1) < 0.01
    assert dataclasses.is_dataclass(model.require_plan())


def test_config_keys_make_the_block_plan():
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.pipeline.recipes import build_plan

    config = load_config("smollm2-135m-executorch-w4a16-lpbq")
    plan = build_plan(config, 3)
    for name in WEIGHTS:
        tq = plan.get(f"layers/{name}")
        assert (tq.bits, tq.block, tq.block_scale_bits) == (4, 64, 4)
    assert plan.get("lm_head").block is None and plan.get("layers/attn_in").bits == 16
    plain = build_plan(config.replace(weight_block=None, weight_block_scale_bits=None), 3)
    assert plain.get("layers/q_proj").block is None


def test_weight_granularity_rows(monkeypatch):
    from qnpu_jax.studies import compare_methods as cm
    from qnpu_jax.studies import weight_granularity as wg

    monkeypatch.setenv("QNPU_DATA_DIR", str(SHARED_DATA))  # the default --wikitext's home
    args = wg.parse_args(["--block", "32", "--rows", "quantnpu-lpbq,executorch-lpbq"])
    assert args.rows == ["quantnpu-lpbq", "executorch-lpbq"]
    base = cm.base_config(args)
    configs = {k: wg.row_config(base, o, args) for k, _, o in (*wg.ROWS, *wg.QUANTNPU_ROWS)}
    assert len(configs) == len(wg.ROWS) + 2
    assert configs["quantnpu-channel"].weights.block is None
    lpbq = configs["executorch-lpbq"]
    assert (lpbq.method, lpbq.bits.w, lpbq.bits.a, lpbq.bits.down_in) == ("rtn", 4, 16, 16)
    assert (lpbq.weights.block, lpbq.weights.block_scale_bits) == (32, 4)
    assert configs["rtn-w4a8-block"].weights.block_scale_bits is None
    assert configs["executorch-smollm2"].bits.kv == 16
    assert configs["rtn-w4a16-channel"].weights.block is None
    qnpu = configs["quantnpu-lpbq"]
    assert qnpu.method == "quantnpu" and qnpu.bits.down_in == 8 and qnpu.promotions.down_in == 0.1
    assert wg._weights_text(lpbq) == "LPBQ 32 (4-bit block scales)"
