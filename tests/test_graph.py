"""The graph description is the single source of the integer graph: a tensor added to a
fixture graph (one edit: one op) reaches the float forward's taps, the plan, calibration, the
exporter's op list and constants, the AIMET names and both integer engines."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax import cost
from qnpu_jax.errors import QnpuError
from qnpu_jax.export import exporter, onnx_export
from qnpu_jax.export.aimet import aimet_encodings
from qnpu_jax.export.exporter import export_model, tokenizer_info, write_exported
from qnpu_jax.export.int_model import IntModel, load_int_model
from qnpu_jax.ir import graph as G
from qnpu_jax.ir.graph import LAYER_ONLY_KINDS, MODEL_ONLY_KINDS, OpKind
from qnpu_jax.models import llama
from qnpu_jax.models.taps import CaptureTaps, FakeQuantTaps, tapped_forward, tapped_token_nll
from qnpu_jax.pipeline.calibrate import calibrate
from qnpu_jax.quant.plan import all_paths, default_plan
from qnpu_jax.runtime import emulator, jax_engine
from qnpu_jax.runtime.emulator import EmulatorEngine
from qnpu_jax.runtime.jax_engine import JaxIntEngine

NEW = "up_act"


def _with_up_activation(graph: G.Graph) -> G.Graph:
    """`graph` with one new op: SiLU of the up projection's output, which the product then
    takes in place of up_out (SwiGLU becomes SiLU(gate)·SiLU(up))."""
    layer = list(graph.layer)
    i = next(k for k, op in enumerate(layer) if op.kind == OpKind.MUL)
    mul = layer[i]
    new = G.Op(
        OpKind.LUT,
        ("up_out",),
        G.Tensor(NEW, "mlp.up_act_fn.output", "16", "ffn"),
        f"layers.{NEW}",
        fn="silu",
    )
    layer[i : i + 1] = [new, dataclasses.replace(mul, ins=(mul.ins[0], NEW))]
    return dataclasses.replace(graph, layer=tuple(layer))


# Every interpreter's dispatch table and the kinds it declares not handled.
INTERPRETERS = {
    "expected_tensors (layer ops)": (G.EXPECTED_LAYER, MODEL_ONLY_KINDS),
    "expected_tensors (model ops)": (G.EXPECTED_MODEL, LAYER_ONLY_KINDS),
    "the float forward (layer ops)": (llama.FLOAT_LAYER_OPS, MODEL_ONLY_KINDS),
    "the emulator (layer ops)": (emulator.LAYER_OPS, MODEL_ONLY_KINDS),
    "the emulator (model ops)": (emulator.MODEL_OPS, LAYER_ONLY_KINDS),
    "the integer forward (layer ops)": (jax_engine.LAYER_OPS, MODEL_ONLY_KINDS),
    "the integer forward (model ops)": (jax_engine.MODEL_OPS, LAYER_ONLY_KINDS),
    "the exporter (layer ops)": (exporter.LAYER_CONSTS, MODEL_ONLY_KINDS),
    "the exporter (model ops)": (exporter.MODEL_CONSTS, LAYER_ONLY_KINDS),
    "the ONNX exporter (layer ops)": (onnx_export.LAYER_NODES, MODEL_ONLY_KINDS),
    "the ONNX exporter (model ops)": (onnx_export.MODEL_NODES, LAYER_ONLY_KINDS),
    "the cost model (layer ops)": (cost.LAYER_COSTS, MODEL_ONLY_KINDS),
}


@pytest.mark.parametrize("who", sorted(INTERPRETERS))
def test_each_interpreter_covers_exactly_the_op_kinds(who):
    table, not_handled = INTERPRETERS[who]
    assert all(type(k) is OpKind for k in table)
    assert set(table) | not_handled == set(OpKind)
    assert not set(table) & not_handled
    G.check_handlers(table, who, not_handled)


def test_the_declared_kinds_split_the_op_kinds():
    assert {OpKind.EMBED, OpKind.LAYERS} == MODEL_ONLY_KINDS
    assert set(OpKind) - MODEL_ONLY_KINDS - LAYER_ONLY_KINDS == {OpKind.RMSNORM, OpKind.LINEAR}
    assert tuple(OpKind) == G.OPS
    assert {op.kind for op in (*G.GRAPH.layer, *G.GRAPH.model)} == set(OpKind)


def test_check_handlers_names_the_interpreter_and_the_kinds():
    table = dict(emulator.LAYER_OPS)
    del table[OpKind.LUT]
    with pytest.raises(ValueError, match=r"^the emulator \(layer ops\): no handler .*: lut$"):
        G.check_handlers(table, "the emulator (layer ops)", MODEL_ONLY_KINDS)
    with pytest.raises(ValueError, match=r"^who: no handler for op kinds: embed, layers$"):
        G.check_handlers(emulator.LAYER_OPS, "who")
    bad = {**emulator.LAYER_OPS, "gelu": None}
    with pytest.raises(ValueError, match=r"who: keys that are not op kinds: 'gelu'"):
        G.check_handlers(bad, "who", MODEL_ONLY_KINDS)
    with pytest.raises(ValueError, match=r"both handled and declared not handled: rmsnorm"):
        G.check_handlers(emulator.LAYER_OPS, "who", {*MODEL_ONLY_KINDS, OpKind.RMSNORM})


def test_op_kinds_are_the_artifact_strings():
    entry = G.graph_ops()["layer"][0]
    assert type(entry["op"]) is str and entry["op"] == "rmsnorm" == OpKind.RMSNORM
    assert G.op_kind("lut", "where") is OpKind.LUT
    with pytest.raises(QnpuError, match=r"^where 'conv': no such op kind \(embed, layers, "):
        G.op_kind("conv", "where")
    assert G.Op("mul", (), None, "c", value="v").kind is OpKind.MUL  # strings are converted
    with pytest.raises(ValueError, match="unknown op kind 'conv'"):
        G.Op("conv", (), None, "c", value="v")


@pytest.fixture(scope="module")
def setting(smollm):
    """SmolLM2's first two layers, W8A8, BOS sink, calibration and evaluation windows."""
    from qnpu_jax.data import load_documents, sample_windows, tokenize_documents
    from qnpu_jax.models.taps import sink_prefix

    cfg = dataclasses.replace(smollm.config, num_layers=2)
    params = dict(smollm.params)
    params["layers"] = jax.tree.map(lambda a: a[:2], smollm.params["layers"])
    tok = smollm.tokenizer
    calib = sample_windows(
        tokenize_documents(load_documents("wiki", "calib"), tok), 64, 2, jax.random.key(0)
    )
    held_out = sample_windows(
        tokenize_documents(load_documents("wiki", "eval"), tok), 48, 2, jax.random.key(1)
    )
    return cfg, params, sink_prefix("bos", tok), calib, held_out


def test_the_shipped_tables_are_read_from_the_description():
    assert tuple(t.name for t in G.GRAPH.layer_acts) == G.LAYER_ACTS
    assert G.graph_ops()["layer"][0] == G.GRAPH.layer[0].to_json()
    assert G.LINEAR_IO["down_proj"] == ("down_in", "down_out")
    assert G.ROTATED_INPUTS == ("attn_in", "attn_out", "mlp_in")
    assert G.KV_TENSORS == ("k_rope", "v_out")
    with pytest.raises(ValueError, match="named twice"):
        dataclasses.replace(G.GRAPH, layer=G.GRAPH.layer + G.GRAPH.layer[-1:])
    with pytest.raises(ValueError, match="bits role"):
        G.Tensor("t", "m.output", "9")


def test_a_new_tensor_reaches_taps_plan_exporter_aimet_and_engines(smollm, setting, tmp_path):
    fixture = _with_up_activation(G.GRAPH)
    cfg, params, prefix, calib, held_out = setting
    tokens = jnp.asarray(held_out)

    # The float forward taps it (and computes with it).
    taps = CaptureTaps(frozenset({NEW, "up_out"}))
    _, aux = tapped_forward(params, None, tokens, cfg=cfg, taps=taps, graph=fixture)
    up, act = aux["layers"]["up_out"], aux["layers"][NEW]
    np.testing.assert_allclose(act, jax.nn.silu(up), rtol=1e-6, atol=1e-6)
    _, shipped = tapped_forward(params, None, tokens, cfg=cfg, taps=taps)
    assert NEW not in shipped["layers"]

    # The plan and its default bits (the tensor's role), and calibration.
    plan = default_plan(2, graph=fixture)
    assert f"layers/{NEW}" in all_paths(fixture) and f"layers/{NEW}" not in all_paths()
    assert plan.get(f"layers/{NEW}").bits == 16
    state = calibrate(params, cfg, plan, calib, prefix=prefix, graph=fixture)
    assert state["layers"][NEW].scale.shape[0] == 2

    # The exporter: op list, activation table, constants, encodings.
    exported = export_model(
        params,
        cfg,
        plan,
        state,
        prefix=prefix,
        max_context=128,
        prefill_chunk=32,
        tokenizer_info=tokenizer_info(smollm.tokenizer),
        graph=fixture,
    )
    graph = exported.manifest["graph"]
    assert {"op": "lut", "in": ["up_out"], "out": NEW, "const": f"layers.{NEW}"} in graph["ops"][
        "layer"
    ]
    assert graph["layer_activations"] == [t.name for t in fixture.layer_acts]
    assert exported.tensors[f"layers.{NEW}.lut"].shape == (2, 256)  # over up_out's 8-bit codes
    encodings = exported.manifest["encodings"]
    assert encodings[f"layers.1.{NEW}"]["bits"] == 16

    # AIMET names it by the graph's Hugging Face name; the shipped graph does not know it.
    names = {e["name"] for e in aimet_encodings(encodings, graph=fixture)["activation_encodings"]}
    assert "model.layers.1.mlp.up_act_fn.output" in names
    with pytest.raises(QnpuError, match=f"unknown tensor name 'layers.0.{NEW}'"):
        aimet_encodings(encodings)

    # The artifact contract is the shipped graph: its loader refuses the fixture graph ...
    with pytest.raises(QnpuError, match="op list differs"):
        load_int_model(write_exported(exported, tmp_path / "fixture", smollm.tokenizer))
    # ... but both engines interpret any op list: they run it bit for bit alike, and the
    # integer model tracks the fake-quant model of the same graph.
    model = IntModel(
        Path(tmp_path / "fixture"),
        exported.manifest["model"],
        graph,
        exported.tensors,
        {},
        {},
    )
    emu_codes, _ = EmulatorEngine(model).prefill(held_out)
    jax_codes, _ = JaxIntEngine(model).prefill(held_out)
    assert np.array_equal(emu_codes, jax_codes)
    nll_int = EmulatorEngine(model).token_nll(held_out)
    nll_fq = np.asarray(
        tapped_token_nll(
            params, state, tokens, cfg=cfg, taps=FakeQuantTaps(plan), prefix=prefix, graph=fixture
        )
    )
    assert np.corrcoef(nll_int.ravel(), nll_fq.ravel())[0, 1] > 0.999
    assert abs(nll_int.mean() - nll_fq.mean()) < 0.01 * nll_fq.mean()
    # the new op changed the model: the shipped graph's fake-quant NLL differs
    nll_shipped = tapped_token_nll(params, None, tokens, cfg=cfg, taps=None, prefix=prefix)
    assert abs(float(jnp.mean(nll_shipped)) - float(nll_fq.mean())) > 0.01
