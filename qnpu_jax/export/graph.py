"""The integer graph of the artifact: its op list and fixed-point constants (pure data).

Shared by the exporter, the numpy emulator and the JAX integer forward; imports nothing
heavy, so the emulator stays free of JAX. docs/artifact.md describes every op.
"""

from __future__ import annotations

from typing import Any

import numpy as np

FORMAT_GRAPH = "qnpu-llama-int/1"
# Activations of one decoder layer with an encoding (order of `layers.act.*` columns).
LAYER_ACTS = (
    "attn_in",
    "q_out",
    "k_out",
    "v_out",
    "q_rope",
    "k_rope",
    "scores",
    "probs",
    "attn_out",
    "o_out",
    "resid_attn",
    "mlp_in",
    "gate_out",
    "silu_out",
    "up_out",
    "down_in",
    "down_out",
    "resid_mlp",
)
GLOBAL_ACTS = ("embed_out", "final_norm_out")
LAYER_INPUT = "x"  # a layer's input: embed_out for layer 0, the previous resid_mlp after
NORM_FRACTION_BITS = 8  # F: the RMSNorm root carries F fractional bits
NORM_UNIT_BITS = 16  # K: the normalized value carries K fractional bits before requantizing
ROPE_FRACTION_BITS = 14  # Q14 cos/sin
LOGITS_SCALE = 2.0**-16  # int32 logits: real logit = code · 2^-16
LOGITS_RANGE = (-(2**31), 2**31 - 1)
OPS = ("embed", "layers", "rmsnorm", "linear", "rope", "attention", "add", "lut", "mul")


def graph_ops() -> dict[str, list[dict[str, Any]]]:
    """The op list of the model and of one decoder layer ("in" names are environment values)."""

    def op(kind: str, ins: list[str], out: str, const: str, **extra: Any) -> dict[str, Any]:
        return {"op": kind, "in": ins, "out": out, "const": const, **extra}

    layer = [
        op("rmsnorm", [LAYER_INPUT], "attn_in", "layers.attn_norm"),
        op("linear", ["attn_in"], "q_out", "layers.q_proj"),
        op("linear", ["attn_in"], "k_out", "layers.k_proj"),
        op("linear", ["attn_in"], "v_out", "layers.v_proj"),
        op("rope", ["q_out"], "q_rope", "layers.q_rope"),
        op("rope", ["k_out"], "k_rope", "layers.k_rope"),
        op("attention", ["q_rope", "k_rope", "v_out"], "attn_out", "layers"),
        op("linear", ["attn_out"], "o_out", "layers.o_proj"),
        op("add", [LAYER_INPUT, "o_out"], "resid_attn", "layers.resid_attn"),
        op("rmsnorm", ["resid_attn"], "mlp_in", "layers.mlp_norm"),
        op("linear", ["mlp_in"], "gate_out", "layers.gate_proj"),
        op("linear", ["mlp_in"], "up_out", "layers.up_proj"),
        op("lut", ["gate_out"], "silu_out", "layers.silu"),
        op("mul", ["silu_out", "up_out"], "down_in", "layers.down_in"),
        op("linear", ["down_in"], "down_out", "layers.down_proj"),
        op("add", ["resid_attn", "down_out"], "resid_mlp", "layers.resid_mlp"),
    ]
    model = [
        op("embed", ["tokens"], "embed_out", "embed"),
        op("layers", ["embed_out"], "resid_mlp", "layers"),
        op("rmsnorm", ["resid_mlp"], "final_norm_out", "final_norm"),
        op("linear", ["final_norm_out"], "logits", "lm_head"),
    ]
    return {"model": model, "layer": layer}


def _layer_ops(kind: str) -> list[dict[str, Any]]:
    return [op for op in graph_ops()["layer"] if op["op"] == kind]


# Derived from the decoder layer's op list, the one description of the graph:
# each linear's (input, output) tensor, in graph order: {"q_proj": ("attn_in", "q_out"), ...}
LINEAR_IO: dict[str, tuple[str, str]] = {
    op["const"].removeprefix("layers."): (op["in"][0], op["out"]) for op in _layer_ops("linear")
}
LINEARS = tuple(LINEAR_IO)  # the decoder layer's weights
LINEAR_OUTPUTS = tuple(out for _, out in LINEAR_IO.values())
# R1 rotates the norms' outputs (q/k/v and gate/up inputs), R2 the attention output (o_proj
# input); the down_proj input, a product of two linear outputs, stays unrotated.
ROTATED_INPUTS = tuple(
    op["out"] for op in graph_ops()["layer"] if op["op"] in ("rmsnorm", "attention")
)
KV_TENSORS = tuple(_layer_ops("attention")[0]["in"][1:])  # the K and V cache
_I8_16_32 = ("int8", "int16", "int32")


def expected_tensors(model: dict[str, Any], graph: dict[str, Any]) -> dict[str, Any]:
    """name -> (shape, allowed dtypes) of every tensor an artifact of this graph must hold.

    A None dimension is free (LUT lengths follow the input's bit-width, checked when used).
    Optional tensors (q/k/v biases, the sink prefix's K/V) are listed when the config or the
    graph says they exist.
    """
    n, d, f = model["num_layers"], model["hidden_size"], model["intermediate_size"]
    hd, hq, hkv = model["head_dim"], model["num_heads"], model["num_kv_heads"]
    v = model["vocab_size"]
    q_size, kv_size = hq * hd, hkv * hd
    shapes = {
        "q_proj": (q_size, d),
        "k_proj": (kv_size, d),
        "v_proj": (kv_size, d),
        "o_proj": (d, q_size),
        "gate_proj": (f, d),
        "up_proj": (f, d),
        "down_proj": (d, f),
    }
    out: dict[str, Any] = {
        "layers.act.zero_point": ((n, len(LAYER_ACTS)), ("int32",)),
        "layers.act.qmin": ((n, len(LAYER_ACTS)), ("int32",)),
        "layers.act.qmax": ((n, len(LAYER_ACTS)), ("int32",)),
        "act.zero_point": ((len(GLOBAL_ACTS),), ("int32",)),
        "act.qmin": ((len(GLOBAL_ACTS),), ("int32",)),
        "act.qmax": ((len(GLOBAL_ACTS),), ("int32",)),
        "embed.table": ((v, d), ("int8",)),
        "embed.M": ((v,), ("int32",)),
        "embed.shift": ((v,), ("int32",)),
        "rope.cos": ((graph["max_context"], hd), ("int16",)),
        "rope.sin": ((graph["max_context"], hd), ("int16",)),
        "layers.scores.M": ((n,), ("int32",)),
        "layers.scores.shift": ((n,), ("int32",)),
        "layers.softmax.exp_lut": ((n, 1 << 16), ("uint16",)),
        "layers.pv.M": ((n,), ("int32",)),
        "layers.pv.shift": ((n,), ("int32",)),
        "layers.silu.lut": ((n, None), _I8_16_32),
        "layers.down_in.M": ((n,), ("int32",)),
        "layers.down_in.shift": ((n,), ("int32",)),
        "lm_head.weight": ((v, d), ("int8",)),
        "lm_head.M": ((v,), ("int32",)),
        "lm_head.shift": ((v,), ("int32",)),
    }
    for name, (o, i) in shapes.items():
        out[f"layers.{name}.weight"] = ((n, o, i), ("int8",))
        out[f"layers.{name}.M"] = ((n, o), ("int32",))
        out[f"layers.{name}.shift"] = ((n, o), ("int32",))
        if model.get("attention_bias") and name in ("q_proj", "k_proj", "v_proj"):
            out[f"layers.{name}.bias"] = ((n, o), ("int32",))
    for rope in ("q_rope", "k_rope"):
        out[f"layers.{rope}.M"] = ((n,), ("int32",))
        out[f"layers.{rope}.shift"] = ((n,), ("int32",))
    for norm, lead in (("layers.attn_norm", (n,)), ("layers.mlp_norm", (n,)), ("final_norm", ())):
        out[f"{norm}.sign"] = ((*lead, d), ("int8",))
        out[f"{norm}.M"] = ((*lead, d), ("int32",))
        out[f"{norm}.shift"] = ((*lead, d), ("int32",))
        out[f"{norm}.eps"] = (lead, ("int64",))
    for add in ("resid_attn", "resid_mlp"):
        for k in ("Ma", "Mb", "shift"):
            out[f"layers.{add}.{k}"] = ((n,), ("int32",))
    p = len(graph["prefix_tokens"])
    if p:
        out["layers.prefix.k"] = ((n, hkv, p, hd), _I8_16_32)
        out["layers.prefix.v"] = ((n, hkv, p, hd), _I8_16_32)
    return out


def check_room(filled: int, new: int, max_context: int) -> None:
    """Refuse `new` positions after `filled` ones past the artifact's maximum context, before
    any of them runs."""
    from qnpu_jax.errors import QnpuError

    if filled + new > max_context:
        raise QnpuError(
            f"{new} tokens after {filled} filled positions need {filled + new} positions; the "
            f"artifact's maximum context is {max_context}"
        )


def check_generation_room(
    prefix: int,
    prompt: int,
    max_new_tokens: int,
    max_context: int,
    context: str = "the artifact's maximum context",
) -> None:
    """Greedy decoding of `max_new_tokens` after a `prompt` feeds all but the last new token
    back: refuse up front what the cache cannot hold, instead of stopping short. `context`
    names the limit in the message (the float model says "the model's context")."""
    from qnpu_jax.errors import QnpuError

    if max_new_tokens < 1:
        raise QnpuError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = prefix + prompt + max_new_tokens - 1
    if need > max_context:
        room = max_context - prefix - prompt + 1
        hint = f"at most {room} new tokens fit" if room >= 1 else "the prompt alone does not fit"
        after = f" (after the {prefix}-token sink prefix)" if prefix else ""
        raise QnpuError(
            f"a {prompt}-token prompt{after} and {max_new_tokens} new tokens need {need} "
            f"positions; {context} is {max_context} ({hint})"
        )


def nll_from_logit_codes(codes: np.ndarray, tokens: np.ndarray, logits_scale: float) -> np.ndarray:
    """Next-token NLL [B, T-1] of tokens[:, 1:] from int32 logits codes [B, T, V], in float64:
    the one float step of the integer path (evaluation, not the device)."""
    logits = np.ascontiguousarray(codes[:, :-1]).astype(np.float64) * float(logits_scale)
    top = logits.max(axis=-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(axis=-1))
    target = np.take_along_axis(logits, np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
    return np.asarray(lse - target)
