"""The integer-only forward in JAX: the artifact's graph run bit-exactly as the emulator runs it.

One jitted pure function, `int_forward(consts, tokens, cache_k, cache_v, start)`, with static
shapes: the K/V cache always spans `max_context` slots and attention looks at all of them,
masking keys after the query (a masked key's exp term is exactly 0, so this equals the
emulator's look at the filled prefix only). The decoder layers run under `jax.lax.scan` over
the stacked per-layer constants; the layer body interprets the artifact's op list
(`graph["ops"]["layer"]`) at trace time, and per-layer zero points and ranges are traced
values, so one compiled program serves layers of different bit-widths.

Arithmetic is exact integer arithmetic in int64, which needs `jax.enable_x64(True)`:
`int_forward` refuses to trace without it; the convenience functions (`prefill`,
`run_chunk`, `token_nll`, `generate`) scope it themselves and leave it off afterwards.
Matmuls run as float32 dots of the integer values by default, split as
`ir.exact_dot.dot_plan` says for the artifact's ranges (each layer's own for the linears,
one `lax.switch` branch per distinct plan; the largest over layers for attention) so that
every partial sum is an integer below 2^24 and any summation order is exact; `matmul="f64"`
(sums below 2^53, checked) and `matmul="i64"` select one float64 or int64 dot instead.
Attention looks at a static window of the cache (`key_window`): the keys a query may see,
rounded up to one of four sizes per octave, so a short context does not pay for the whole
cache (one compiled program per window size).
No constant is derived here: every multiplier, shift, zero point, range, LUT and table is
the artifact's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import IntModel, centered_weights
from qnpu_jax.ir.exact_dot import EXACT, DotPlan, dot_plan, run_dot_plan
from qnpu_jax.ir.graph import (
    HEAD_NORM_MAX,
    LAYER_INPUT,
    LAYER_ONLY_KINDS,
    LOCAL_ROPE,
    LOGITS_RANGE,
    MODEL_ONLY_KINDS,
    SCORES,
    OpKind,
    check_handlers,
    check_room,
    op_kind,
    sliding_layers,
)
from qnpu_jax.quant.requantize import requantize_jax
from qnpu_jax.runtime.interface import IntegerEngine, KVCache, check_cache_batch, check_tokens

MATMULS = ("f32", "f64", "i64")
MATMUL_KINDS = (OpKind.LINEAR, OpKind.ATTENTION)  # the ops `matmul_bounds` bounds
MATMUL_DTYPES = {"f32": "float32", "f64": "float64", "i64": "int64"}
PROB_MAX = (1 << 16) - 1  # softmax probability codes are unsigned 16-bit
I64 = jnp.int64
F64 = jnp.float64

Act = tuple[jax.Array, jax.Array, jax.Array]  # zero point, qmin, qmax (traced scalars)
Value = tuple[jax.Array, jax.Array]  # codes and their zero point


# ------------------------------------------------------------------------ constants


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One op of the artifact's op list (hashable: part of the jit cache key)."""

    op: OpKind
    ins: tuple[str, ...]
    out: str
    const: str


@dataclasses.dataclass(frozen=True)
class IntSpec:
    """The static part of an artifact: dimensions, graph parameters and op lists."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    prefill_chunk: int
    prefix_len: int
    norm_fraction_bits: int
    norm_unit_bits: int
    logits_scale: float
    model_ops: tuple[OpSpec, ...]
    layer_ops: tuple[OpSpec, ...]
    layer_acts: tuple[str, ...]  # the columns of `layers.act.*`
    global_acts: tuple[str, ...]  # the entries of `act.*`
    matmul: str
    # max |operand| of each matmul: linear consts -> ((input, weight) per layer, or one pair
    # for a model-level linear); "scores" -> ((q, k),) and "pv" -> ((probabilities, v),), the
    # largest over layers. Filled by `check_exact` from the artifact's ranges and weights.
    bounds: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    # every layer's score codes lie within ±2^29: the softmax may work in int32
    narrow_scores: bool = False
    # Gemma 3: whether each layer attends over the last `sliding_window` keys only (and
    # rotates by the `rope_local` tables); () when no layer does
    sliding: tuple[bool, ...] = ()
    sliding_window: int = 0
    # the residual split: the exp of each value the adds and norms read with split channels
    # (`IntModel.read_exp`; their shifts are `read.<value>.shift` in the layer constants)
    read_exps: tuple[tuple[str, int], ...] = ()

    def read_exp(self, name: str) -> int:
        return dict(self.read_exps).get(name, 0)

    def plans(self, key: str, k: int) -> tuple[tuple[DotPlan, ...], tuple[int, ...]]:
        """How the matmul `key` with a contraction of `k` runs: its distinct plans (see
        `dot_plan`) and, per layer, the index of the one that layer uses."""
        pairs = dict(self.bounds)[key]
        # a row of probability codes sums to at most PROB_MAX + k/2 (each rounds by <= 1/2)
        a_sum = PROB_MAX + k // 2 if key == "pv" else None
        each = [self._plan(key, a_max, b_max, k, a_sum) for a_max, b_max in pairs]
        distinct = tuple(dict.fromkeys(each))
        return distinct, tuple(distinct.index(p) for p in each)

    def _plan(self, key: str, a_max: int, b_max: int, k: int, a_sum: int | None) -> DotPlan:
        if self.matmul == "f32":
            return dot_plan(a_max, b_max, k, a_sum)
        dtype = MATMUL_DTYPES[self.matmul]
        bound = (a_max * k if a_sum is None else min(a_max * k, a_sum)) * b_max
        if bound >= EXACT[dtype]:
            raise QnpuError(
                f"{key}: integer matmul bound {bound:.3g} is not exact with matmul="
                f"{self.matmul!r} (limit {EXACT[dtype]:.3g})"
            )
        return DotPlan(dtype, 0, 1, max(k, 1))


@partial(jax.tree_util.register_dataclass, data_fields=["layers", "globals"], meta_fields=["spec"])
@dataclasses.dataclass(frozen=True)
class IntConsts:
    """The artifact's tensors as device arrays: `layers` holds the per-layer ones stacked
    [L, ...] under their names without the `layers.` prefix (`q_proj.weight`, `act.qmin`,
    ...) and the per-layer matmul plan indices (`dot_plan.<const>`), `globals` the others
    under their full names. Model-level matmul weights (`lm_head.weight`) are stored as
    float32 (float64 with `matmul="f64"`), the same integer values; layer weights keep their
    integer dtype and are converted inside the scan."""

    layers: dict[str, jax.Array]
    globals: dict[str, jax.Array]
    spec: IntSpec


def _op_specs(ops: Any, part: str, known: Mapping[OpKind, Any]) -> tuple[OpSpec, ...]:
    """The op list `ops` of `part` ("model", "layer"), each op of a kind in `known`."""
    if not isinstance(ops, list):
        raise QnpuError(f"the artifact's graph has no {part} op list")
    out = []
    for op in ops:
        what = f"the integer forward has no {part}-level op"
        kind = op_kind(op.get("op") if isinstance(op, dict) else op, what)
        if kind not in known:
            raise QnpuError(f"{what} {kind.value!r}")
        out.append(OpSpec(kind, tuple(op["in"]), str(op["out"]), str(op["const"])))
    return tuple(out)


def int_spec(model: IntModel, matmul: str = "f32") -> IntSpec:
    """The static description of `model` that the jitted forward is specialized on."""
    if matmul not in MATMULS:
        raise QnpuError(f"matmul must be one of {MATMULS}, got {matmul!r}")
    m, g = model.model, model.graph
    ops = g.get("ops")
    if not isinstance(ops, dict):
        raise QnpuError("the artifact's graph has no op list")
    try:
        return IntSpec(
            num_layers=int(m["num_layers"]),
            hidden_size=int(m["hidden_size"]),
            num_heads=int(m["num_heads"]),
            num_kv_heads=int(m["num_kv_heads"]),
            head_dim=int(m["head_dim"]),
            vocab_size=int(m["vocab_size"]),
            max_context=int(g["max_context"]),
            prefill_chunk=int(g["prefill_chunk"]),
            prefix_len=len(g["prefix_tokens"]),
            norm_fraction_bits=int(g["norm_fraction_bits"]),
            norm_unit_bits=int(g["norm_unit_bits"]),
            logits_scale=float(g["logits_scale"]),
            model_ops=_op_specs(ops.get("model"), "model", MODEL_OPS),
            layer_ops=_op_specs(ops.get("layer"), "layer", LAYER_OPS),
            layer_acts=tuple(str(a) for a in g["layer_activations"]),
            global_acts=tuple(str(a) for a in g["global_activations"]),
            matmul=matmul,
            sliding=sliding if any(sliding := sliding_layers(m)) else (),
            sliding_window=int(m.get("sliding_window") or 0),
            read_exps=tuple(
                (n, model.read_exp(n))
                for n in dict.fromkeys(
                    i for part in ("layer", "model") for op in ops.get(part) or [] for i in op["in"]
                )
                if model.read_shifts(n) is not None
            ),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise QnpuError(f"incomplete model config or graph: {e}") from e


def _centered_max(model: IntModel, spec: IntSpec, name: str, layer: int | None) -> int:
    """max |code − zero point| over the range of activation `name`."""
    if layer is None:
        j, prefix = spec.global_acts.index(name), "act."
        z, lo, hi = (int(model.tensors[prefix + f][j]) for f in ("zero_point", "qmin", "qmax"))
    else:
        j, prefix = spec.layer_acts.index(name), "layers.act."
        z, lo, hi = (
            int(model.tensors[prefix + f][layer, j]) for f in ("zero_point", "qmin", "qmax")
        )
        bounds = model.shadow_bounds(name)
        if bounds is not None:  # shadow channels: their codes span SHADOW_BITS
            lo, hi = int(bounds[0][layer].min()), int(bounds[1][layer].max())
        if len(model.muxq_channels(name, layer)):  # the linear reads MUXQ codes times 2^exp
            return max(hi - z, z - lo, 0) << model.muxq_exp(name)
    return max(hi - z, z - lo, 0)


def _abs_max(a: np.ndarray) -> int:
    return max(abs(int(a.max(initial=0))), abs(int(a.min(initial=0))))


def matmul_bounds(
    model: IntModel, spec: IntSpec
) -> tuple[tuple[str, tuple[tuple[int, int], ...]], ...]:
    """max |operand| of every matmul (per layer for the layers' linears), from the
    activation ranges and the weights: the `IntSpec.bounds` the jitted forward plans from."""
    t = model.tensors
    acts = set(spec.layer_acts)
    unbounded = [
        op.ins
        for ops, known in ((spec.model_ops, set(spec.global_acts)), (spec.layer_ops, acts))
        for op in ops
        if op.op in MATMUL_KINDS and not set(op.ins) <= known
    ]
    if unbounded:
        raise QnpuError(f"matmul inputs {unbounded[0]} have no activation range to bound them")
    out: list[tuple[str, tuple[tuple[int, int], ...]]] = []
    for op in spec.model_ops:
        if op.op == OpKind.LINEAR:
            r = _centered_max(model, spec, op.ins[0], None)
            out.append((op.const, ((r, _abs_max(t[f"{op.const}.weight"])),)))
    layers = range(spec.num_layers)
    for op in spec.layer_ops:
        if op.op == OpKind.LINEAR:
            w = centered_weights(model, op.const)
            pairs = tuple(
                (_centered_max(model, spec, op.ins[0], i), _abs_max(w[i])) for i in layers
            )
            out.append((op.const, pairs))
        elif op.op == OpKind.ATTENTION:
            rq, rk, rv = (max(_centered_max(model, spec, n, i) for i in layers) for n in op.ins)
            out += [("scores", ((rq, rk),)), ("pv", ((PROB_MAX, rv),))]
    return tuple(out)


def check_exact(model: IntModel, spec: IntSpec) -> IntSpec:
    """`spec` with its matmul bounds, each matmul planned at the longest contraction it can
    see: raises QnpuError naming the first matmul that `spec.matmul` cannot run exactly."""
    j = spec.layer_acts.index(SCORES)
    lo, hi = (model.tensors[f"layers.act.{f}"][:, j] for f in ("qmin", "qmax"))
    narrow = max(-int(lo.min()), int(hi.max())) < 2**29
    spec = dataclasses.replace(spec, bounds=matmul_bounds(model, spec), narrow_scores=narrow)
    for key, _ in spec.bounds:
        spec.plans(key, _contraction(model, spec, key))
    return spec


def _contraction(model: IntModel, spec: IntSpec, key: str) -> int:
    if key == "scores":
        return spec.head_dim
    if key == "pv":
        return spec.max_context
    return int(model.tensors[f"{key}.weight"].shape[-1])


def int_consts(model: IntModel, matmul: str = "f32") -> IntConsts:
    """Upload the artifact's tensors (int64 ones need x64, enabled here for the upload), and
    for each layer linear whose layers need different matmul plans the per-layer plan index
    (`dot_plan.<const>`, int32 [L])."""
    spec = check_exact(model, int_spec(model, matmul))
    layers: dict[str, jax.Array] = {}
    glob: dict[str, jax.Array] = {}
    wtype = {"f32": jnp.float32, "f64": F64}.get(matmul)
    with jax.enable_x64(True):
        for name, a in model.tensors.items():
            arr = jnp.asarray(np.asarray(a))
            if wtype is not None and name.endswith(".weight") and not name.startswith("layers."):
                # converted once, on the device. Layer weights stay integers: the scan slices
                # one layer's out of the stack at each step, and slicing int8 then converting
                # moves a quarter of the bytes of slicing float32 (21 against 31 ms for 30
                # layers' gate and down on this CPU)
                arr = arr.astype(wtype)
            if name.endswith(".weight") and name.startswith("layers."):
                # an asymmetric weight runs centered (q − z_w, int16): the z_w·Σx term folded
                arr = jnp.asarray(centered_weights(model, name.removesuffix(".weight")))
            if name.startswith("layers."):
                layers[name.removeprefix("layers.")] = arr
            else:
                glob[name] = arr
        for name in spec.layer_acts:  # per-channel tables of shadow and MUXQ tensors [L, C]
            bounds = model.shadow_bounds(name)
            if bounds is not None:
                layers[f"shadow.{name}.qmin"] = jnp.asarray(bounds[0], jnp.int32)
                layers[f"shadow.{name}.qmax"] = jnp.asarray(bounds[1], jnp.int32)
            shifts = model.muxq_shifts(name)
            if shifts is not None:
                layers[f"muxq.{name}.shift"] = jnp.asarray(shifts, jnp.int32)
        last = spec.layer_ops[-1].out
        for name, _ in spec.read_exps:  # the residual split, as its readers shift it
            read = jnp.asarray(model.read_shifts(name), jnp.int32)
            if name == last:  # the final norm reads the last layer's output
                glob[f"read.{name}.shift"] = read[-1]
            else:
                layers[f"read.{name}.shift"] = read
        for key, _ in spec.bounds:
            plans, index = spec.plans(key, _contraction(model, spec, key))
            if len(plans) > 1:
                layers[f"dot_plan.{key}"] = jnp.asarray(index, jnp.int32)
    return IntConsts(layers, glob, spec)


def key_window(end: int, spec: IntSpec) -> int:
    """The static number of cache slots attention looks at when the last query sits at
    position end−1: `end` rounded up to four steps per octave (65 → 80, 513 → 640), at least
    one prefill chunk, at most max_context: few compiled programs, few keys wasted."""
    w = max(int(end), spec.prefill_chunk, 1)
    step = 1 << max((w - 1).bit_length() - 3, 0)
    return min(-(-w // step) * step, spec.max_context)


# ------------------------------------------------------------------------ kernels


def _require_x64() -> None:
    if not jax.enable_x64.value:
        raise QnpuError(
            "the integer forward needs 64-bit integers: call it inside "
            "`with jax.enable_x64(True):` (prefill/run_chunk/generate do this themselves)"
        )


def _einsum(subscripts: str, a: jax.Array, b: jax.Array) -> jax.Array:
    if a.dtype == I64:
        return jnp.einsum(subscripts, a, b.astype(I64), preferred_element_type=I64)
    return jnp.einsum(
        subscripts, a, b, precision=jax.lax.Precision.HIGHEST, preferred_element_type=a.dtype
    )


def _dot(
    spec: IntSpec,
    key: str,
    subscripts: str,
    a: jax.Array,
    b: jax.Array,
    index: jax.Array | None = None,
) -> jax.Array:
    """Exact integer einsum (int64 result) of integer-valued operands, contracting a's last
    axis, planned from the bounds of matmul `key`; where layers need different plans,
    `index` (this layer's `dot_plan.<key>`) picks the branch that runs."""
    plans, _ = spec.plans(key, a.shape[-1])
    branches = [partial(run_dot_plan, p, subscripts, xp=jnp, einsum=_einsum) for p in plans]
    a = a.astype(I64)
    if len(branches) == 1:
        return branches[0](a=a, b=b)
    if index is None:
        raise QnpuError(f"{key}: layers need different matmul plans but no plan index is given")
    return jax.lax.switch(index, [lambda a, b, f=f: f(a=a, b=b) for f in branches], a, b)


def _center(x: Value) -> jax.Array:
    return x[0].astype(I64) - x[1].astype(I64)


def isqrt(v: jax.Array) -> jax.Array:
    """floor(sqrt(v)) of non-negative int64 values below 2^62, exactly: a float64 estimate
    corrected by ±1 steps until r² <= v < (r+1)² holds everywhere (needs x64)."""
    _require_x64()
    v = jnp.asarray(v).astype(I64)
    r0 = jnp.floor(jnp.sqrt(v.astype(F64))).astype(I64)

    def wrong(r: jax.Array) -> jax.Array:
        return jnp.any(r * r > v) | jnp.any((r + 1) * (r + 1) <= v)

    def fix(r: jax.Array) -> jax.Array:
        r = jnp.where(r * r > v, r - 1, r)
        return jnp.where((r + 1) * (r + 1) <= v, r + 1, r)

    return jax.lax.while_loop(wrong, fix, r0)


def _stream_codes(x: Value, shift: jax.Array | None) -> jax.Array:
    """Centered codes as an add or a norm reads them: the residual split's channels shifted
    left by their exp (`shift` [C]; None: no split)."""
    xc = _center(x)
    return xc if shift is None else jnp.left_shift(xc, shift.astype(I64))


def _rmsnorm_centered(
    spec: IntSpec, xc: jax.Array, c: Mapping[str, jax.Array], out: Act, exp: int = 0
) -> jax.Array:
    """Integer RMSNorm over the last axis of centered codes (docs/artifact.md, "RMSNorm"); an
    input on the residual split runs with `exp` fewer fractional bits of the root."""
    f, k = spec.norm_fraction_bits - exp, spec.norm_unit_bits
    d = xc.shape[-1]
    ss = jnp.sum(xc * xc, axis=-1, keepdims=True)
    v = jnp.left_shift(ss, 2 * f) // d + jnp.reshape(c["eps"], ()).astype(I64)
    r = jnp.maximum(isqrt(v), 1)
    t = (jnp.left_shift(xc, f + k + 1) + r) // (2 * r)
    return requantize_jax(t * c["sign"].astype(I64), c["M"], c["shift"], *out)


def _linear(
    spec: IntSpec,
    key: str,
    x: Value,
    c: Mapping[str, jax.Array],
    out: Act,
    index: jax.Array | None = None,
    channel_scale: jax.Array | None = None,
) -> jax.Array:
    """`channel_scale` [C]: integers the centered input codes are multiplied by (MUXQ's 2^exp
    on its outlier channels: the Body and Aux matmuls in one)."""
    a = _center(x) if channel_scale is None else _center(x) * channel_scale.astype(I64)
    acc = _dot(spec, key, "...i,oi->...o", a, c["weight"], index)
    if "bias" in c:
        acc = acc + c["bias"].astype(I64)
    return requantize_jax(acc, c["M"], c["shift"], *out)


def _rope(
    spec: IntSpec,
    x: Value,
    c: Mapping[str, jax.Array],
    out: Act,
    cos: jax.Array,
    sin: jax.Array,
) -> jax.Array:
    b, t, width = x[0].shape
    hd = spec.head_dim
    xc = _center(x).reshape(b, t, width // hd, hd)
    if "norm.M" in c:  # Qwen3: each head RMSNormed into a 16-bit intermediate first
        norm = _sub(c, "norm")
        bound = jnp.asarray(HEAD_NORM_MAX, I64)
        xc = _rmsnorm_centered(spec, xc, norm, (jnp.zeros((), I64), -bound, bound)).astype(I64)
    half = hd // 2
    rot = jnp.concatenate([-xc[..., half:], xc[..., :half]], axis=-1)
    acc = xc * cos[None, :, None, :] + rot * sin[None, :, None, :]
    return requantize_jax(acc, c["M"], c["shift"], *out).reshape(b, t, width)


def _softmax_codes(
    scores: jax.Array, top: jax.Array, allowed: jax.Array, exp_lut: jax.Array, narrow: bool
) -> jax.Array:
    """Integer softmax over the last axis: unsigned 16-bit probability codes (masked → 0).
    `top` [.., 1] is the largest allowed score of each row. `narrow`: the scores lie within
    ±2^29, so differences and the exp terms' sums fit int32 (half the bytes of int64 on these
    [.., T, S] arrays); the last step is int64 either way."""
    wide = jnp.int32 if narrow else I64
    s = scores.astype(wide)
    d = jnp.where(allowed, jnp.minimum(top.astype(wide) - s, PROB_MAX), 0)
    # d is in [0, PROB_MAX]: "clip" never acts, and unlike the default ("fill") its consumers
    # need no bounds test on d, which made XLA recompute the scores for each of them
    e = jnp.where(allowed, jnp.take(exp_lut, d, axis=0, mode="clip"), 0).astype(wide)
    total = jnp.sum(e, axis=-1, keepdims=True, dtype=I64)  # S·65535 may pass 2^31
    num = e.astype(I64) * PROB_MAX + total // 2
    # both >= 0, so truncating division is floor division: one integer division per
    # element where jnp's `//` spends two (the slowest op left in this function on XLA:CPU)
    return jax.lax.div(num, jnp.broadcast_to(total, num.shape))


def _attention(
    spec: IntSpec,
    q: Value,
    k: Value,
    v: Value,
    c: Mapping[str, jax.Array],
    acts: Callable[[str], Act],
    out: Act,
    cache: tuple[jax.Array, jax.Array],
    layer: jax.Array,
    positions: jax.Array,
    window: int,
    sliding: jax.Array | None,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    hd, hkv, hq = spec.head_dim, spec.num_kv_heads, spec.num_heads
    b, t, _ = q[0].shape
    ck, cv = cache  # all layers' [L, B, Hkv, S, hd] int16 codes, carried through the scan
    # Write this chunk's K/V at its positions of this layer, in place (the buffers are the
    # scan's carry); positions past the context (prefill padding) drop.
    k_new = k[0].reshape(b, t, hkv, hd).transpose(1, 0, 2, 3).astype(ck.dtype)  # [T, B, ..]
    v_new = v[0].reshape(b, t, hkv, hd).transpose(1, 0, 2, 3).astype(cv.dtype)
    ck = ck.at[layer, :, :, positions].set(k_new, mode="drop")
    cv = cv.at[layer, :, :, positions].set(v_new, mode="drop")
    size = (1, b, hkv, window, hd)  # read only the window: keys past it are never seen
    zero = jnp.zeros((), layer.dtype)
    kl = jax.lax.dynamic_slice(ck, (layer, zero, zero, zero, zero), size)[0]
    vl = jax.lax.dynamic_slice(cv, (layer, zero, zero, zero, zero), size)[0]
    kc = kl.astype(I64) - k[1].astype(I64)
    vc = vl.astype(I64) - v[1].astype(I64)
    qc = _center(q).reshape(b, t, hkv, hq // hkv, hd)
    acc = _dot(spec, "scores", "btkgd,bksd->bkgts", qc, kc)
    keys = jnp.arange(window, dtype=positions.dtype)
    allowed = keys[None, :] <= positions[:, None]  # [T, S]: key position <= query position
    if sliding is not None:  # Gemma 3: the last sliding_window keys, the query's included
        recent = keys[None, :] > positions[:, None] - spec.sliding_window
        allowed &= recent | ~sliding
    rq = (c["scores.M"], c["scores.shift"], *acts(SCORES))
    scores = requantize_jax(acc, *rq)
    # requantization is monotone, so the largest score is the requantized largest
    # accumulator: the row maximum reads the matmul's output and XLA need not recompute the
    # [.., T, S] requantization for it (key 0 is allowed in every row, padding rows too)
    top = requantize_jax(
        jnp.max(jnp.where(allowed, acc, jnp.iinfo(I64).min), axis=-1, keepdims=True), *rq
    )
    probs = _softmax_codes(scores, top, allowed, c["softmax.exp_lut"], spec.narrow_scores)
    pv = _dot(spec, "pv", "bkgts,bksd->btkgd", probs, vc)
    res = requantize_jax(pv, c["pv.M"], c["pv.shift"], *out)
    return res.reshape(b, t, hq * hd), (ck, cv)


def _add(ac: jax.Array, bc: jax.Array, c: Mapping[str, jax.Array], out: Act) -> jax.Array:
    """Two centered inputs rescaled into the output with one shared shift (per channel where
    the output has residual-split channels)."""
    acc = ac * c["Ma"].astype(I64) + bc * c["Mb"].astype(I64)
    sh = c["shift"].astype(I64)
    y = jnp.right_shift(acc + jnp.left_shift(jnp.ones_like(sh), sh - 1), sh)
    y = y + out[0].astype(I64)
    return jnp.clip(y, out[1].astype(I64), out[2].astype(I64)).astype(jnp.int32)


def _sub(consts: Mapping[str, jax.Array], prefix: str) -> dict[str, jax.Array]:
    """The constants named `prefix.*` (all of them for an empty prefix)."""
    if not prefix:
        return dict(consts)
    p = prefix + "."
    return {k.removeprefix(p): v for k, v in consts.items() if k.startswith(p)}


# ------------------------------------------------------------------------ the forward


@dataclasses.dataclass
class _LayerRun:
    """What the ops of one decoder layer read (`_layer`'s arguments, `act` its activation
    bounds) and the K/V caches its attention op writes."""

    spec: IntSpec
    lc: Mapping[str, jax.Array]
    act: Callable[[str], Act]
    cache: tuple[jax.Array, jax.Array]
    layer: jax.Array
    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    window: int
    sliding: jax.Array | None  # this layer attends in a sliding window (None: no layer does)


Consts = Mapping[str, jax.Array]


def _read_shift(r: _LayerRun, name: str) -> jax.Array | None:
    return r.lc.get(f"read.{name}.shift")


def _run_rmsnorm(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    xc = _stream_codes(ins[0], _read_shift(r, op.ins[0]))
    return _rmsnorm_centered(r.spec, xc, c, out, r.spec.read_exp(op.ins[0]))


def _run_linear(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    shift = r.lc.get(f"muxq.{op.ins[0]}.shift")  # Body·W + (2^e − 1)·Aux·W, as one
    scale = None if shift is None else jnp.left_shift(jnp.ones_like(shift), shift)
    plan = r.lc.get(f"dot_plan.{op.const}")
    return _linear(r.spec, op.const, ins[0], c, out, plan, scale)


def _run_rope(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    return _rope(r.spec, ins[0], c, out, r.cos, r.sin)


def _run_attention(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    q, k, v = ins
    y, r.cache = _attention(
        r.spec, q, k, v, c, r.act, out, r.cache, r.layer, r.positions, r.window, r.sliding
    )
    return y


def _run_add(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    a, b = (_stream_codes(v, _read_shift(r, n)) for n, v in zip(op.ins, ins, strict=True))
    return _add(a, b, c, out)


def _run_lut(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    lo = r.act(op.ins[0])[1]
    index = ins[0][0].astype(I64) - lo.astype(I64)  # in range: the LUT spans it
    y = jnp.take(c["lut"], index, axis=0, mode="clip")
    return y.astype(jnp.int32)


def _run_mul(r: _LayerRun, op: OpSpec, ins: list[Value], c: Consts, out: Act) -> jax.Array:
    prod = _center(ins[0]) * _center(ins[1])
    return requantize_jax(prod, c["M"], c["shift"], *out)


# The integer forward's layer ops, traced once per compiled program (`_layer`).
LAYER_OPS: dict[OpKind, Callable[[_LayerRun, OpSpec, list[Value], Consts, Act], jax.Array]] = {
    OpKind.RMSNORM: _run_rmsnorm,
    OpKind.LINEAR: _run_linear,
    OpKind.ROPE: _run_rope,
    OpKind.ATTENTION: _run_attention,
    OpKind.ADD: _run_add,
    OpKind.LUT: _run_lut,
    OpKind.MUL: _run_mul,
}
check_handlers(LAYER_OPS, "the integer forward (layer ops)", MODEL_ONLY_KINDS)


def _layer(
    spec: IntSpec,
    x: Value,
    lc: Mapping[str, jax.Array],
    cache: tuple[jax.Array, jax.Array],
    layer: jax.Array,
    positions: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    window: int,
    sliding: jax.Array | None,
) -> tuple[Value, tuple[jax.Array, jax.Array]]:
    """One decoder layer: the layer op list interpreted over this layer's constants; `cache`
    holds every layer's K/V, `layer` says which are this one's; `sliding`, whether it attends
    in a sliding window (`cos`/`sin` are its own tables' rows)."""
    zp, qmin, qmax = lc["act.zero_point"], lc["act.qmin"], lc["act.qmax"]

    def act(name: str) -> Act:
        j = spec.layer_acts.index(name)
        if f"shadow.{name}.qmin" in lc:  # per channel: shadow channels are not clamped
            return zp[j], lc[f"shadow.{name}.qmin"], lc[f"shadow.{name}.qmax"]
        return zp[j], qmin[j], qmax[j]

    r = _LayerRun(spec, lc, act, cache, layer, positions, cos, sin, window, sliding)
    env: dict[str, Value] = {LAYER_INPUT: x}
    for op in spec.layer_ops:  # `int_spec` admits only LAYER_OPS' kinds
        out = act(op.out)
        ins = [env[n] for n in op.ins]
        c = _sub(lc, op.const.removeprefix("layers").removeprefix("."))
        if f"muxq.{op.out}.shift" in lc:  # MUXQ's Body: outlier channels exp bits further
            c = {**c, "shift": c["shift"] + lc[f"muxq.{op.out}.shift"]}
        y = LAYER_OPS[op.op](r, op, ins, c, out)
        env[op.out] = (y, out[0])
    return env[spec.layer_ops[-1].out], r.cache


@dataclasses.dataclass
class _ModelRun:
    """What the model's ops read (`_int_forward`'s arguments and what it derives from them)
    and the caches the layers op writes."""

    consts: IntConsts
    tokens: jax.Array
    cache_k: jax.Array
    cache_v: jax.Array
    positions: jax.Array
    cos: jax.Array
    sin: jax.Array
    window: int
    local: tuple[jax.Array, jax.Array] | None  # the sliding layers' cos/sin rows

    def act(self, name: str) -> Act:
        g = self.consts.globals
        if name == "logits":
            zero = jnp.zeros((), jnp.int32)
            return zero, jnp.asarray(LOGITS_RANGE[0], I64), jnp.asarray(LOGITS_RANGE[1], I64)
        j = self.consts.spec.global_acts.index(name)
        return g["act.zero_point"][j], g["act.qmin"][j], g["act.qmax"][j]


def _run_embed(m: _ModelRun, op: OpSpec, env: dict[str, Value]) -> Value:
    g = m.consts.globals
    out = m.act(op.out)
    ids = m.tokens.astype(jnp.int32)
    rows = jnp.take(g[f"{op.const}.table"], ids, axis=0).astype(I64)
    scale = jnp.take(g[f"{op.const}.M"], ids, axis=0)[..., None]
    sh = jnp.take(g[f"{op.const}.shift"], ids, axis=0)[..., None]
    return requantize_jax(rows, scale, sh, *out), out[0]


def _run_layers(m: _ModelRun, op: OpSpec, env: dict[str, Value]) -> Value:
    """Every decoder layer, under one `jax.lax.scan` over the stacked layer constants."""
    spec = m.consts.spec
    layer_consts = {k: v for k, v in m.consts.layers.items() if not k.startswith("prefix.")}

    def body(
        carry: tuple[Value, jax.Array, jax.Array],
        xs: tuple[dict[str, jax.Array], jax.Array, jax.Array],
    ) -> tuple[tuple[Value, jax.Array, jax.Array], None]:
        x, ck, cv = carry
        lc, layer, is_sliding = xs
        cos, sin, sliding = m.cos, m.sin, None
        if m.local is not None:  # Gemma 3: the sliding layers' tables and window
            cos = jnp.where(is_sliding, m.local[0], m.cos)
            sin = jnp.where(is_sliding, m.local[1], m.sin)
            sliding = is_sliding
        x, (ck, cv) = _layer(spec, x, lc, (ck, cv), layer, m.positions, cos, sin, m.window, sliding)
        return (x, ck, cv), None

    layers = jnp.arange(spec.num_layers, dtype=jnp.int32)
    flags = jnp.asarray(spec.sliding or (False,) * spec.num_layers)
    (x, m.cache_k, m.cache_v), _ = jax.lax.scan(
        body, (env[op.ins[0]], m.cache_k, m.cache_v), (layer_consts, layers, flags)
    )
    return x


def _run_model_rmsnorm(m: _ModelRun, op: OpSpec, env: dict[str, Value]) -> Value:
    """The final norm (of the last layer's output, on its residual split if it has one)."""
    out, g, spec = m.act(op.out), m.consts.globals, m.consts.spec
    c = _sub(g, op.const)
    shift = g.get(f"read.{op.ins[0]}.shift")
    exp = spec.read_exp(op.ins[0]) if shift is not None else 0
    xc = _stream_codes(env[op.ins[0]], shift)
    return _rmsnorm_centered(spec, xc, c, out, exp), out[0]


def _run_model_linear(m: _ModelRun, op: OpSpec, env: dict[str, Value]) -> Value:
    out = m.act(op.out)
    c = _sub(m.consts.globals, op.const)
    return _linear(m.consts.spec, op.const, env[op.ins[0]], c, out), out[0]


# The integer forward's model ops (`_int_forward`).
MODEL_OPS: dict[OpKind, Callable[[_ModelRun, OpSpec, dict[str, Value]], Value]] = {
    OpKind.EMBED: _run_embed,
    OpKind.LAYERS: _run_layers,
    OpKind.RMSNORM: _run_model_rmsnorm,
    OpKind.LINEAR: _run_model_linear,
}
check_handlers(MODEL_OPS, "the integer forward (model ops)", LAYER_ONLY_KINDS)


def _int_forward(
    consts: IntConsts,
    tokens: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    start: jax.Array,
    window: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Integer logits int32 [B, T, V] of `tokens` int32 [B, T] at positions
    start..start+T-1, and the caches [L, B, Hkv, max_context, hd] (int16 codes) with their
    K/V written. Positions past max_context are computed but not written (prefill padding).
    Attention reads the first `window` cache slots (static; all of them when None), which
    must hold every key up to the last query (`key_window(start + T, spec)`; a smaller
    window silently drops keys). Token ids are not checked here (out-of-range ids clamp; the
    convenience functions check them). Must run inside `with jax.enable_x64(True):`, raises
    QnpuError otherwise."""
    _require_x64()
    spec = consts.spec
    window = spec.max_context if window is None else window
    if not 0 < window <= spec.max_context:
        raise QnpuError(f"window must be in [1, {spec.max_context}], got {window}")
    g = consts.globals
    t = tokens.shape[1]
    positions = jnp.asarray(start, jnp.int32) + jnp.arange(t, dtype=jnp.int32)

    def rows(table: str) -> jax.Array:
        return jnp.take(g[table], positions, axis=0, mode="clip").astype(I64)

    cos, sin = rows("rope.cos"), rows("rope.sin")
    local = (rows(f"{LOCAL_ROPE}.cos"), rows(f"{LOCAL_ROPE}.sin")) if spec.sliding else None
    m = _ModelRun(consts, tokens, cache_k, cache_v, positions, cos, sin, window, local)
    env: dict[str, Value] = {}
    for op in spec.model_ops:  # `int_spec` admits only MODEL_OPS' kinds
        env[op.out] = MODEL_OPS[op.op](m, op, env)
    logits = env[spec.model_ops[-1].out][0].astype(jnp.int32)
    return logits, m.cache_k, m.cache_v


int_forward = jax.jit(_int_forward, static_argnames=("window",))
int_forward.__doc__ = _int_forward.__doc__
# The drivers' variant (`JaxIntEngine._extend`): the caches it is given are its own to reuse,
# so XLA writes the new K/V into them instead of copying every layer's cache at each call
# (a [L, B, Hkv, max_context, hd] copy per decode step made batched decoding no faster).
_int_forward_in_place = jax.jit(
    _int_forward, static_argnames=("window",), donate_argnames=("cache_k", "cache_v")
)


# ------------------------------------------------------------------------ the engine


@dataclasses.dataclass(frozen=True)
class IntCache:
    """K/V cache codes [L, B, Hkv, max_context, hd] (int16, on the device) and the number of
    filled positions. Slots at and after `length` hold garbage that no query ever sees.
    `np.asarray(cache.k)` gives the codes; an emulator `Cache` is accepted as input too."""

    k: jax.Array
    v: jax.Array
    length: int


class JaxIntEngine(IntegerEngine[IntCache]):
    """An artifact ready to run in JAX: the validated `IntModel` and its constants, uploaded
    once; compiled programs are cached per shape and shared by equal specs. Prefill, NLL and
    decoding come from `IntegerEngine`; each chunk is one jitted `int_forward` call."""

    def __init__(self, model: IntModel, matmul: str = "f32") -> None:
        if not isinstance(model, IntModel):
            raise QnpuError(f"JaxIntEngine runs an IntModel (load_int_model), got {type(model)}")
        self.model = model
        self.consts = int_consts(model, matmul)

    @property
    def spec(self) -> IntSpec:
        return self.consts.spec

    def new_cache(self, batch: int) -> IntCache:
        s = self.spec
        if batch < 1:
            raise QnpuError(f"batch must be >= 1, got {batch}")
        shape = (s.num_layers, batch, s.num_kv_heads, s.max_context, s.head_dim)
        k = np.zeros(shape, np.int16)
        v = np.zeros(shape, np.int16)
        if s.prefix_len:
            k[:, :, :, : s.prefix_len] = np.asarray(self.consts.layers["prefix.k"])[:, None]
            v[:, :, :, : s.prefix_len] = np.asarray(self.consts.layers["prefix.v"])[:, None]
        return IntCache(jnp.asarray(k), jnp.asarray(v), s.prefix_len)

    def _device_cache(self, cache: KVCache) -> IntCache:
        """`cache` (any engine's) as device arrays, shape checked; no copy of device arrays."""
        s = self.spec
        k, v = jnp.asarray(cache.k, jnp.int16), jnp.asarray(cache.v, jnp.int16)
        want = (s.num_layers, s.num_kv_heads, s.max_context, s.head_dim)
        for a in (k, v):
            if a.ndim != 5 or (a.shape[0], *a.shape[2:]) != want:
                expected = f"[{want[0]}, batch, {', '.join(map(str, want[1:]))}]"
                raise QnpuError(f"cache has shape {a.shape}, expected {expected}")
        return IntCache(k, v, int(cache.length))

    def _own(self, cache: KVCache) -> IntCache:
        c = self._device_cache(cache)  # a copy: `_extend` reuses (donates) its buffers
        return IntCache(jnp.array(c.k, copy=True), jnp.array(c.v, copy=True), c.length)

    def _take_rows(self, cache: KVCache, rows: np.ndarray) -> IntCache:
        c = self._device_cache(cache)
        idx = jnp.asarray(rows, jnp.int32)
        return IntCache(jnp.take(c.k, idx, axis=1), jnp.take(c.v, idx, axis=1), c.length)

    def _extend(self, tokens: np.ndarray, cache: IntCache) -> tuple[np.ndarray, IntCache]:
        return self._run(tokens, cache, _int_forward_in_place)

    def run_chunk(self, tokens: np.ndarray, cache: KVCache) -> tuple[np.ndarray, IntCache]:
        return self._run(tokens, self._device_cache(cache), int_forward)

    def _run(
        self, tokens: np.ndarray, cache: IntCache, fn: Callable[..., Any]
    ) -> tuple[np.ndarray, IntCache]:
        ids = check_tokens(tokens, self.spec.vocab_size)
        check_cache_batch(cache, ids.shape[0])
        check_room(cache.length, ids.shape[1], self.spec.max_context)
        with jax.enable_x64(True):
            window = key_window(cache.length + ids.shape[1], self.spec)
            start = jnp.int32(cache.length)
            logits, k, v = fn(self.consts, jnp.asarray(ids), cache.k, cache.v, start, window)
            out = np.asarray(logits)
        return out, IntCache(k, v, cache.length + ids.shape[1])
