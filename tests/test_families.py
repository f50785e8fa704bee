"""The families users deploy through the whole path: Qwen3 (per-head q_norm / k_norm before
RoPE), Qwen2.5 (q/k/v biases) and Llama-3.2 (llama3 RoPE scaling), tied embeddings. Each is
SmolLM2's first two layers (its tokenizer reads the wiki text) given that family's parts, run
through `qnpu quantize`, exported, and run by both integer engines bit for bit and by
onnxruntime; and Qwen3's norms survive fusion and rotation."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from qnpu_jax.cli import main
from qnpu_jax.export.int_model import load_int_model
from qnpu_jax.models.config import ModelConfig, RopeConfig
from qnpu_jax.models.hf import save_hf_dir
from qnpu_jax.models.llama import forward, init_random_params
from qnpu_jax.models.load import load_model
from qnpu_jax.runtime import emulator as E
from qnpu_jax.runtime import jax_engine as F
from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations

# family -> the method its quick run uses (stage 1 on the one with new arithmetic)
FAMILIES = {"qwen3": "quantnpu", "qwen2.5": "quarot", "llama3.2": "quarot"}


def _family_model(smollm, family):
    cfg = dataclasses.replace(smollm.config, num_layers=2)
    layers = {k: v[:2] for k, v in smollm.params["layers"].items()}
    k1, k2, k3 = jax.random.split(jax.random.key(7), 3)
    if family == "qwen3":  # trained q/k norm gains are far from one, of both magnitudes
        cfg = dataclasses.replace(cfg, architecture="qwen3")
        layers["q_norm"] = jnp.exp(0.8 * jax.random.normal(k1, (2, cfg.head_dim)))
        layers["k_norm"] = jnp.exp(0.8 * jax.random.normal(k2, (2, cfg.head_dim)))
    elif family == "qwen2.5":
        cfg = dataclasses.replace(cfg, architecture="qwen2", attention_bias=True)
        for key, name, width in zip(
            (k1, k2, k3),
            ("q_bias", "k_bias", "v_bias"),
            (cfg.q_size, cfg.kv_size, cfg.kv_size),
            strict=True,
        ):
            layers[name] = 0.5 * jax.random.normal(key, (2, width))
    else:  # Llama-3.2's RoPE: llama3 frequency scaling
        rope = RopeConfig(
            theta=500000.0, rope_type="llama3", factor=32.0, original_max_position_embeddings=16
        )
        cfg = dataclasses.replace(cfg, rope=rope)
    return cfg, dict(smollm.params, layers=layers)  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, smollm, tmp_path_factory):
    cfg, params = _family_model(smollm, request.param)
    out = tmp_path_factory.mktemp(request.param) / f"{request.param}-2l"
    return request.param, save_hf_dir(out, cfg, params, smollm.tokenizer)


def test_qk_norm_changes_the_forward_and_survives_fusion_and_rotation():
    cfg = ModelConfig(
        architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    assert cfg.qk_norm and cfg.to_hf()["architectures"] == ["Qwen3ForCausalLM"]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    params = init_random_params(cfg, jax.random.key(0), scale=0.2)
    assert params["layers"]["q_norm"].shape == (2, 16)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)
    ref = forward(params, tokens, cfg=cfg)
    plain = dict(params)
    plain["layers"] = {k: v for k, v in params["layers"].items() if k not in ("q_norm", "k_norm")}
    llama = dataclasses.replace(cfg, architecture="llama")
    assert float(jnp.max(jnp.abs(forward(plain, tokens, cfg=llama) - ref))) > 1e-2
    fused = fuse_norms(params, cfg)
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(3))
    rotated = apply_rotations(fused, cfg, r1, r2)
    for p in (fused, rotated):
        np.testing.assert_allclose(forward(p, tokens, cfg=cfg), ref, atol=2e-4)


def test_quick_run_exports_and_both_engines_agree_bit_for_bit(family_dir, tmp_path, smollm):
    family, directory = family_dir
    loaded = load_model(str(directory))
    assert loaded.config.qk_norm == (family == "qwen3") and loaded.config.tie_word_embeddings
    assert loaded.config.attention_bias == (family == "qwen2.5")
    assert (loaded.config.rope.rope_type == "llama3") == (family == "llama3.2")
    config = {
        "model": str(directory), "method": FAMILIES[family], "w_bits": 4, "a_bits": 8,
        "seq_len": 32, "calib_windows": 2, "eval_windows": 2,
        "stage1": {"steps": 2, "batch_size": 1, "checkpoint_every": 1},
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    run = tmp_path / "run"
    assert main(["quantize", "--config", str(tmp_path / "c.yaml"), "--out", str(run)]) == 0
    fake = json.loads((run / "report.json").read_text())["perplexity"]["wiki"]["quantized_ppl"]
    art = tmp_path / "artifact"
    export = ["export", "--run", str(run), "--out", str(art), "--max-context", "64"]
    assert main([*export, "--prefill-chunk", "16"]) == 0
    model = load_int_model(art)
    if family == "qwen3":
        assert model.tensors["layers.q_rope.norm.M"].shape == (2, 64)
        assert model.tensors["layers.k_rope.norm.eps"].shape == (2,)
    assert ("layers.k_proj.bias" in model.tensors) == (family == "qwen2.5")
    # the same tokens through both engines: logits and K/V caches bit for bit
    text = "The quick brown fox jumps over the lazy dog, and then it runs into the forest."
    ids = np.asarray([smollm.tokenizer.encode(text + " " + text)])
    assert ids.shape[1] >= 24
    emu = E.EmulatorEngine(model)
    jx = F.JaxIntEngine(model)
    logits_e, cache_e = emu.run_chunk(ids, emu.new_cache(1))
    logits_j, cache_j = jx.run_chunk(ids, jx.new_cache(1))
    np.testing.assert_array_equal(np.asarray(logits_e), np.asarray(logits_j))
    n = cache_e.length
    for a, b in ((cache_e.k, cache_j.k), (cache_e.v, cache_j.v)):
        np.testing.assert_array_equal(np.asarray(a)[:, :, :, :n], np.asarray(b)[:, :, :, :n])
    ppl = {}
    for engine in ("emulator", "jax"):
        ev = ["eval", "--artifact", str(art), "--engine", engine, "--data", "wiki"]
        ev += ["--seq-len", "32", "--max-windows", "2", "--no-progress"]
        assert main([*ev, "--json", str(tmp_path / f"{engine}.json")]) == 0
        ppl[engine] = json.loads((tmp_path / f"{engine}.json").read_text())["ppl"]
    assert ppl["emulator"] == ppl["jax"]
    # the integer model tracks the fake-quant one (integer ops and Qwen3's 16-bit head-norm
    # intermediate round differently). Two of 30 layers make no language model (ppl in the
    # millions): compare mean NLL per token (measured: 0.004 to 0.024 nats)
    assert abs(np.log(ppl["emulator"] / fake)) < 0.05, (ppl, fake)
    # the ONNX hand-off: the float graph is our float forward, the QDQ graph the fake-quant one
    from qnpu_jax.models.taps import tapped_forward
    from qnpu_jax.pipeline.run import load_run
    from qnpu_jax.runtime.onnx_run import OnnxModel

    onnx_dir = tmp_path / "onnx"
    export = ["export", "--run", str(run), "--format", "onnx", "--out", str(onnx_dir)]
    assert main([*export, "--prefill-chunk", "16", "--max-context", "64"]) == 0
    quantized = load_run(run).model
    window = np.asarray(ids[0, :24])
    ref, _ = tapped_forward(
        quantized.params(), None, jnp.asarray(window[None]), cfg=quantized.cfg, taps=None,
        prefix=quantized.prefix,
    )  # fmt: skip
    got = OnnxModel(onnx_dir).logits(window, prefill=20)
    ref = np.asarray(ref[0])
    assert np.max(np.abs(got - ref)) / np.max(np.abs(ref)) <= 1e-4
    ev = ["eval", "--data", "wiki", "--seq-len", "32", "--max-windows", "2", "--no-progress"]
    assert main([*ev, "--onnx", str(onnx_dir), "--qdq", "--json", str(tmp_path / "q.json")]) == 0
    qdq = json.loads((tmp_path / "q.json").read_text())["ppl"]
    assert abs(np.log(qdq / fake)) < 0.05, (qdq, fake)
    # AIMET's QuantSim takes the encodings: each entry on a quantizer of its own, nothing else
    # quantized (Qwen3's head-norm intermediate included: it has no encoding)
    from qnpu_jax.runtime.onnx_run import aimet_quantsim

    _, loaded_sim = aimet_quantsim(onnx_dir)
    enc = json.loads((onnx_dir / "model.encodings").read_text())
    assert loaded_sim["quantizers"] == len(enc["activation_encodings"]) + len(
        enc["param_encodings"]
    )
