"""GGUF files the tests write with gguf.GGUFWriter (F32, so the round trip must be exact)."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGUFWriter
from tokenizers import pre_tokenizers

from qnpu_jax import QnpuError
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.hf import HF_LAYER_NAMES
from qnpu_jax.models.llama import forward, init_random_params, layer_param_shapes
from qnpu_jax.models.load import load_model

_GGUF_NAMES = {
    "input_layernorm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "post_attention_layernorm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py (LlamaModel): HF rotate-half rows -> interleaved pairs
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, cfg: ModelConfig, params, extra_tensors=(), raw_norm=None):
    arch = cfg.architecture
    writer = GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": cfg.num_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_heads,
        "attention.head_count_kv": cfg.num_kv_heads,
        "vocab_size": cfg.vocab_size,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", cfg.rope.theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    tokens = ["<s>", "</s>", *sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt"]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3, 3] + [1] * (len(tokens) - 2))
    writer.add_array("tokenizer.ggml.merges", ["Ġ t"])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 0)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 1)
    writer.add_tensor("token_embd.weight", np.asarray(params["embed_tokens"]))
    if raw_norm is None:
        writer.add_tensor("output_norm.weight", np.asarray(params["norm"]))
    else:  # (bytes as uint8, GGMLQuantizationType)
        writer.add_tensor("output_norm.weight", raw_norm[0], raw_dtype=raw_norm[1])
    if "lm_head" in params:
        writer.add_tensor("output.weight", np.asarray(params["lm_head"]))
    for key in layer_param_shapes(cfg):
        for i in range(cfg.num_layers):
            w = np.asarray(params["layers"][key][i])
            if arch == "llama" and key in ("q_proj", "q_bias", "k_proj", "k_bias"):
                w = _llama_cpp_permute(w, cfg.num_heads if key[0] == "q" else cfg.num_kv_heads)
            writer.add_tensor(f"blk.{i}.{_GGUF_NAMES[key]}", np.ascontiguousarray(w))
    for name, value in extra_tensors:
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_written_gguf_loads_back_exactly(tmp_path, arch):
    assert set(_GGUF_NAMES) == set(HF_LAYER_NAMES)
    cfg = ModelConfig(
        architecture=arch,
        vocab_size=259,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=arch == "qwen2",
        attention_bias=arch == "qwen2",
        bos_token_id=0,
        eos_token_id=1,
    )
    params = init_random_params(cfg, jax.random.key(4))
    loaded = load_model(str(_write_gguf(tmp_path / f"{arch}.gguf", cfg, params)))
    assert loaded.config == dataclasses.replace(cfg, rope=loaded.config.rope)
    assert loaded.config.rope.theta == cfg.rope.theta
    for key in layer_param_shapes(cfg):
        np.testing.assert_array_equal(loaded.params["layers"][key], params["layers"][key])
    tokens = jnp.asarray([loaded.tokenizer.encode("a tiny test")])
    np.testing.assert_array_equal(
        forward(loaded.params, tokens, cfg=cfg), forward(params, tokens, cfg=cfg)
    )
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("a tiny test")) == "a tiny test"


def test_rope_frequency_tensor_is_refused_clearly(tmp_path, tiny_cfg, tiny_params):
    cfg = dataclasses.replace(tiny_cfg, vocab_size=259)
    params = init_random_params(cfg, jax.random.key(5))
    extra = [("rope_freqs.weight", np.ones(cfg.head_dim // 2, np.float32))]
    path = _write_gguf(tmp_path / "llama31.gguf", cfg, params, extra)
    with pytest.raises(QnpuError, match="rope frequency factors"):
        load_model(str(path))


def test_a_corrupt_block_scale_is_one_error_line_and_no_numpy_warning(tmp_path, capsys):
    """A Q4_1 block whose float16 scale is Inf dequantizes to NaN: the CLI prints its one
    `qnpu: error:` line naming the tensor, not numpy's RuntimeWarning first (issue 55)."""
    from gguf import GGMLQuantizationType

    from qnpu_jax.cli import main

    cfg = ModelConfig(
        vocab_size=259, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
        num_kv_heads=2, head_dim=8, max_position_embeddings=128, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    params = init_random_params(cfg, jax.random.key(6))
    block = np.zeros(20, np.uint8)  # Q4_1: float16 d, float16 m, 16 bytes of 4-bit codes
    block[:2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # d = Inf: Inf * 0 = NaN
    path = _write_gguf(
        tmp_path / "bad.gguf", cfg, params, raw_norm=(block, GGMLQuantizationType.Q4_1)
    )
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:  # pytest would hide them from stderr
        warnings.simplefilter("always")
        code = main(["eval", "--model", str(path), "--data", "wiki", "--seq-len", "8"])
    err = capsys.readouterr().err
    assert code == 2 and not [str(w.message) for w in caught]
    assert err.splitlines() == ["qnpu: error: checkpoint tensor norm contains NaN or Inf"], err
