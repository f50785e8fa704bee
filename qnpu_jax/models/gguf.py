"""GGUF loader (llama.cpp files): dequantize every tensor to float32 with the `gguf` package."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

from qnpu_jax.errors import QnpuError
from qnpu_jax.models.config import (
    FULL_ATTENTION,
    GEMMA3_LOCAL_THETA,
    GEMMA3_SLIDING_PATTERN,
    SLIDING_ATTENTION,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    RopeConfig,
)
from qnpu_jax.models.hf import params_from_state_dict
from qnpu_jax.models.tokenizer import Tokenizer, tokenizer_from_gguf_vocab

# GGUF tensor name (inside "blk.{i}.") -> HF name (inside "model.layers.{i}.")
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 (llama.cpp's gemma3 tensors): ffn_norm is the pre-MLP norm, and the attention and
# MLP outputs have norms of their own
_GGUF_GEMMA3_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_ARCH_LAYER_NAMES = {"gemma3": _GGUF_GEMMA3_LAYER_NAMES}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (HF rotate-half -> interleaved RoPE pairs).

    convert_hf_to_gguf.py reorders each head's rows from [first half, second half] to
    interleaved pairs; this is its inverse, for weights [out, in] and biases [out].
    """
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class _Reader(GGUFReader):
    """GGUFReader, with arrays read in one piece: the stock reader makes a numpy view per
    element (and two per string), half a minute for a 262k-token vocabulary. `contents()`
    reads the same values: a numeric array is one part, a string one memoryview slice."""

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        offs = orig_offs + 12
        itype = GGUFValueType(int(raw_itype[0]))
        count = int(alen[0])
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            return (
                12 + int(values.nbytes),
                [raw_itype, alen, values],
                [2],
                [
                    GGUFValueType.ARRAY,
                    itype,
                ],
            )
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        buf = memoryview(self.data)  # type: ignore[arg-type]  # numpy arrays are buffers
        parts: list[Any] = [raw_itype, alen]
        for _ in range(count):
            size = int.from_bytes(buf[offs : offs + 8], "little")
            parts += [buf[offs : offs + 8], buf[offs + 8 : offs + 8 + size]]
            offs += 8 + size
        return offs - orig_offs, parts, list(range(3, len(parts), 2)), [GGUFValueType.ARRAY, itype]


def _f32(value: Any) -> float:
    # GGUF stores floats as float32; print-and-parse recovers the config's decimal (1e-05).
    return float(str(np.float32(value)))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise QnpuError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def get(key: str, default: Any = None) -> Any:
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise QnpuError(f"GGUF metadata lacks {arch}.{key}")
        return value

    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    if num_heads <= 0:
        raise QnpuError(f"GGUF metadata: {arch}.attention.head_count must be positive")
    if "rope_freqs.weight" in names:
        raise QnpuError(
            "GGUF rope frequency factors (rope_freqs, LLaMA 3.1+ scaling) are not supported; "
            "load the model's Hugging Face directory instead"
        )
    gemma = _gemma3_fields(reader, arch) if arch == "gemma3" else {}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise QnpuError(f"GGUF rope scaling {scaling!r} is not supported")
    rope = RopeConfig(
        theta=_f32(get("rope.freq_base", 10000.0)),
        rope_type="linear" if scaling == "linear" else "default",
        factor=_f32(_field(reader, f"{arch}.rope.scaling.factor", 1.0)),
    )
    return ModelConfig(
        architecture=arch,
        vocab_size=int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length") or hidden // num_heads),
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope=rope,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        **gemma,
    )


def _gemma3_fields(reader: Any, arch: str) -> dict[str, Any]:
    """Gemma 3's fields as llama.cpp runs a gemma3 file: every 6th layer global (or the
    file's `attention.sliding_window_pattern`), local RoPE base 1e4 (or `rope.freq_base_swa`),
    scores · head_dim^-0.5, tanh-GELU."""
    layers = int(_field(reader, f"{arch}.block_count", 0))
    if layers == 62:  # llama.cpp scales the 27B's scores by (hidden / heads)^-0.5
        raise QnpuError("GGUF gemma3 with 62 layers (27B) is not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if _field(reader, f"{arch}.{key}") is not None:
            raise QnpuError(f"GGUF {arch}.{key} is set: softcapping is not supported")
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window is None:
        raise QnpuError(f"GGUF metadata lacks {arch}.attention.sliding_window")
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):  # per layer: true = sliding
        types = [SLIDING_ATTENTION if p else FULL_ATTENTION for p in pattern]
    else:
        types = [
            SLIDING_ATTENTION if (i + 1) % int(pattern) else FULL_ATTENTION for i in range(layers)
        ]
    key_length = int(_field(reader, f"{arch}.attention.key_length", 0))
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "sliding_window": int(window),
        "layer_types": tuple(types),
        "rope_local_theta": _f32(_field(reader, f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_THETA)),
        "query_pre_attn_scalar": float(key_length) if key_length else None,
    }


def _open_reader(path: Path) -> Any:
    """The file's reader (metadata parsed, tensors memory-mapped, nothing dequantized)."""
    if not path.is_file():
        raise QnpuError(f"GGUF file {path} does not exist")
    size = path.stat().st_size
    try:
        reader = _Reader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:
        # The reader maps tensors at the offsets the header promises: a short file fails here
        # with numpy's reshape/view messages, which say nothing of the cause.
        raise QnpuError(
            f"cannot read GGUF file {path}: truncated or corrupt ({size} bytes; reader: {e})"
        ) from e
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise QnpuError(f"GGUF file {path} is truncated: {size} bytes, its tensors end at {end}")
    return reader


@dataclasses.dataclass(frozen=True)
class GgufFile:
    """A GGUF file opened once: its metadata parsed and its config read; its tensors memory-
    mapped, nothing dequantized (`load_gguf` takes it, so the metadata is parsed once)."""

    path: Path
    reader: Any
    config: ModelConfig


def open_gguf(path: Path) -> GgufFile:
    """The file's reader and config (the metadata alone: no weight is read)."""
    reader = _open_reader(Path(path))
    return GgufFile(Path(path), reader, gguf_model_config(reader))


def load_gguf(source: Path | GgufFile) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """Load a LLaMA/Qwen2/Qwen3/Gemma 3 GGUF file (a path, or the file `open_gguf` opened) as
    float32 params (quantized blocks dequantized)."""

    opened = source if isinstance(source, GgufFile) else open_gguf(Path(source))
    path, reader, cfg = opened.path, opened.reader, opened.config
    # The tokenizer first: a file we cannot use fails before the slow dequantization.
    tokenizer = tokenizer_from_gguf_vocab(
        architecture=cfg.architecture,
        model=_field(reader, "tokenizer.ggml.model", ""),
        pre=_field(reader, "tokenizer.ggml.pre", "default"),
        tokens=_field(reader, "tokenizer.ggml.tokens", []),
        merges=_field(reader, "tokenizer.ggml.merges", []),
        token_types=_field(reader, "tokenizer.ggml.token_type", []),
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    )
    state: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        hf_name = _hf_name(t.name, cfg.architecture)
        try:
            # a corrupt block scale (NaN, Inf) makes NaN here, which the checkpoint's finiteness
            # check names; numpy's RuntimeWarning would print before that one error line
            with np.errstate(all="ignore"):
                w = dequantize(t.data, t.tensor_type).astype(np.float32)
        except (NotImplementedError, ValueError) as e:
            raise QnpuError(
                f"{path}: cannot dequantize {t.name} ({t.tensor_type.name}): {e}"
            ) from e
        # GGUF lists dims fastest-first; numpy wants them slowest-first.
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        # llama.cpp permutes q/k rows for LLaMA only (Qwen2 keeps HF's layout).
        if cfg.architecture == "llama":
            if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_rope_rows(w, cfg.num_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rope_rows(w, cfg.num_kv_heads)
        state[hf_name] = w
    # Gemma's norms are stored as gains (llama.cpp's converter adds 1 to HF's weights)
    return cfg, params_from_state_dict(state, cfg, gains=True), tokenizer


def _hf_name(gguf_name: str, architecture: str = "llama") -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    names = _GGUF_ARCH_LAYER_NAMES.get(architecture, _GGUF_LAYER_NAMES)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    # Unknown names pass through, so params_from_state_dict reports them as unexpected.
    return gguf_name
