"""Fold a quantized model (params + plan + quantizer state) into the integer artifact.

Every constant the integer run time needs is computed here, once, in numpy float64 from the
float32 encodings: weight codes, fixed-point requantization multipliers and shifts, zero
points and ranges, RMSNorm constants, LUTs (SiLU, exp) and the Q14 RoPE tables. The emulator
and the JAX integer forward only read them (docs/artifact.md writes the contract out).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.aimet import check_encodings_destination, write_aimet
from qnpu_jax.export.artifact import check_destination, write_artifact
from qnpu_jax.files import check_outside
from qnpu_jax.ir.graph import (
    FORMAT_GRAPH,
    FORMAT_GRAPH_CHANNELS,
    GRAPH,
    HEAD_NORM_MAX,
    LOGITS_SCALE,
    NORM_FRACTION_BITS,
    NORM_UNIT_BITS,
    ROPE_FRACTION_BITS,
    SOFTMAX_ROLE,
    Graph,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import (
    Params,
    forward_tapped,
    init_cache,
    lm_head_weight,
    rope_tables,
)
from qnpu_jax.models.taps import CacheOnlyTaps, FakeQuantTaps, QuantState, effective_state
from qnpu_jax.pipeline.run import load_run
from qnpu_jax.quant.plan import (
    PROBS_SCALE_DENOMINATOR,
    QuantPlan,
    TensorQuant,
    all_paths,
    is_weight,
)
from qnpu_jax.quant.requantize import (
    M_MAX,
    M_MIN,
    SHIFT_MAX,
    build_lut,
    fixed_point_multiplier,
    quantize_to_int,
)
from qnpu_jax.quant.spec import QuantSpec, block_view, check_block, lpbq_split, qrange
from qnpu_jax.quant.state import get_entry

DEFAULT_CONTEXT = 2048  # tokens after the sink prefix (the paper's sequence length)


@dataclasses.dataclass(frozen=True)
class IntEncoding:
    """One layer's slice of an activation's `quant.state.Encoding` as the integer graph
    uses it: a float64 scale, an integer zero point and the integer code range."""

    scale: float
    zero_point: int
    qmin: int
    qmax: int


def _requant(real: np.ndarray | float, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        return fixed_point_multiplier(real)
    except QnpuError as e:
        raise QnpuError(f"{what}: {e}") from e


def _two_input_rescale(ra: float, rb: float, what: str) -> tuple[int, int, int]:
    """(Ma, Mb, sh): a·ra + b·rb ≈ (a·Ma + b·Mb) / 2^sh, the larger multiplier in [2^30, 2^31)."""
    _, sh = _requant(max(ra, rb), what)
    s = int(sh)
    ma, mb = round(ra * 2.0**s), round(rb * 2.0**s)
    if max(ma, mb) >= M_MAX or min(ma, mb) < 0:
        raise QnpuError(f"{what}: rescale multipliers out of range")
    return ma, mb, s


def _lut(
    f: Callable[[np.ndarray], np.ndarray], enc_in: IntEncoding, enc_out: IntEncoding
) -> np.ndarray:
    """The contract's LUT (`build_lut`) between two encodings, zero points included."""
    return build_lut(
        f,
        enc_in.scale,
        enc_in.qmin,
        enc_in.qmax,
        enc_out.scale,
        enc_out.qmin,
        enc_out.qmax,
        zero_in=enc_in.zero_point,
        zero_out=enc_out.zero_point,
    )


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


# The real function of each LUT op of the graph, in float64 (LUTs are built offline).
LUT_FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"silu": _silu}


def _narrow(a: np.ndarray) -> np.ndarray:
    """The smallest of int8/int16/int32 holding `a` (int codes), for compact storage."""
    for dt in (np.int8, np.int16, np.int32):
        info = np.iinfo(dt)
        if a.size == 0 or (a.min() >= info.min and a.max() <= info.max):
            return a.astype(dt)
    raise QnpuError("integer constant does not fit int32")


def _padded_channels(lists: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Per-layer channel lists as int32 [L, K] (K the longest, at least 1), −1 padded."""
    out = np.full((len(lists), max(1, *(len(c) for c in lists))), -1, np.int32)
    for i, chans in enumerate(lists):
        out[i, : len(chans)] = chans
    return out


def _layer_scales(tq: TensorQuant, scale: np.ndarray, name: str) -> np.ndarray:
    """A layer activation's per-tensor scales [L]; for a MUXQ tensor, its Body scales (the
    state's per-channel scale divided by the outlier channels' 2^exp, equal on every one)."""
    n = scale.shape[0]
    if tq.muxq_channels is None:
        return scale.reshape(n)
    body = scale / tq.muxq_multipliers(scale.shape[-1]).astype(np.float32)
    if (body != body[:, :1]).any():
        raise QnpuError(f"layers/{name}: the MUXQ scales are not one Body scale times 2^exp")
    return body[:, 0]


def _activation_encodings(
    plan: QuantPlan, state: QuantState, num_layers: int, graph: Graph = GRAPH
) -> tuple[dict[str, list[IntEncoding]], dict[str, IntEncoding]]:
    layers: dict[str, list[IntEncoding]] = {}
    for t in graph.layer_acts:
        name = t.name
        tq = plan.get(f"layers/{name}")
        assert tq is not None
        if t.bits == SOFTMAX_ROLE:  # the integer softmax's fixed output encoding
            qmin, qmax = qrange(16, False)
            layers[name] = [IntEncoding(1.0 / PROBS_SCALE_DENOMINATOR, 0, qmin, qmax)] * num_layers
            continue
        s = _layer_scales(tq, np.asarray(state["layers"][name].scale, np.float32), name)
        z = np.rint(np.asarray(state["layers"][name].zero_point, np.float32)).reshape(num_layers)
        encs = []
        for i in range(num_layers):
            qmin, qmax = tq.qrange(tq.bits_for_layer(i))
            encs.append(IntEncoding(float(s[i]), int(z[i]), qmin, qmax))
        layers[name] = encs
    outer: dict[str, IntEncoding] = {}
    for name in (t.name for t in graph.global_acts):
        tq = plan.get(name)
        assert tq is not None
        qmin, qmax = tq.qrange(tq.bits)
        entry = get_entry(state, name)
        s0 = float(np.asarray(entry.scale, np.float32).reshape(()))
        z0 = int(np.rint(np.asarray(entry.zero_point, np.float32).reshape(())))
        outer[name] = IntEncoding(s0, z0, qmin, qmax)
    return layers, outer


def _weight_codes(
    w: np.ndarray, scale: np.ndarray, zero_point: np.ndarray, spec: QuantSpec, what: str
) -> np.ndarray:
    try:
        return quantize_to_int(w, scale, zero_point, spec).astype(np.int8)
    except QnpuError as e:
        raise QnpuError(f"{what}: {e}") from e


def _norm_constants(
    gamma: np.ndarray, enc_in: IntEncoding, enc_out: IntEncoding, eps: float, what: str
) -> dict[str, np.ndarray]:
    """RMSNorm: sign(γ), multipliers of |γ|·2^-K / s_out per channel, ε in fixed point."""
    g = np.asarray(gamma, np.float64)
    sign = np.sign(g).astype(np.int8)
    real = np.where(g == 0, 1.0, np.abs(g)) * 2.0**-NORM_UNIT_BITS / enc_out.scale
    m, sh = _requant(real, what)
    eps_fx = round(eps / enc_in.scale**2 * 2.0 ** (2 * NORM_FRACTION_BITS))
    if eps_fx >= 2**61:
        raise QnpuError(f"{what}: ε / s_in² is too large for the integer RMSNorm")
    return {"sign": sign, "M": m, "shift": sh, "eps": np.asarray(eps_fx, np.int64)}


def _stack(per_layer: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([d[k] for d in per_layer]) for k in per_layer[0]}


def _check_plan(
    plan: QuantPlan, num_layers: int, graph: Graph = GRAPH, *, integer: bool = True
) -> None:
    """What the integer graph needs of a plan (`integer` False: of an encodings table)."""
    missing = [p for p in all_paths(graph) if p not in plan]
    if missing:
        raise QnpuError(
            "the integer artifact quantizes every tensor of the graph, but the plan keeps "
            f"these in float: {', '.join(missing)} (use scope 'full')"
        )
    for path, tq in plan.entries:
        if is_weight(path, graph) and max(tq.layer_bits or (tq.bits,)) > 8:
            raise QnpuError(f"{path}: integer weights are at most 8 bits")
        if integer and tq.block is not None and tq.block_scale_bits is None:
            raise QnpuError(
                f"{path}: per-block weights with float block scales are not integer-only; "
                "give them integer block scales (block_scale_bits, AIMET's LPBQ) to export "
                "the integer artifact (AIMET encodings and ONNX take float block scales)"
            )


def weight_scales(tq: TensorQuant, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """One layer's weight scales as the integer graph holds them: (per-channel float32
    [out], LPBQ integer block scales [out, nb] or None). `scale` is the state's [out, 1]
    (per channel) or [out, nb] (per block): a float per-block weight keeps [out · nb]."""
    s = np.asarray(scale, np.float32)
    if tq.block_scale_bits is None:
        return s.reshape(-1), None
    channel, k = lpbq_split(s.reshape(s.shape[0], -1), tq.block_scale_bits)
    return channel.reshape(-1).astype(np.float32), k.astype(np.uint8)


def weight_zero_points(tq: TensorQuant, zero_point: np.ndarray, what: str) -> np.ndarray:
    """One layer's weight zero points [out] as integers: zeros for a symmetric weight; for an
    asymmetric one each row's, which must lie on its code grid (a row with both signs does)."""
    z = np.rint(np.asarray(zero_point, np.float64)).reshape(-1)
    if tq.symmetric:
        return np.zeros(z.shape, np.int32)
    lo, hi = tq.qrange(max(tq.layer_bits or (tq.bits,)))
    if z.min(initial=0) < lo or z.max(initial=0) > hi:
        raise QnpuError(f"{what}: weight zero points must lie in [{lo}, {hi}] (the code range)")
    return z.astype(np.int32)


def _layer_weight_codes(
    w: np.ndarray,
    tq: TensorQuant,
    layer: int,
    scale: np.ndarray,
    what: str,
    zero_point: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(codes [out, in], per-channel scales [out], LPBQ block scales [out, nb] or None) of
    one layer's weight; `zero_point` [out] for an asymmetric one."""
    blocks = 1 if tq.block is None else check_block(tq.block, w.shape[-1], what)
    if np.shape(scale) != (w.shape[0], blocks):
        raise QnpuError(
            f"{what}: weight scales {np.shape(scale)} do not match the plan's "
            f"{(w.shape[0], blocks)} (calibrate again after changing the plan)"
        )
    channel, k = weight_scales(tq, scale)
    if tq.block is None or k is None:
        s = channel.reshape(-1, 1)
        z = np.zeros_like(s) if zero_point is None else zero_point.reshape(-1, 1)
        return _weight_codes(w, s, z.astype(np.float32), tq.spec(layer), what), channel, None
    s = (channel[:, None] * k.astype(np.float32))[..., None]  # the block scales, [out, nb, 1]
    view = block_view(w, tq.block)
    codes = _weight_codes(view, s, np.zeros_like(s), tq.spec(layer), what)
    return codes.reshape(w.shape), channel, k


def prefix_cache_codes(
    params: Params,
    cfg: ModelConfig,
    plan: QuantPlan,
    state: QuantState,
    prefix: tuple[int, ...],
    k_enc: list[IntEncoding],
    v_enc: list[IntEncoding],
    graph: Graph = GRAPH,
) -> tuple[np.ndarray, np.ndarray]:
    """K/V cache codes [L, Hkv, P, hd] of the sink prefix, computed offline as fake-quant does
    (the prefix runs in float; only its K/V are quantized)."""
    p = len(prefix)
    cache = init_cache(cfg, 1, p)
    tokens = jnp.asarray([prefix], jnp.int32)
    taps = CacheOnlyTaps(FakeQuantTaps(plan))
    _, cache, _ = jax.jit(
        lambda params, state, tokens, cache: forward_tapped(
            params, tokens, cache, jnp.int32(0), state, cfg=cfg, taps=taps, graph=graph
        )
    )(params, state, tokens, cache)
    out = []
    for key, encs in (("k", k_enc), ("v", v_enc)):
        vals = np.asarray(cache[key], np.float32)[:, 0]  # [L, Hkv, P, hd] dequantized values
        codes = np.stack(
            [
                np.clip(np.rint(vals[i] / e.scale) + e.zero_point, e.qmin, e.qmax)
                for i, e in enumerate(encs)
            ]
        )
        out.append(_narrow(codes.astype(np.int64)))
    return out[0], out[1]


def encodings_table(
    plan: QuantPlan,
    state: QuantState,
    cfg: ModelConfig,
    layer_encs: Mapping[str, list[IntEncoding]],
    outer_encs: Mapping[str, IntEncoding],
    graph: Graph = GRAPH,
) -> dict[str, dict[str, Any]]:
    """Every tensor's encoding by artifact name (`layers.{i}.NAME`, `embed_tokens`, ...)."""
    table: dict[str, dict[str, Any]] = {}
    n = cfg.num_layers
    for name in (t.name for t in graph.layer_weights):
        tq = plan.get(f"layers/{name}")
        assert tq is not None
        s = np.asarray(state["layers"][name].scale, np.float32)
        zp = np.asarray(state["layers"][name].zero_point, np.float32)
        for i in range(n):
            channel, k = weight_scales(tq, s[i])
            z = weight_zero_points(tq, zp[i], f"layers.{i}.{name}") if k is None else None
            entry: dict[str, Any] = {
                "bits": tq.bits_for_layer(i),
                "signed": True,
                "symmetric": tq.symmetric,
                "axis": 0,
                "scale": [float(v) for v in channel],
                "zero_point": [0] * channel.size if z is None else [int(v) for v in z],
            }
            if tq.block is not None:
                entry["block"] = tq.block
            if k is not None:
                entry["block_scale_bits"] = tq.block_scale_bits
                entry["block_scale"] = [int(v) for v in k.reshape(-1)]
            table[f"layers.{i}.{name}"] = entry
    for name, encs in layer_encs.items():
        tq = plan.get(f"layers/{name}")
        assert tq is not None
        for i, e in enumerate(encs):
            table[f"layers.{i}.{name}"] = _act_entry(e, tq.symmetric, tq.signed)
            if tq.shadow_channels and tq.shadow_channels[i]:  # codes not clamped there
                table[f"layers.{i}.{name}"]["shadow_channels"] = list(tq.shadow_channels[i])
            if tq.muxq_channels and tq.muxq_channels[i]:  # scale · 2^exp there
                table[f"layers.{i}.{name}"]["muxq"] = {
                    "exp": tq.muxq_exp,
                    "channels": list(tq.muxq_channels[i]),
                }
    for name, e in outer_encs.items():
        tq = plan.get(name)
        assert tq is not None
        table[name] = _act_entry(e, tq.symmetric, tq.signed)
    for name in (op.weight_name for op in graph.model if op.weight is not None):
        tq = plan.get(name)
        assert tq is not None
        rows = np.asarray(get_entry(state, name).scale, np.float32).reshape(-1)
        table[name] = {
            "bits": tq.bits,
            "signed": True,
            "symmetric": True,
            "axis": 0,
            "scale": [float(v) for v in rows],
            "zero_point": [0] * rows.size,
        }
    return table


def run_encodings(
    plan: QuantPlan, state: QuantState, cfg: ModelConfig, graph: Graph = GRAPH
) -> dict[str, Any]:
    """The encodings table of a run (what `export_model` puts in the manifest and the AIMET
    file carries), without building the integer tensors."""
    _check_plan(plan, cfg.num_layers, graph, integer=False)
    state = effective_state(plan, state)
    acts, outer = _activation_encodings(plan, state, cfg.num_layers, graph)
    return encodings_table(plan, state, cfg, acts, outer, graph)


def _act_entry(e: IntEncoding, symmetric: bool, signed: bool) -> dict[str, Any]:
    bits = int(math.log2(e.qmax - e.qmin + 1))
    return {
        "bits": bits,
        "signed": signed,
        "symmetric": symmetric,
        "axis": None,
        "scale": [e.scale],
        "zero_point": [e.zero_point],
    }


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """Everything an artifact holds, before it is written."""

    manifest: dict[str, Any]
    tensors: dict[str, np.ndarray]
    int4: frozenset[str]


def context_positions(cfg: ModelConfig, prefix_tokens: int, max_context: int | None) -> int:
    """The positions an export's cache and RoPE tables hold: `max_context`, by default 2048
    after the sink prefix, within the model's maximum; QnpuError when they do not fit."""
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, DEFAULT_CONTEXT + prefix_tokens)
    if max_context > cfg.max_position_embeddings:
        raise QnpuError(
            f"max context {max_context} exceeds the model's {cfg.max_position_embeddings} "
            "positions (max_position_embeddings)"
        )
    if prefix_tokens >= max_context:
        raise QnpuError(
            f"sink prefix of {prefix_tokens} tokens does not fit {max_context} positions"
        )
    return max_context


def export_model(
    params: Params,
    cfg: ModelConfig,
    plan: QuantPlan,
    state: QuantState,
    *,
    prefix: tuple[int, ...] = (),
    max_context: int | None = None,
    prefill_chunk: int = 64,
    tokenizer_info: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
    graph: Graph = GRAPH,
    prefix_params: Params | None = None,
) -> ExportedModel:
    """The integer artifact of a fake-quant model (`params` as the fake-quant forward uses
    them: fused and rotated for rotated methods): the constants of each op of `graph`.
    `prefix_params`: what the offline sink prefix runs on where not `params`
    (`QuantizedModel.prefix_params`)."""
    n = cfg.num_layers
    if plan.num_layers != n:
        raise QnpuError(f"plan has {plan.num_layers} layers, the model {n}")
    _check_plan(plan, n, graph)
    state = effective_state(plan, state)
    max_context = context_positions(cfg, len(prefix), max_context)
    if not 1 <= prefill_chunk <= max_context - len(prefix):
        raise QnpuError(
            f"prefill chunk must be in 1..{max_context - len(prefix)} (the context of "
            f"{max_context} after a {len(prefix)}-token prefix), got {prefill_chunk}"
        )
    if cfg.head_dim % 2:
        raise QnpuError("RoPE needs an even head dimension")
    np_params = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    layers = np_params["layers"]
    acts, outer = _activation_encodings(plan, state, n, graph)
    layer_acts = [t.name for t in graph.layer_acts]
    embed_op, _, norm_op, head_op = graph.model  # embed → layers → final norm → lm_head
    tensors: dict[str, np.ndarray] = {}
    int4: set[str] = set()

    def enc(name: str, i: int) -> IntEncoding:
        """The encoding of value `name` in layer i (the layer input: the previous output)."""
        if name == graph.layer_input:
            return outer[embed_op.out_name] if i == 0 else enc(graph.layer[-1].out_name, i - 1)
        return acts[name][i]

    def scales(name: str) -> np.ndarray:
        """The per-layer scales [L] of value `name`, in float64."""
        return np.array([enc(name, i).scale for i in range(n)])

    # Activation ranges and zero points, [L, len(layer acts)] and [len(global acts)].
    for field in ("zero_point", "qmin", "qmax"):
        tensors[f"layers.act.{field}"] = np.array(
            [[getattr(enc(a, i), field) for a in layer_acts] for i in range(n)], np.int32
        )
        tensors[f"act.{field}"] = np.array([getattr(e, field) for e in outer.values()], np.int32)

    # Channel lists of linear inputs: shadow channels (mllm-NPU) and MUXQ's outlier channels.
    shadow: dict[str, int] = {}
    muxq: dict[str, dict[str, int]] = {}
    weight_zero: list[str] = []  # the linears with asymmetric weights
    for act in layer_acts:
        tq = plan.get(f"layers/{act}")
        if tq is not None and tq.shadow_channels is not None:
            tensors[f"layers.shadow.{act}.channels"] = _padded_channels(tq.shadow_channels)
            shadow[act] = tensors[f"layers.shadow.{act}.channels"].shape[1]
        if tq is not None and tq.muxq_channels is not None and tq.muxq_exp is not None:
            tensors[f"layers.muxq.{act}.channels"] = _padded_channels(tq.muxq_channels)
            k = tensors[f"layers.muxq.{act}.channels"].shape[1]
            muxq[act] = {"exp": tq.muxq_exp, "channels": k}

    # Embedding: per-row int8 codes, requantized row by row into embed_out.
    table = embed_op.weight_name
    tq = plan.get(table)
    assert tq is not None
    s_rows = np.asarray(get_entry(state, table).scale, np.float32).reshape(-1, 1)
    tensors["embed.table"] = _weight_codes(
        np_params[table], s_rows, np.zeros_like(s_rows), tq.spec(), table
    )
    m, sh = _requant(s_rows[:, 0].astype(np.float64) / outer[embed_op.out_name].scale, table)
    tensors["embed.M"], tensors["embed.shift"] = m, sh

    eps = cfg.rms_norm_eps
    for op in graph.layer:
        src, dst, c = op.ins[0], op.out_name, op.const
        if op.kind == "linear":
            # codes [L, out, in], per-output-channel requantization into the output
            name = op.weight_name
            tq = plan.get(f"layers/{name}")
            assert tq is not None
            w = layers[name]
            s_state = np.asarray(state["layers"][name].scale, np.float32)
            z_state = np.asarray(state["layers"][name].zero_point, np.float32)
            codes, ms, shs, biases, blocks, zeros = [], [], [], [], [], []
            for i in range(n):
                where = f"layers.{i}.{name}"
                z_w = weight_zero_points(tq, z_state[i], where)
                q, s_w, block_scales = _layer_weight_codes(w[i], tq, i, s_state[i], where, z_w)
                codes.append(q)
                zeros.append(z_w)
                if block_scales is not None:
                    blocks.append(block_scales)
                s_acc = enc(src, i).scale * s_w.astype(np.float64)
                m, sh = _requant(s_acc / enc(dst, i).scale, where)
                ms.append(m)
                shs.append(sh)
                if op.bias and op.bias in layers:
                    b = np.rint(layers[op.bias][i].astype(np.float64) / s_acc)
                    if np.abs(b).max() >= 2**31:
                        raise QnpuError(f"layers.{i}.{op.bias} does not fit int32 at s_in·s_w")
                    biases.append(b.astype(np.int32))
            tensors[f"{c}.weight"] = np.stack(codes)
            tensors[f"{c}.M"] = np.stack(ms)
            tensors[f"{c}.shift"] = np.stack(shs)
            if biases:
                tensors[f"{c}.bias"] = np.stack(biases)
            if blocks:  # LPBQ: the engines run the int8 codes k·q (`int_model.lpbq_weights`)
                tensors[f"{c}.block_scale"] = np.stack(blocks)
            if not tq.symmetric:  # the matmul subtracts z_w[o]·Σ_i xc_i
                tensors[f"{c}.weight_zero_point"] = np.stack(zeros)
                weight_zero.append(c)
            if max(tq.layer_bits or (tq.bits,)) <= 4:
                int4.add(f"{c}.weight")
        elif op.kind == "rmsnorm":
            # γ = 1 after fuse_norms; kept general for unrotated methods
            norms = [
                _norm_constants(
                    layers[op.gain][i], enc(src, i), enc(dst, i), eps, f"layers.{i}.{op.gain}"
                )
                for i in range(n)
            ]
            for k, v in _stack(norms).items():
                tensors[f"{c}.{k}"] = v
        elif op.kind == "rope":  # Q14 tables: requantize s_in·2^-14 / s_out
            s_in = scales(src)
            if cfg.qk_norm and op.head_norm:  # Qwen3: each head RMSNormed into 16 bits first
                gains = np.asarray(layers[op.head_norm], np.float64)  # [L, hd]
                s_in = np.maximum(np.abs(gains).max(axis=1), 1e-30) * math.sqrt(cfg.head_dim)
                s_in = s_in / HEAD_NORM_MAX
                norms = [
                    _norm_constants(
                        gains[i],
                        enc(src, i),
                        IntEncoding(float(s_in[i]), 0, -HEAD_NORM_MAX, HEAD_NORM_MAX),
                        eps,
                        f"layers.{i}.{op.head_norm}",
                    )
                    for i in range(n)
                ]
                for k, v in _stack(norms).items():
                    tensors[f"{c}.norm.{k}"] = v
            real = s_in * 2.0**-ROPE_FRACTION_BITS / scales(dst)
            tensors[f"{c}.M"], tensors[f"{c}.shift"] = _requant(real, c)
        elif op.kind == "attention":
            # scores requantization, exp LUT of the softmax, P·V requantization
            q_in, k_in, v_in = op.ins
            scores, probs = (t.name for t in op.inner)
            real = scales(q_in) * scales(k_in) / math.sqrt(cfg.head_dim) / scales(scores)
            tensors["layers.scores.M"], tensors["layers.scores.shift"] = _requant(
                real, "layers.scores"
            )
            exp_luts = []
            for i in range(n):
                diff = IntEncoding(enc(scores, i).scale, 0, 0, (1 << 16) - 1)
                exp_luts.append(_lut(lambda x: np.exp(-x), diff, enc(probs, i)).astype(np.uint16))
            tensors["layers.softmax.exp_lut"] = np.stack(exp_luts)
            real = scales(v_in) / PROBS_SCALE_DENOMINATOR / scales(dst)
            tensors["layers.pv.M"], tensors["layers.pv.shift"] = _requant(real, "layers.pv")
            if prefix:
                k_codes, v_codes = prefix_cache_codes(
                    params if prefix_params is None else prefix_params,
                    cfg,
                    plan,
                    state,
                    prefix,
                    acts[k_in],
                    acts[v_in],
                    graph,
                )
                tensors["layers.prefix.k"], tensors["layers.prefix.v"] = k_codes, v_codes
        elif op.kind == "add":  # two inputs rescaled into the output with one shared shift
            triples = [
                _two_input_rescale(
                    enc(op.ins[0], i).scale / enc(dst, i).scale,
                    enc(op.ins[1], i).scale / enc(dst, i).scale,
                    f"layers.{i}.{dst}",
                )
                for i in range(n)
            ]
            arr = np.array(triples, np.int64)
            tensors[f"{c}.Ma"] = arr[:, 0].astype(np.int32)
            tensors[f"{c}.Mb"] = arr[:, 1].astype(np.int32)
            tensors[f"{c}.shift"] = arr[:, 2].astype(np.int32)
        elif op.kind == "lut":  # a table over the input's whole code range
            f = LUT_FUNCTIONS[op.fn]
            luts = [_lut(f, enc(src, i), enc(dst, i)) for i in range(n)]
            if len({len(t) for t in luts}) != 1:
                raise QnpuError(f"layers/{src}: the {op.fn} LUTs need one bit-width in every layer")
            tensors[f"{c}.lut"] = _narrow(np.stack(luts))
        elif op.kind == "mul":  # the product requantized
            real = scales(src) * scales(op.ins[1]) / scales(dst)
            tensors[f"{c}.M"], tensors[f"{c}.shift"] = _requant(real, c)
        else:
            raise QnpuError(f"the exporter has no {op.kind!r} op in a layer")

    # The final norm and the RoPE tables.
    last = graph.layer[-1].out_name
    final = _norm_constants(
        np_params[norm_op.gain], enc(last, n - 1), outer[norm_op.out_name], eps, norm_op.gain
    )
    for k, v in final.items():
        tensors[f"{norm_op.const}.{k}"] = v
    cos, sin = rope_tables(cfg, max_context)
    tensors["rope.cos"], tensors["rope.sin"] = cos, sin

    # lm_head: W8 per channel; int32 logits at the fixed scale LOGITS_SCALE.
    head_name = head_op.weight_name
    tq = plan.get(head_name)
    assert tq is not None
    head = np.asarray(lm_head_weight(np_params), np.float32)
    s_head = np.asarray(get_entry(state, head_name).scale, np.float32).reshape(-1, 1)
    tensors[f"{head_op.const}.weight"] = _weight_codes(
        head, s_head, np.zeros_like(s_head), tq.spec(), head_name
    )
    real_head = outer[norm_op.out_name].scale * s_head[:, 0].astype(np.float64) / LOGITS_SCALE
    tensors[f"{head_op.const}.M"], tensors[f"{head_op.const}.shift"] = _requant(
        real_head, head_name
    )

    _check_multipliers(tensors)
    for act, entry in muxq.items():  # the producer shifts MUXQ channels exp bits further
        producer = next(op for op in graph.layer if op.out_name == act)
        if int(tensors[f"{producer.const}.shift"].max()) + entry["exp"] > SHIFT_MAX:
            raise QnpuError(f"layers/{act}: MUXQ's exp takes the requantization shift past 62")
    manifest = {
        "model": dataclasses.asdict(cfg),
        "graph": {
            "format": FORMAT_GRAPH_CHANNELS if shadow or muxq or weight_zero else FORMAT_GRAPH,
            "ops": graph.ops_json(),
            "layer_activations": layer_acts,
            "global_activations": list(outer),
            "prefix_tokens": list(prefix),
            "max_context": max_context,
            "prefill_chunk": prefill_chunk,
            "norm_fraction_bits": NORM_FRACTION_BITS,
            "norm_unit_bits": NORM_UNIT_BITS,
            "rope_fraction_bits": ROPE_FRACTION_BITS,
            "logits_scale": LOGITS_SCALE,
            **({"shadow": shadow} if shadow else {}),
            **({"muxq": muxq} if muxq else {}),
            **({"weight_zero_points": weight_zero} if weight_zero else {}),
        },
        "encodings": encodings_table(plan, state, cfg, acts, outer, graph),
        "tokenizer": dict(tokenizer_info or {}),
        "source": dict(source or {}),
    }
    return ExportedModel(manifest, tensors, frozenset(int4))


def _check_multipliers(tensors: Mapping[str, np.ndarray]) -> None:
    for name, a in tensors.items():
        if name.endswith(".M"):
            assert a.dtype == np.int32 and (a >= M_MIN).all(), name
        if name.endswith(".shift"):
            assert (a >= 1).all() and (a <= SHIFT_MAX).all(), name


def export_run(run_dir: Path, out_dir: Path, **kwargs: Any) -> Path:
    """Export a finished `qnpu quantize` run to an integer artifact at `out_dir`."""

    check_export_destination(run_dir, out_dir)  # refuse before the slow part, too
    run = load_run(Path(run_dir))
    source = {"run": Path(run_dir).name, "method": run.config.method, "model": run.model.source}
    return export_quantized(run.model, out_dir, run.tokenizer, source=source, **kwargs)


def export_quantized(
    model: Any,
    out_dir: Path | str,
    tokenizer: Any,
    *,
    source: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Path:
    """Export a `QuantizedModel` (calibrated) to an integer artifact at `out_dir`; `kwargs`
    as `export_model` takes them (max_context, prefill_chunk, ...)."""
    check_destination(Path(os.path.abspath(out_dir)))
    exported = export_model(
        model.params(),
        model.cfg,
        model.require_plan(),
        model.require_state(),
        prefix=model.prefix,
        prefix_params=model.prefix_params(),
        tokenizer_info=tokenizer_info(tokenizer),
        source=dict(source or {"model": model.source, "steps": [s.name for s in model.steps]}),
        **kwargs,
    )
    return write_exported(exported, Path(out_dir), tokenizer)


def export_run_aimet(run_dir: Path, out_dir: Path, *, version: str = "1.0.0") -> Path:
    """AIMET encodings of a run's tensors: OUT/<run name>.encodings (HF module names)."""

    out = Path(out_dir)
    check_outside(out, {"--run": run_dir}, "--out")
    if out.exists() and not out.is_dir():
        raise QnpuError(f"{out} exists and is not a directory")
    target = out / f"{Path(run_dir).resolve().name}.encodings"
    check_encodings_destination(target)
    model = load_run(Path(run_dir)).model
    encodings = run_encodings(model.require_plan(), model.require_state(), model.cfg)
    return write_aimet(target, encodings, version=version)


def check_export_destination(run_dir: Path | str, out_dir: Path | str) -> None:
    """Refuse an export's `out_dir` inside the run it exports (the export would change the
    run), or anything there but one of our artifacts (`check_destination`)."""
    check_destination(Path(os.path.abspath(out_dir)))
    check_outside(Path(out_dir), {"--run": run_dir}, "--out")


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    return {
        "file": "tokenizer.json",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def write_exported(exported: ExportedModel, out_dir: Path, tokenizer: Any | None) -> Path:
    files: dict[str, bytes] = {}
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.backend.to_str().encode()
    return write_artifact(
        Path(out_dir), exported.manifest, exported.tensors, int4=exported.int4, files=files
    )
