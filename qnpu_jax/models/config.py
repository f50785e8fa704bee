"""ModelConfig: the LLaMA family (LLaMA 2/3.x, Qwen2/2.5, Qwen3, SmolLM2) and Gemma 3 (text)
as HF configs give it."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    FULL_ATTENTION,
    QK_NORM_ARCHITECTURES,
    SLIDING_ATTENTION,
    sliding_layers,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# transformers' class of each architecture (config.json "architectures")
ARCHITECTURE_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# config.json "model_type" -> architecture, where they differ (Gemma 3's text-only model;
# its "gemma3" model_type is the multimodal model, refused)
HF_MODEL_TYPES = {"gemma3_text": "gemma3"}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# Gemma 3's defaults (transformers' Gemma3TextConfig, llama.cpp's hparams): every 6th layer is
# global, the sliding layers' RoPE base
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_THETA = 10000.0
GEMMA3_GLOBAL_THETA = 1_000_000.0


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
    # Gemma 3 (the defaults are the LLaMA family's; `to_json` omits fields at their default)
    hidden_act: str = "silu"  # the MLP's gate activation
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    layer_types: tuple[str, ...] = ()  # per layer FULL_ATTENTION / SLIDING_ATTENTION; () all full
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (default rope type)
    query_pre_attn_scalar: float | None = None  # scores · scalar^-0.5; None: head_dim

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
        self._check_gemma_fields()

    def _check_gemma_fields(self) -> None:
        gemma = self.architecture == "gemma3"
        want_act = "gelu_pytorch_tanh" if gemma else "silu"
        if self.hidden_act != want_act:
            raise QnpuError(
                f"model config: {self.architecture} needs hidden_act {want_act!r}, "
                f"got {self.hidden_act!r}"
            )
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if not gemma and (
            self.sliding_window is not None
            or self.layer_types
            or self.rope_local_theta is not None
            or self.query_pre_attn_scalar is not None
        ):
            raise QnpuError(
                "model config: sliding_window, layer_types, rope_local_theta and "
                f"query_pre_attn_scalar are Gemma 3's; {self.architecture} has none"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise QnpuError(
                f"model config: layer_types has {len(self.layer_types)} entries for "
                f"{self.num_layers} layers"
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise QnpuError(f"model config: unknown layer types {bad}; known: {LAYER_TYPES}")
        window = self.sliding_window
        if window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window <= 0
        ):
            raise QnpuError(
                f"model config: sliding_window must be a positive integer, got {window!r}"
            )
        if SLIDING_ATTENTION in self.layer_types and window is None:
            raise QnpuError("model config: sliding_attention layers need a sliding_window")
        for name in ("rope_local_theta", "query_pre_attn_scalar"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise QnpuError(f"model config: {name} must be a positive number, got {value}")

    @property
    def norm_unit_offset(self) -> bool:
        """Gemma: a checkpoint (HF) stores each RMSNorm gain as w, the gain is 1 + w. Our params
        hold the gain itself (GGUF does too)."""
        return self.architecture == "gemma3"

    @property
    def post_norms(self) -> bool:
        """Gemma: RMSNorms of the attention and MLP outputs before they join the residual."""
        return self.architecture == "gemma3"

    @property
    def embed_scale(self) -> float:
        """Gemma scales the embedding rows by √hidden, rounded to float32 (tied lm_head is not)."""
        if self.architecture != "gemma3":
            return 1.0
        return float(np.float32(math.sqrt(self.hidden_size)))

    @property
    def attn_scale(self) -> float:
        """The attention scores' scale: query_pre_attn_scalar^-0.5, else head_dim^-0.5."""
        scalar = self.query_pre_attn_scalar
        return (scalar if scalar is not None else self.head_dim) ** -0.5

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Whether each layer attends in a sliding window (`sliding_window` keys)."""
        return sliding_layers({"layer_types": self.layer_types, "num_layers": self.num_layers})

    @property
    def local_rope(self) -> RopeConfig:
        """The sliding layers' rotary embedding (default type, `rope_local_theta`)."""
        if self.rope_local_theta is None:
            return self.rope
        return RopeConfig(theta=self.rope_local_theta)

    def to_json(self) -> dict[str, Any]:
        """The config as JSON (its persisted identity: saved runs, manifests): the fields, less
        the Gemma fields at their default, so a LLaMA-family config reads as before they were."""
        out = json.loads(json.dumps(dataclasses.asdict(self)))
        for f in dataclasses.fields(self):
            if f.name in _GEMMA_FIELDS and getattr(self, f.name) == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Inverse of `to_json` (and of `dataclasses.asdict` of configs before Gemma)."""
        data = dict(data)
        if "layer_types" in data:
            data["layer_types"] = tuple(data["layer_types"])
        return cls(**{**data, "rope": RopeConfig(**data["rope"])})

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (q_norm / k_norm, gains [head_dim]): Qwen3,
        Gemma 3."""
        return self.architecture in QK_NORM_ARCHITECTURES

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
        # the model_types we read: each architecture's own name, or its HF_MODEL_TYPES alias
        known = [a for a in SUPPORTED_ARCHITECTURES if a not in HF_MODEL_TYPES.values()]
        known += list(HF_MODEL_TYPES)
        if model_type == "gemma3" or "text_config" in hf:
            raise QnpuError(
                f"config.json: model_type {model_type!r} is a multimodal model (text_config); "
                "only Gemma 3's text-only model (model_type gemma3_text: gemma-3-270m, 1b) is "
                "supported"
            )
        architecture = HF_MODEL_TYPES.get(str(model_type), model_type)
        if model_type not in known or architecture not in SUPPORTED_ARCHITECTURES:
            raise QnpuError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {', '.join(known)}"
            )
        if hf.get("mlp_bias"):
            raise QnpuError("config.json: mlp_bias=true is not supported")
        if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
            raise QnpuError("config.json: Qwen sliding-window attention is not supported")
        if model_type == "qwen3" and hf.get("attention_bias"):
            raise QnpuError("config.json: Qwen3 attention_bias=true is not supported")
        if architecture == "gemma3":
            gemma = _gemma3_from_hf(hf)
        else:
            gemma = {}
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
            architecture=architecture,
            vocab_size=_hf_int(hf, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_hf_int(hf, "intermediate_size"),
            num_layers=_hf_int(hf, "num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=_hf_int(hf, "num_key_value_heads", num_heads),
            head_dim=_hf_int(hf, "head_dim", hidden // num_heads),
            rms_norm_eps=_hf_float(hf, "rms_norm_eps", 1e-6),
            rope=_rope_from_hf(hf) if architecture != "gemma3" else gemma.pop("rope"),
            max_position_embeddings=_hf_int(hf, "max_position_embeddings", 2048),
            # Gemma ties by default (Gemma3TextConfig); the LLaMA family does not
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", architecture == "gemma3")),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=_token_id(hf.get("bos_token_id"), "bos_token_id"),
            eos_token_id=_token_id(eos, "eos_token_id"),
            **gemma,
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
        if self.architecture == "gemma3":
            out = self._gemma3_to_hf(out, rope_parameters, rope_scaling)
        return out

    def _gemma3_to_hf(
        self,
        out: dict[str, Any],
        full_rope: dict[str, Any],
        rope_scaling: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """Gemma3TextConfig's keys: model_type gemma3_text, hidden_activation, both RoPE
        layouts (5.x per layer type, 4.x flat: rope_scaling applies to full attention)."""
        for key in ("hidden_act", "mlp_bias"):
            del out[key]
        local = self.local_rope.theta
        scalar = self.query_pre_attn_scalar or float(self.head_dim)
        return out | {
            "model_type": next(t for t, a in HF_MODEL_TYPES.items() if a == self.architecture),
            "hidden_activation": self.hidden_act,
            # an int in transformers' config class
            "query_pre_attn_scalar": int(scalar) if scalar.is_integer() else scalar,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types) or [FULL_ATTENTION] * self.num_layers,
            "rope_local_base_freq": local,
            "rope_parameters": {
                FULL_ATTENTION: full_rope,
                SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": local},
            },
            "rope_scaling": rope_scaling,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "use_bidirectional_attention": False,
        }


def _gemma3_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The Gemma 3 fields of a `gemma3_text` config.json (Gemma3TextConfig's defaults), and
    its global RoPE under "rope"; what our forward does not compute is refused."""
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise QnpuError(f"config.json: Gemma 3 hidden_activation {act!r} is not supported")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise QnpuError(f"config.json: Gemma 3 {key}={hf[key]!r} is not supported (null only)")
    if hf.get("use_bidirectional_attention"):
        raise QnpuError("config.json: Gemma 3 use_bidirectional_attention=true is not supported")
    if hf.get("attention_bias"):
        raise QnpuError("config.json: Gemma 3 attention_bias=true is not supported")
    layers = _hf_int(hf, "num_hidden_layers")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
        pattern = GEMMA3_SLIDING_PATTERN if pattern is None else pattern
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise QnpuError(
                f"config.json: sliding_window_pattern must be positive, got {pattern!r}"
            )
        layer_types = [
            SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(layers)
        ]
    if not isinstance(layer_types, list | tuple) or not all(
        isinstance(t, str) for t in layer_types
    ):
        raise QnpuError(f"config.json: layer_types must be a list of strings, got {layer_types!r}")
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and (FULL_ATTENTION in params or SLIDING_ATTENTION in params):
        full = dict(params.get(FULL_ATTENTION) or {})
        local = dict(params.get(SLIDING_ATTENTION) or {})
    else:  # 4.x: flat rope_theta / rope_scaling (full attention only), rope_local_base_freq
        full = {**dict(hf.get("rope_scaling") or {}), **dict(params or {})}
        local = {}
    full.setdefault("rope_theta", hf.get("rope_theta", GEMMA3_GLOBAL_THETA))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", GEMMA3_LOCAL_THETA))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise QnpuError("config.json: Gemma 3 scaled RoPE on sliding layers is not supported")
    return {
        "hidden_act": act,
        "sliding_window": hf.get("sliding_window", 4096),
        "layer_types": tuple(layer_types),
        "rope_local_theta": _hf_float(local, "rope_theta"),
        "query_pre_attn_scalar": _hf_float(hf, "query_pre_attn_scalar", 256),
        "rope": _rope_from_hf({"rope_parameters": full}),
    }


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


# the fields Gemma 3 added: omitted from `to_json` at their defaults
_GEMMA_FIELDS = (
    "hidden_act",
    "sliding_window",
    "layer_types",
    "rope_local_theta",
    "query_pre_attn_scalar",
)

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
