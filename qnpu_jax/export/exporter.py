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
    LAYER_ONLY_KINDS,
    LOCAL_ROPE,
    LOGITS_SCALE,
    MODEL_ONLY_KINDS,
    NORM_FRACTION_BITS,
    NORM_UNIT_BITS,
    RESIDUAL_OUTPUTS,
    ROPE_FRACTION_BITS,
    SOFTMAX_ROLE,
    Graph,
    Op,
    OpKind,
    check_handlers,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import (
    Params,
    forward_tapped,
    graph_of,
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


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (Gemma's gelu_pytorch_tanh; `jax.nn.gelu(approximate=True)`)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


# The real function of each LUT op of the graph, in float64 (LUTs are built offline).
LUT_FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "silu": _silu,
    "gelu_tanh": _gelu_tanh,
}


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
    gamma: np.ndarray,
    enc_in: IntEncoding,
    enc_out: IntEncoding,
    eps: float,
    what: str,
    read_exp: int = 0,
) -> dict[str, np.ndarray]:
    """RMSNorm: sign(γ), multipliers of |γ|·2^-K / s_out per channel, ε in fixed point (at
    F − `read_exp` fractional bits for an input on the residual split)."""
    g = np.asarray(gamma, np.float64)
    sign = np.sign(g).astype(np.int8)
    real = np.where(g == 0, 1.0, np.abs(g)) * 2.0**-NORM_UNIT_BITS / enc_out.scale
    m, sh = _requant(real, what)
    eps_fx = round(eps / enc_in.scale**2 * 2.0 ** (2 * (NORM_FRACTION_BITS - read_exp)))
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


def run_encodings(plan: QuantPlan, state: QuantState, cfg: ModelConfig) -> dict[str, Any]:
    """The encodings table of a run over its plan's graph (what `export_model` puts in the
    manifest and the AIMET file carries), without building the integer tensors."""
    graph = plan.graph
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


@dataclasses.dataclass
class _Export:
    """What the constant builders read (the model, plan, state and encodings) and what they
    fill: the artifact's tensors, the int4 ones, the channel lists and asymmetric linears."""

    params: Params  # as given: the offline sink prefix runs on them (or `prefix_params`)
    np_params: Params  # float32 numpy
    cfg: ModelConfig
    plan: QuantPlan
    state: QuantState
    graph: Graph
    acts: dict[str, list[IntEncoding]]
    outer: dict[str, IntEncoding]
    prefix: tuple[int, ...]
    prefix_params: Params | None
    tensors: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    int4: set[str] = dataclasses.field(default_factory=set)
    shadow: dict[str, int] = dataclasses.field(default_factory=dict)
    muxq: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    weight_zero: list[str] = dataclasses.field(default_factory=list)  # asymmetric linears

    @property
    def n(self) -> int:
        return self.cfg.num_layers

    @property
    def layers(self) -> Params:
        return self.np_params["layers"]  # type: ignore[no-any-return]

    def enc(self, name: str, i: int) -> IntEncoding:
        """The encoding of value `name` in layer i (the layer input: the previous output)."""
        g = self.graph
        if name == g.layer_input:
            if i == 0:
                layers_op = next(op for op in g.model if op.kind == OpKind.LAYERS)
                return self.outer[layers_op.ins[0]]
            return self.enc(g.layer[-1].out_name, i - 1)
        return self.acts[name][i]

    def read_exp(self, name: str) -> int:
        """The residual split's exp of value `name` as the adds and norms read it (of the
        last layer op's output for the layer input; 0 without a split)."""
        g = self.graph
        source = g.layer[-1].out_name if name == g.layer_input else name
        tq = self.plan.get(f"layers/{source}")
        return (tq.muxq_exp or 0) if tq is not None and source in RESIDUAL_OUTPUTS else 0

    def scales(self, name: str) -> np.ndarray:
        """The per-layer scales [L] of value `name`, in float64."""
        return np.array([self.enc(name, i).scale for i in range(self.n)])

    def model_enc(self, name: str) -> IntEncoding:
        """The encoding of model-level value `name`: a global activation's, or the last
        layer's (the layers op's output)."""
        return self.outer[name] if name in self.outer else self.enc(name, self.n - 1)


def _act_tables(x: _Export) -> None:
    """Activation ranges and zero points, [L, len(layer acts)] and [len(global acts)]."""
    layer_acts = [t.name for t in x.graph.layer_acts]
    for field in ("zero_point", "qmin", "qmax"):
        x.tensors[f"layers.act.{field}"] = np.array(
            [[getattr(x.enc(a, i), field) for a in layer_acts] for i in range(x.n)], np.int32
        )
        x.tensors[f"act.{field}"] = np.array(
            [getattr(e, field) for e in x.outer.values()], np.int32
        )


def _channel_lists(x: _Export) -> None:
    """Channel lists of linear inputs: shadow channels (mllm-NPU) and MUXQ's outlier channels."""
    for act in (t.name for t in x.graph.layer_acts):
        tq = x.plan.get(f"layers/{act}")
        if tq is not None and tq.shadow_channels is not None:
            x.tensors[f"layers.shadow.{act}.channels"] = _padded_channels(tq.shadow_channels)
            x.shadow[act] = x.tensors[f"layers.shadow.{act}.channels"].shape[1]
        if tq is not None and tq.muxq_channels is not None and tq.muxq_exp is not None:
            x.tensors[f"layers.muxq.{act}.channels"] = _padded_channels(tq.muxq_channels)
            k = x.tensors[f"layers.muxq.{act}.channels"].shape[1]
            x.muxq[act] = {"exp": tq.muxq_exp, "channels": k}


def _linear_consts(x: _Export, op: Op) -> None:
    """Codes [L, out, in], per-output-channel requantization into the output."""
    src, dst, c, n = op.ins[0], op.out_name, op.const, x.n
    name = op.weight_name
    tq = x.plan.get(f"layers/{name}")
    assert tq is not None
    w = x.layers[name]
    s_state = np.asarray(x.state["layers"][name].scale, np.float32)
    z_state = np.asarray(x.state["layers"][name].zero_point, np.float32)
    codes, ms, shs, biases, blocks, zeros = [], [], [], [], [], []
    for i in range(n):
        where = f"layers.{i}.{name}"
        z_w = weight_zero_points(tq, z_state[i], where)
        q, s_w, block_scales = _layer_weight_codes(w[i], tq, i, s_state[i], where, z_w)
        codes.append(q)
        zeros.append(z_w)
        if block_scales is not None:
            blocks.append(block_scales)
        s_acc = x.enc(src, i).scale * s_w.astype(np.float64)
        m, sh = _requant(s_acc / x.enc(dst, i).scale, where)
        ms.append(m)
        shs.append(sh)
        if op.bias and op.bias in x.layers:
            b = np.rint(x.layers[op.bias][i].astype(np.float64) / s_acc)
            if np.abs(b).max() >= 2**31:
                raise QnpuError(f"layers.{i}.{op.bias} does not fit int32 at s_in·s_w")
            biases.append(b.astype(np.int32))
    x.tensors[f"{c}.weight"] = np.stack(codes)
    x.tensors[f"{c}.M"] = np.stack(ms)
    x.tensors[f"{c}.shift"] = np.stack(shs)
    if biases:
        x.tensors[f"{c}.bias"] = np.stack(biases)
    if blocks:  # LPBQ: the engines run the int8 codes k·q (`int_model.lpbq_weights`)
        x.tensors[f"{c}.block_scale"] = np.stack(blocks)
    if not tq.symmetric:  # the matmul subtracts z_w[o]·Σ_i xc_i
        x.tensors[f"{c}.weight_zero_point"] = np.stack(zeros)
        x.weight_zero.append(c)
    if max(tq.layer_bits or (tq.bits,)) <= 4:
        x.int4.add(f"{c}.weight")


def _rmsnorm_consts(x: _Export, op: Op) -> None:
    """γ = 1 after fuse_norms; kept general for unrotated methods."""
    src, dst, eps = op.ins[0], op.out_name, x.cfg.rms_norm_eps
    norms = [
        _norm_constants(
            x.layers[op.gain][i],
            x.enc(src, i),
            x.enc(dst, i),
            eps,
            f"layers.{i}.{op.gain}",
            x.read_exp(src),
        )
        for i in range(x.n)
    ]
    for k, v in _stack(norms).items():
        x.tensors[f"{op.const}.{k}"] = v


def _rope_consts(x: _Export, op: Op) -> None:
    """Q14 tables: requantize s_in·2^-14 / s_out (Qwen3: each head RMSNormed into 16 bits
    first)."""
    src, dst, c, cfg = op.ins[0], op.out_name, op.const, x.cfg
    s_in = x.scales(src)
    if cfg.qk_norm and op.head_norm:
        gains = np.asarray(x.layers[op.head_norm], np.float64)  # [L, hd]
        s_in = np.maximum(np.abs(gains).max(axis=1), 1e-30) * math.sqrt(cfg.head_dim)
        s_in = s_in / HEAD_NORM_MAX
        norms = [
            _norm_constants(
                gains[i],
                x.enc(src, i),
                IntEncoding(float(s_in[i]), 0, -HEAD_NORM_MAX, HEAD_NORM_MAX),
                cfg.rms_norm_eps,
                f"layers.{i}.{op.head_norm}",
            )
            for i in range(x.n)
        ]
        for k, v in _stack(norms).items():
            x.tensors[f"{c}.norm.{k}"] = v
    real = s_in * 2.0**-ROPE_FRACTION_BITS / x.scales(dst)
    x.tensors[f"{c}.M"], x.tensors[f"{c}.shift"] = _requant(real, c)


def _attention_consts(x: _Export, op: Op) -> None:
    """Scores requantization, exp LUT of the softmax, P·V requantization; the sink prefix's
    K/V codes."""
    q_in, k_in, v_in = op.ins
    scores, probs = (t.name for t in op.inner)
    t = x.tensors
    # scores · (query_pre_attn_scalar or head_dim)^-0.5 (Gemma 3 names its own scalar)
    root = math.sqrt(x.cfg.query_pre_attn_scalar or x.cfg.head_dim)
    real = x.scales(q_in) * x.scales(k_in) / root / x.scales(scores)
    t["layers.scores.M"], t["layers.scores.shift"] = _requant(real, "layers.scores")
    exp_luts = []
    for i in range(x.n):
        diff = IntEncoding(x.enc(scores, i).scale, 0, 0, (1 << 16) - 1)
        exp_luts.append(_lut(lambda v: np.exp(-v), diff, x.enc(probs, i)).astype(np.uint16))
    t["layers.softmax.exp_lut"] = np.stack(exp_luts)
    real = x.scales(v_in) / PROBS_SCALE_DENOMINATOR / x.scales(op.out_name)
    t["layers.pv.M"], t["layers.pv.shift"] = _requant(real, "layers.pv")
    if x.prefix:
        t["layers.prefix.k"], t["layers.prefix.v"] = prefix_cache_codes(
            x.params if x.prefix_params is None else x.prefix_params,
            x.cfg,
            x.plan,
            x.state,
            x.prefix,
            x.acts[k_in],
            x.acts[v_in],
            x.graph,
        )


def _add_consts(x: _Export, op: Op) -> None:
    """Two inputs rescaled into the output with one shared shift."""
    dst = op.out_name
    triples = [
        _two_input_rescale(
            x.enc(op.ins[0], i).scale / x.enc(dst, i).scale,
            x.enc(op.ins[1], i).scale / x.enc(dst, i).scale,
            f"layers.{i}.{dst}",
        )
        for i in range(x.n)
    ]
    arr = np.array(triples, np.int64)
    x.tensors[f"{op.const}.Ma"] = arr[:, 0].astype(np.int32)
    x.tensors[f"{op.const}.Mb"] = arr[:, 1].astype(np.int32)
    x.tensors[f"{op.const}.shift"] = arr[:, 2].astype(np.int32)


def _lut_consts(x: _Export, op: Op) -> None:
    """A table over the input's whole code range."""
    src = op.ins[0]
    f = LUT_FUNCTIONS[op.fn]
    luts = [_lut(f, x.enc(src, i), x.enc(op.out_name, i)) for i in range(x.n)]
    if len({len(t) for t in luts}) != 1:
        raise QnpuError(f"layers/{src}: the {op.fn} LUTs need one bit-width in every layer")
    x.tensors[f"{op.const}.lut"] = _narrow(np.stack(luts))


def _mul_consts(x: _Export, op: Op) -> None:
    """The product requantized."""
    real = x.scales(op.ins[0]) * x.scales(op.ins[1]) / x.scales(op.out_name)
    x.tensors[f"{op.const}.M"], x.tensors[f"{op.const}.shift"] = _requant(real, op.const)


ConstBuilder = Callable[[_Export, Op], None]
# The constants of each layer op, stacked over layers (`export_model`).
LAYER_CONSTS: dict[OpKind, ConstBuilder] = {
    OpKind.RMSNORM: _rmsnorm_consts,
    OpKind.LINEAR: _linear_consts,
    OpKind.ROPE: _rope_consts,
    OpKind.ATTENTION: _attention_consts,
    OpKind.ADD: _add_consts,
    OpKind.LUT: _lut_consts,
    OpKind.MUL: _mul_consts,
}
check_handlers(LAYER_CONSTS, "the exporter (layer ops)", MODEL_ONLY_KINDS)


def _embed_consts(x: _Export, op: Op) -> None:
    """Per-row int8 codes, requantized row by row into the output."""
    table = op.weight_name
    tq = x.plan.get(table)
    assert tq is not None
    s_rows = np.asarray(get_entry(x.state, table).scale, np.float32).reshape(-1, 1)
    x.tensors[f"{op.const}.table"] = _weight_codes(
        x.np_params[table], s_rows, np.zeros_like(s_rows), tq.spec(), table
    )
    # Gemma scales the rows by √hidden (`ModelConfig.embed_scale`): folded into each row's scale
    real = s_rows[:, 0].astype(np.float64) * x.cfg.embed_scale / x.outer[op.out_name].scale
    m, sh = _requant(real, table)
    x.tensors[f"{op.const}.M"], x.tensors[f"{op.const}.shift"] = m, sh


def _layers_consts(x: _Export, op: Op) -> None:
    """Every layer op's constants (LAYER_CONSTS)."""
    for layer_op in x.graph.layer:
        build = LAYER_CONSTS.get(layer_op.kind)
        if build is None:  # MODEL_ONLY_KINDS
            raise QnpuError(f"the exporter has no {layer_op.kind.value!r} op in a layer")
        build(x, layer_op)


def _final_norm_consts(x: _Export, op: Op) -> None:
    final = _norm_constants(
        x.np_params[op.gain],
        x.model_enc(op.ins[0]),
        x.outer[op.out_name],
        x.cfg.rms_norm_eps,
        op.gain,
        x.read_exp(op.ins[0]),
    )
    for k, v in final.items():
        x.tensors[f"{op.const}.{k}"] = v


def _lm_head_consts(x: _Export, op: Op) -> None:
    """W8 per channel; int32 logits at the fixed scale LOGITS_SCALE."""
    name, c = op.weight_name, op.const
    tq = x.plan.get(name)
    assert tq is not None
    head = np.asarray(lm_head_weight(x.np_params), np.float32)
    s_head = np.asarray(get_entry(x.state, name).scale, np.float32).reshape(-1, 1)
    x.tensors[f"{c}.weight"] = _weight_codes(head, s_head, np.zeros_like(s_head), tq.spec(), name)
    real = x.model_enc(op.ins[0]).scale * s_head[:, 0].astype(np.float64) / LOGITS_SCALE
    x.tensors[f"{c}.M"], x.tensors[f"{c}.shift"] = _requant(real, name)


# The constants of each model op (`export_model`).
MODEL_CONSTS: dict[OpKind, ConstBuilder] = {
    OpKind.EMBED: _embed_consts,
    OpKind.LAYERS: _layers_consts,
    OpKind.RMSNORM: _final_norm_consts,
    OpKind.LINEAR: _lm_head_consts,
}
check_handlers(MODEL_CONSTS, "the exporter (model ops)", LAYER_ONLY_KINDS)


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
    graph: Graph | None = None,
    prefix_params: Params | None = None,
) -> ExportedModel:
    """The integer artifact of a fake-quant model (`params` as the fake-quant forward uses
    them: fused and rotated for rotated methods): the constants of each op of `graph` (None:
    the graph `params` are the weights of, `graph_of`). `prefix_params`: what the offline
    sink prefix runs on where not `params` (`QuantizedModel.prefix_params`)."""
    graph = graph_of(cfg, params) if graph is None else graph
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
    acts, outer = _activation_encodings(plan, state, n, graph)
    x = _Export(params, np_params, cfg, plan, state, graph, acts, outer, prefix, prefix_params)
    _act_tables(x)
    _channel_lists(x)
    for op in graph.model:
        build = MODEL_CONSTS.get(op.kind)
        if build is None:  # LAYER_ONLY_KINDS
            raise QnpuError(f"the exporter has no {op.kind.value!r} op in the model")
        build(x, op)
    x.tensors["rope.cos"], x.tensors["rope.sin"] = rope_tables(cfg, max_context)
    if any(cfg.sliding_layers):  # Gemma 3's sliding layers rotate at their own base
        local = dataclasses.replace(cfg, rope=cfg.local_rope)
        x.tensors[f"{LOCAL_ROPE}.cos"], x.tensors[f"{LOCAL_ROPE}.sin"] = rope_tables(
            local, max_context
        )
    _check_multipliers(x.tensors)
    for act, entry in x.muxq.items():  # the producer shifts MUXQ channels exp bits further
        producer = graph.producer(act)
        if int(x.tensors[f"{producer.const}.shift"].max()) + entry["exp"] > SHIFT_MAX:
            raise QnpuError(f"layers/{act}: MUXQ's exp takes the requantization shift past 62")
    manifest = {
        "model": cfg.to_json(),
        "graph": _graph_section(x, max_context, prefill_chunk),
        "encodings": encodings_table(plan, state, cfg, acts, outer, graph),
        "tokenizer": dict(tokenizer_info or {}),
        "source": dict(source or {}),
    }
    return ExportedModel(manifest, x.tensors, frozenset(x.int4))


def _graph_section(x: _Export, max_context: int, prefill_chunk: int) -> dict[str, Any]:
    """The manifest's "graph": the op list, activation tables and fixed-point parameters."""
    lists = x.shadow or x.muxq or x.weight_zero
    return {
        "format": FORMAT_GRAPH_CHANNELS if lists else FORMAT_GRAPH,
        "ops": x.graph.ops_json(),
        "layer_activations": [t.name for t in x.graph.layer_acts],
        "global_activations": list(x.outer),
        "prefix_tokens": list(x.prefix),
        "max_context": max_context,
        "prefill_chunk": prefill_chunk,
        "norm_fraction_bits": NORM_FRACTION_BITS,
        "norm_unit_bits": NORM_UNIT_BITS,
        "rope_fraction_bits": ROPE_FRACTION_BITS,
        "logits_scale": LOGITS_SCALE,
        **({"shadow": x.shadow} if x.shadow else {}),
        **({"muxq": x.muxq} if x.muxq else {}),
        **({"weight_zero_points": x.weight_zero} if x.weight_zero else {}),
    }


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
    plan = model.require_plan()
    encodings = run_encodings(plan, model.require_state(), model.cfg)
    return write_aimet(target, encodings, version=version, graph=plan.graph)


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
