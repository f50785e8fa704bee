"""A numpy NPU emulator: executes an integer artifact as the device would.

Integer codes in, integer logits out: integer matmuls with wide accumulators, fixed-point
requantization, LUT non-linearities, integer RMSNorm and softmax, an integer KV cache and a
fixed prefill chunk (the last chunk padded). No JAX: this is the independent reference the
JAX integer forward is checked against, bit for bit.

Matmuls run as float32 BLAS on integer values, split (`ir.exact_dot.dot_plan`, from the
operands' magnitudes at each call) so that every partial sum is an integer below 2^24: then
any summation order is exact. Float64 or int64 take over where float32 cannot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import IntModel
from qnpu_jax.ir.exact_dot import dot_plan, run_dot_plan
from qnpu_jax.ir.graph import (
    HEAD_NORM_MAX,
    LAYER_INPUT,
    LAYER_ONLY_KINDS,
    LOCAL_ROPE,
    LOGITS_RANGE,
    MODEL_ONLY_KINDS,
    PROBS,
    SCORES,
    OpKind,
    check_handlers,
    check_room,
    op_kind,
    sliding_layers,
)
from qnpu_jax.runtime.interface import IntegerEngine, KVCache, check_cache_batch, check_tokens

I64 = np.int64
H = TypeVar("H")
INT64_MAX = np.iinfo(np.int64).max


# ---------------------------------------------------------------------------- kernels


def requantize(
    acc: np.ndarray, m: Any, shift: Any, zero_point: Any, qmin: Any, qmax: Any
) -> np.ndarray:
    """clamp(z + ((acc·M + 2^(sh−1)) >> sh), qmin, qmax), int64 with an overflow check."""
    a = np.asarray(acc, I64)
    m = np.asarray(m, I64)
    sh = np.asarray(shift, I64)
    half = np.left_shift(I64(1), sh - 1)
    limit = (INT64_MAX - half) // m
    a_max = max(int(a.max(initial=0)), -int(a.min(initial=0)))
    if a_max > int(limit.min()) and (np.abs(a) > limit).any():  # exact check only if needed
        raise QnpuError("requantization overflows int64 (accumulator too large)")
    z = np.asarray(zero_point, I64)
    shape = np.broadcast_shapes(a.shape, m.shape, sh.shape, z.shape, np.shape(qmin), np.shape(qmax))
    y = np.empty(shape, I64)  # one buffer, updated in place
    np.multiply(a, m, out=y)
    y += half
    np.right_shift(y, sh, out=y)
    y += z
    return np.clip(y, qmin, qmax, out=y)


def _einsum(subscripts: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.einsum(subscripts, a, b, optimize=True)


def exact_matmul(
    a: np.ndarray, b: np.ndarray, subscripts: str, *, b_absmax: float | None = None
) -> np.ndarray:
    """einsum of integer arrays contracting a's last axis, exact, int64: float32 BLAS with
    the operands split as `dot_plan` says for the magnitudes at hand (the largest |a|, the
    largest row sum of |a|, the largest |b|; float64 or int64 when float32 cannot).

    `b` may already be float32 holding integers, with its max |b| given as `b_absmax` (the
    emulator keeps its weights so, instead of converting them at every call)."""
    b_max = int(np.abs(b).max(initial=0)) if b_absmax is None else int(b_absmax)
    a = np.asarray(a, I64)
    a_max = max(int(a.max(initial=0)), -int(a.min(initial=0)))
    plan = dot_plan(a_max, b_max, a.shape[-1])
    if plan != dot_plan(0, 0, a.shape[-1]):  # not one float32 pass: try the rows' mass
        a_sum = int(np.abs(a).sum(axis=-1).max(initial=0))
        plan = dot_plan(a_max, b_max, a.shape[-1], a_sum)
    return run_dot_plan(plan, subscripts, a, b, np, _einsum)


def isqrt(v: np.ndarray) -> np.ndarray:
    """floor(sqrt(v)) of non-negative int64 values below 2^62, exactly."""
    r = np.floor(np.sqrt(v.astype(np.float64))).astype(I64)
    for _ in range(2):  # float64 sqrt is within one unit; correct both ways
        r = np.where(r * r > v, r - 1, r)
        r = np.where((r + 1) * (r + 1) <= v, r + 1, r)
    return r


def rmsnorm(
    xc: np.ndarray, c: dict[str, np.ndarray], out: tuple[int, int, int], f: int, k: int
) -> np.ndarray:
    """Integer RMSNorm of centered codes xc [..., D] (docs/artifact.md, "RMSNorm")."""
    d = xc.shape[-1]
    ss = np.sum(xc * xc, axis=-1, keepdims=True)
    v = np.left_shift(ss, 2 * f) // d + c["eps"]
    r = np.maximum(isqrt(v), 1)
    t = (np.left_shift(xc, f + k + 1) + r) // (2 * r)
    return requantize(t * c["sign"].astype(I64), c["M"], c["shift"], *out)


def softmax_codes(scores: np.ndarray, allowed: np.ndarray, exp_lut: np.ndarray) -> np.ndarray:
    """Integer softmax over the last axis: unsigned 16-bit probability codes."""
    s = np.asarray(scores, I64)
    top = np.where(allowed, s, np.iinfo(I64).min).max(axis=-1, keepdims=True)
    d = np.minimum(top - s, (1 << 16) - 1)
    d[..., ~allowed] = 0  # masked keys: any valid index, their terms are zeroed next
    e = exp_lut[d].astype(I64)
    e[..., ~allowed] = 0
    total = e.sum(axis=-1, keepdims=True)
    e *= (1 << 16) - 1
    e += total // 2
    return e // total


@dataclasses.dataclass(frozen=True)
class Cache:
    """Integer K/V cache codes [L, B, Hkv, S, hd] and the number of filled positions."""

    k: np.ndarray
    v: np.ndarray
    length: int


def new_cache(model: IntModel, batch: int) -> Cache:
    """An empty cache holding the sink prefix's K/V at positions 0..P-1."""
    m = model.model
    shape = (m["num_layers"], batch, m["num_kv_heads"], model.graph["max_context"], m["head_dim"])
    k, v = np.zeros(shape, np.int16), np.zeros(shape, np.int16)
    p = len(model.graph["prefix_tokens"])
    if p:
        k[:, :, :, :p] = model.t("layers.prefix.k")[:, None]
        v[:, :, :, :p] = model.t("layers.prefix.v")[:, None]
    return Cache(k, v, p)


Value = tuple[np.ndarray, int]  # codes and their zero point


def _act(model: IntModel, layer: int, name: str) -> tuple[int, int, int]:
    j = model.graph["layer_activations"].index(name)
    return tuple(  # type: ignore[return-value]
        int(model.t(f"layers.act.{f}")[layer, j]) for f in ("zero_point", "qmin", "qmax")
    )


def _bounds(model: IntModel, layer: int, name: str) -> tuple[int, Any, Any]:
    """`_act`, with per-channel bounds [C] where `name` has shadow channels in `layer` (their
    codes are not clamped to the tensor's range)."""
    z, lo, hi = _act(model, layer, name)
    bounds = model.shadow_bounds(name)
    if bounds is None or not len(model.shadow_channels(name, layer)):
        return z, lo, hi
    return z, bounds[0][layer], bounds[1][layer]


def _global_act(model: IntModel, name: str) -> tuple[int, int, int]:
    j = model.graph["global_activations"].index(name)
    return tuple(  # type: ignore[return-value]
        int(model.t(f"act.{f}")[j]) for f in ("zero_point", "qmin", "qmax")
    )


def _layer_slice(model: IntModel, prefix: str, layer: int | None) -> dict[str, np.ndarray]:
    """The constants named `prefix.*` (of one layer when `layer` is set)."""
    out = {}
    for name, a in model.tensors.items():
        if name.startswith(prefix + "."):
            out[name[len(prefix) + 1 :]] = a if layer is None else a[layer]
    return out


def _linear(
    x: Value,
    c: dict[str, np.ndarray],
    out: tuple[int, int, int],
    weight: tuple[np.ndarray, float],
    shadow: tuple[np.ndarray, int, int] | None = None,
    muxq: tuple[np.ndarray, int] | None = None,
) -> np.ndarray:
    """`shadow` (channels, qmin, qmax): the input carries shadow channels. Then the NPU's
    matmul reads the codes clamped to [qmin, qmax], and the shadow path adds the overflow
    q − clamp(q) of those channels times their weight columns only (mllm-NPU).
    `muxq` (channels, exp): the input is MUXQ's Body; the Aux matmul of those channels,
    times 2^exp − 1, is added to the Body matmul.
    An asymmetric weight (`weight_zero_point` z_w [out] in `c`): the matmul runs on its
    codes, and z_w[o] times the row sum of the input it read is subtracted, as a device
    does (Σ (q_w − z_w)·x = Σ q_w·x − z_w·Σ x)."""
    codes, z = x
    w64, w_max = weight
    xc = codes.astype(I64) - z
    if shadow is not None:
        channels, lo, hi = shadow
        q = codes.astype(I64)
        clamped = np.clip(q, lo, hi)
        acc = exact_matmul(clamped - z, w64, "...i,oi->...o", b_absmax=w_max)
        overflow = (q - clamped)[..., channels]
        acc = acc + exact_matmul(overflow, w64[:, channels], "...i,oi->...o", b_absmax=w_max)
    else:
        acc = exact_matmul(xc, w64, "...i,oi->...o", b_absmax=w_max)
    if muxq is not None:
        channels, exp = muxq
        aux = codes[..., channels].astype(I64) - z
        aux_acc = exact_matmul(aux, w64[:, channels], "...i,oi->...o", b_absmax=w_max)
        acc = acc + ((1 << exp) - 1) * aux_acc
    if "weight_zero_point" in c:
        x_sum = np.sum(xc, axis=-1, keepdims=True)  # what the matmul above read, summed
        if muxq is not None:
            x_sum = x_sum + ((1 << muxq[1]) - 1) * np.sum(aux, axis=-1, keepdims=True)
        acc = acc - c["weight_zero_point"].astype(I64) * x_sum
    if "bias" in c:
        acc = acc + c["bias"].astype(I64)
    return requantize(acc, c["M"], c["shift"], *out)


def _rope(
    x: Value,
    c: dict[str, np.ndarray],
    out: tuple[int, int, int],
    cos: np.ndarray,
    sin: np.ndarray,
    head_dim: int,
    norm_bits: tuple[int, int],
) -> np.ndarray:
    """RoPE of codes [B, T, H·hd] with the Q14 tables (after the per-head RMSNorm the
    constants hold under `norm.*`), requantized into `out`; `norm_bits` (F, K)."""
    codes, z = x
    b, t, width = codes.shape
    xc = (codes.astype(I64) - z).reshape(b, t, width // head_dim, head_dim)
    if "norm.M" in c:  # Qwen3: each head RMSNormed into a 16-bit intermediate first
        norm = {k.removeprefix("norm."): v for k, v in c.items() if k.startswith("norm.")}
        xc = rmsnorm(xc, norm, (0, -HEAD_NORM_MAX, HEAD_NORM_MAX), *norm_bits)
    half = head_dim // 2
    rot = np.concatenate([-xc[..., half:], xc[..., :half]], axis=-1)
    acc = xc * cos[None, :, None, :] + rot * sin[None, :, None, :]
    return requantize(acc, c["M"], c["shift"], *out).reshape(b, t, width)


def _attention(
    model: IntModel,
    layer: int,
    q: Value,
    k: Value,
    v: Value,
    cache: Cache,
    start: int,
    out: tuple[int, int, int],
    trace: dict[str, list[np.ndarray]] | None = None,
) -> np.ndarray:
    m = model.model
    hd, hkv, hq = m["head_dim"], m["num_kv_heads"], m["num_heads"]
    b, t, _ = q[0].shape
    end = start + t
    cache.k[layer, :, :, start:end] = k[0].reshape(b, t, hkv, hd).transpose(0, 2, 1, 3)
    cache.v[layer, :, :, start:end] = v[0].reshape(b, t, hkv, hd).transpose(0, 2, 1, 3)
    kc = cache.k[layer, :, :, :end].astype(I64) - k[1]  # [B, Hkv, S, hd]
    vc = cache.v[layer, :, :, :end].astype(I64) - v[1]
    qc = (q[0].astype(I64) - q[1]).reshape(b, t, hkv, hq // hkv, hd)
    acc = exact_matmul(qc, kc, "btkgd,bksd->bkgts")
    z_s, lo_s, hi_s = _act(model, layer, SCORES)
    m_s, sh_s = model.t("layers.scores.M")[layer], model.t("layers.scores.shift")[layer]
    scores = requantize(acc, m_s, sh_s, z_s, lo_s, hi_s)
    keys, queries = np.arange(end)[None, :], (start + np.arange(t))[:, None]
    allowed = keys <= queries  # [T, S]
    if sliding_layers(m)[layer]:  # Gemma 3: the last sliding_window keys, the query's included
        allowed &= keys > queries - int(m["sliding_window"])
    probs = softmax_codes(scores, allowed, model.t("layers.softmax.exp_lut")[layer])
    if trace is not None:
        trace.setdefault(SCORES, []).append(scores)
        trace.setdefault(PROBS, []).append(probs)
    pv = exact_matmul(probs, vc, "bkgts,bksd->btkgd")
    res = requantize(pv, model.t("layers.pv.M")[layer], model.t("layers.pv.shift")[layer], *out)
    return res.reshape(b, t, hq * hd)


def _add(
    ac: np.ndarray, bc: np.ndarray, c: dict[str, np.ndarray], out: tuple[int, int, int]
) -> np.ndarray:
    """Two centered inputs rescaled into the output with one shared shift (per channel where
    the output has residual-split channels: `_LayerRun.consts`)."""
    acc = ac * I64(c["Ma"]) + bc * I64(c["Mb"])
    sh = I64(c["shift"])
    y = np.right_shift(acc + np.left_shift(I64(1), sh - 1), sh) + out[0]
    return np.clip(y, out[1], out[2])


Trace = dict[str, list[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class _LayerRun:
    """What the ops of one layer read: the model, the layer, the cache, the chunk's first
    position and RoPE rows, the norms' fixed-point bits (F, K) and the trace."""

    model: IntModel
    layer: int
    cache: Cache
    start: int
    cos: np.ndarray
    sin: np.ndarray
    norm_bits: tuple[int, int]
    trace: Trace | None

    def consts(self, op: dict[str, Any]) -> dict[str, np.ndarray]:
        """This layer's constants of `op`, with MUXQ's extra shift of its output channels."""
        c = _layer_slice(self.model, op["const"], self.layer)
        shifts = self.model.muxq_shifts(op["out"])
        if shifts is not None:  # MUXQ's Body: its outlier channels shifted exp bits further
            c = {**c, "shift": c["shift"] + shifts[self.layer]}
        return c


Out = tuple[int, Any, Any]  # zero point, qmin, qmax (per channel with shadow channels)


def stream_codes(model: IntModel, name: str, layer: int, x: Value) -> tuple[np.ndarray, int]:
    """The centered codes of value `name` in `layer` as an add or a norm reads them (the
    residual split's channels shifted left by their exp: one grid) and that exp."""
    xc = x[0].astype(I64) - x[1]
    shifts = model.read_shifts(name)
    if shifts is None:
        return xc, 0
    return np.left_shift(xc, shifts[layer]), model.read_exp(name)


def _run_rmsnorm(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    """A residual-split input runs with exp fewer fractional bits of the root, its precision
    on the split's coarse grid (docs/artifact.md, "The residual split")."""
    xc, exp = stream_codes(r.model, op["in"][0], r.layer, ins[0])
    f, k = r.norm_bits
    return rmsnorm(xc, r.consts(op), out, f - exp, k)


def _run_linear(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    model, layer, src = r.model, r.layer, op["in"][0]
    c = r.consts(op)
    hot = model.shadow_channels(src, layer)
    shadow = (hot, *_act(model, layer, src)[1:]) if len(hot) else None
    outliers = model.muxq_channels(src, layer)
    muxq = (outliers, model.muxq_exp(src)) if len(outliers) else None
    weight = model.weight_operand(op["const"], layer)
    return _linear(ins[0], c, out, weight, shadow, muxq)


def _run_rope(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    hd = r.model.model["head_dim"]
    cos, sin = r.cos.astype(I64), r.sin.astype(I64)
    return _rope(ins[0], r.consts(op), out, cos, sin, hd, r.norm_bits)


def _run_attention(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    q, k, v = ins
    return _attention(r.model, r.layer, q, k, v, r.cache, r.start, out, r.trace)


def _run_add(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    (a, _), (b, _) = (
        stream_codes(r.model, n, r.layer, v) for n, v in zip(op["in"], ins, strict=True)
    )
    return _add(a, b, r.consts(op), out)


def _run_lut(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    c = r.consts(op)
    codes, _ = ins[0]
    lo = _act(r.model, r.layer, op["in"][0])[1]
    return c["lut"][codes.astype(I64) - lo].astype(I64)  # type: ignore[no-any-return]


def _run_mul(r: _LayerRun, op: dict[str, Any], ins: list[Value], out: Out) -> np.ndarray:
    c = r.consts(op)
    prod = (ins[0][0].astype(I64) - ins[0][1]) * (ins[1][0].astype(I64) - ins[1][1])
    return requantize(prod, c["M"], c["shift"], *out)


# The emulator's layer ops: each returns its output codes (`_run_layer`).
LAYER_OPS: dict[OpKind, Callable[[_LayerRun, dict[str, Any], list[Value], Out], np.ndarray]] = {
    OpKind.RMSNORM: _run_rmsnorm,
    OpKind.LINEAR: _run_linear,
    OpKind.ROPE: _run_rope,
    OpKind.ATTENTION: _run_attention,
    OpKind.ADD: _run_add,
    OpKind.LUT: _run_lut,
    OpKind.MUL: _run_mul,
}
check_handlers(LAYER_OPS, "the emulator (layer ops)", MODEL_ONLY_KINDS)


def _handler(table: Mapping[OpKind, H], op: Any, part: str) -> H:
    """The handler of op list entry `op` in `table`; QnpuError for an unknown kind or one
    the emulator does not run at this level."""
    kind = op_kind(op["op"], "unknown op")
    if kind not in table:
        raise QnpuError(f"the emulator has no {part}-level op {kind.value!r}")
    return table[kind]


def _run_layer(
    model: IntModel,
    layer: int,
    x: Value,
    cache: Cache,
    start: int,
    positions: np.ndarray,
    trace: Trace | None = None,
) -> Value:
    env: dict[str, Value] = {LAYER_INPUT: x}
    f, k = model.graph["norm_fraction_bits"], model.graph["norm_unit_bits"]
    table = LOCAL_ROPE if sliding_layers(model.model)[layer] else "rope"
    cos, sin = model.t(f"{table}.cos")[positions], model.t(f"{table}.sin")[positions]
    r = _LayerRun(model, layer, cache, start, cos, sin, (f, k), trace)
    for op in model.graph["ops"]["layer"]:
        out = _bounds(model, layer, op["out"])
        ins = [env[n] for n in op["in"]]
        y = _handler(LAYER_OPS, op, "layer")(r, op, ins, out)
        env[op["out"]] = (y, out[0])
        if trace is not None:
            trace.setdefault(op["out"], []).append(y)
    return env[model.graph["ops"]["layer"][-1]["out"]]


def run_chunk(
    model: IntModel,
    tokens: np.ndarray,
    cache: KVCache,
    trace: dict[str, list[np.ndarray]] | None = None,
) -> tuple[np.ndarray, Cache]:
    """Integer logits [B, T, V] (int32 codes) of `tokens` [B, T] placed after the cache's
    filled positions, and a new cache with their K/V written (the given one is left as it
    was). `trace`, when given, collects every activation's codes by name: a list over layers
    (attention's scores and probs included; embed and final norm outputs as one-item lists)."""
    ids = check_tokens(tokens, int(model.model["vocab_size"]))
    return _run_chunk_into(model, ids, _own(cache), trace)


def _own(cache: KVCache) -> Cache:
    """A copy in numpy buffers of any engine's cache."""
    return Cache(np.array(cache.k, np.int16), np.array(cache.v, np.int16), int(cache.length))


@dataclasses.dataclass(frozen=True)
class _ChunkRun:
    """What the model's ops read: the model, the chunk's token ids, the cache, its first
    position, the positions and the trace."""

    model: IntModel
    tokens: np.ndarray
    cache: Cache
    start: int
    positions: np.ndarray
    trace: Trace | None


def _run_embed(m: _ChunkRun, op: dict[str, Any], env: dict[str, Value]) -> Value:
    model, tokens = m.model, m.tokens
    z, lo, hi = _global_act(model, op["out"])
    table = op["const"]
    rows = model.t(f"{table}.table")[tokens].astype(I64)
    x = requantize(
        rows,
        model.t(f"{table}.M")[tokens][..., None],
        model.t(f"{table}.shift")[tokens][..., None],
        z,
        lo,
        hi,
    )
    if m.trace is not None:
        m.trace[op["out"]] = [x]
    return x, z


def _run_layers(m: _ChunkRun, op: dict[str, Any], env: dict[str, Value]) -> Value:
    value = env[op["in"][0]]
    for layer in range(m.model.num_layers):
        value = _run_layer(m.model, layer, value, m.cache, m.start, m.positions, m.trace)
    return value


def _run_final_norm(m: _ChunkRun, op: dict[str, Any], env: dict[str, Value]) -> Value:
    model, value = m.model, env[op["in"][0]]
    f, k = model.graph["norm_fraction_bits"], model.graph["norm_unit_bits"]
    out = _global_act(model, op["out"])
    xc, exp = stream_codes(model, op["in"][0], model.num_layers - 1, value)
    h = rmsnorm(xc, _layer_slice(model, op["const"], None), out, f - exp, k)
    if m.trace is not None:
        m.trace[op["out"]] = [h]
    return h, out[0]


def _run_lm_head(m: _ChunkRun, op: dict[str, Any], env: dict[str, Value]) -> Value:
    """The int32 logits (zero point 0)."""
    logits = _linear(
        env[op["in"][0]],
        _layer_slice(m.model, op["const"], None),
        (0, *LOGITS_RANGE),
        m.model.weight_operand(op["const"], None),
    )
    return logits, 0


# The emulator's model ops: embed → layers → final norm → lm_head (`_run_chunk_into`).
MODEL_OPS: dict[OpKind, Callable[[_ChunkRun, dict[str, Any], dict[str, Value]], Value]] = {
    OpKind.EMBED: _run_embed,
    OpKind.LAYERS: _run_layers,
    OpKind.RMSNORM: _run_final_norm,
    OpKind.LINEAR: _run_lm_head,
}
check_handlers(MODEL_OPS, "the emulator (model ops)", LAYER_ONLY_KINDS)


def _run_chunk_into(
    model: IntModel,
    tokens: np.ndarray,
    cache: Cache,
    trace: Trace | None = None,
) -> tuple[np.ndarray, Cache]:
    """`run_chunk` of checked token ids writing K/V into `cache`'s buffers: for callers that
    own the cache, so a decode step does not copy the whole cache."""
    t = tokens.shape[1]
    start = cache.length
    check_room(start, t, model.graph["max_context"])
    check_cache_batch(cache, tokens.shape[0])
    m = _ChunkRun(model, tokens, cache, start, start + np.arange(t), trace)
    env: dict[str, Value] = {}
    ops = model.graph["ops"]["model"]
    for op in ops:
        env[op["out"]] = _handler(MODEL_OPS, op, "model")(m, op, env)
    logits = env[ops[-1]["out"]][0]
    return np.ascontiguousarray(logits, np.int32), Cache(cache.k, cache.v, start + t)


@dataclasses.dataclass(frozen=True)
class EmulatorEngine(IntegerEngine[Cache]):
    """The numpy emulator behind the engine interface (`JaxIntEngine`'s twin)."""

    model: IntModel

    def new_cache(self, batch: int) -> Cache:
        return new_cache(self.model, batch)

    def run_chunk(self, tokens: np.ndarray, cache: KVCache) -> tuple[np.ndarray, Cache]:
        return run_chunk(self.model, tokens, cache)

    def _own(self, cache: KVCache) -> Cache:
        return _own(cache)

    def _extend(self, tokens: np.ndarray, cache: Cache) -> tuple[np.ndarray, Cache]:
        return _run_chunk_into(self.model, tokens, cache)

    def _take_rows(self, cache: KVCache, rows: np.ndarray) -> Cache:
        k, v = (np.take(np.asarray(a, np.int16), rows, axis=1) for a in (cache.k, cache.v))
        return Cache(k, v, int(cache.length))
