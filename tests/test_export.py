"""The exporter and the emulator: integer kernels, graph validation, refusals, fidelity."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import artifact_tokenizer, load_int_model
from qnpu_jax.quant.requantize import fixed_point_multiplier, requantize_np
from qnpu_jax.runtime import emulator as E


def test_isqrt_is_the_exact_floor_square_root():
    rng = np.random.default_rng(0)
    v = np.concatenate(
        [
            rng.integers(0, 2**62, 2000, dtype=np.int64),
            np.array([0, 1, 2, 3, 4, 15, 16, 17, 2**52 - 1, 2**52, (2**31 - 1) ** 2], np.int64),
            np.array([(2**31 - 1) ** 2 - 1, 2**62 - 1], np.int64),
        ]
    )
    r = E.isqrt(v)
    assert [int(x) for x in r] == [math.isqrt(int(x)) for x in v]


def test_emulator_requantize_equals_the_shared_primitive():
    rng = np.random.default_rng(1)
    acc = rng.integers(-(2**31), 2**31, 5000, dtype=np.int64)
    m, sh = fixed_point_multiplier(rng.uniform(1e-6, 0.5, 5000))
    ours = E.requantize(acc, m, sh, 3, -128, 127)
    assert np.array_equal(ours, requantize_np(acc, m, sh, 3, -128, 127))
    # ties round half up: 5 · 2^-1 = 2.5 -> 3, −2.5 -> −2
    m1, s1 = fixed_point_multiplier(0.5)
    assert E.requantize(np.array([5, -5]), m1, s1, 0, -128, 127).tolist() == [3, -2]


def test_integer_softmax_by_hand():
    exp_lut = np.rint(np.exp(-np.arange(65536) * 0.01) * 65535).astype(np.uint16)
    scores = np.array([[100, 100, 0, 7]], np.int64)
    allowed = np.array([[True, True, False, True]])
    p = E.softmax_codes(scores, allowed, exp_lut)
    e = np.array([65535, 65535, 0, int(exp_lut[93])], np.int64)
    total = e.sum()
    assert p.tolist() == [[(int(x) * 65535 + total // 2) // total for x in e]]
    assert p[0, 2] == 0 and abs(int(p.sum()) - 65535) <= 2


def test_integer_rmsnorm_matches_the_float_norm():
    rng = np.random.default_rng(2)
    xc = rng.integers(-3000, 3000, (4, 576)).astype(np.int64)
    s_in, s_out, eps = 0.01, 8 / 32767, 1e-5
    gamma = rng.uniform(-2, 2, 576)
    m, sh = fixed_point_multiplier(np.abs(gamma) * 2.0**-16 / s_out)
    consts = {
        "sign": np.sign(gamma).astype(np.int8),
        "M": m,
        "shift": sh,
        "eps": np.int64(round(eps / s_in**2 * 2**16)),
    }
    y = E.rmsnorm(xc, consts, (0, -32768, 32767), 8, 16)
    x = xc * s_in
    ref = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma / s_out
    assert np.abs(y - ref).max() <= 1.0  # within one output code


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(path, edit, *, reseal=True):
    """Edit the manifest; `reseal` gives it a valid digest again, so the engine's own checks
    (behind the container's digest) are what the edit meets."""
    from qnpu_jax.integrity import seal

    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(seal(manifest) if reseal else manifest))


def test_graph_refusals_name_the_problem(int_artifacts, tmp_path):
    base = int_artifacts["w8a8"]
    cases = {
        "unknown op": lambda m: m["graph"]["ops"]["layer"][3].update(op="conv"),
        "op list differs": lambda m: m["graph"]["ops"]["layer"].pop(),
        "graph format": lambda m: m["graph"].update(format="other/9"),
        # an artifact of the previous graph format (other activation column order)
        r"'qnpu-llama-int/1' is not supported \(this version runs qnpu-llama-int/2 and "
        r"qnpu-llama-int/3\); export the run again": lambda m: m["graph"].update(
            format="qnpu-llama-int/1"
        ),
        # /3 is the format with channel lists: a /3 artifact without them is refused
        "the one with shadow or MUXQ channels": lambda m: m["graph"].update(
            format="qnpu-llama-int/3"
        ),
        "has shape": lambda m: m["model"].update(hidden_size=512),
        "tensors missing": lambda m: m["tensors"].pop("layers.pv.M"),
        r"logits_scale is 3\.05.*fixes it at 1\.52": lambda m: m["graph"].update(
            logits_scale=2.0**-15
        ),
        "norm_fraction_bits is 9; graph .* fixes it at 8": lambda m: m["graph"].update(
            norm_fraction_bits=9
        ),
        "rope_fraction_bits is 13": lambda m: m["graph"].update(rope_fraction_bits=13),
        r"max_context 9000 is not in 1\.\.8192": lambda m: m["graph"].update(max_context=9000),
        r"prefill_chunk 0 is not in": lambda m: m["graph"].update(prefill_chunk=0),
        "prefix_tokens must be a list of token ids": lambda m: m["graph"].update(
            prefix_tokens=[49152]
        ),
        "tokenizer eos_token_id 50000 is not a token id": lambda m: m["tokenizer"].update(
            eos_token_id=50000
        ),
    }
    for i, (message, edit) in enumerate(cases.items()):
        art = _copy(base, tmp_path / f"a{i}")
        _edit_manifest(art, edit)
        with pytest.raises(QnpuError, match=message):
            load_int_model(art)
    art = _copy(base, tmp_path / "unsealed")
    _edit_manifest(art, lambda m: m["graph"].update(logits_scale=2.0**-15), reseal=False)
    with pytest.raises(QnpuError, match="digest mismatch: the manifest was edited"):
        load_int_model(art)


def test_tampered_tensor_is_refused_before_running(int_artifacts, tmp_path):
    art = _copy(int_artifacts["w4a8"], tmp_path / "a")
    f = art / "tensors" / "layers.q_proj.weight.npy"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(QnpuError, match=r"layers\.q_proj\.weight.*(hash|tampered)"):
        load_int_model(art)


def test_w4_weights_are_packed_and_the_artifact_is_self_contained(int_artifacts):
    manifest = json.loads((int_artifacts["w4a8"] / "manifest.json").read_text())
    assert manifest["tensors"]["layers.q_proj.weight"]["packing"] == "int4"
    assert manifest["tensors"]["lm_head.weight"]["packing"] == "none"
    model = load_int_model(int_artifacts["w4a8"])
    w = model.t("layers.q_proj.weight")
    assert w.dtype == np.int8 and w.min() >= -8 and w.max() <= 7
    tok = artifact_tokenizer(model)
    assert tok.decode(tok.encode("Paris is")) == "Paris is"
    # per-layer bits: the down_proj input is 8-bit in layer 0 and 16-bit in layer 1
    col = list(manifest["graph"]["layer_activations"]).index("down_in")
    assert model.t("layers.act.qmax")[:, col].tolist() == [127, 32767]
    assert model.t("layers.prefix.k").shape[2] == 1  # the BOS sink's K/V codes


def test_chunked_prefill_equals_one_call_and_decode_continues_it(int_artifacts):
    model = load_int_model(int_artifacts["w8a8"])
    tokens = np.arange(100, 170, dtype=np.int64)[None]  # 70 tokens: chunks of 32, 32, 6
    chunked, cache = E.EmulatorEngine(model).prefill(tokens)
    whole, _ = E.run_chunk(model, tokens, E.new_cache(model, 1))
    assert np.array_equal(chunked, whole)
    assert cache.length == 1 + 70  # BOS prefix + text
    before = (cache.k.copy(), cache.v.copy())
    step, after = E.run_chunk(model, np.array([[5]]), cache)
    longer, _ = E.run_chunk(model, np.concatenate([tokens, [[5]]], 1), E.new_cache(model, 1))
    assert np.array_equal(step[:, -1], longer[:, -1])
    # run_chunk and prefill leave the caller's cache as it was; generate (which decodes into
    # its own cache without copying it each step) gives the same greedy tokens as stepping
    assert np.array_equal(cache.k, before[0]) and np.array_equal(cache.v, before[1])
    assert after.length == cache.length + 1 and not np.array_equal(after.k, cache.k)
    E.EmulatorEngine(model).prefill(np.array([[7, 8]]), cache)
    assert np.array_equal(cache.k, before[0]) and np.array_equal(cache.v, before[1])
    prompt = [int(t) for t in tokens[0, :9]]
    out = E.EmulatorEngine(model).generate(prompt, 4)
    codes, c = E.EmulatorEngine(model).prefill(np.asarray([prompt]))
    stepped = [int(np.argmax(codes[0, -1]))]
    for _ in range(3):
        codes, c = E.run_chunk(model, np.asarray([[stepped[-1]]]), c)
        stepped.append(int(np.argmax(codes[0, -1])))
    assert out == stepped


def test_emulator_tracks_the_fake_quant_model(smollm, int_sources, int_artifacts):
    """Same windows, same encodings: the integer model's NLL follows fake-quant's up to
    rounding (2 layers, 4 held-out windows of 64; the full-model perplexity gap is measured
    by qnpu study simulation_gap)."""
    import jax
    import jax.numpy as jnp

    from qnpu_jax.data import load_documents, sample_windows, tokenize_documents
    from qnpu_jax.models.taps import FakeQuantTaps, tapped_token_nll

    windows = sample_windows(
        tokenize_documents(load_documents("wiki", "eval"), smollm.tokenizer),
        64,
        4,
        jax.random.key(5),
    )
    src = int_sources["w8a8"]
    nll_fq = np.asarray(
        tapped_token_nll(
            src["params"],
            src["state"],
            jnp.asarray(windows),
            cfg=src["cfg"],
            taps=FakeQuantTaps(src["plan"]),
            prefix=src["prefix"],
        )
    )
    nll_int = E.EmulatorEngine(load_int_model(int_artifacts["w8a8"])).token_nll(windows)
    assert np.isfinite(nll_int).all()
    # A 2-layer cut has huge logits (mean NLL ≈ 18 nats), so one-code differences move each
    # token's NLL by ~0.1 nat; measured: correlation 0.99994, mean NLL 0.1% apart.
    corr = np.corrcoef(nll_int.ravel(), nll_fq.ravel())[0, 1]
    assert corr > 0.999, corr
    assert abs(nll_int.mean() - nll_fq.mean()) < 0.01 * nll_fq.mean()


def test_export_refuses_plans_and_states_it_cannot_fold(tiny_cfg, tiny_params):
    import jax

    from qnpu_jax.export.exporter import export_model
    from qnpu_jax.pipeline.calibrate import calibrate
    from qnpu_jax.quant.plan import QuantRule, default_plan

    windows = np.asarray(jax.random.randint(jax.random.key(0), (2, 16), 0, tiny_cfg.vocab_size))
    plan = default_plan(tiny_cfg.num_layers)
    state = calibrate(tiny_params, tiny_cfg, plan, windows)
    exported = export_model(tiny_params, tiny_cfg, plan, state, max_context=64, prefill_chunk=16)
    assert exported.manifest["graph"]["max_context"] == 64
    partial = plan.apply([QuantRule(pattern="layers/scores", quantize=False)])
    with pytest.raises(QnpuError, match="keeps these in float: layers/scores"):
        export_model(tiny_params, tiny_cfg, partial, state)
    up = state["layers"]["up_proj"]
    bad = {"layers": {**state["layers"], "up_proj": up.replace(scale=-up.scale)}}
    bad["outer"] = state["outer"]
    with pytest.raises(QnpuError, match=r"layers\.0\.up_proj.*> 0"):
        export_model(tiny_params, tiny_cfg, plan, bad)
    with pytest.raises(QnpuError, match="prefill chunk"):
        export_model(tiny_params, tiny_cfg, plan, state, max_context=16, prefill_chunk=32)


def test_tiny_model_artifact_runs_identically_on_both_engines(tiny_cfg, tiny_params, tmp_path):
    """Random weights, no prefix, unrotated (RMSNorm γ ≠ 1, one negative, kept per channel)."""
    import jax

    from qnpu_jax.export.exporter import export_model, write_exported
    from qnpu_jax.pipeline.calibrate import calibrate
    from qnpu_jax.quant.plan import default_plan
    from qnpu_jax.runtime.jax_engine import JaxIntEngine

    params = dict(tiny_params)
    layers = dict(params["layers"])
    layers["input_layernorm"] = layers["input_layernorm"].at[:, 0].set(-0.5)
    params["layers"] = layers
    windows = np.asarray(jax.random.randint(jax.random.key(0), (2, 16), 0, tiny_cfg.vocab_size))
    plan = default_plan(tiny_cfg.num_layers, w_bits=4)
    state = calibrate(params, tiny_cfg, plan, windows)
    exported = export_model(params, tiny_cfg, plan, state, max_context=64, prefill_chunk=16)
    model = load_int_model(write_exported(exported, tmp_path / "tiny", None))
    tokens = windows[:, :13]
    emu, _ = E.EmulatorEngine(model).prefill(tokens)
    jx, _ = JaxIntEngine(model).prefill(tokens)
    assert np.array_equal(emu, jx)
    with pytest.raises(QnpuError, match="no tokenizer"):
        artifact_tokenizer(model)
