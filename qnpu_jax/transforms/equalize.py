"""Equivalent channel scaling of every linear pair that admits it (SmoothQuant, OmniQuant's
LET, MobileQuant §3.2 / §4.3 "weight equalization transformation on all possible layers").

For a linear input X whose producer can absorb a per-channel division and whose readers a
per-channel multiplication, s > 0 rewrites

    X' = X / s        (the producer: a norm's gain / s, or a linear's output rows / s)
    W' = W · diag(s)  (every reader's input columns · s)

and leaves the float model unchanged. The pairs of a LLaMA layer, named by the input they
divide (`EQUALIZED`):
    attn_in  input_layernorm → q/k/v_proj         mlp_in   post_attention_layernorm → gate/up
    attn_out v_proj → o_proj (per V channel; with GQA each V channel feeds its group's heads,
             so o_proj's columns of every head of the group take the same factor)
    down_in  up_proj → down_proj (silu(gate) ⊙ (up / s) = down_in / s)
With rotations, the scaling acts in the rotated basis (it is applied after R1/R2: a norm gain
on the rotated stream, V after R2), so it composes with any rotation.

s follows SmoothQuant's rule s_j = max|X_j|^α / max|W_:,j|^(1−α) (`smoothing_scales`); stage 1
may then learn log s end to end (`pipeline.stage1`). Row-vector convention as in `rotate.py`:
W is stored [out, in].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    GRAPH,
    LINEAR_BIAS,
    NORM_READERS,
    O_LINEAR,
    SMOOTHED_LINEARS,
    UNROTATED_INPUT,
    V_LINEAR,
    OpKind,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import check_llama_graph

Params = dict[str, Any]

_NORM_OUT = {op.gain: op.out_name for op in GRAPH.ops(OpKind.RMSNORM)}
ATTENTION_OUT = GRAPH.ops(OpKind.ATTENTION)[0].out_name
# input name -> (producer kind, producer param, readers)
EQUALIZED: dict[str, tuple[str, str, tuple[str, ...]]] = {
    **{_NORM_OUT[g]: ("gain", g, readers) for g, readers in NORM_READERS.items()},
    ATTENTION_OUT: ("linear", V_LINEAR, (O_LINEAR,)),
    UNROTATED_INPUT: ("linear", SMOOTHED_LINEARS[0], (SMOOTHED_LINEARS[1],)),
}


def equalization_widths(cfg: ModelConfig) -> dict[str, int]:
    """The length of each pair's scale vector: the producer's channels (V's for attn_out)."""
    check_llama_graph(cfg, "equalization")
    return {
        name: cfg.kv_size if name == ATTENTION_OUT else cfg.dims[_width_key(name)]
        for name in EQUALIZED
    }


def _width_key(name: str) -> str:
    return next(t.width for t in GRAPH.layer_acts if t.name == name)


def _reader_scale(name: str, s: jax.Array, cfg: ModelConfig) -> jax.Array:
    """s [L, C] as the readers' input columns see it ([L, q_size] for attn_out under GQA)."""
    if name != ATTENTION_OUT:
        return s
    n, group = s.shape[0], cfg.num_heads // cfg.num_kv_heads
    per_head = s.reshape(n, cfg.num_kv_heads, 1, cfg.head_dim)
    return jnp.broadcast_to(per_head, (n, cfg.num_kv_heads, group, cfg.head_dim)).reshape(n, -1)


def equalize(params: Params, cfg: ModelConfig | None, scales: Mapping[str, ArrayLike]) -> Params:
    """`params` with each pair's s [L, C] folded in (producer / s, readers · s);
    model-equivalent and differentiable in `scales`. `cfg` is needed for attn_out (heads).

    The pairs fold in `EQUALIZED`'s order whatever the mapping's order: pairs share tensors
    (up_proj is mlp_in's reader and down_in's producer), so the order moves their last bits,
    and a mapping's order does not survive a pytree (sorted keys) or a checkpoint."""
    if cfg is not None:
        check_llama_graph(cfg, "equalization")
    unknown = sorted(set(scales) - set(EQUALIZED))
    if unknown:
        raise QnpuError(f"no equalized pair divides {unknown[0]!r}; known: {sorted(EQUALIZED)}")
    out = params
    for name in EQUALIZED:
        if name in scales:
            out = fold_pair(out, name, scales[name], cfg)
    return out


def fold_pair(params: Params, name: str, scales: ArrayLike, cfg: ModelConfig | None) -> Params:
    """One pair's s [L, C] folded in; shapes are checked, and values when concrete (not
    under a trace)."""
    if name not in EQUALIZED:
        raise QnpuError(f"no equalized pair divides {name!r}; known: {sorted(EQUALIZED)}")
    if name == ATTENTION_OUT and cfg is None:
        raise QnpuError(f"equalizing {name} needs the model config (its heads)")
    kind, producer, readers = EQUALIZED[name]
    layers = dict(params["layers"])
    s = jnp.asarray(scales, jnp.float32)
    channels = layers[producer].shape[:2] if kind == "linear" else layers[producer].shape
    if s.shape != tuple(channels):
        raise QnpuError(
            f"equalization scales of {name} of shape {s.shape} do not match {producer} "
            f"{tuple(layers[producer].shape)}"
        )
    if not isinstance(s, jax.core.Tracer) and not bool(jnp.all(jnp.isfinite(s) & (s > 0))):
        raise QnpuError(f"equalization scales of {name} must be finite and positive")
    if kind == "gain":
        layers[producer] = (layers[producer] / s).astype(layers[producer].dtype)
    else:
        layers[producer] = (layers[producer] / s[:, :, None]).astype(layers[producer].dtype)
        bias = LINEAR_BIAS.get(producer)
        if bias in layers:
            layers[bias] = (layers[bias] / s).astype(layers[bias].dtype)
    cols = (_reader_scale(name, s, cfg) if cfg is not None else s)[:, None, :]
    for reader in readers:
        if layers[reader].shape[-1] != cols.shape[-1]:
            raise QnpuError(
                f"equalization scales of {name} of shape {s.shape} do not match {reader} "
                f"{tuple(layers[reader].shape)}"
            )
        layers[reader] = (layers[reader] * cols).astype(layers[reader].dtype)
    out = dict(params)
    out["layers"] = layers
    return out


def reader_absmax(params: Params, cfg: ModelConfig, name: str) -> jax.Array:
    """max |W[:, j]| [L, C] over the readers of pair `name` (all heads of a V channel's group
    for attn_out): SmoothQuant's weight range per channel."""
    _, _, readers = EQUALIZED[name]
    cols = jnp.max(jnp.stack([jnp.max(jnp.abs(params["layers"][r]), axis=1) for r in readers]), 0)
    return grouped_max(name, cols, cfg)


def grouped_max(name: str, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """A per-reader-column range [L, q_size] of attn_out as per V channel [L, kv_size] (the
    max over the heads sharing it); other pairs unchanged."""
    if name != ATTENTION_OUT:
        return x
    n, group = x.shape[0], cfg.num_heads // cfg.num_kv_heads
    return jnp.max(x.reshape(n, cfg.num_kv_heads, group, cfg.head_dim), axis=2).reshape(n, -1)


def smoothing_scales(act_absmax: ArrayLike, weight_absmax: ArrayLike, alpha: float) -> jax.Array:
    """SmoothQuant's s [L, C] = max|X_j|^α / max|W_:,j|^(1−α) from the input's per-channel
    max |x| and its readers' per-column max |w| (both [L, C], as quantized: after rotations).
    Channels that are never active or whose weights are all zero keep s = 1."""
    if not 0.0 < alpha < 1.0:
        raise QnpuError(f"smoothing alpha must be in (0, 1), got {alpha!r}")
    act = jnp.asarray(act_absmax, jnp.float32)
    w = jnp.asarray(weight_absmax, jnp.float32)
    if act.shape != w.shape:
        raise QnpuError(
            f"activation ranges of shape {act.shape} do not match the readers' input "
            f"channels {w.shape}"
        )
    if not bool(jnp.all(jnp.isfinite(act))):
        raise QnpuError("the activation ranges are not finite (NaN/inf in calibration)")
    live = (act > 0) & (w > 0)
    safe_act = jnp.where(live, act, 1.0)
    safe_w = jnp.where(live, w, 1.0)
    return jnp.where(live, safe_act**alpha / safe_w ** (1.0 - alpha), 1.0)
