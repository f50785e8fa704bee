import dataclasses

import pytest

from qnpu_jax import QnpuError
from qnpu_jax.models import ModelConfig, RopeConfig

LLAMA32_1B = {  # the fields of meta-llama/Llama-3.2-1B's config.json that matter
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

QWEN25_05B = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "eos_token_id": 151643,
}


def test_llama3_config_with_rope_scaling():
    cfg = ModelConfig.from_hf(LLAMA32_1B)
    assert cfg.rope.rope_type == "llama3"
    assert cfg.rope.factor == 32.0 and cfg.rope.theta == 500000.0
    assert cfg.num_kv_heads == 8 and cfg.head_dim == 64 and cfg.tie_word_embeddings
    assert not cfg.attention_bias


def test_qwen2_has_qkv_bias_and_derived_head_dim():
    cfg = ModelConfig.from_hf(QWEN25_05B)
    assert cfg.attention_bias
    assert cfg.head_dim == 64  # 896 / 14


def test_transformers5_rope_parameters_layout():
    hf = dict(LLAMA32_1B)
    rope = {**hf.pop("rope_scaling"), "rope_theta": hf.pop("rope_theta")}
    hf["rope_parameters"] = rope
    assert ModelConfig.from_hf(hf) == ModelConfig.from_hf(LLAMA32_1B)


@pytest.mark.parametrize("hf", [LLAMA32_1B, QWEN25_05B])
def test_to_hf_round_trip(hf):
    cfg = ModelConfig.from_hf(hf)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 7}, "multiple of num_kv_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"num_hidden_layers": 0}, "num_layers must be a positive integer"),
        ({"num_attention_heads": 0}, "num_attention_heads must be positive"),
        ({"num_key_value_heads": 0}, "num_kv_heads must be a positive integer"),
        ({"vocab_size": None}, "missing vocab_size"),
        ({"vocab_size": "many"}, "vocab_size must be an integer, got 'many'"),
        ({"hidden_size": 2048.5}, "hidden_size must be an integer"),
        ({"tie_word_embeddings": True, "bos_token_id": [1, 2]}, "bos_token_id must be"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number"),
        ({"rope_scaling": LLAMA32_1B["rope_scaling"] | {"factor": float("nan")}}, "factor"),
        ({"rope_scaling": LLAMA32_1B["rope_scaling"] | {"low_freq_factor": 0.0}}, "llama3 rope"),
        ({"attention_bias": True}, "LLaMA attention_bias=true"),
    ],
)
def test_bad_configs_are_clear_errors(change, message):
    with pytest.raises(QnpuError, match=message):
        ModelConfig.from_hf(LLAMA32_1B | change)


def test_missing_keys_are_named():
    hf = {k: v for k, v in LLAMA32_1B.items() if k != "hidden_size"}
    with pytest.raises(QnpuError, match="missing hidden_size"):
        ModelConfig.from_hf(hf)


def test_config_is_frozen_and_hashable():
    cfg = ModelConfig.from_hf(LLAMA32_1B)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]
    assert hash(cfg) == hash(ModelConfig.from_hf(LLAMA32_1B))
    with pytest.raises(QnpuError, match="theta"):
        RopeConfig(theta=-1.0)
