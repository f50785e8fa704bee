"""ModelConfig: the LLaMA family (LLaMA 2/3.x, Qwen2/2.5, Qwen3, SmolLM2) as HF configs give it."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from qnpu_jax.errors import QnpuError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# transformers' class of each architecture (config.json "architectures")
ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding: base theta plus optional frequency scaling (HF `rope_parameters`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise QnpuError(
                f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise QnpuError(f"rope theta must be a positive number, got {self.theta}")
        if not (self.factor > 0 and math.isfinite(self.factor)):
            raise QnpuError(f"rope scaling factor must be positive, got {self.factor}")
        if self.rope_type == "llama3" and not (
            0 < self.low_freq_factor < self.high_freq_factor
            and math.isfinite(self.high_freq_factor)
            and self.original_max_position_embeddings > 0
        ):
            raise QnpuError(
                "llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor and a positive "
                "original_max_position_embeddings"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and constants of a decoder-only LLaMA-style model.

    Hashable, so it can be a static argument of `jax.jit`.
    """

    architecture: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise QnpuError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise QnpuError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise QnpuError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise QnpuError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise QnpuError(f"model config: rms_norm_eps must be positive, got {self.rms_norm_eps}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3's per-head RMSNorm of q and k before RoPE (q_norm / k_norm, gains [head_dim])."""
        return self.architecture == "qwen3"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dims(self) -> dict[str, int]:
        """The activation widths the graph description names (`ir.graph.Tensor.width`)."""
        return {
            "hidden": self.hidden_size,
            "q": self.q_size,
            "kv": self.kv_size,
            "ffn": self.intermediate_size,
        }

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Build from a Hugging Face `config.json` dict (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise QnpuError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("mlp_bias"):
            raise QnpuError("config.json: mlp_bias=true is not supported")
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise QnpuError("config.json: Qwen sliding-window attention is not supported")
        if model_type == "qwen3" and hf.get("attention_bias"):
            raise QnpuError("config.json: Qwen3 attention_bias=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise QnpuError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported")
        if model_type == "llama" and hf.get("attention_bias"):
            raise QnpuError(
                "config.json: LLaMA attention_bias=true (q/k/v/o biases) is not supported"
            )
        num_heads = _hf_int(hf, "num_attention_heads")
        hidden = _hf_int(hf, "hidden_size")
        if num_heads <= 0:
            raise QnpuError(f"config.json: num_attention_heads must be positive, got {num_heads}")
        if "head_dim" not in hf and hidden % num_heads:
            raise QnpuError(
                f"config.json: num_attention_heads {num_heads} does not divide hidden_size {hidden}"
            )
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):  # several stop tokens: the first is the tokenizer's EOS
            eos = eos[0] if eos else None
        return cls(
            architecture=model_type,
            vocab_size=_hf_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_int(hf, "intermediate_size"),
            num_layers=_hf_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_hf_int(hf, "num_key_value_heads", num_heads),
            head_dim=_hf_int(hf, "head_dim", hidden // num_heads),
            rms_norm_eps=_hf_float(hf, "rms_norm_eps", 1e-6),
            rope=_rope_from_hf(hf),
            max_position_embeddings=_hf_int(hf, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=_token_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_id=_token_id(eos, "eos_token_id"),
        )

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that transformers 4.x and 5.x both read."""
        rope_parameters: dict[str, Any] = {
            "rope_type": self.rope.rope_type,
            "rope_theta": self.rope.theta,
        }
        rope_scaling: dict[str, Any] | None = None
        if self.rope.rope_type != "default":
            rope_scaling = {"rope_type": self.rope.rope_type, "factor": self.rope.factor}
            if self.rope.rope_type == "llama3":
                rope_scaling |= {
                    "low_freq_factor": self.rope.low_freq_factor,
                    "high_freq_factor": self.rope.high_freq_factor,
                    "original_max_position_embeddings": self.rope.original_max_position_embeddings,
                }
            rope_parameters |= rope_scaling
        arch_class = ARCHITECTURE_CLASSES[self.architecture]
        out: dict[str, Any] = {
            "architectures": [arch_class],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": rope_scaling,
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        return out


def _rope_from_hf(hf: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 nests theta and scaling in `rope_parameters`;
    # 4.x uses rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = merged.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    kwargs: dict[str, Any] = {"theta": _hf_float({"rope_theta": theta}, "rope_theta")}
    kwargs["rope_type"] = rope_type
    if rope_type in ("llama3", "linear"):
        kwargs["factor"] = _hf_float(merged, "factor", 1.0)
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key in merged:
                kwargs[key] = _hf_float(merged, key)
        if "original_max_position_embeddings" in merged:
            kwargs["original_max_position_embeddings"] = _hf_int(
                merged, "original_max_position_embeddings"
            )
    return RopeConfig(**kwargs)


_REQUIRED: Any = object()


def _hf_int(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> int:
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise QnpuError(f"config.json is missing {key}")
        return int(default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise QnpuError(f"config.json: {key} must be an integer, got {value!r}")
    return value


def _hf_float(hf: Mapping[str, Any], key: str, default: Any = _REQUIRED) -> float:
    value = hf.get(key)
    if value is None:
        if default is _REQUIRED:
            raise QnpuError(f"config.json is missing {key}")
        return float(default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise QnpuError(f"config.json: {key} must be a finite number, got {value!r}")
    return float(value)


def _token_id(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise QnpuError(f"config.json: {key} must be a non-negative integer, got {value!r}")
    return value
