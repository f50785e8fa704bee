"""ONNX export (issue 20): the graphs pass onnx.checker, every AIMET encoding names a tensor of
model.onnx and every quantized tensor has one, onnxruntime runs the float graphs equal to our
float forward (chunked prefill + decode included) and the QDQ graphs as our fake-quant model,
and the export is atomic and refuses what it cannot translate."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import LAYER_ACTS
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import FakeQuantTaps, effective_state, tapped_forward
from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
from qnpu_jax.quant.plan import QuantRule

CHUNK, CONTEXT, SEQ = 16, 96, 40


@pytest.fixture(scope="module")
def quantized(two_layer_dir):
    """The 2-layer real model: fused norms, Hadamard R1/R2, W4A8 with the down_proj input at
    8 bits in layer 0 and 16 in layer 1, BOS sink prefix, calibrated on two 64-token windows."""
    fp = load_model(str(two_layer_dir))
    data = Calibration.from_text("wiki", fp.tokenizer, seq_len=64, windows=2, key=jax.random.key(0))
    rule = QuantRule(pattern="layers/down_in", layer_bits=(8, 16))
    recipe = chain(
        steps.fuse_norms(),
        steps.hadamard_rotations(jax.random.key(1)),
        steps.plan(w_bits=4, a_bits=8, rules=[rule]),
        steps.calibrate(),
    )
    return recipe(QuantizedModel.from_float(fp, prefix="bos"), data), fp.tokenizer


@pytest.fixture(scope="module")
def exported(quantized, tmp_path_factory):
    from qnpu_jax.export.onnx_export import export_onnx

    model, tokenizer = quantized
    out = tmp_path_factory.mktemp("onnx") / "export"
    return export_onnx(model, out, tokenizer, chunk=CHUNK, max_context=CONTEXT)


@pytest.fixture(scope="module")
def windows(quantized):
    _, tokenizer = quantized
    data = Calibration.from_text("wiki", tokenizer, seq_len=SEQ, windows=2, key=jax.random.key(7))
    return np.asarray(data.windows)


def test_every_graph_passes_the_full_onnx_check(exported):
    from qnpu_jax.export.onnx_export import GRAPH_FILES, check_models

    check_models(exported)
    names = sorted(p.name for p in exported.iterdir())
    assert set(GRAPH_FILES.values()) <= set(names)
    assert {"model.data", "model_qdq.data", "model.encodings", "prefix_kv.npy"} <= set(names)
    assert {"embed_tokens.npy", "embed_tokens_codes.npy", "embed_tokens_scale.npy"} <= set(names)
    manifest = json.loads((exported / "manifest.json").read_text())
    info = manifest["onnx"]
    assert (info["chunk"], info["max_context"], info["opset"]) == (CHUNK, CONTEXT, 21)
    # the two float graphs share one weights file: each weight is stored once
    model = onnx.load(str(exported / "model.onnx"), load_external_data=False)
    decode = onnx.load(str(exported / "model_decode.onnx"), load_external_data=False)
    external = {t.name for t in model.graph.initializer if t.data_location == t.EXTERNAL}
    assert "model.layers.0.self_attn.q_proj.weight" in external
    assert external <= {t.name for t in decode.graph.initializer}
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["position_ids"] == [1, CHUNK]  # static shapes
    assert dims["model.embed_tokens.output"] == [1, CHUNK, 576]  # the host looks rows up
    assert dims["past_key.1"] == [1, 3, CONTEXT, 64]


def test_encodings_name_only_tensors_of_the_graph_and_cover_the_plan(quantized, exported):
    """A walk of model.onnx: every activation entry is a node output, every param entry an
    initializer, and every tensor of the run's encodings table has exactly one entry."""
    from qnpu_jax.export.exporter import run_encodings
    from qnpu_jax.export.onnx_export import graph_tensor_names

    model, _ = quantized
    enc = json.loads((exported / "model.encodings").read_text())
    assert enc["version"] == "1.0.0"
    graph = onnx.load(str(exported / "model.onnx"), load_external_data=False)
    acts, inits = graph_tensor_names(graph)
    act_names = [e["name"] for e in enc["activation_encodings"]]
    param_names = [e["name"] for e in enc["param_encodings"]]
    assert set(act_names) <= acts and set(param_names) <= inits
    assert not set(act_names) & inits and not set(param_names) & acts
    table = run_encodings(model.require_plan(), model.require_state(), model.cfg)
    inside = [t for t in table if t != "embed_tokens"]  # the host reads the table's rows
    caches = [
        f"{s}_{k}.{i}" for i in range(2) for s in ("past", "present") for k in ("key", "value")
    ]
    assert len(act_names) + len(param_names) == len(inside) + len(caches)
    assert len(set(act_names + param_names)) == len(act_names) + len(param_names)  # none twice
    assert set(caches) <= set(act_names)  # the caches are on their K/V grids
    by_name = {e["name"]: e for e in enc["activation_encodings"]}
    k_rope = by_name["model.layers.1.self_attn.k_rope.output"]
    assert {**by_name["past_key.1"], "name": ""} == {**k_rope, "name": ""}
    assert "model.embed_tokens.output" in act_names  # the graph input, quantized
    # each encoded activation is a graph input or the output of its own node
    producers = [o for node in graph.graph.node for o in node.output if o in set(act_names)]
    producers += [i.name for i in graph.graph.input if i.name in set(act_names)]
    assert sorted(producers) == sorted(act_names)
    by_name = {e["name"]: e for e in enc["activation_encodings"] + enc["param_encodings"]}
    assert by_name["model.layers.0.mlp.down_proj.input"]["bw"] == 8
    assert by_name["model.layers.1.mlp.down_proj.input"]["bw"] == 16  # per-layer bits
    assert by_name["model.layers.0.self_attn.q_proj.weight"]["bw"] == 4
    assert by_name["model.layers.0.self_attn.softmax.output"]["offset"] == [0]  # uint16 probs


def _max_rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_onnxruntime_float_graphs_equal_our_float_forward(quantized, exported, windows):
    """Prefill in chunks (the last padded) and chunked prefill followed by decode steps both
    give the float forward's logits of the whole sequence."""
    from qnpu_jax.runtime.onnx_run import OnnxModel

    model, _ = quantized
    ref, _ = tapped_forward(
        model.params(), None, jnp.asarray(windows[:1]), cfg=model.cfg, taps=None,
        prefix=model.prefix,
    )  # fmt: skip
    ref = np.asarray(ref[0])
    om = OnnxModel(exported)
    for prefill in (SEQ, 2 * CHUNK, CHUNK + 3):  # all prefill; then decode the rest
        assert _max_rel(om.logits(windows[0], prefill=prefill), ref) <= 1e-4, prefill


def test_onnxruntime_qdq_graph_is_the_fake_quant_model(quantized, exported, windows):
    """The QDQ graph quantizes exactly the fake-quant model's tensors with its encodings: the
    first layer's tensors up to the attention scores are equal bit for bit (after that, float
    reduction order in the matmuls can move a code by one step); the logits agree in argmax
    and the NLL within 1% on this truncated, chaotic 2-layer model (the full model's figures:
    reports/onnx_fidelity.json)."""
    from qnpu_jax.export.exporter import run_encodings
    from qnpu_jax.export.onnx_export import OnnxPlan, build_graph
    from qnpu_jax.runtime.onnx_run import OnnxModel

    model, _ = quantized
    # Float ops between QDQ pairs: the float simulation, not the device's integer softmax.
    plan = dataclasses.replace(model.require_plan(), simulation="fake")
    model = model.replace(plan=plan)
    state = effective_state(plan, model.require_state())
    params = model.params()
    tokens = jnp.asarray(windows[:1, :CHUNK])

    class Capture(FakeQuantTaps):
        """Fake quantization that also returns each layer tensor's quantized value."""

        def layer(self, st):
            tap, aux = super().layer(st)
            seen = {}

            def capture(name, x, where=None):
                seen[name] = tap(name, x, where)
                return seen[name]

            return capture, lambda: {**aux(), **seen}

    fq, captured = tapped_forward(
        params, state, tokens, cfg=model.cfg, taps=Capture(plan), prefix=model.prefix
    )
    captured = captured["layers"]
    table = run_encodings(plan, model.require_state(), model.cfg)
    graph = build_graph(params, model.cfg, OnnxPlan(CHUNK, CONTEXT, table), name="probe")
    first = [f"model.layers.0.{n}" for n in ("input_layernorm", "self_attn.q_proj")]
    probes = [f"{first[0]}.output_dequantized", f"{first[1]}.output_dequantized"]
    for name in probes:
        graph.graph.output.append(onnx.helper.make_tensor_value_info(name, 1, None))
    om = OnnxModel(exported, qdq=True)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(
        graph.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    p = len(model.prefix)
    feeds = {
        "model.embed_tokens.output": om.table[windows[:1, :CHUNK]],
        "position_ids": np.arange(p, p + CHUNK, dtype=np.int64)[None],
    }
    cache = om.new_cache()
    for i in range(model.cfg.num_layers):
        feeds[f"past_key.{i}"], feeds[f"past_value.{i}"] = cache[2 * i], cache[2 * i + 1]
    logits, attn_in, q_out = session.run(["logits", *probes], feeds)
    assert "attn_in" in LAYER_ACTS
    np.testing.assert_array_equal(attn_in, np.asarray(captured["attn_in"][0]))
    np.testing.assert_array_equal(q_out, np.asarray(captured["q_out"][0]))
    assert (logits[0].argmax(-1) == np.asarray(fq[0]).argmax(-1)).mean() >= 0.9
    nll_onnx = om.token_nll(windows)
    nll_fake = np.asarray(model.nll_fn()(jnp.asarray(windows)))
    assert abs(nll_onnx.mean() / nll_fake.mean() - 1) < 0.01


def test_an_op_the_exporter_does_not_know_is_refused_by_name(quantized):
    import dataclasses

    from qnpu_jax.export.onnx_export import OnnxPlan, _Writer
    from qnpu_jax.ir.graph import GRAPH, Graph

    model, _ = quantized
    lut = next(op for op in GRAPH.layer if op.kind == "lut")
    gelu = dataclasses.replace(lut, fn="gelu")
    layer = tuple(gelu if op is lut else op for op in GRAPH.layer)
    writer = _Writer(model.params(), model.cfg, OnnxPlan(CHUNK, CONTEXT))
    with pytest.raises(QnpuError, match=r"does not know the layer op 'lut' \(gelu\)"):
        writer.model(Graph(layer=layer, model=GRAPH.model))


def test_a_failed_export_leaves_nothing_behind(quantized, tmp_path, monkeypatch):
    import qnpu_jax.export.onnx_export as ox

    model, tokenizer = quantized
    out = tmp_path / "export"

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ox, "_npy_bytes", broken)
    with pytest.raises(OSError, match="disk full"):
        ox.export_onnx(model, out, tokenizer, chunk=CHUNK, max_context=CONTEXT)
    assert os.listdir(tmp_path) == []
    with pytest.raises(QnpuError, match="prefill chunk"):
        ox.export_onnx(model, out, tokenizer, chunk=CONTEXT, max_context=CONTEXT)
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(QnpuError, match="not a qnpu artifact"):
        ox.export_onnx(model, tmp_path / "keep", tokenizer, chunk=CHUNK, max_context=CONTEXT)
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"


def test_onnx_model_refuses_an_integer_artifact(tmp_path):
    from qnpu_jax.export.artifact import write_artifact
    from qnpu_jax.runtime.onnx_run import OnnxModel

    art = write_artifact(tmp_path / "a", {"model": {}}, {}, files={})
    with pytest.raises(QnpuError, match="not an ONNX export"):
        OnnxModel(art)


def test_encodings_of_another_graph_are_refused(exported):
    from qnpu_jax.runtime.onnx_run import check_encodings

    enc = json.loads((exported / "model.encodings").read_text())
    check_encodings(exported, json.dumps(enc).encode())  # its own: accepted
    other = dict(enc)
    other["activation_encodings"] = [
        {**e, "name": e["name"].replace("layers.1.", "layers.7.")}
        for e in enc["activation_encodings"]
    ]
    with pytest.raises(QnpuError, match="encodings of another graph"):
        check_encodings(exported, json.dumps(other).encode())
    swapped = dict(enc)
    swapped["param_encodings"], swapped["activation_encodings"] = (
        enc["activation_encodings"],
        enc["param_encodings"],
    )
    with pytest.raises(QnpuError, match="lacks"):  # a weight is no activation
        check_encodings(exported, json.dumps(swapped).encode())


@pytest.fixture(scope="module")
def rtn_run(two_layer_dir, tmp_path_factory):
    """`qnpu quantize` of the 2-layer model, RTN W8A8 with a BOS sink prefix."""
    from qnpu_jax.cli import main

    run = tmp_path_factory.mktemp("rtn") / "run"
    sets = ["seq_len=32", "calib_windows=2", "eval_windows=2", "prefix=bos"]
    quantize = ["quantize", "--model", str(two_layer_dir), "--method", "rtn", "--bits", "w8a8"]
    assert main([*quantize, *(a for s in sets for a in ("--set", s)), "--out", str(run)]) == 0
    return run


def test_cli_exports_a_run_and_evaluates_it_in_onnxruntime(rtn_run, tmp_path, capsys):
    """qnpu quantize → qnpu export --format onnx → qnpu eval --onnx [--qdq] → qnpu report; a
    tampered export is refused."""
    from qnpu_jax.cli import main

    run, out = rtn_run, tmp_path / "onnx"
    export = ["export", "--run", str(run), "--format", "onnx", "--out", str(out)]
    capsys.readouterr()
    assert main([*export, "--prefill-chunk", "16", "--max-context", "64"]) == 0
    # every phase of the export announces itself on stderr with the seconds since the start
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    phases = ["reading and verifying the run", "encodings", "float graphs", "qdq graphs"]
    phases += ["sink prefix's K/V", "writing"]
    assert [p for line in said for p in phases if p in line] == phases, said
    ev = ["eval", "--data", "wiki", "--seq-len", "32", "--max-windows", "2", "--no-progress"]
    results = {}
    for name, source in (
        ("run", ["--run", str(run)]),
        ("float", ["--onnx", str(out)]),
        ("qdq", ["--onnx", str(out), "--qdq"]),
    ):
        assert main([*ev, *source, "--json", str(tmp_path / f"{name}.json")]) == 0
        results[name] = json.loads((tmp_path / f"{name}.json").read_text())
    qdq = results["qdq"]
    assert qdq["path"] == "onnxruntime (QDQ)" and qdq["source"]["run"] == "run"
    assert results["float"]["path"] == "onnxruntime (float graph: float weights)"  # no GPTQ
    assert qdq["windows"] == results["run"]["windows"] == 2
    assert abs(qdq["nll_mean"] / results["run"]["nll_mean"] - 1) < 0.01
    assert results["float"]["ppl"] != qdq["ppl"]
    report = ["report", "--runs", str(run), "--evals", str(tmp_path / "qdq.json")]
    assert main([*report, "--out", str(tmp_path / "reports" / "t")]) == 0
    assert "RTN (onnxruntime, QDQ)" in (tmp_path / "reports" / "t.md").read_text()
    with (out / "model.encodings").open("a") as f:
        f.write(" ")
    capsys.readouterr()
    assert main([*ev, "--onnx", str(out)]) == 2
    assert "model.encodings" in capsys.readouterr().err


def test_aimet_quantsim_loads_the_encodings_onto_model_onnx(exported, windows):
    """aimet-onnx's QuantizationSimModel over model.onnx with model.encodings loaded by its own
    loader: each entry lands on an enabled quantizer of its own, nothing else is quantized, and
    the sim scores the windows as the QDQ graph does (both quantize the same tensors on the
    same grids; AIMET rounds halves up, and float order differs, so not bit for bit)."""
    from qnpu_jax.runtime.onnx_run import OnnxModel, aimet_quantsim

    session, loaded = aimet_quantsim(exported)
    enc = json.loads((exported / "model.encodings").read_text())
    entries = len(enc["activation_encodings"]) + len(enc["param_encodings"])
    assert loaded["quantizers"] == entries  # 2 layers × (23 + 4 cache I/O) + 3 model tensors
    sim = OnnxModel(exported, qdq=True, sessions={"prefill": session})
    qdq = OnnxModel(exported, qdq=True)
    nll_sim, top_sim = sim.token_nll_argmax(windows)
    nll_qdq, top_qdq = qdq.token_nll_argmax(windows)
    assert (top_sim == top_qdq).mean() >= 0.9
    assert abs(nll_sim.mean() / nll_qdq.mean() - 1) < 0.01
    with pytest.raises(QnpuError, match="no decode session"):
        sim.logits(windows[0], prefill=CHUNK)


def test_aimet_quantsim_loads_the_legacy_schema_too(quantized, tmp_path):
    """`--aimet-version 0.6.1`: the same entries in AIMET's legacy layout, loaded the same way."""
    from qnpu_jax.export.onnx_export import export_onnx
    from qnpu_jax.runtime.onnx_run import aimet_quantsim, encoding_bits

    model, tokenizer = quantized
    out = export_onnx(model, tmp_path / "e", tokenizer, chunk=CHUNK, max_context=CONTEXT,
                      version="0.6.1")  # fmt: skip
    enc = json.loads((out / "model.encodings").read_text())
    assert enc["version"] == "0.6.1" and isinstance(enc["activation_encodings"], dict)
    _, loaded = aimet_quantsim(out)
    assert loaded["quantizers"] == len(encoding_bits(enc))


def test_simulation_gap_study_scores_the_onnx_export_and_aimet(rtn_run, tmp_path):
    """`qnpu study simulation_gap --onnx --aimet`, the command behind reports/onnx_fidelity.json:
    the emulator, onnxruntime's QDQ graphs and AIMET's QuantSim scored on the same windows as
    the fake-quant model (this truncated 2-layer model's perplexity is in the millions, so the
    NLLs are compared), and the float graphs against the JAX float forward."""
    from qnpu_jax.cli import main

    fidelity = tmp_path / "fidelity.json"
    study = ["study", "simulation_gap", "--runs", str(rtn_run), "--seq-len", "32", "--windows", "2"]
    where = ["--artifacts", str(tmp_path / "art"), "--exports", str(tmp_path / "exp")]
    sims = ["--simulations", "fake", "device"]  # the QDQ graphs' float ops: "fake" first
    assert main([*study, *where, *sims, "--onnx", "--aimet", "--json", str(fidelity)]) == 0
    entry = json.loads(fidelity.read_text())["runs"]["run"]
    assert entry["simulation"] == "fake"
    device = entry["other_simulations"]["device"]
    for engine in ("emulator", "onnxruntime_qdq", "aimet_quantsim"):
        nll = device["fake_quant"]["nll_mean"] + device[engine]["nll_diff_mean"]
        assert nll == pytest.approx(entry[engine]["nll_mean"], rel=1e-6)
    assert entry["onnxruntime_float_max_rel_logit_diff"] <= 1e-4
    for engine in ("emulator", "onnxruntime_qdq", "aimet_quantsim"):
        assert abs(entry[engine]["nll_mean"] / entry["fake_quant"]["nll_mean"] - 1) < 0.01
        assert entry[engine]["prefill_tokens_per_second"] > 0
    assert entry["onnxruntime_qdq"]["argmax_agreement_with_fake_quant"] >= 0.9
    assert entry["aimet_loaded"]["quantizers"] > 0


def test_activation_matmuls_are_on_the_qnn_htp_grids(quantized, exported):
    """The QDQ graph puts activations on unsigned grids (onnxruntime's QNN EP convention) and
    lists each MatMul of two activations with its type pair: W4A8 with an 8-bit KV cache gives
    the pairs the QNN EP documents for HTP; a 16-bit V makes P·V uint16 × uint16, which it
    does not, and a symmetric 16-bit tensor has zero point 32768."""
    from qnpu_jax.export.exporter import run_encodings
    from qnpu_jax.export.onnx_export import OnnxPlan, activation_matmuls, build_graph

    info = json.loads((exported / "manifest.json").read_text())["onnx"]
    pairs = info["activation_matmuls"]
    assert len(pairs) == 2 * 2 and all(p["qnn_htp_documented"] for p in pairs)
    assert pairs[0]["inputs"] == ["model.layers.0.self_attn.q_rope.output", "past_key.0"]
    assert [p["types"] for p in pairs[:2]] == [["uint8", "uint8"], ["uint16", "uint8"]]
    qdq = onnx.load(str(exported / "model_qdq.onnx"), load_external_data=False)
    zero_point_types = {
        t.data_type for t in qdq.graph.initializer if t.name.endswith(".output_zero_point")
    }
    assert zero_point_types == {onnx.TensorProto.UINT8, onnx.TensorProto.UINT16}
    model, _ = quantized
    table = run_encodings(model.require_plan(), model.require_state(), model.cfg)
    v = table["layers.0.v_out"]
    assert v["signed"] and v["zero_point"] == [0]
    table["layers.0.v_out"] = {**v, "bits": 16, "scale": [v["scale"][0] / 256]}
    graph = build_graph(model.params(), model.cfg, OnnxPlan(CHUNK, CONTEXT, table), name="v16")
    pv = activation_matmuls(graph.graph)[1]
    assert pv["types"] == ["uint16", "uint16"] and pv["zero_points"][1] == 32768
    assert not pv["qnn_htp_documented"]


def test_edited_encodings_are_refused_naming_the_entry(rtn_run, tmp_path, capsys):
    """An encodings file edited to another bit-width, scale or name, sealed or not, is
    refused by `qnpu eval --onnx` with a message naming the entry (or the name the graph
    lacks)."""
    import shutil

    from qnpu_jax.cli import main
    from qnpu_jax.runtime.onnx_run import check_encodings, check_encodings_match_qdq

    out = tmp_path / "onnx"
    export = ["export", "--run", str(rtn_run), "--format", "onnx", "--out", str(out)]
    assert main([*export, "--prefill-chunk", "16", "--max-context", "64"]) == 0
    enc = json.loads((out / "model.encodings").read_text())
    qdq = (out / "model_qdq.onnx").read_bytes()
    check_encodings_match_qdq(json.dumps(enc).encode(), qdq)  # its own: accepted
    name = "model.layers.1.mlp.up_proj.output"  # 8 bits

    def edited(field, value, section="activation_encodings", target=name):
        other = json.loads(json.dumps(enc))
        for e in other[section]:
            if e["name"] == target:
                e[field] = value
        return json.dumps(other).encode()

    with pytest.raises(QnpuError, match=rf"{name} says 16 bits.* at 8"):
        check_encodings_match_qdq(edited("bw", 16), qdq)
    with pytest.raises(QnpuError, match=rf"{name} has scale"):
        check_encodings_match_qdq(edited("scale", [0.5]), qdq)
    weight = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(QnpuError, match=rf"{weight} says 4 bits"):
        check_encodings_match_qdq(edited("bw", 4, "param_encodings", weight), qdq)
    with pytest.raises(QnpuError, match=r"present_key\.0 differs from past_key\.0"):
        check_encodings_match_qdq(edited("bw", 16, target="present_key.0"), qdq)
    with pytest.raises(QnpuError, match=r"model\.layers\.1\.mlp\.up_proj\.outptu"):
        check_encodings(out, edited("name", name.replace("output", "outptu")))
    ev = ["eval", "--data", "wiki", "--seq-len", "32", "--max-windows", "1", "--no-progress"]
    for data, says in ((edited("bw", 16), f"{name} says 16 bits"), (b"{", "model.encodings")):
        shutil.copy(tmp_path / "onnx" / "model.encodings", tmp_path / "kept")
        (out / "model.encodings").write_bytes(data)  # edited after the export sealed it
        capsys.readouterr()
        assert main([*ev, "--onnx", str(out), "--qdq"]) == 2
        assert says in capsys.readouterr().err
        shutil.copy(tmp_path / "kept", out / "model.encodings")


def test_float_weights_sit_off_ties_so_any_rounding_gives_our_codes():
    """`off_ties` moves a weight that sits exactly halfway between two codes (or within the
    margin of it) inside the code the exporter gives it; rounding halves up, as AIMET does
    (in float32, after adding 2^(bits-1)), then gives our codes on every weight."""
    from qnpu_jax.export.onnx_export import off_ties, tie_margin

    rng = np.random.default_rng(0)
    scale = np.asarray([0.5, 0.25, 0.125], np.float32)
    codes = rng.integers(-8, 8, (64, 3))
    w = ((codes + 0.5) * scale).astype(np.float32)  # every weight on a tie
    w[::2] = (codes[::2] * scale + 0.1 * scale).astype(np.float32)  # half of them not
    entry = {"axis": 0, "scale": list(scale), "bits": 4}
    moved = off_ties(w, entry, axis=1)
    ours = np.rint(w * (1 / scale))
    half_up = np.floor((moved / scale + 8).astype(np.float32) + np.float32(0.5)) - 8
    np.testing.assert_array_equal(half_up, ours)
    np.testing.assert_array_equal(np.rint(moved * (1 / scale)), ours)
    np.testing.assert_array_equal(moved[::2], w[::2])  # away from ties: untouched
    assert np.abs(moved - w).max() <= 2 * tie_margin(4) * scale.max()
    assert off_ties(w, {**entry, "block": 32}, axis=1) is w  # per-block: as it was


def test_off_ties_equals_deciding_every_weight_in_float64():
    """`off_ties` decides in float64 only on the weights float32 puts near an edge (or beyond
    2^(bits+1) codes): the same weights, bit for bit, as deciding every weight in float64."""
    from qnpu_jax.export.onnx_export import off_ties, tie_margin

    def every_weight(w, scale, bits, axis):
        shape = [1] * w.ndim
        shape[axis] = -1
        s = scale.reshape(shape)
        target = np.rint(w * (1.0 / s).astype(np.float32))
        offset = w.astype(np.float64) / s.astype(np.float64) - target
        margin = tie_margin(bits)
        edge = np.abs(offset) > 0.5 - margin
        moved = (target + np.clip(offset, margin - 0.5, 0.5 - margin)) * s.astype(np.float64)
        return np.where(edge, moved.astype(np.float32), w), int(edge.sum())

    rng = np.random.default_rng(3)
    moved_cases = 0
    for case in range(60):
        bits, axis = (2, 4, 8, 16)[case % 4], case % 2
        shape = (int(rng.integers(1, 40)), int(rng.integers(1, 40)))
        scale = rng.uniform(1e-4, 1.0, shape[axis]).astype(np.float32)
        view = scale.reshape([-1, 1] if axis == 0 else [1, -1])
        codes = rng.integers(-(2**bits), 2**bits, shape) * (1 + 8 * (case % 3 == 2))
        near = rng.choice([0.5, -0.5, 0.5 - tie_margin(bits), 0.4999, 0.25], shape)
        w = ((codes + near) * view).astype(np.float32)  # on, at and off ties; beyond the range
        want, edges = every_weight(w, scale, bits, axis)
        got = off_ties(w, {"axis": axis, "scale": list(scale), "bits": bits}, axis)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert (got is w) == (edges == 0)
        moved_cases += edges > 0
    assert moved_cases > 40


def test_aimet_codes_match_ours_on_the_first_layer(exported, windows):
    """AIMET's QuantSim and the QDQ graph on the same inputs, quantizer by quantizer
    (`qnpu study aimet_gap`): every weight has our codes (the float graph's weights sit off
    ties), the embedding rows come in on the input's grid, and the first layer's tensors up
    to the q/k/v projections have the same codes; both score the window within 3% (one window
    of 40 tokens: 2.10% on an AMD EPYC, under 2% on CI's earlier machine)."""
    from qnpu_jax.studies.aimet_gap import aimet_gap

    report = aimet_gap(exported, np.asarray(windows[:1, :SEQ]), 1)
    assert report["weights_differing"] == []
    rows = report["tensors"]
    assert rows["model.embed_tokens.output"]["differ_share"] == 0
    for t in ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
        assert rows[f"model.layers.0.{t}.output"]["differ_share"] < 1e-3, t
    assert report["first_differing_activation"] != "model.embed_tokens.output"
    assert abs(report["aimet_vs_qdq"]["gap"]) < 0.03
    # where both sides quantize the same value and still differ, AIMET's float32 rounding
    # (`aimet_rounding`) gives AIMET's code: nothing of ours is left
    same = [r for r in rows.values() if r.get("same_input_differ_share", 0) > 0]
    assert same and all(r["same_input_differ_explained"] == 1.0 for r in same)
