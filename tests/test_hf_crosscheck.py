"""Agreement with Hugging Face transformers' PyTorch models (CI installs torch==2.13.0 CPU)."""

import json
import math
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the test extras install torch==2.13.0 (CPU) for this cross-check
import transformers

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.models.hf import save_hf_dir
from qnpu_jax.models.llama import forward, token_nll
from qnpu_jax.models.load import builtin_model_path, load_model


def _word_level_tokenizer(directory, vocab_size):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2"})
    )


def _tiny_hf_model(kind, dtype):
    torch.manual_seed(0)
    common = dict(
        vocab_size=120,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if kind in ("llama3", "llama3.2"):
        # Llama-3.2: llama3 RoPE scaling and tied embeddings
        cfg = transformers.LlamaConfig(
            **(common | {"tie_word_embeddings": kind == "llama3.2"}),
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen3":  # per-head q_norm / k_norm, head_dim not hidden/heads, tied
        cfg = transformers.Qwen3Config(
            **(common | {"tie_word_embeddings": True}), head_dim=24, rope_theta=1000000.0
        )
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, rope_theta=1000000.0)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # Qwen2 initializes biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.5)
    with torch.no_grad():
        for p in model.parameters():  # HF init is too small to exercise anything; widen it
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()


@pytest.mark.parametrize(
    ("kind", "dtype", "max_shard_size"),
    [
        ("llama3", torch.float32, "200KB"),
        ("qwen2", torch.float32, None),
        ("llama3", torch.bfloat16, None),
        ("llama3.2", torch.float32, None),
        ("qwen3", torch.float32, None),
    ],
)
def test_save_pretrained_directory_matches_transformers(tmp_path, kind, dtype, max_shard_size):
    model = _tiny_hf_model(kind, dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp_path, **kwargs)
    if max_shard_size:
        assert (tmp_path / "model.safetensors.index.json").exists()
    _word_level_tokenizer(tmp_path, 100)
    ours = load_model(str(tmp_path))
    assert ours.config.attention_bias == (kind == "qwen2")
    assert ours.config.qk_norm == (kind == "qwen3")
    assert ours.config.tie_word_embeddings == (kind in ("llama3.2", "qwen3"))
    assert ours.config.rope.rope_type == ("llama3" if kind.startswith("llama3") else "default")
    tokens = np.random.default_rng(0).integers(0, 120, size=(2, 150))  # past original_max (64)
    # Reload in float32 (not model.float()): casting to bf16 also rounds the RoPE inv_freq buffer.
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        ref = reference.eval()(torch.tensor(tokens)).logits.numpy()
    got = np.asarray(forward(ours.params, jnp.asarray(tokens, jnp.int32), cfg=ours.config))
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-4)
    assert ours.tokenizer.bos_token_id == 1 and ours.tokenizer.eos_token_id == 2


def test_tokenizer_matches_transformers_gguf_conversion(smollm):
    path = builtin_model_path("smollm2-135m")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers' GGUF converter splits digits *after* the GPT-2 regex, so a whitespace run
    # just before a digit ("1819.\n\n19th") tokenizes differently there; llama.cpp and the
    # model's own tokenizer.json (Digits, then ByteLevel) split digits first, as we do.
    # Compare on text without such runs, and pin that one case separately.
    text = "\n\n".join(load_documents("wiki", "eval"))[:30000]
    text = re.sub(r"\s{2,}(?=\d)", " ", text)
    text += " Digits 1234567 and ünïcödé 東京 😀 <|im_start|>user\nhi<|im_end|>\n"
    assert smollm.tokenizer.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
    ids = smollm.tokenizer.encode("1819.\n\n19th")
    assert smollm.tokenizer.token_to_id("ĊĊ") in ids


def test_gguf_dequantization_matches_transformers(smollm):
    """transformers' own GGUF reader (independent dequantize + q/k un-permutation)."""
    path = builtin_model_path("smollm2-135m")
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    state = ref.state_dict()
    layers = smollm.params["layers"]
    for i in (0, 17, 29):
        for ours, theirs in (
            ("q_proj", "self_attn.q_proj"),
            ("k_proj", "self_attn.k_proj"),
            ("down_proj", "mlp.down_proj"),
        ):
            np.testing.assert_array_equal(
                np.asarray(layers[ours][i]), state[f"model.layers.{i}.{theirs}.weight"].numpy()
            )
    np.testing.assert_array_equal(
        np.asarray(smollm.params["embed_tokens"]), state["model.embed_tokens.weight"].numpy()
    )


def test_real_model_logits_and_perplexity_match_transformers(smollm, tmp_path):
    """Our GGUF load -> save_hf_dir -> transformers LlamaForCausalLM, on wiki eval windows."""
    directory = save_hf_dir(tmp_path / "smollm", smollm.config, smollm.params, smollm.tokenizer)
    ref = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = tokenize_documents(load_documents("wiki", "eval"), smollm.tokenizer)
    windows = eval_windows(ids, 256, max_windows=3)
    with torch.no_grad():
        ref_logits = ref(torch.tensor(windows, dtype=torch.long)).logits.numpy()
    ours = np.asarray(forward(smollm.params, jnp.asarray(windows), cfg=smollm.config))
    assert np.abs(ours - ref_logits).max() < 1e-2
    ref_nll = torch.nn.functional.cross_entropy(
        torch.tensor(ref_logits[:, :-1]).reshape(-1, ref_logits.shape[-1]),
        torch.tensor(windows[:, 1:], dtype=torch.long).reshape(-1),
    ).item()
    our_nll = float(np.mean(token_nll(smollm.params, jnp.asarray(windows), cfg=smollm.config)))
    assert abs(math.exp(our_nll) / math.exp(ref_nll) - 1) < 0.005
