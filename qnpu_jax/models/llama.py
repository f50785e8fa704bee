"""Pure-JAX float forward of LLaMA-family decoders (GQA, RoPE, SwiGLU, RMSNorm) and Gemma 3.

Params pytree (float32, weights stored [out, in] as in Hugging Face checkpoints; decoder layers
stacked along a leading axis so the depth is one `jax.lax.scan`):

    embed_tokens [V, D]
    layers/ input_layernorm [L, D]      q_proj [L, Hq*hd, D]   k_proj, v_proj [L, Hkv*hd, D]
            q_bias, k_bias, v_bias      (only when config.attention_bias) [L, out]
            q_norm, k_norm [L, hd]      (only when config.qk_norm: Qwen3)
            o_proj [L, D, Hq*hd]        post_attention_layernorm [L, D]
            gate_proj, up_proj [L, F, D]   down_proj [L, D, F]
    norm [D]
    lm_head [V, D]                      (only when embeddings are not tied)

Gemma 3 (`GEMMA3_GRAPH`): q_norm/k_norm, post_attention_layernorm (the attention output's
norm), pre_feedforward_layernorm (the MLP input's), post_feedforward_layernorm (the MLP
output's); every gain is the gain itself (HF's 1 + w). Its sliding-window layers use the
window and the local RoPE base, passed through the scan per layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    ARCHITECTURE_GRAPHS,
    EMBED_TABLE,
    FINAL_NORM,
    GRAPH,
    HEAD_NORMS,
    LM_HEAD,
    MODEL_ONLY_KINDS,
    PROBS,
    ROPE_FRACTION_BITS,
    ROTATION_GRAPHS,
    ROTATION_WEIGHTS,
    SCORES,
    Graph,
    Op,
    OpKind,
    check_generation_room,
    check_handlers,
    layer_widths,
)
from qnpu_jax.models.config import ModelConfig, RopeConfig

Params = dict[str, Any]
KVCache = dict[str, jax.Array]  # {"k": [L, B, Hkv, S, hd], "v": same}
# a full-attention layer's window: no key is that far behind a query
_NO_WINDOW = np.iinfo(np.int32).max


def graph_of(cfg: ModelConfig, params: Params | None = None) -> Graph:
    """The layer graph of `cfg`'s architecture: GRAPH, or Gemma 3's; with `params`, the one
    they are the weights of (Gemma 3 with a linear after each pre-norm once
    `transforms.add_rotation_linears` gave them those weights)."""
    added = ROTATION_WEIGHTS.get(cfg.architecture)
    if params is not None and added and set(added) <= params.get("layers", {}).keys():
        return ROTATION_GRAPHS[cfg.architecture]
    return ARCHITECTURE_GRAPHS.get(cfg.architecture, GRAPH)


def rotated_graph(cfg: ModelConfig) -> Graph:
    """The graph of `cfg`'s model once R1 rotates it: `graph_of(cfg)` (R1 on the residual
    stream), or with a linear after each pre-norm that holds R1 online (Gemma 3, whose
    post-norms join the residual: `transforms.add_rotation_linears`)."""
    return ROTATION_GRAPHS.get(cfg.architecture, graph_of(cfg))


def graphs_of(cfg: ModelConfig) -> tuple[Graph, ...]:
    """Every graph a model of `cfg` may have (`graph_of` with any params)."""
    return tuple(dict.fromkeys((graph_of(cfg), rotated_graph(cfg))))


def check_llama_graph(cfg: ModelConfig, what: str) -> None:
    """Refuse a path that reads GRAPH's LLaMA semantics (smoothing, equalization, stage 1,
    the integer graph) for an architecture with a graph of its own."""
    if graph_of(cfg) is not GRAPH:
        raise QnpuError(
            f"{what} is not supported for {cfg.architecture} yet (float, RTN, the rotating "
            "methods and the cost model are: docs/cli.md)"
        )


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32, with llama3 / linear scaling."""
    inv = 1.0 / (
        rope.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim)
    )
    inv = inv.astype(np.float32)
    if rope.rope_type == "linear":
        return (inv / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_cos_sin(
    positions: jax.Array, cfg: ModelConfig, table_length: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., head_dim] for integer positions (HF's rotate-half layout).
    `table_length`: gather them from the device's Q14 tables of that many positions instead
    of computing them in float32 (the device simulation)."""
    if table_length is not None:
        cos, sin = (
            jnp.asarray(t.astype(np.float32) * 2.0**-ROPE_FRACTION_BITS)
            for t in rope_tables(cfg, table_length)
        )
        return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)
    inv = jnp.asarray(rope_inv_freq(cfg.rope, cfg.head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rope_tables(cfg: ModelConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    """The device's cos/sin tables [length, head_dim]: int16 Q14, built in float64."""
    inv = rope_inv_freq(cfg.rope, cfg.head_dim).astype(np.float64)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    one = 1 << ROPE_FRACTION_BITS
    return (
        np.rint(np.cos(angles) * one).astype(np.int16),
        np.rint(np.sin(angles) * one).astype(np.int16),
    )


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, hd]; cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + eps) * weight


MATMUL_DTYPES = ("float32", "bfloat16")


def linear(
    x: jax.Array, w: jax.Array, b: jax.Array | None = None, dtype: str = "float32"
) -> jax.Array:
    """x [..., in] @ w[out, in]^T (+ b); `dtype` "bfloat16": both operands rounded to bf16,
    products accumulated in float32 (what bf16 training runs on accelerators)."""
    if dtype == "bfloat16":
        bf = jnp.bfloat16
        y = jnp.einsum(
            "...i,oi->...o", x.astype(bf), w.astype(bf), preferred_element_type=jnp.float32
        )
    else:
        y = jnp.einsum("...i,oi->...o", x, w)
    return y if b is None else y + b


def matmul_dtype(taps: Any) -> str:
    """The linears' operand type `taps` ask for (their `matmul_dtype`; float32 without)."""
    return str(getattr(taps, "matmul_dtype", "float32")) if taps is not None else "float32"


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: Any = jnp.float32) -> KVCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


class Tap(Protocol):
    """Sees (and may replace) a named tensor of the graph: weights and activations alike."""

    def __call__(self, name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
        """`where` marks the elements that exist (attention scores: the unmasked ones)."""
        ...


def no_tap(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
    return x


def embed_rows(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The float embedding rows of `tokens` (what every non-quantizing tap's `embed` returns)."""
    return jnp.take(table, tokens, axis=0).astype(jnp.float32)


PROB_ONE = 2**16 - 1  # the device's probability and exp codes: p = code / 65535


def probability_codes(e: jax.Array) -> jax.Array:
    """The integer softmax's division, P = (e · 65535 + Σe // 2) // Σe over the last axis, as
    int32, for exp codes `e` (integers in [0, 65535] held as floats, Σe > 0).

    Exact without a 64-bit type: a float estimate, within one unit, is corrected by its
    remainder computed modulo 2^32. Rows may hold up to 32767 keys (Σe < 2^31)."""
    if e.shape[-1] > 32767:
        raise ValueError("probability_codes: more than 32767 keys overflow its uint32 division")
    e_int = e.astype(jnp.uint32)
    total = jnp.sum(e_int, axis=-1, keepdims=True, dtype=jnp.uint32)  # also under x64
    half = total // 2
    numerator = e_int * jnp.uint32(PROB_ONE) + half  # the true value modulo 2^32
    estimate = jnp.floor((e * PROB_ONE + half.astype(e.dtype)) / total.astype(e.dtype))
    codes = estimate.astype(jnp.int32)
    for _ in range(2):
        rem = jax.lax.bitcast_convert_type(numerator - codes.astype(jnp.uint32) * total, jnp.int32)
        codes = codes - (rem < 0) + (rem >= total.astype(jnp.int32))
    return codes


def device_softmax(scores: jax.Array, allowed: jax.Array) -> jax.Array:
    """The integer softmax's probabilities (docs/artifact.md, "Attention") from float scores
    on their 16-bit grid, with the float softmax's gradient (straight-through):

        e = round(exp(scores − rowmax) · 65535), 0 where masked;   P = probability_codes(e)

    returned as P / 65535. e is computed in float32 where the device reads a float64 table, so
    an occasional e (and P) differs by one code."""
    p = jax.nn.softmax(scores, axis=-1)
    top = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.where(allowed, jnp.round(jnp.exp(scores - top) * PROB_ONE), 0.0)
    exact = probability_codes(e).astype(p.dtype) / PROB_ONE
    return p + jax.lax.stop_gradient(exact - p)


def _attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_pos: jax.Array,
    valid_len: jax.Array,
    tap: Tap = no_tap,
    scores_name: str = SCORES,
    probs_name: str = PROBS,
    device: bool = False,
    *,
    window: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal GQA attention over a cache.

    q [B, T, Hq, hd]; k, v [B, Hkv, S, hd]; query_pos [B, T]; keys at index >= valid_len or
    after the query's position are masked, and with `window` (sliding attention) keys at
    `window` or more positions before the query: q − window < key ≤ q. `device`: the integer
    softmax's probabilities. Scores are q·k / √hd, or q·k · `scale` when one is given.
    """
    b, t, hq, hd = q.shape
    hkv, s = k.shape[1], k.shape[2]
    q = q.reshape(b, t, hkv, hq // hkv, hd)
    key_pos = jnp.arange(s)
    allowed = (key_pos[None, None, :] <= query_pos[:, :, None]) & (key_pos < valid_len)
    if window is not None:
        allowed &= key_pos[None, None, :] > query_pos[:, :, None] - window
    allowed = allowed[:, None, None, :, :]
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k)
    scores = scores / math.sqrt(hd) if scale is None else scores * scale
    # Masked entries are no data: calibration statistics skip them.
    scores = jnp.where(allowed, tap(scores_name, scores, where=allowed), -jnp.inf)
    probs = device_softmax(scores, allowed) if device else jax.nn.softmax(scores, axis=-1)
    probs = tap(probs_name, probs)
    out = jnp.einsum("bkgts,bksd->btkgd", probs, v)
    return out.reshape(b, t, hq * hd)


class Taps(Protocol):
    """A static (hashable) description of what happens at every tensor of the graph.

    `layer` is called inside the scan over decoder layers with that layer's slice of the tap
    state; `outer` with the rest. Each returns the tap and a function giving the auxiliary
    output (e.g. observed statistics) once the tensors have passed.
    """

    def layer(self, state: Any) -> tuple[Tap, Callable[[], Any]]: ...

    def outer(self, state: Any) -> tuple[Tap, Callable[[], Any]]: ...

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array: ...


def attention_kernel(taps: Any) -> Callable[..., jax.Array] | None:
    """The attention `taps` put in place of the float one (their `attention` attribute: a
    function of (q, k_cache, v_cache, query_pos, valid_len) -> [B, T, Hq·hd] with
    `_attention`'s shapes and masking, e.g. `kernels.fp16_lut_attention`), or None. The
    kernel runs untapped: taps with one quantize no attention scores or probabilities."""
    return getattr(taps, "attention", None) if taps is not None else None


def simulates_device(taps: Any) -> bool:
    """Whether `taps` ask for the device's arithmetic: their `simulation` attribute is
    "device" (taps without one, and no taps, mean the float ops)."""
    return taps is not None and getattr(taps, "simulation", "fake") == "device"


def no_aux() -> dict[str, Any]:
    return {}


# The float function of each LUT op of the graph.
LUT_FUNCTIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": partial(jax.nn.gelu, approximate=True),  # Gemma's gelu_pytorch_tanh
}


@dataclasses.dataclass
class _LayerRun:
    """What the float reading of one decoder layer's ops reads (`_decoder_layer`'s
    arguments) and the K/V caches its attention op writes."""

    cfg: ModelConfig
    layer: Params
    k_cache: jax.Array
    v_cache: jax.Array
    start: jax.Array
    cos: jax.Array
    sin: jax.Array
    tap: Tap
    device: bool
    dtype: str
    attention: Callable[..., jax.Array] | None
    b: int
    t: int
    window: jax.Array | None = None  # keys a query sees (sliding layers); None: all before it


def _float_rmsnorm(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    return rms_norm(ins[0], r.layer[op.gain], r.cfg.rms_norm_eps)


def _float_linear(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    w = op.weight_name
    bias = r.layer.get(op.bias) if op.bias else None
    return linear(ins[0], r.tap(w, r.layer[w]), bias, r.dtype)


def _float_rope(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    heads = {"q": r.cfg.num_heads, "kv": r.cfg.num_kv_heads}
    x_heads = ins[0].reshape(r.b, r.t, heads[op.heads], r.cfg.head_dim)
    if op.head_norm in r.layer:  # Qwen3: RMSNorm over each head first
        x_heads = rms_norm(x_heads, r.layer[op.head_norm], r.cfg.rms_norm_eps)
    return apply_rope(x_heads, r.cos, r.sin)


def _float_attention(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    b, t, start = r.b, r.t, r.start
    q, k, v = (a.reshape(b, t, -1, r.cfg.head_dim) for a in ins)
    r.k_cache = jax.lax.dynamic_update_slice_in_dim(
        r.k_cache, k.transpose(0, 2, 1, 3), start, axis=2
    )
    r.v_cache = jax.lax.dynamic_update_slice_in_dim(
        r.v_cache, v.transpose(0, 2, 1, 3), start, axis=2
    )
    query_pos = start + jnp.broadcast_to(jnp.arange(t), (b, t))
    scores, probs = (i.name for i in op.inner)
    if r.attention is not None:
        return r.attention(q, r.k_cache, r.v_cache, query_pos, start + t)
    scale = r.cfg.attn_scale if r.cfg.query_pre_attn_scalar is not None else None
    return _attention(
        q,
        r.k_cache,
        r.v_cache,
        query_pos,
        start + t,
        r.tap,
        scores,
        probs,
        r.device,
        window=r.window,
        scale=scale,
    )


def _float_add(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    return ins[0] + ins[1]


def _float_lut(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    return LUT_FUNCTIONS[op.fn](ins[0])


def _float_mul(r: _LayerRun, op: Op, ins: list[jax.Array]) -> jax.Array:
    return ins[0] * ins[1]


# The float reading of each layer op (`_decoder_layer`); model-level ops: `forward_tapped`.
FLOAT_LAYER_OPS: dict[OpKind, Callable[[_LayerRun, Op, list[jax.Array]], jax.Array]] = {
    OpKind.RMSNORM: _float_rmsnorm,
    OpKind.LINEAR: _float_linear,
    OpKind.ROPE: _float_rope,
    OpKind.ATTENTION: _float_attention,
    OpKind.ADD: _float_add,
    OpKind.LUT: _float_lut,
    OpKind.MUL: _float_mul,
}
check_handlers(FLOAT_LAYER_OPS, "the float forward (layer ops)", MODEL_ONLY_KINDS)


def _decoder_layer(
    cfg: ModelConfig,
    x: jax.Array,
    layer: Params,
    k_cache: jax.Array,
    v_cache: jax.Array,
    start: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    tap: Tap = no_tap,
    graph: Graph | None = None,
    device: bool = False,
    dtype: str = "float32",
    attention: Callable[..., jax.Array] | None = None,
    window: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer: the float reading of `graph`'s layer ops (default `graph_of(cfg)`),
    in order; `tap` marks every quantized tensor (weights and op outputs) by its name in the
    graph; `attention` replaces the float attention (`attention_kernel`), untapped; `window`:
    this layer's sliding window (None: causal over the whole cache)."""
    graph = graph_of(cfg) if graph is None else graph
    b, t, _ = x.shape
    r = _LayerRun(
        cfg, layer, k_cache, v_cache, start, cos, sin, tap, device, dtype, attention, b, t, window
    )
    env = {graph.layer_input: x}
    for op in graph.layer:
        ins = [env[n] for n in op.ins]
        handler = FLOAT_LAYER_OPS.get(op.kind)
        if handler is None:  # MODEL_ONLY_KINDS
            raise ValueError(f"the float forward has no {op.kind.value!r} op in a layer")
        y = handler(r, op, ins)
        env[op.out_name] = tap(op.out_name, y) if op.out is not None else y
    return env[graph.layer[-1].out_name], r.k_cache, r.v_cache


def lm_head_weight(params: Params) -> jax.Array:
    return params[LM_HEAD] if LM_HEAD in params else params[EMBED_TABLE]


def forward_tapped(
    params: Params,
    tokens: jax.Array,
    cache: KVCache,
    start: jax.Array,
    tap_state: Any = None,
    *,
    cfg: ModelConfig,
    taps: Taps | None = None,
    remat: bool = False,
    residual_rotation: jax.Array | None = None,
    graph: Graph | None = None,
    teacher: Params | None = None,
    head_at: jax.Array | None = None,
) -> tuple[jax.Array, KVCache, Any]:
    """Run `tokens` [B, T] at positions start..start+T-1, writing K/V into `cache`.

    `remat` recomputes each decoder layer in the backward pass (`jax.checkpoint`), so training
    memory stays flat in depth.
    `residual_rotation`: R1 of params rotated with `apply_rotations(..., tables=False)`: the
    embedding rows are rotated after the gather, the final hidden state is rotated back
    before lm_head. That equals rotating the [V, D] tables at T·D² instead of V·D² FLOPs, and
    is valid only while the taps quantize neither table (stage 1 keeps both float).

    `teacher` (block-wise training, OmniQuant style): float params of the same model; every
    layer also runs on them, untapped, from the same input, the teacher's output is what
    the next layer reads, and the per-layer aux gains "block_error", the mean squared
    difference of the tapped layer's output from the teacher's. `cache` then also holds the
    teacher's "teacher_k"/"teacher_v". The logits are the teacher's.
    `head_at` [B, K]: lm_head runs on those positions of each row alone (the logits are
    [B, K, V]); scoring a few tokens of each row, that saves most of a forward whose V·D head
    outweighs its layers (Gemma 3: 262,144 x 640 against ~100M layer weights).

    Returns float32 logits [B, T, V] ([B, K, V] with `head_at`), the updated cache and the
    taps' auxiliary output
    ({"layers": stacked per-layer aux, **outer aux}). Prefill, decode, full-sequence forward,
    fake quantization and calibration statistics are all this one function.
    """
    if graph is None:
        graph = graph_of(cfg, params)
    elif graph is not graph_of(cfg, params):
        check_llama_graph(cfg, "a forward over another graph (quantization plans, taps)")
    b, t = tokens.shape
    embed_op, _, norm_op, head_op = graph.model  # embed → layers → final norm → lm_head
    start = jnp.asarray(start, jnp.int32)
    state = tap_state if tap_state is not None else {"layers": None, "outer": None}
    outer_tap, outer_aux = taps.outer(state["outer"]) if taps else (no_tap, no_aux)
    if taps:
        x = taps.embed(state["outer"], params[EMBED_TABLE], tokens)
    else:
        x = embed_rows(params[EMBED_TABLE], tokens)
    if cfg.embed_scale != 1.0:  # Gemma: rows · √hidden (float32), lm_head unscaled
        x = x * jnp.float32(cfg.embed_scale)
    if residual_rotation is not None:
        x = x @ residual_rotation
    x = outer_tap(embed_op.out_name, x)
    device = simulates_device(taps)
    dtype = matmul_dtype(taps)
    attention = attention_kernel(taps)
    positions = start + jnp.broadcast_to(jnp.arange(t), (b, t))
    sliding = cfg.sliding_layers
    if any(sliding) and attention is not None:
        raise QnpuError(
            f"sliding-window attention ({cfg.architecture}) is not supported with an attention "
            "kernel yet"
        )
    table_length = cache["k"].shape[3] if device else None
    cos, sin = rope_cos_sin(positions, cfg, table_length)
    # Sliding layers (Gemma 3): their RoPE tables and window, selected per layer in the scan
    local = (
        rope_cos_sin(positions, dataclasses.replace(cfg, rope=cfg.local_rope), table_length)
        if any(sliding)
        else None
    )
    flags = jnp.asarray(sliding) if any(sliding) else None

    def body(x: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, Any]:
        layer, k_cache, v_cache, layer_state, taught, is_sliding = xs
        tap, aux = taps.layer(layer_state) if taps else (no_tap, no_aux)
        cos_l, sin_l, window = cos, sin, None
        if local is not None:
            cos_l = jnp.where(is_sliding, local[0], cos)
            sin_l = jnp.where(is_sliding, local[1], sin)
            window = jnp.where(is_sliding, jnp.int32(cfg.sliding_window), jnp.int32(_NO_WINDOW))
        y, k_cache, v_cache = _decoder_layer(
            cfg,
            x,
            layer,
            k_cache,
            v_cache,
            start,
            cos_l,
            sin_l,
            tap,
            graph,
            device,
            dtype,
            attention,
            window,
        )
        if taught is None:
            return y, (k_cache, v_cache, aux(), None)
        t_layer, t_k, t_v = taught
        y_t, t_k, t_v = _decoder_layer(
            cfg, x, t_layer, t_k, t_v, start, cos_l, sin_l, graph=graph, window=window
        )
        y_t = jax.lax.stop_gradient(y_t)
        out = {**aux(), "block_error": jnp.mean(jnp.square(y - y_t))}
        return y_t, (k_cache, v_cache, out, (t_k, t_v))

    taught = (
        None if teacher is None else (teacher["layers"], cache["teacher_k"], cache["teacher_v"])
    )
    xs = (params["layers"], cache["k"], cache["v"], state["layers"], taught, flags)
    x, (k_new, v_new, layer_aux, t_new) = jax.lax.scan(
        jax.checkpoint(body) if remat else body, x, xs
    )
    x = outer_tap(norm_op.out_name, rms_norm(x, params[norm_op.gain], cfg.rms_norm_eps))
    if residual_rotation is not None:
        x = x @ residual_rotation.T
    if head_at is not None:
        x = jnp.take_along_axis(x, head_at[..., None], axis=1)
    logits = linear(
        x,
        outer_tap(head_op.weight.name if head_op.weight else "", lm_head_weight(params)),
        dtype=dtype,
    )
    new_cache = {"k": k_new, "v": v_new}
    if t_new is not None:
        new_cache |= {"teacher_k": t_new[0], "teacher_v": t_new[1]}
    return logits, new_cache, {"layers": layer_aux, **outer_aux()}


def forward_cached(
    params: Params, tokens: jax.Array, cache: KVCache, start: jax.Array, *, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    """The float forward over a KV cache: float32 logits [B, T, V] and the updated cache."""
    logits, cache, _ = forward_tapped(params, tokens, cache, start, cfg=cfg)
    return logits, cache


@partial(jax.jit, static_argnames="cfg")
def forward(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Float32 logits [B, T, V] of a full causal forward over `tokens` [B, T]."""
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    logits, _ = forward_cached(params, tokens, cache, jnp.int32(0), cfg=cfg)
    return logits


def target_nll(logits: jax.Array, target: jax.Array) -> jax.Array:
    """Negative log-likelihood [...] of the ids `target` [...] under `logits` [..., V]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def next_token_nll(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Negative log-likelihood [B, T-1] of tokens[:, 1:] under logits[:, :-1]."""
    return target_nll(logits[:, :-1], tokens[:, 1:])


@partial(jax.jit, static_argnames="cfg")
def token_nll(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """Per-position next-token NLL [B, T-1] of the float model (logits never leave the jit)."""
    return next_token_nll(forward(params, tokens, cfg=cfg), tokens)


@partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def _prefill(
    params: Params, tokens: jax.Array, cache: KVCache, length: jax.Array, *, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    logits, cache = forward_cached(params, tokens, cache, jnp.int32(0), cfg=cfg)
    last = jnp.take_along_axis(logits, (length - 1)[:, None, None], axis=1)[:, 0]
    return jnp.argmax(last, axis=-1).astype(jnp.int32), cache


@partial(jax.jit, static_argnames="cfg", donate_argnames="cache")
def _decode_step(
    params: Params, token: jax.Array, cache: KVCache, pos: jax.Array, *, cfg: ModelConfig
) -> tuple[jax.Array, KVCache]:
    logits, cache = forward_cached(params, token[:, None], cache, pos, cfg=cfg)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def _bucket(n: int, multiple: int = 32) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def generate(
    params: Params,
    prompt: list[int],
    *,
    cfg: ModelConfig,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """Greedy decoding with a KV cache; returns the new token ids (stops after EOS).

    The prompt is padded to a multiple of 32 so prompts of similar length share one compiled
    prefill; padded cache slots are overwritten by decode before any query can see them.
    Ties in argmax go to the lowest token id.
    """
    if not prompt:
        raise ValueError("generate needs a non-empty prompt")
    if max_new_tokens <= 0:
        return []
    check_generation_room(
        0, len(prompt), max_new_tokens, cfg.max_position_embeddings, "the model's context"
    )
    padded = _bucket(len(prompt))
    cache = init_cache(cfg, 1, _bucket(padded + max_new_tokens))
    tokens = jnp.asarray([prompt + [0] * (padded - len(prompt))], jnp.int32)
    token, cache = _prefill(params, tokens, cache, jnp.asarray([len(prompt)]), cfg=cfg)
    out = [int(token[0])]
    pos = len(prompt)
    while len(out) < max_new_tokens and out[-1] != eos_token_id:
        token, cache = _decode_step(params, token, cache, jnp.int32(pos), cfg=cfg)
        out.append(int(token[0]))
        pos += 1
    return out


def layer_param_shapes(cfg: ModelConfig, graph: Graph | None = None) -> dict[str, tuple[int, ...]]:
    """Shape of each per-layer param, without the leading layer axis: the norms' gains, the
    linears' weights [width(out), width(in)] and, with attention_bias, their biases (`graph`:
    default `graph_of(cfg)`)."""
    graph = graph_of(cfg) if graph is None else graph
    widths = layer_widths(cfg.dims, graph)
    shapes: dict[str, tuple[int, ...]] = {}
    for op in graph.layer:
        if op.gain:
            shapes[op.gain] = (cfg.hidden_size,)
        if op.kind == OpKind.LINEAR:
            shapes[op.weight_name] = (widths[op.out_name], widths[op.ins[0]])
    if cfg.attention_bias:
        shapes |= {
            op.bias: shapes[op.weight_name][:1] for op in graph.ops(OpKind.LINEAR) if op.bias
        }
    if cfg.qk_norm:
        shapes |= {op.head_norm: (cfg.head_dim,) for op in graph.ops(OpKind.ROPE) if op.head_norm}
    return shapes


def init_random_params(cfg: ModelConfig, key: jax.Array, scale: float = 0.02) -> Params:
    """Random float32 params of the layout above (for tests and experiments on tiny models)."""
    shapes = layer_param_shapes(cfg)
    gains = {op.gain for op in graph_of(cfg).layer if op.gain} | set(HEAD_NORMS)
    layer_key, embed_key, head_key = jax.random.split(key, 3)
    layers = {}
    for (name, shape), k in zip(
        shapes.items(), jax.random.split(layer_key, len(shapes)), strict=True
    ):
        noise = jax.random.normal(k, (cfg.num_layers, *shape))
        layers[name] = 1.0 + 0.1 * noise if name in gains else scale * noise
    params: Params = {
        EMBED_TABLE: jax.random.normal(embed_key, (cfg.vocab_size, cfg.hidden_size)),
        "layers": layers,
        FINAL_NORM: jnp.ones((cfg.hidden_size,)),
    }
    if not cfg.tie_word_embeddings:
        params[LM_HEAD] = scale * jax.random.normal(head_key, (cfg.vocab_size, cfg.hidden_size))
    return params
