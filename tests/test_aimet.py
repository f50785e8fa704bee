"""AIMET encodings export: schemas 1.0.0 / 0.6.1, offset convention, naming, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.export import aimet
from qnpu_jax.export.aimet import aimet_encodings, aimet_name, tensor_names, write_aimet


def _enc(
    bits: int = 8,
    *,
    signed: bool = True,
    symmetric: bool = True,
    scale: float | list[float] = 0.02,
    zero_point: int | list[int] = 0,
) -> dict[str, Any]:
    scales = scale if isinstance(scale, list) else [scale]
    zps = zero_point if isinstance(zero_point, list) else [zero_point] * len(scales)
    return {
        "bits": bits,
        "signed": signed,
        "symmetric": symmetric,
        "axis": 0 if isinstance(scale, list) else None,
        "scale": scales,
        "zero_point": zps,
    }


def _table() -> dict[str, dict[str, Any]]:
    """A hand-made 1-layer table with every tensor name and a mix of encodings."""
    t: dict[str, dict[str, Any]] = {}
    for w in aimet.LAYER_WEIGHTS:
        t[f"layers.0.{w}"] = _enc(8, scale=[0.01, 0.03])
    t["layers.0.q_proj"] = _enc(4, scale=[0.1, 0.2, 0.05])  # W4 per-channel, 3 output rows
    for a in aimet.LAYER_ACTIVATIONS:
        t[f"layers.0.{a}"] = _enc(8, scale=0.02)
    t["layers.0.probs"] = _enc(16, signed=False, scale=1 / 65535)
    t["layers.0.down_in"] = _enc(16, scale=0.001)
    t["layers.0.silu_out"] = _enc(8, symmetric=False, scale=0.05, zero_point=-100)
    t["layers.0.attn_out"] = _enc(8, signed=False, symmetric=False, scale=0.1, zero_point=37)
    t["embed_tokens"] = _enc(8, scale=[0.01, 0.02, 0.03, 0.04, 0.05])  # one per vocab row
    t["embed_out"] = _enc(16, scale=0.0005)
    t["final_norm_out"] = _enc(8, scale=0.04)
    t["lm_head"] = _enc(8, scale=[0.005, 0.006, 0.007, 0.008])
    return t


def _v1(out: dict[str, Any]) -> dict[str, dict[str, Any]]:
    entries = [*out["activation_encodings"], *out["param_encodings"]]
    by_name = {e["name"]: e for e in entries}
    assert len(by_name) == len(entries)
    return by_name


def _v061(out: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    both = {**out["activation_encodings"], **out["param_encodings"]}
    assert len(both) == len(out["activation_encodings"]) + len(out["param_encodings"])
    return both


def _our_real(e: dict[str, Any], ch: int, q: int) -> float:
    return e["scale"][ch] * (q - e["zero_point"][ch])


def _codes(bits: int, signed: bool) -> list[int]:
    lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    return sorted({lo, lo + 1, -1 if signed else 1, 0, 1, hi - 1, hi})


def test_name_lists_match_the_plan() -> None:
    from qnpu_jax.quant import plan

    assert aimet.LAYER_WEIGHTS == plan.WEIGHTS
    assert aimet.LAYER_ACTIVATIONS == plan.LAYER_ACTIVATIONS
    assert {*aimet.GLOBAL_HEAD, *aimet.GLOBAL_TAIL} == set(plan.GLOBAL_TENSORS)
    assert set(tensor_names(1)) == set(_table())


def test_naming_is_a_bijection_over_a_full_table() -> None:
    ours = tensor_names(3)
    assert len(ours) == 4 + 3 * 25
    for naming in aimet.NAMINGS:
        theirs = [aimet_name(t, naming) for t in ours]
        assert len(set(theirs)) == len(ours)
    table = {t: _enc(8) for t in ours}
    for t in ours:
        if aimet.is_param(t):
            table[t] = _enc(8, scale=[0.01, 0.02])
    out = aimet_encodings(table)
    names = [e["name"] for e in out["activation_encodings"] + out["param_encodings"]]
    assert sorted(names) == sorted(aimet_name(t) for t in ours)
    params = {e["name"] for e in out["param_encodings"]}
    assert params == {aimet_name(t) for t in ours if aimet.is_param(t)}
    assert all(n.endswith(".weight") for n in params)
    assert not any(n.endswith(".weight") for n in set(names) - params)


def test_hf_names() -> None:
    expect = {
        "layers.0.q_proj": "model.layers.0.self_attn.q_proj.weight",
        "layers.2.down_proj": "model.layers.2.mlp.down_proj.weight",
        "embed_tokens": "model.embed_tokens.weight",
        "lm_head": "lm_head.weight",
        "layers.1.attn_in": "model.layers.1.input_layernorm.output",
        "layers.0.q_out": "model.layers.0.self_attn.q_proj.output",
        "layers.0.down_in": "model.layers.0.mlp.down_proj.input",
        "layers.0.probs": "model.layers.0.self_attn.softmax.output",
        "layers.0.scores": "model.layers.0.self_attn.scores.output",
        "layers.0.k_rope": "model.layers.0.self_attn.k_rope.output",
        "layers.0.resid_attn": "model.layers.0.post_attention_layernorm.input",
        "layers.0.resid_mlp": "model.layers.0.output",
        "embed_out": "model.embed_tokens.output",
        "final_norm_out": "model.norm.output",
        "layers.10.v_out": "model.layers.10.self_attn.v_proj.output",
    }
    for ours, hf in expect.items():
        assert aimet_name(ours) == hf
        assert aimet_name(ours, "native") == ours


def test_schema_1_0_0_structure() -> None:
    table = _table()
    out = aimet_encodings(table)
    assert out["version"] == "1.0.0"
    assert isinstance(out["activation_encodings"], list)
    assert len(out["param_encodings"]) == 7 + 2
    assert len(out["activation_encodings"]) == 18 + 2
    for e in out["activation_encodings"] + out["param_encodings"]:
        assert set(e) == {"name", "dtype", "enc_type", "bw", "is_sym", "scale", "offset"}
        assert e["dtype"] == "INT"
        assert all(isinstance(o, int) for o in e["offset"])
        assert len(e["scale"]) == len(e["offset"])
    by = _v1(out)
    q = by["model.layers.0.self_attn.q_proj.weight"]
    assert (q["enc_type"], q["bw"], q["is_sym"]) == ("PER_CHANNEL", 4, True)
    assert q["scale"] == [0.1, 0.2, 0.05]
    assert q["offset"] == [-8, -8, -8]
    emb = by["model.embed_tokens.weight"]
    assert emb["enc_type"] == "PER_CHANNEL" and len(emb["scale"]) == 5 == len(emb["offset"])
    assert len(by["lm_head.weight"]["scale"]) == 4
    x = by["model.layers.0.input_layernorm.output"]
    assert (x["enc_type"], x["bw"], x["is_sym"], x["offset"]) == ("PER_TENSOR", 8, True, [-128])
    p = by["model.layers.0.self_attn.softmax.output"]
    assert (p["bw"], p["is_sym"], p["offset"], p["scale"]) == (16, False, [0], [1 / 65535])
    assert by["model.layers.0.mlp.down_proj.input"]["offset"] == [-32768]
    silu = by["model.layers.0.mlp.act_fn.output"]
    assert (silu["is_sym"], silu["offset"]) == (False, [100 - 128])
    ao = by["model.layers.0.self_attn.o_proj.input"]
    assert (ao["is_sym"], ao["offset"]) == (False, [-37])


def test_schema_0_6_1_structure_and_min_max() -> None:
    out = aimet_encodings(_table(), version="0.6.1")
    assert out["version"] == "0.6.1"
    assert isinstance(out["param_encodings"], dict)
    by = _v061(out)
    for entries in by.values():
        for e in entries:
            assert set(e) == {"bitwidth", "dtype", "is_symmetric", "min", "max", "offset", "scale"}
            assert e["dtype"] == "int" and e["is_symmetric"] in ("True", "False")
            assert isinstance(e["offset"], int)
            top = (1 << e["bitwidth"]) - 1
            assert e["min"] == pytest.approx(e["scale"] * e["offset"], rel=1e-12)
            assert e["max"] == pytest.approx(e["scale"] * (e["offset"] + top), rel=1e-12)
    # per-channel: one dict per output row
    assert len(by["model.layers.0.self_attn.q_proj.weight"]) == 3
    assert len(by["model.embed_tokens.weight"]) == 5
    assert len(by["lm_head.weight"]) == 4
    assert len(by["model.layers.0.mlp.up_proj.weight"]) == 2
    assert len(by["model.layers.0.self_attn.scores.output"]) == 1

    # signed symmetric 8-bit, scale 0.02: offset −128, min −2.56, max 2.54
    (x,) = by["model.layers.0.input_layernorm.output"]
    assert (x["bitwidth"], x["is_symmetric"], x["offset"]) == (8, "True", -128)
    assert x["min"] == pytest.approx(-2.56) and x["max"] == pytest.approx(2.54)
    # signed symmetric 4-bit per channel, scales 0.1/0.2/0.05: offset −8, [−8s, 7s]
    q = by["model.layers.0.self_attn.q_proj.weight"]
    assert [e["offset"] for e in q] == [-8, -8, -8]
    assert [e["is_symmetric"] for e in q] == ["True"] * 3
    assert [e["min"] for e in q] == pytest.approx([-0.8, -1.6, -0.4])
    assert [e["max"] for e in q] == pytest.approx([0.7, 1.4, 0.35])
    # unsigned 16-bit probs, scale 1/65535: offset 0, [0, 1]
    (p,) = by["model.layers.0.self_attn.softmax.output"]
    assert (p["bitwidth"], p["is_symmetric"], p["offset"]) == (16, "False", 0)
    assert p["min"] == 0.0 and p["max"] == pytest.approx(1.0, rel=1e-12)
    # signed asymmetric 8-bit, zero point −100, scale 0.05: offset −28, [−1.4, 11.35]
    (s,) = by["model.layers.0.mlp.act_fn.output"]
    assert (s["offset"], s["is_symmetric"]) == (-28, "False")
    assert (s["min"], s["max"]) == (pytest.approx(-1.4), pytest.approx(11.35))
    # unsigned asymmetric 8-bit, zero point 37, scale 0.1: offset −37, [−3.7, 21.8]
    (a,) = by["model.layers.0.self_attn.o_proj.input"]
    assert (a["offset"], a["min"], a["max"]) == (-37, pytest.approx(-3.7), pytest.approx(21.8))


@pytest.mark.parametrize(
    "tensor", ["layers.0.attn_in", "layers.0.q_proj", "layers.0.probs", "layers.0.silu_out",
               "layers.0.attn_out", "embed_tokens", "layers.0.down_in"]
)  # fmt: skip
def test_dequantization_agrees(tensor: str) -> None:
    """Our real = s·(q − z) equals AIMET's s·(u + offset) on the unsigned code u of q, in both
    schemas, and AIMET's 1.0.0 loader reading (signed dtype when is_sym) agrees as well."""
    table = _table()
    ours = table[tensor]
    name = aimet_name(tensor)
    v1 = _v1(aimet_encodings(table))[name]
    v0 = _v061(aimet_encodings(table, version="0.6.1"))[name]
    bits, signed = ours["bits"], ours["signed"]
    shift = 1 << (bits - 1)
    for ch in range(len(ours["scale"])):
        for q in _codes(bits, signed):
            want = _our_real(ours, ch, q)
            u = q + shift if signed else q  # the same bits read as an unsigned code
            assert 0 <= u <= (1 << bits) - 1
            assert v0[ch]["scale"] * (u + v0[ch]["offset"]) == pytest.approx(want, abs=1e-12)
            assert v1["scale"][ch] * (u + v1["offset"][ch]) == pytest.approx(want, abs=1e-12)
            if v1["is_sym"]:  # aimet reads int{bw} codes x with offset + 2^(b−1) added back
                x, off = u - shift, v1["offset"][ch] + shift
                assert off == 0
                assert v1["scale"][ch] * (x + off) == pytest.approx(want, abs=1e-12)
            lo, hi = v0[ch]["min"], v0[ch]["max"]
            assert lo - 1e-12 <= want <= hi + 1e-12


def test_order_is_canonical_and_input_order_free() -> None:
    table = _table()
    fwd = aimet_encodings(table)
    rev = aimet_encodings(dict(reversed(list(table.items()))))
    assert fwd == rev
    acts = [e["name"] for e in fwd["activation_encodings"]]
    assert acts[0] == "model.embed_tokens.output" and acts[-1] == "model.norm.output"
    params = [e["name"] for e in fwd["param_encodings"]]
    assert params[0] == "model.embed_tokens.weight" and params[-1] == "lm_head.weight"


def test_partial_table_and_native_names() -> None:
    out = aimet_encodings({"layers.3.k_rope": _enc(8)}, version="0.6.1", names="native")
    assert out["param_encodings"] == {}
    assert list(out["activation_encodings"]) == ["layers.3.k_rope"]


def test_write_aimet(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "enc.json"
    table = _table()
    assert write_aimet(path, table) == path
    assert json.loads(path.read_text()) == aimet_encodings(table)
    write_aimet(path, table, version="0.6.1")
    assert json.loads(path.read_text()) == aimet_encodings(table, version="0.6.1")
    with pytest.raises(QnpuError, match=r"layers\.0\.scores"):
        bad = {**table, "layers.0.scores": _enc(8, scale=-1.0)}
        write_aimet(path, bad)
    assert json.loads(path.read_text())["version"] == "0.6.1"  # untouched
    assert sorted(p.name for p in path.parent.iterdir()) == ["enc.json"]


def test_imports_no_jax() -> None:
    code = "import sys, qnpu_jax.export.aimet; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_refuses_unknown_version_naming_and_tensor() -> None:
    with pytest.raises(QnpuError, match="version"):
        aimet_encodings(_table(), version="2.0.0")
    with pytest.raises(QnpuError, match="naming"):
        aimet_encodings(_table(), names="onnx")
    for bad in ("layers.0.foo", "layers.01.q_proj", "layers.x.q_out", "model.norm", "q_proj"):
        with pytest.raises(QnpuError, match="unknown tensor") as info:
            aimet_encodings({**_table(), bad: _enc(8)})
        assert bad in str(info.value)
    with pytest.raises(QnpuError, match="unknown tensor"):
        aimet_name("layers.0.nope")


def _bad(key: str, value: Any, base: dict[str, Any] | None = None) -> dict[str, Any]:
    e = dict(base if base is not None else _enc(8))
    if value is _MISSING:
        del e[key]
    else:
        e[key] = value
    return e


_MISSING = object()


@pytest.mark.parametrize(
    ("tensor", "entry", "match"),
    [
        ("layers.0.scores", _bad("scale", [0.1, 0.2]), "1 scale"),
        ("layers.0.scores", _bad("scale", []), "empty"),
        ("layers.0.scores", _bad("scale", [0.0]), "positive"),
        ("layers.0.scores", _bad("scale", [-0.5]), "positive"),
        ("layers.0.scores", _bad("scale", [float("nan")]), "finite"),
        ("layers.0.scores", _bad("scale", [float("inf")]), "finite"),
        ("layers.0.scores", _bad("scale", ["0.1"]), "non-number"),
        ("layers.0.scores", _bad("scale", 0.1), "list"),
        ("layers.0.scores", _bad("bits", 1), "bits"),
        ("layers.0.scores", _bad("bits", 17), "bits"),
        ("layers.0.scores", _bad("bits", True), "bits"),
        ("layers.0.scores", _bad("bits", 8.0), "bits"),
        ("layers.0.scores", _bad("signed", 1), "signed"),
        ("layers.0.scores", _bad("axis", 0), "only exported for weights"),
        ("layers.0.scores", _bad("zero_point", [3]), "symmetric"),
        ("layers.0.scores", _bad("zero_point", [0, 0]), "zero points"),
        ("layers.0.scores", _bad("zero_point", _MISSING), "lacks zero_point"),
        ("layers.0.scores", "not a dict", "mapping"),
        ("layers.0.mlp_in", _bad("zero_point", [0.5], _enc(8, symmetric=False)), "integers"),
        ("layers.0.o_proj", _bad("axis", 1, _enc(8, scale=[0.1, 0.2])), "axis"),
        ("layers.0.o_proj", _bad("zero_point", [0], _enc(8, scale=[0.1, 0.2])), "zero points"),
        ("lm_head", _bad("scale", [0.1, float("nan")], _enc(8, scale=[0.1, 0.2])), "finite"),
        ("embed_tokens", _bad("scale", np.zeros((2, 2)), _enc(8, scale=[0.1, 0.2])), "1-d"),
    ],
)
def test_refuses_malformed_entries(tensor: str, entry: Any, match: str) -> None:
    for version in aimet.VERSIONS:
        with pytest.raises(QnpuError, match=match) as info:
            aimet_encodings({**_table(), tensor: entry}, version=version)
        assert tensor in str(info.value)


def test_accepts_numpy_values() -> None:
    table = _table()
    table["lm_head"] = {
        "bits": np.int64(8),
        "signed": np.True_,
        "symmetric": True,
        "axis": 0,
        "scale": np.array([0.5, 0.25], np.float32),
        "zero_point": np.zeros(2, np.int32),
    }
    e = _v1(aimet_encodings(table))["lm_head.weight"]
    assert (e["scale"], e["offset"], e["bw"]) == ([0.5, 0.25], [-128, -128], 8)
    json.dumps(aimet_encodings(table, version="0.6.1"))  # plain Python types only
