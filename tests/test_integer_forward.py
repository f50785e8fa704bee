"""The JAX integer forward against the numpy emulator: bit for bit, at every position."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import build_int_artifact  # tests/ is on sys.path (rootdir conftest)

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import IntModel, load_int_model
from qnpu_jax.ir.graph import LAYER_ACTS
from qnpu_jax.runtime import emulator as E
from qnpu_jax.runtime import jax_engine as F
from qnpu_jax.runtime.engines import open_engine
from qnpu_jax.runtime.interface import IntegerEngine

TEXT = (
    "The history of the town goes back to the twelfth century, when a small group of monks "
    "built a stone chapel beside the river. Over the following centuries the settlement grew "
    "into a market town, and by 1850 it had a railway station, three schools and a brewery "
    "that employed most of the men who lived there."
)


@pytest.fixture(scope="module")
def text_ids(smollm) -> list[int]:
    ids = smollm.tokenizer.encode(TEXT)
    assert len(ids) >= 60
    return ids


@pytest.fixture(scope="module")
def models(int_artifacts) -> dict[str, tuple[IntModel, F.JaxIntEngine]]:
    out = {}
    for name, path in int_artifacts.items():
        model = load_int_model(path)
        out[name] = (model, F.JaxIntEngine(model))
    return out


def _same_cache(emu: E.Cache, ours: F.IntCache) -> None:
    """Equal lengths and equal codes in every filled slot."""
    assert ours.length == emu.length
    n = emu.length
    for a, b in ((emu.k, ours.k), (emu.v, ours.v)):
        b = np.asarray(b)
        assert b.dtype == np.int16 and b.shape == a.shape
        assert np.array_equal(a[..., :n, :], b[..., :n, :])


def _same_logits(emu: np.ndarray, ours: np.ndarray) -> None:
    assert ours.dtype == np.int32 and emu.dtype == np.int32
    assert ours.shape == emu.shape
    assert np.array_equal(emu, ours), f"{int((emu != ours).sum())} logits differ"


def _decode_both(model, engine, emu_cache, our_cache, last_logits, steps=3) -> None:
    """`steps` greedy decode steps from both caches, checking logits and caches each step."""
    for _ in range(steps):
        nxt = np.argmax(last_logits[:, -1], axis=-1)[:, None]
        emu_logits, emu_cache = E.run_chunk(model, nxt, emu_cache)
        our_logits, our_cache = engine.run_chunk(nxt, our_cache)
        _same_logits(emu_logits, our_logits)
        _same_cache(emu_cache, our_cache)
        last_logits = emu_logits


@pytest.mark.parametrize("name", ["w8a8", "w4a8"])
def test_logits_and_caches_are_bit_exact(models, text_ids, name):
    model, engine = models[name]
    # the artifact mixes per-layer bit-widths (down_in at 8 then 16 bits): one program for both
    j = LAYER_ACTS.index("down_in")
    assert model.t("layers.act.qmax")[:, j].tolist() == [127, 32767]
    ids = np.asarray(text_ids)
    # 1 token, 7, exactly one chunk, and across a chunk boundary (32 + 13, last chunk padded)
    for length in (1, 7, 32, 45):
        tokens = ids[None, :length]
        emu_logits, emu_cache = E.EmulatorEngine(model).prefill(tokens)
        our_logits, our_cache = engine.prefill(tokens)
        _same_logits(emu_logits, our_logits)
        _same_cache(emu_cache, our_cache)
    _decode_both(model, engine, emu_cache, our_cache, emu_logits)
    # a batch of two different prompts of equal length, then greedy decoding of both rows
    tokens = np.stack([ids[:20], ids[25:45]])
    emu_logits, emu_cache = E.EmulatorEngine(model).prefill(tokens)
    our_logits, our_cache = engine.prefill(tokens)
    _same_logits(emu_logits, our_logits)
    _same_cache(emu_cache, our_cache)
    _decode_both(model, engine, emu_cache, our_cache, emu_logits)


def test_one_call_equals_chunked_prefill(models, text_ids):
    _, engine = models["w8a8"]
    tokens = np.asarray(text_ids)[None, :45]
    chunked, cache = engine.prefill(tokens)
    fresh = engine.new_cache(1)
    with jax.enable_x64(True):
        whole, k, v = F.int_forward(
            engine.consts, jnp.asarray(tokens, jnp.int32), fresh.k, fresh.v, jnp.int32(1)
        )
    assert np.array_equal(np.asarray(whole), chunked)
    n = cache.length
    assert np.array_equal(np.asarray(k)[..., :n, :], np.asarray(cache.k)[..., :n, :])
    assert np.array_equal(np.asarray(v)[..., :n, :], np.asarray(cache.v)[..., :n, :])


def test_the_end_of_the_context(models):
    """A long filled cache (attention over 255 keys) and a last chunk whose padding would run
    past max_context: both engines run it unpadded."""
    model, engine = models["w4a8"]
    rng = np.random.default_rng(0)
    cache = E.new_cache(model, 1)
    p, length = cache.length, 240
    k, v = cache.k.copy(), cache.v.copy()
    k[..., p:length, :] = rng.integers(-128, 128, k[..., p:length, :].shape)
    v[..., p:length, :] = rng.integers(-128, 128, v[..., p:length, :].shape)
    cache = E.Cache(k, v, length)
    tokens = rng.integers(0, model.model["vocab_size"], (1, 16))
    emu_logits, emu_cache = E.EmulatorEngine(model).prefill(tokens, cache)
    our_logits, our_cache = engine.prefill(tokens, cache)  # an emulator cache is accepted
    _same_logits(emu_logits, our_logits)
    _same_cache(emu_cache, our_cache)
    assert our_cache.length == model.graph["max_context"]
    with pytest.raises(QnpuError, match="maximum context"):
        engine.prefill(tokens[:, :1], our_cache)


def test_greedy_generation_matches_the_emulator(models, smollm):
    model, engine = models["w8a8"]
    prompt = smollm.tokenizer.encode("The capital of France is")
    emu = E.EmulatorEngine(model).generate(prompt, 6)
    seen: list[int] = []
    ours = engine.generate(prompt, 6, on_token=seen.append)
    assert ours == emu == seen and len(ours) == 6
    # stops at the end-of-sequence token, which is emitted
    assert engine.generate(prompt, 6, eos_token_id=emu[1]) == emu[:2]


def test_token_nll_matches_the_emulator(models, text_ids):
    model, engine = models["w4a8"]
    tokens = np.asarray(text_ids)[None, :12]
    ours = engine.token_nll(tokens)
    assert ours.dtype == np.float64 and ours.shape == (1, 11)
    # identical logit codes through one shared float64 scoring function: identical NLL
    assert np.array_equal(ours, E.EmulatorEngine(model).token_nll(tokens))
    with pytest.raises(QnpuError, match="runs an IntModel"):
        F.JaxIntEngine(engine.consts)  # type: ignore[arg-type]


def test_engines_share_one_interface(models, text_ids):
    """Both engines are `IntegerEngine`s driven by the same prefill/decode code, and each
    continues from the other's cache."""
    model, jax_engine = models["w8a8"]
    emu = open_engine("emulator", model)
    assert isinstance(emu, IntegerEngine) and isinstance(jax_engine, IntegerEngine)
    assert type(open_engine("jax", model)) is F.JaxIntEngine
    with pytest.raises(QnpuError, match="unknown engine 'npu'"):
        open_engine("npu", model)
    ids = np.asarray(text_ids)
    _, emu_cache = emu.prefill(ids[None, :10])
    _, jax_cache = jax_engine.prefill(ids[None, :10])
    a, a_cache = emu.prefill(ids[None, 10:14], jax_cache)
    b, b_cache = jax_engine.prefill(ids[None, 10:14], emu_cache)
    _same_logits(a, b)
    _same_cache(a_cache, b_cache)


def test_x64_is_scoped_and_required(models, text_ids):
    _, engine = models["w8a8"]
    assert not jax.enable_x64.value
    engine.prefill(np.asarray(text_ids)[None, :3])
    engine.generate(text_ids[:3], 2)
    assert not jax.enable_x64.value  # the engine never leaves x64 on
    cache = engine.new_cache(1)
    tokens = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(QnpuError, match="enable_x64"):
        F.int_forward(engine.consts, tokens, cache.k, cache.v, jnp.int32(1))
    with pytest.raises(QnpuError, match="enable_x64"):
        F.isqrt(jnp.asarray([4]))


def test_nonzero_zero_points_agree(models, text_ids):
    """The two engines compute the same integer function of any valid constants: shift the
    zero points of most activations (same ranges) and compare again."""
    model, _ = models["w8a8"]
    zp = model.t("layers.act.zero_point").copy()
    for name, z in (("attn_in", 3), ("q_out", -2), ("v_out", 5), ("attn_out", -4)):
        zp[:, LAYER_ACTS.index(name)] = z
    for name, z in (("up_out", 2), ("mlp_in", -1), ("resid_attn", 7), ("down_in", -3)):
        zp[:, LAYER_ACTS.index(name)] = z
    tensors = dict(model.tensors)
    tensors["layers.act.zero_point"] = zp
    tensors["act.zero_point"] = np.array([-5, 9], np.int32)
    shifted = dataclasses.replace(model, tensors=tensors)
    tokens = np.asarray(text_ids)[None, :7]
    emu_logits, emu_cache = E.EmulatorEngine(shifted).prefill(tokens)
    our_logits, our_cache = F.JaxIntEngine(shifted).prefill(tokens)
    _same_logits(emu_logits, our_logits)
    _same_cache(emu_cache, our_cache)
    # the shifted zero points did matter
    assert not np.array_equal(emu_logits, E.EmulatorEngine(model).prefill(tokens)[0])


def test_isqrt_is_exact():
    rng = np.random.default_rng(0)
    squares = np.array([1, 2, 3, 2**26 - 1, 2**31 - 1], np.int64) ** 2
    v = np.concatenate(
        [
            rng.integers(0, 2**62, 4000, dtype=np.int64),
            np.array([0, 1, 2, 3, 2**52 - 1, 2**52, 2**52 + 1, 2**62 - 1], np.int64),
            squares - 1,
            squares,
            squares + 1,
        ]
    )
    with jax.enable_x64(True):
        r = np.asarray(F.isqrt(jnp.asarray(v)))
    assert [int(x) for x in r] == [math.isqrt(int(x)) for x in v]


def _with_ranges(model: IntModel, halves: dict[str, int]) -> IntModel:
    """`model` with activations given the range [−h, h−1]."""
    tensors = dict(model.tensors)
    for field in ("qmin", "qmax"):
        tensors[f"layers.act.{field}"] = model.t(f"layers.act.{field}").astype(np.int64)
    for name, h in halves.items():
        j = LAYER_ACTS.index(name)
        tensors["layers.act.qmin"][:, j] = -h
        tensors["layers.act.qmax"][:, j] = h - 1
    return dataclasses.replace(model, tensors=tensors)


def test_refusals(models):
    model, engine = models["w8a8"]
    ops = {k: [dict(op) for op in v] for k, v in model.graph["ops"].items()}
    ops["layer"][3]["op"] = "gelu"
    with pytest.raises(QnpuError, match="no layer-level op 'gelu'"):
        F.int_consts(dataclasses.replace(model, graph={**model.graph, "ops": ops}))
    with pytest.raises(QnpuError, match="matmul must be one of"):
        F.int_consts(model, matmul="bf16")
    # 32-bit q and 23-bit k codes make the scores inexact in float64 (2^31·2^22·64 > 2^53):
    # matmul="f64" refuses, "i64" runs them, and "f32" plans them as one int64 dot
    wide = _with_ranges(model, {"q_rope": 2**31, "k_rope": 2**22})
    with pytest.raises(QnpuError, match="scores: integer matmul bound"):
        F.check_exact(wide, F.int_spec(wide, "f64"))
    F.check_exact(wide, F.int_spec(wide, "i64"))
    plans, _ = F.check_exact(wide, F.int_spec(wide, "f32")).plans("scores", 64)
    assert [p.dtype for p in plans] == ["int64"]
    wider = _with_ranges(model, {"q_rope": 2**31, "k_rope": 2**31})
    with pytest.raises(QnpuError, match="overflows int64"):  # 2^31·2^31·64 > 2^63
        F.check_exact(wider, F.int_spec(wider))
    for bad in (np.zeros((1, 0), int), np.zeros((0, 2), int), np.array([[1, 49152]])):
        with pytest.raises(QnpuError, match="token ids"):
            engine.prefill(bad)
    with pytest.raises(QnpuError, match="token ids must be integers"):
        engine.prefill(np.array([[1.0, 2.0]]))
    with pytest.raises(QnpuError, match="cache holds batch 2, the tokens 1"):
        engine.prefill(np.array([[1, 2]]), engine.new_cache(2))
    with pytest.raises(QnpuError, match="cache has shape"):
        engine.prefill(np.array([[1, 2]]), E.Cache(np.zeros((1, 1, 1, 1)), np.zeros(1), 1))
    with pytest.raises(QnpuError, match="prompt is empty"):
        engine.generate([], 3)


def test_every_matmul_mode_is_bit_exact(models, text_ids):
    """float32 with split operands (the default), float64 and int64 dots: the same codes."""
    model, engine = models["w4a8"]
    tokens = np.asarray(text_ids)[None, :40]
    want = E.EmulatorEngine(model).prefill(tokens)[0]
    assert engine.consts.layers["q_proj.weight"].dtype == np.int8  # converted in the scan
    assert engine.consts.globals["lm_head.weight"].dtype == np.float32
    for matmul, dtype in (("f64", np.float64), ("i64", np.int8)):
        other = F.JaxIntEngine(model, matmul=matmul)
        assert other.consts.globals["lm_head.weight"].dtype == dtype
        assert np.array_equal(other.prefill(tokens)[0], want)
    assert np.array_equal(engine.prefill(tokens)[0], want)


def test_scores_beyond_int32_take_the_wide_softmax(models, text_ids):
    """Score codes of ±2^30 (no exporter makes them; the contract allows them): the softmax
    works in int64 instead of int32, and both engines still agree."""
    model, engine = models["w8a8"]
    assert engine.spec.narrow_scores
    wide = _with_ranges(model, {"scores": 2**30})
    ours = F.JaxIntEngine(wide)
    assert not ours.spec.narrow_scores
    tokens = np.asarray(text_ids)[None, :40]
    assert np.array_equal(ours.prefill(tokens)[0], E.EmulatorEngine(wide).prefill(tokens)[0])


def test_layers_with_different_matmul_plans_share_one_program(models, text_ids):
    """down_proj reads 8-bit codes in layer 0 and 16-bit ones in layer 1: one plan each,
    chosen per layer inside the scan (and run bit-exactly by the tests above)."""
    for name, first, second in (("w4a8", 1, 2), ("w8a8", 2, 3)):
        engine = models[name][1]
        plans, index = engine.spec.plans("layers.down_proj", 1536)
        assert [plans[i].digits for i in index] == [first, second]
        assert engine.consts.layers["dot_plan.layers.down_proj"].tolist() == list(index)
        assert "dot_plan.layers.q_proj" not in engine.consts.layers  # one plan: no switch


def test_attention_reads_a_window_of_the_cache(models):
    spec = models["w8a8"][1].spec  # prefill chunk 32, max context 256
    ends = {1: 32, 32: 32, 33: 40, 65: 80, 129: 160, 200: 224, 256: 256}
    assert {e: F.key_window(e, spec) for e in ends} == ends
    assert all(F.key_window(e, spec) >= e for e in range(1, 257))
    assert len({F.key_window(e, spec) for e in range(1, 257)}) == 13  # compiled programs


def test_full_depth(smollm, tmp_path):
    """All 30 layers of SmolLM2-135M at W8A8: one compiled scan, bit-exact at every position."""
    model = load_int_model(build_int_artifact(smollm, tmp_path / "full", w_bits=8, layers=30))
    tokens = np.asarray(smollm.tokenizer.encode(TEXT))[None, :9]
    emu_logits, emu_cache = E.EmulatorEngine(model).prefill(tokens)
    our_logits, our_cache = F.JaxIntEngine(model).prefill(tokens)
    _same_logits(emu_logits, our_logits)
    _same_cache(emu_cache, our_cache)


def test_the_emulator_never_imports_jax():
    code = "import qnpu_jax.runtime.emulator, sys; assert 'jax' not in sys.modules"
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
