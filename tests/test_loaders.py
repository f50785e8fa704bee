"""Loaders on files the tests write: every bad input is a QnpuError that names the problem."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from qnpu_jax import QnpuError
from qnpu_jax.models.gguf import load_gguf, unpermute_rope_rows
from qnpu_jax.models.hf import load_hf_dir, save_hf_dir
from qnpu_jax.models.load import load_model
from qnpu_jax.models.tokenizer import Tokenizer


@pytest.fixture
def tiny_dir(tmp_path, tiny_cfg, tiny_params):
    vocab = {f"t{i}": i for i in range(tiny_cfg.vocab_size)}
    tok = Tokenizer(HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0")), 1, 2)
    return save_hf_dir(tmp_path / "tiny", tiny_cfg, tiny_params, tok)


def test_tiny_round_trip(tiny_dir, tiny_cfg, tiny_params):
    cfg, params, tok = load_hf_dir(tiny_dir)
    assert cfg == tiny_cfg
    np.testing.assert_array_equal(params["layers"]["q_proj"], tiny_params["layers"]["q_proj"])
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    # every file gets the umask's default mode (safetensors alone wrote 0600 before)
    import os

    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tiny_dir.iterdir()}
    assert set(modes.values()) == {0o666 & ~mask}, modes


def _edit_weights(directory, edit):
    path = directory / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("model.layers.1.mlp.up_proj.weight"), "missing 1 tensors"),
        (lambda s: s.update(extra=np.zeros(2, np.float32)), "unexpected tensors"),
        (
            lambda s: s.update({"model.norm.weight": np.ones(31, np.float32)}),
            r"model.norm.weight has shape \(31,\), config expects \(32,\)",
        ),
        (
            lambda s: s["model.layers.0.self_attn.v_proj.weight"].__setitem__((0, 0), np.nan),
            "layers/v_proj contains NaN",
        ),
    ],
)
def test_bad_weights(tiny_dir, edit, message):
    _edit_weights(tiny_dir, edit)
    with pytest.raises(QnpuError, match=message):
        load_hf_dir(tiny_dir)


def test_corrupt_safetensors(tiny_dir):
    path = tiny_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(QnpuError, match=r"cannot read weight file .*model.safetensors"):
        load_hf_dir(tiny_dir)


def test_missing_files(tiny_dir):
    (tiny_dir / "model.safetensors").unlink()
    with pytest.raises(QnpuError, match=r"neither model.safetensors"):
        load_hf_dir(tiny_dir)
    (tiny_dir / "tokenizer.json").unlink()
    with pytest.raises(QnpuError, match=r"no tokenizer.json"):
        load_hf_dir(tiny_dir)
    (tiny_dir / "config.json").unlink()
    with pytest.raises(QnpuError, match=r"missing .*config.json"):
        load_hf_dir(tiny_dir)


def test_unsupported_architecture_in_directory(tiny_dir):
    config = json.loads((tiny_dir / "config.json").read_text())
    (tiny_dir / "config.json").write_text(json.dumps(config | {"model_type": "gpt_neox"}))
    with pytest.raises(QnpuError, match="unsupported model_type 'gpt_neox'"):
        load_model(str(tiny_dir))


def test_shard_index_cannot_escape_directory(tiny_dir, tmp_path):
    shutil.copy(tiny_dir / "model.safetensors", tmp_path / "outside.safetensors")
    index = {"weight_map": {"model.norm.weight": "../outside.safetensors"}}
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(QnpuError, match="outside the checkpoint"):
        load_hf_dir(tiny_dir)


def test_unknown_model_spec_and_paths(tmp_path):
    with pytest.raises(QnpuError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(QnpuError, match="unknown model"):
        load_model(str(tmp_path / "missing" / "dir"))
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    with pytest.raises(QnpuError, match=r"not a .gguf model"):
        load_model(str(text))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(QnpuError, match=r"cannot read GGUF file .*bad.gguf"):
        load_gguf(bad)
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(QnpuError, match=r"bad.gguf"):
        load_model(str(bad))


def test_truncated_real_gguf(tmp_path):
    from qnpu_jax.models.load import builtin_model_path

    data = builtin_model_path("smollm2-135m").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(QnpuError, match=r"cut.gguf"):
        load_gguf(cut)


def test_unpermute_inverts_llama_cpp_permutation():
    # convert_hf_to_gguf.py's permute for q/k rows: (H, 2, hd/2, D) -> swap -> (H, hd/2, 2, D)
    heads, head_dim, d = 3, 8, 5
    w = np.arange(heads * head_dim * d, dtype=np.float32).reshape(heads * head_dim, d)
    permuted = w.reshape(heads, 2, head_dim // 2, d).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, heads), w)
    bias = np.arange(heads * head_dim, dtype=np.float32)
    permuted_bias = bias.reshape(heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted_bias, heads), bias)


def test_tied_checkpoint_with_stray_lm_head_is_accepted(tmp_path, tiny_cfg, tiny_params):
    import dataclasses

    tied_cfg = dataclasses.replace(tiny_cfg, tie_word_embeddings=True)
    tied = {k: v for k, v in tiny_params.items() if k != "lm_head"}
    vocab = {f"t{i}": i for i in range(tiny_cfg.vocab_size)}
    tok = Tokenizer(HFTokenizer(models.WordLevel(vocab=vocab, unk_token="t0")), 1, 2)
    directory = save_hf_dir(tmp_path / "tied", tied_cfg, tied, tok)
    _edit_weights(directory, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"]}))
    cfg, params, _ = load_hf_dir(directory)
    assert cfg.tie_word_embeddings and "lm_head" not in params


def test_the_config_peek_and_the_load_parse_a_gguf_once(monkeypatch, smollm):
    """`qnpu quantize` reads the model's config before the weights (`open_model`) and loads
    the model it opened: the GGUF's metadata (262k tokens for Gemma 3: 2 s) is parsed once."""
    from qnpu_jax.models import gguf
    from qnpu_jax.models.load import open_model

    opened: list[str] = []
    reader = gguf._Reader

    def counting(path, *args, **kwargs):
        opened.append(path)
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "_Reader", counting)
    source = open_model("smollm2-135m")
    assert source.kind == "gguf" and source.config == smollm.config
    loaded = load_model(source)
    assert len(opened) == 1 and loaded.config == smollm.config and loaded.source == "smollm2-135m"
    assert load_model("smollm2-135m").weights == loaded.weights and len(opened) == 2
