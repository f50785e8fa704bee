"""ONNX graphs of a calibrated QuantizedModel, built op by op from the graph description.

`qnpu export --format onnx` writes, into one sealed directory (the artifact container:
every file hashed in manifest.json, written to a temporary sibling and renamed into place):

    model.onnx            prefill: a chunk of C tokens          (float, the transformed model)
    model_decode.onnx     decode: one token                      (float)
    model.data            the float graphs' weights (ONNX external data, shared by both)
    model_qdq.onnx        prefill with QuantizeLinear/DequantizeLinear at every quantized
    model_qdq_decode.onnx decode, QDQ                             tensor (opset 21)
    model_qdq.data        the QDQ graphs' integer weights and their scales (shared)
    model.encodings       AIMET encodings; every name is a tensor of model.onnx (shadow
                          outliers and MUXQ are graph structure: `_Writer._extra`)
    embed_tokens.npy      the embedding table, float [V, D] (for the float graphs)
    embed_tokens_codes.npy  its integer codes [V, D] and per-row scales [V]: the lookup
    embed_tokens_scale.npy  the host does for the QDQ graphs (docs/design.md §3: 8 bits per row)
    prefix_kv.npy         the sink prefix's K/V [2, 2, L, Hkv, P, hd]: float, then fake-quant
    tokenizer.json

Every graph has static shapes: inputs `model.embed_tokens.output` float32 [1, C, D] (the
embedding rows of the chunk's tokens: the lookup runs on the host, as NPU LLM deployments do,
since neither AIMET's QuantSim nor a QDQ Gather carries the table's per-row encoding) and
`position_ids` int64 [1, C] and, per layer i, `past_key.i` / `past_value.i` float32
[1, Hkv, S, hd] (S: the fixed maximum context); outputs `logits` [1, C, V] and
`present_key.i` / `present_value.i`, the caches with the chunk's K/V written at its
positions. A query attends to the cache positions at or before its own. The sink prefix's K/V
are the caches' initial contents (positions 0..P-1); the first chunk starts at position P.

Tensor names: each quantized tensor of the graph description is the ONNX tensor named by its
AIMET ("hf") name (`model.layers.3.self_attn.q_proj.output`; weights are initializers named
`....weight`), so `model.encodings` (`qnpu_jax.export.aimet`) names only tensors of the graph.
Linear weights are stored transposed ([in, out], MatMul's B): their channel axis is 1.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import io
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.aimet import OUTLIER_KEYS, aimet_encodings, aimet_name
from qnpu_jax.export.artifact import check_destination, write_artifact
from qnpu_jax.export.exporter import (
    check_export_destination,
    context_positions,
    run_encodings,
    tokenizer_info,
)
from qnpu_jax.ir.graph import (
    FORMAT_GRAPH,
    GRAPH,
    KV_TENSORS,
    LAYER_ONLY_KINDS,
    LOCAL_ROPE,
    MODEL_ONLY_KINDS,
    RESIDUAL_OUTPUTS,
    Graph,
    Op,
    OpKind,
    check_handlers,
    layer_widths,
)
from qnpu_jax.models.llama import (
    forward_tapped,
    graph_of,
    init_cache,
    lm_head_weight,
    rope_inv_freq,
)
from qnpu_jax.models.taps import CacheOnlyTaps, FakeQuantTaps, effective_state
from qnpu_jax.pipeline.run import load_run
from qnpu_jax.quant.requantize import quantize_to_int
from qnpu_jax.quant.spec import QuantSpec

OPSET = 21
FORMAT = "qnpu-onnx"  # the manifest's "onnx" section
GRAPH_FILES = {
    ("float", "prefill"): "model.onnx",
    ("float", "decode"): "model_decode.onnx",
    ("qdq", "prefill"): "model_qdq.onnx",
    ("qdq", "decode"): "model_qdq_decode.onnx",
}
DATA_FILES = {"float": "model.data", "qdq": "model_qdq.data"}
# the manifest's "float_weights": what the float graphs' weights are (eval --onnx says it).
# After GPTQ they are its rounded codes times their scales, the weights AIMET must quantize
# (it finds the same codes), so the float graphs are neither the float nor the quantized model.
FLOAT_WEIGHTS = {
    "transformed": "float weights",
    "gptq_codes": "GPTQ-rounded weights, float activations",
}
# what installs onnx and onnxruntime (pyproject.toml's optional dependencies)
EXPORT_EXTRA = "pip install 'qnpu_jax[export]'"
ENCODINGS_FILE = "model.encodings"
PREFIX_FILE = "prefix_kv.npy"
# The caches hold K and V: graph inputs past_<kind>.i and outputs present_<kind>.i carry the
# encodings of the K and V tensors (AIMET ties a ScatterElements' data, updates and output to
# one quantizer, so the caches need entries of their own).
CACHE_TENSORS = dict(zip(("key", "value"), KV_TENSORS, strict=True))
EMBED_FILES = {
    "float": "embed_tokens.npy",
    "codes": "embed_tokens_codes.npy",
    "scale": "embed_tokens_scale.npy",
}
# Where a node runs: the NPU, or the host CPU (mllm-NPU's shadow path: its nodes carry
# doc_string CPU_SIDE, read back by `node_side`)
NPU_SIDE, CPU_SIDE = "npu", "cpu"
MASKED = -1e9  # added to masked scores: exp underflows to exactly 0, as with -inf
# Bits of the codes ONNX QDQ can hold (opset 21): the signed and unsigned types by width.
_QDQ_TYPES = {(4, True): "INT4", (8, True): "INT8", (16, True): "INT16"}
_QDQ_TYPES |= {(4, False): "UINT4", (8, False): "UINT8", (16, False): "UINT16"}


# A linear's extra term: given rows(channels) (those input rows of its weight), the term's
# value and the side that adds it to the matmul
Extra = Callable[[Callable[[list[int]], str]], tuple[str, str]]


def node_side(node: Any) -> str:
    """Where an exported node runs: CPU_SIDE for the shadow path's, NPU_SIDE otherwise."""
    return CPU_SIDE if node.doc_string == CPU_SIDE else NPU_SIDE


@dataclass
class _Builder:
    """Nodes and initializers of one graph; names are unique by construction."""

    nodes: list[Any] = field(default_factory=list)
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    count: int = 0
    side: str = NPU_SIDE  # where the nodes made now run (`node_side`)

    def fresh(self, hint: str) -> str:
        self.count += 1
        return f"/{hint}_{self.count}"

    def node(self, op: str, ins: list[str], out: str | None = None, **attrs: Any) -> str:
        from onnx import helper

        name = out or self.fresh(op)
        node = helper.make_node(op, ins, [name], name=f"{name}/{op}", **attrs)
        if self.side != NPU_SIDE:
            node.doc_string = self.side
        self.nodes.append(node)
        return name

    @contextlib.contextmanager
    def on(self, side: str) -> Iterator[None]:
        """Nodes made inside run on `side`."""
        before, self.side = self.side, side
        try:
            yield
        finally:
            self.side = before

    def const(self, value: Any, dtype: Any = np.float32, name: str | None = None) -> str:
        arr = np.asarray(value, dtype)
        key = name or self.fresh("const")
        if key in self.inits:
            raise QnpuError(f"ONNX initializer {key} is defined twice")
        self.inits[key] = arr
        return key


@dataclass(frozen=True)
class OnnxPlan:
    """What a graph is built for: `chunk` tokens per call, `max_context` cache positions,
    `encodings` (our tensor name -> entry, `exporter.run_encodings`) when QDQ, and the
    `outliers` entries whose shadow or MUXQ structure every graph carries."""

    chunk: int
    max_context: int
    encodings: Mapping[str, Mapping[str, Any]] | None = None
    # the entries with shadow or MUXQ channels (`outlier_entries`): their structure is in the
    # float graphs too, since AIMET's QuantSim quantizes the float graph
    outliers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # float graphs: the weights' encodings, to move their exact ties off (`off_ties`)
    weight_grids: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def _np_params(params: Any) -> Any:

    return jax.tree.map(lambda a: np.asarray(a, np.float32), params)


def _onnx_int_type(bits: int, signed: bool, what: str) -> int:
    from onnx import TensorProto

    key = (bits, signed)
    if key not in _QDQ_TYPES:
        kind = "signed" if signed else "unsigned"
        raise QnpuError(f"{what}: {bits}-bit {kind} codes have no ONNX QDQ type (4, 8 or 16 bits)")
    return int(getattr(TensorProto, _QDQ_TYPES[key]))


def _int_tensor(name: str, codes: np.ndarray, onnx_type: int) -> Any:
    """A TensorProto of integer codes (int4/uint4 packed two per byte, low nibble first)."""
    from onnx import TensorProto

    t = TensorProto()
    t.name = name
    t.data_type = onnx_type
    t.dims.extend(codes.shape)
    flat = np.asarray(codes).reshape(-1)  # integers in the type's range (float or int)
    if onnx_type in (TensorProto.INT4, TensorProto.UINT4):
        nib = (flat.astype(np.int8) & 0x0F).view(np.uint8)
        if nib.size % 2:
            nib = np.concatenate([nib, np.zeros(1, np.uint8)])
        t.raw_data = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes()
    else:
        dtypes: dict[int, Any] = {
            TensorProto.INT8: np.int8,
            TensorProto.UINT8: np.uint8,
            TensorProto.INT16: np.int16,
            TensorProto.UINT16: np.uint16,
        }
        dtype = dtypes[onnx_type]
        t.raw_data = flat.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    return t


def _qdq(
    b: _Builder,
    x: str,
    entry: Mapping[str, Any],
    out: str,
) -> str:
    """x -> QuantizeLinear -> DequantizeLinear, per tensor; returns the dequantized value.

    Activations go on the unsigned grid whatever the contract's code type, as onnxruntime's
    QNN execution provider expects (uint8/uint16 activations): signed codes c become
    c + 2^(bits-1) with the zero point moved by as much, the same real values exactly (a
    symmetric int16 tensor is the symmetric uint16 of zero point 32768)."""
    bits = int(entry["bits"])
    shift = 1 << (bits - 1) if entry["signed"] else 0
    onnx_type = _onnx_int_type(bits, False, out)
    scale = b.const(np.float32(entry["scale"][0]), name=f"{out}_scale")
    zero_point = np.asarray(int(entry["zero_point"][0]) + shift)
    zp = _int_tensor(f"{out}_zero_point", zero_point, onnx_type)
    b.inits[zp.name] = zp
    q = b.node("QuantizeLinear", [x, scale, zp.name], f"{out}_quantized")
    return b.node("DequantizeLinear", [q, scale, zp.name], f"{out}_dequantized")


def _muxq_multipliers(muxq: Mapping[str, Any], width: int) -> np.ndarray:
    """[width] float32: 2^exp on MUXQ's outlier channels, 1 elsewhere."""
    out = np.ones(width, np.float32)
    out[list(muxq["channels"])] = np.float32(2.0 ** int(muxq["exp"]))
    return out


def unshifted(name: str) -> str:
    """The ONNX name of a MUXQ input's value before its outlier channels are shifted."""
    return f"{name}_unshifted"


def rows_name(weight: str) -> str:
    """The ONNX initializer of the input rows of `weight` a shadow path or Aux term reads."""
    return f"{weight}_rows"


def overflow_name(name: str) -> str:
    """The ONNX name of a shadow path's overflow over linear input `name`'s clamped value."""
    return f"{name}_overflow"


# a shadow path's overflow is rounded to its input's grid at this width (its codes are the
# integer contract's q − clamp(q); a larger overflow than 2^15 codes would clip here)
OVERFLOW_BITS = 16


def overflow_entry(e: Mapping[str, Any]) -> dict[str, Any]:
    """The encoding of a shadow path's overflow: its input's scale, signed symmetric 16-bit."""
    return {
        "bits": OVERFLOW_BITS,
        "signed": True,
        "symmetric": True,
        "axis": None,
        "scale": [float(e["scale"][0])],
        "zero_point": [0],
    }


def outlier_entries(table: Mapping[str, Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """The entries of an encodings table with shadow or MUXQ channels."""
    return {k: e for k, e in table.items() if any(f in e for f in OUTLIER_KEYS)}


def _weight(
    b: _Builder,
    w: np.ndarray,
    name: str,
    entry: Mapping[str, Any] | None,
    axis: int,
) -> str:
    """A weight initializer (float), or its integer codes + DequantizeLinear (QDQ). The
    per-channel scales run along `axis` of the stored layout."""
    if entry is None:
        return b.const(w, name=name)
    if entry.get("block") is not None:
        return _blocked_weight(b, w, name, entry, axis)
    bits, signed = int(entry["bits"]), bool(entry["signed"])
    onnx_type = _onnx_int_type(bits, signed, name)
    scale = np.asarray(entry["scale"], np.float32)
    zp = np.asarray(entry["zero_point"], np.int64)
    shape = [1] * w.ndim
    shape[axis] = -1
    # the artifact's codes, by the same rule (any zero point: symmetric=False admits it)
    spec = QuantSpec(bits=bits, symmetric=False, signed=signed, axis=axis)
    codes = quantize_to_int(w, scale.reshape(shape), zp.reshape(shape), spec)
    q = _int_tensor(f"{name}_quantized", codes, onnx_type)
    z = _int_tensor(f"{name}_zero_point", zp, onnx_type)
    b.inits[q.name] = q
    b.inits[z.name] = z
    s = b.const(scale, name=f"{name}_scale")
    return b.node("DequantizeLinear", [q.name, s, z.name], name, axis=axis)


def tie_margin(bits: int) -> float:
    """How far inside its code's rounding interval `off_ties` puts a weight that sat on its
    edge, in codes: 4 float32 ulps of the unsigned code value (below 2^bits) AIMET rounds."""
    return 2.0 ** (bits - 21)


def off_ties(w: np.ndarray, entry: Mapping[str, Any], axis: int) -> np.ndarray:
    """Float weights `w` whose codes under `entry` (per channel along `axis`) are the same
    whatever round-to-nearest a tool uses: a weight within `tie_margin` codes of the halfway
    point between two codes is moved that far inside the code this exporter gives it
    (rint(w·(1/s)), the QDQ graph's and the artifact's). AIMET's QuantSim quantizes the float
    graph's weights itself, rounding halves up, in float32 after adding 2^(bits-1); weights
    that sit exactly halfway are common in these models (dequantized GGUF weights on their
    grids). Per-block weights are returned as they are."""
    if entry.get("block") is not None or entry.get("axis") is None:
        return w
    shape = [1] * w.ndim
    shape[axis] = -1
    scale = np.asarray(entry["scale"], np.float32).reshape(shape)
    bits = int(entry["bits"])
    margin = tie_margin(bits)
    product = w * (1.0 / scale).astype(np.float32)
    target = np.rint(product)
    # float32 picks the candidates (an lm_head has 28M-168M weights: float64 over all of them
    # took seconds an export), float64 decides on them as before. float32's |product - target|
    # is within |w/s|·2^-23 of the exact offset, less than `margin` below 2^(bits+2): so a
    # weight it puts 2 margins inside its code is off the edge, and every larger one is checked.
    product -= target
    near = np.abs(product) > 0.5 - 2 * margin
    near |= np.abs(target) >= 2.0 ** (bits + 1)
    at = np.flatnonzero(near)
    if at.size == 0:
        return w
    s64 = scale.ravel()[np.unravel_index(at, w.shape)[axis]].astype(np.float64)
    at_target = target.ravel()[at]
    offset = w.ravel()[at].astype(np.float64) / s64 - at_target  # in [-0.5, 0.5]
    edge = np.abs(offset) > 0.5 - margin
    if not edge.any():
        return w
    inside = np.clip(offset[edge], margin - 0.5, 0.5 - margin)
    out = np.array(w, np.float32, order="C")
    out.ravel()[at[edge]] = ((at_target[edge] + inside) * s64[edge]).astype(np.float32)
    return out


def _blocked_weight(
    b: _Builder, w: np.ndarray, name: str, entry: Mapping[str, Any], axis: int
) -> str:
    """A per-block weight stored [in, out] (`axis` 1, the output channels): its codes and a
    blocked DequantizeLinear (opset 21 `block_size`, scales [in/B, out]). LPBQ block scales
    come from a DequantizeLinear of the integer block scales at the per-channel scales, as
    AIMET's ONNX export writes them, so a runtime sees the compressed form."""
    if axis != 1 or w.ndim != 2:
        raise QnpuError(f"{name}: blocked weights are stored [in, out]")
    block, bits = int(entry["block"]), int(entry["bits"])
    onnx_type = _onnx_int_type(bits, True, name)
    n_in, n_out = w.shape
    nb = n_in // block
    channel = np.asarray(entry["scale"], np.float32)
    ints = entry.get("block_scale")
    counts = (channel.size, None if ints is None else len(ints))
    if n_in % block or counts != ((n_out, n_out * nb) if ints is not None else (n_out * nb, None)):
        raise QnpuError(
            f"{name}: {counts} scales do not fit blocks of {block} of a weight [in, out] {w.shape}"
        )
    if entry.get("block_scale") is not None:
        k = np.asarray(entry["block_scale"], np.int64).reshape(n_out, nb)
        scales = (channel[:, None] * k.astype(np.float32)).T  # [nb, out], float32 products
        kt = _int_tensor(f"{name}_block_scale", k.T, _onnx_int_type(8, False, name))
        kz = _int_tensor(f"{name}_block_scale_zero_point", np.zeros(n_out), kt.data_type)
        b.inits[kt.name], b.inits[kz.name] = kt, kz
        ch = b.const(channel, name=f"{name}_scale")
        s = b.node("DequantizeLinear", [kt.name, ch, kz.name], f"{name}_block_scales", axis=1)
    else:
        scales = channel.reshape(n_out, nb).T
        s = b.const(scales, name=f"{name}_scale")
    qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    inv = np.repeat((1.0 / scales).astype(np.float32), block, axis=0)
    codes = np.clip(np.rint(w * inv), qmin, qmax)
    q = _int_tensor(f"{name}_quantized", codes, onnx_type)
    z = _int_tensor(f"{name}_zero_point", np.zeros((nb, n_out)), onnx_type)
    b.inits[q.name], b.inits[z.name] = q, z
    return b.node("DequantizeLinear", [q.name, s, z.name], name, axis=0, block_size=block)


class _Writer:
    """Translates the graph description's ops into ONNX nodes for one chunk size. Every
    quantized tensor is produced under its ONNX name (`aimet_name`); with QDQ its readers get
    the QuantizeLinear → DequantizeLinear value instead."""

    def __init__(self, params: Any, cfg: Any, plan: OnnxPlan, graph: Graph = GRAPH) -> None:

        self.p = _np_params(params)
        self.cfg, self.plan, self.graph, self.b = cfg, plan, graph, _Builder()
        self.branches: dict[str, str] = {}  # outlier input -> its overflow or Aux value
        c, s, hd = plan.chunk, plan.max_context, cfg.head_dim
        self.groups = cfg.num_heads // cfg.num_kv_heads
        self.heads = {"q": cfg.num_heads, "kv": cfg.num_kv_heads}
        b = self.b
        # each layer's RoPE tables and mask: the global ones, or (Gemma 3) its sliding
        # window's, with the local RoPE base
        self.sliding = cfg.sliding_layers
        self.tables = {False: self._rope_tables(cfg.rope, "rope")}
        # query rows are (group, position): row g·C + c attends to cache positions <= its own
        qpos = b.node("Tile", ["position_ids", b.const([1, self.groups], np.int64)])
        qpos = self.reshape(qpos, 1, 1, self.groups * c, 1)
        kpos = b.const(np.arange(s).reshape(1, 1, 1, s), np.int64, "cache.positions")
        allowed = b.node("LessOrEqual", [kpos, qpos])
        self.masks = {False: self._mask(allowed, "attention.mask")}
        if any(self.sliding):  # and after the query's window start: q − window < key
            self.tables[True] = self._rope_tables(cfg.local_rope, LOCAL_ROPE)
            start = b.node("Sub", [qpos, b.const(cfg.sliding_window, np.int64)])
            recent = b.node("And", [allowed, b.node("Greater", [kpos, start])])
            self.masks[True] = self._mask(recent, "attention.sliding_mask")
        idx = self.reshape("position_ids", 1, 1, c, 1)
        shape = b.const([1, cfg.num_kv_heads, c, hd], np.int64)
        self.write_index = b.node("Expand", [idx, shape], "cache.write_index")

    def _rope_tables(self, rope: Any, name: str) -> tuple[str, str]:
        """The chunk's cos/sin [1, C, 1, hd] gathered from float32 tables of `rope` over
        the context (`{name}.cos_table`), as the float forward computes them."""
        b = self.b
        inv = rope_inv_freq(rope, self.cfg.head_dim)
        angles = np.arange(self.plan.max_context, dtype=np.float32)[:, None] * inv[None, :]
        angles = np.concatenate([angles, angles], axis=-1).astype(np.float32)
        axis2 = b.const([2], np.int64)
        cos, sin = (
            b.node(
                "Unsqueeze",
                [
                    b.node(
                        "Gather", [b.const(f(angles), name=f"{name}.{n}_table"), "position_ids"]
                    ),
                    axis2,
                ],
                f"{name}.{n}",
            )
            for n, f in (("cos", np.cos), ("sin", np.sin))
        )
        return cos, sin

    def _mask(self, allowed: str, name: str) -> str:
        b = self.b
        return b.node("Where", [allowed, b.const(0.0), b.const(MASKED)], name)

    def name(self, ours: str) -> str:
        """The ONNX (AIMET "hf") name of our tensor `ours` of this writer's graph."""
        return aimet_name(ours, "hf", self.graph)

    def reshape(self, x: str, *dims: int) -> str:
        return self.b.node("Reshape", [x, self.b.const(list(dims), np.int64)])

    def entry(self, ours: str) -> Mapping[str, Any] | None:
        enc = self.plan.encodings
        return None if enc is None else enc.get(ours)

    def read(self, ours: str) -> str:
        """The value readers of tensor `ours` get, once its node is emitted: with QDQ, its
        QuantizeLinear → DequantizeLinear value on the tensor's one grid. A MUXQ input is the
        Body (`_body`), a residual split's output the Body times 2^exp again; shadow channels
        are added back by the linear that reads them (`_shadow_path`), so here they are
        clamped like every other channel."""
        name = self.name(ours)
        muxq = self.plan.outliers.get(ours, {}).get("muxq")
        if muxq is not None:
            self._body(ours, muxq)
        e = self.entry(ours)
        value = name if e is None else _qdq(self.b, name, e, name)
        if muxq is not None and ours.split(".")[2] in RESIDUAL_OUTPUTS:
            # the residual split: its readers (adds, norms) take the channels back times 2^exp
            m = _muxq_multipliers(muxq, self._width(ours))
            value = self.b.node("Mul", [value, self.b.const(m, name=f"{name}_unsplit")])
        return value

    def _width(self, ours: str) -> int:
        return layer_widths(self.cfg.dims)[ours.split(".")[2]]

    def _body(self, ours: str, muxq: Mapping[str, Any]) -> None:
        """MUXQ's Body: the unshifted value times 2^-exp on the outlier channels (exact in
        float), on the tensor's per-tensor grid; the linear reading it adds the Aux term."""
        name = self.name(ours)
        m = 1.0 / _muxq_multipliers(muxq, self._width(ours))
        self.b.node("Mul", [unshifted(name), self.b.const(m, name=f"{name}_shift")], name)

    def _shadow_path(self, ours: str, x: str, made: tuple[Op, list[str]], i: int) -> str:
        """mllm-NPU's shadow path on the CPU, for linear input `ours` read as `x` (clamped):
        the input's op is run again on the hot channels only (`made`: the op and the values
        it read), the overflow over the clamped value is rounded to the input's grid (a
        16-bit tensor of its own, `overflow_name`), and times the weight's hot rows it gives
        the term the caller adds to the NPU's matmul. Without quantizers the recomputed
        value equals x, so the term is exactly zero and the float graph is the float model."""
        with self.b.on(CPU_SIDE):
            return self._shadow_nodes(ours, x, made, i)

    def _shadow_nodes(self, ours: str, x: str, made: tuple[Op, list[str]], i: int) -> str:
        b, name = self.b, self.name(ours)
        hot = b.const(self.plan.outliers[ours]["shadow_channels"], np.int64, f"{name}_hot")
        op, ins = made
        again = f"{name}_recomputed"
        if op.kind == OpKind.MUL:
            b.node("Mul", [b.node("Gather", [v, hot], axis=-1) for v in ins], again)
        else:
            value = self.emit(i, op, ins, b.fresh(f"{name}.shadow"))
            b.node("Gather", [value, hot], again, axis=-1)
        overflow = b.node("Sub", [again, b.node("Gather", [x, hot], axis=-1)], overflow_name(name))
        e = self.entry(ours)
        if e is not None:
            overflow = _qdq(b, overflow, overflow_entry(e), overflow)
        return overflow

    def emit(self, i: int, op: Op, ins: list[str], out: str, made: Made | None = None) -> str:
        """The nodes of layer op `op` of layer i reading `ins`, writing `out` (LAYER_NODES);
        `made`: how the layer's tensors so far were made (a linear's shadow path reads it)."""
        emit = LAYER_NODES.get(op.kind)
        if emit is None:  # MODEL_ONLY_KINDS
            raise QnpuError(f"the ONNX exporter does not know the layer op {op.kind.value!r}")
        emit(self, i, op, ins, out, {} if made is None else made)
        return out

    def rmsnorm(self, x: str, gain: np.ndarray, gain_name: str, out: str) -> None:
        b = self.b
        var = b.node("ReduceMean", [b.node("Mul", [x, x]), b.const([-1], np.int64)], keepdims=1)
        root = b.node("Sqrt", [b.node("Add", [var, b.const(np.float32(self.cfg.rms_norm_eps))])])
        normed = b.node("Mul", [x, b.node("Reciprocal", [root])])
        gain_value = gain_name if gain_name in b.inits else b.const(gain, name=gain_name)
        b.node("Mul", [normed, gain_value], out)

    def linear(
        self,
        x: str,
        w: np.ndarray,
        w_ours: str,
        bias: np.ndarray | None,
        out: str,
        extra: Extra | None = None,
    ) -> None:
        """out = x·W (+ bias). `extra(rows)` returns a term added to the matmul before the
        bias (the shadow path's or MUXQ's Aux) and the side that adds it; `rows(channels)`
        gives it those input rows of the weight, an initializer of their own on the weight's
        grid (AIMET refuses a weight that two kinds of op read)."""
        b, w_name = self.b, self.name(w_ours)
        w_t = np.ascontiguousarray(w.T)
        entry = self.entry(w_ours)
        grid = self.plan.weight_grids.get(w_ours)
        if entry is None and grid is not None:
            w_t = off_ties(w_t, grid, axis=1)
        wt = _weight(b, w_t, w_name, entry, axis=1)
        if bias is None and extra is None:
            b.node("MatMul", [x, wt], out)
            return
        acc = b.node("MatMul", [x, wt])
        if extra is not None:
            if entry is not None and entry.get("block") is not None:
                raise QnpuError(
                    f"{w_name}: per-block weights with shadow or MUXQ channels on their input "
                    "have no ONNX form (the rows they take would mix blocks)"
                )

            def rows(channels: list[int]) -> str:
                return _weight(b, w_t[channels], rows_name(w_name), entry, axis=1)

            term, side = extra(rows)
            with b.on(side):  # the shadow path's term is added where it is made
                acc = b.node("Add", [acc, term], None if bias is not None else out)
        if bias is not None:
            bias_name = w_name.removesuffix("weight") + "bias"
            b.node("Add", [acc, b.const(bias, name=bias_name)], out)

    def _extra(self, i: int, op: Op, x: str, made: dict[str, tuple[Op, list[str]]]) -> Extra | None:
        """The term a linear adds when its input has shadow or MUXQ channels in layer i."""
        ours = f"layers.{i}.{op.ins[0]}"
        e = self.plan.outliers.get(ours)
        if e is None:
            return None
        b, name = self.b, self.name(ours)
        if "shadow_channels" in e:
            if ours not in self.branches:  # once for all the linears reading it
                self.branches[ours] = self._shadow_path(ours, x, made[op.ins[0]], i)
            overflow, hot = self.branches[ours], list(e["shadow_channels"])

            def shadow_term(rows: Callable[[list[int]], str]) -> tuple[str, str]:
                with b.on(CPU_SIDE):
                    return b.node("MatMul", [overflow, rows(hot)]), CPU_SIDE

            return shadow_term
        muxq = e["muxq"]  # Aux = Body's outlier channels; X = Body + (2^exp − 1)·Aux
        channels = list(muxq["channels"])
        if ours not in self.branches:
            idx = b.const(channels, np.int64, f"{name}_aux_channels")
            self.branches[ours] = b.node("Gather", [x, idx], f"{name}_aux", axis=-1)
        aux = self.branches[ours]
        times = b.const(np.float32((1 << int(muxq["exp"])) - 1))

        def aux_term(rows: Callable[[list[int]], str]) -> tuple[str, str]:
            return b.node("Mul", [b.node("MatMul", [aux, rows(channels)]), times]), NPU_SIDE

        return aux_term

    def rope(
        self,
        i: int,
        x: str,
        heads: int,
        out: str,
        head_norm: tuple[np.ndarray, str] | None = None,
    ) -> None:
        """RoPE of layer i's x [1, C, heads·hd] per head (the layer's tables), after the
        per-head RMSNorm `head_norm` (gain [hd], its name) when the model has one (Qwen3,
        Gemma 3; the normalized value is float: the integer graph keeps it in a 16-bit
        intermediate, no quantized tensor)."""
        from onnx import helper

        b, hd = self.b, self.cfg.head_dim
        x4 = self.reshape(x, 1, self.plan.chunk, heads, hd)
        if head_norm is not None:
            normed = b.fresh("head_norm")
            self.rmsnorm(x4, head_norm[0], head_norm[1], normed)
            x4 = normed
        first, second = b.fresh("half"), b.fresh("half")
        b.nodes.append(
            helper.make_node(
                "Split", [x4], [first, second], name=f"{first}/Split", axis=-1, num_outputs=2
            )
        )
        rotated = b.node("Concat", [b.node("Neg", [second]), first], axis=-1)
        cos, sin = self.tables[self.sliding[i]]
        b.node("Add", [b.node("Mul", [x4, cos]), b.node("Mul", [rotated, sin])], out)

    def attention(self, i: int, op: Op, q: str, k: str, v: str, out: str) -> None:
        """Write the chunk's K/V into the caches (present_*), then causal GQA attention over
        them (in its window in a sliding layer); scores and probabilities are quantized
        tensors of their own."""
        b, c, hd = self.b, self.plan.chunk, self.cfg.head_dim
        hkv, g = self.cfg.num_kv_heads, self.groups
        cache = {}
        for (kind, tensor), new in zip(CACHE_TENSORS.items(), (k, v), strict=True):
            new4 = b.node("Transpose", [self.reshape(new, 1, c, hkv, hd)], perm=[0, 2, 1, 3])
            past = f"past_{kind}.{i}"  # on the K/V grid already: its QDQ is exact
            e = self.entry(f"layers.{i}.{tensor}")
            cache[kind] = b.node(
                "ScatterElements",
                [past if e is None else _qdq(b, past, e, past), self.write_index, new4],
                f"present_{kind}.{i}",
                axis=2,
            )
        scores_t, probs_t = op.inner
        qg = b.node("Transpose", [self.reshape(q, 1, c, hkv, g, hd)], perm=[0, 2, 3, 1, 4])
        kt = b.node("Transpose", [cache["key"]], perm=[0, 1, 3, 2])
        raw = b.node("MatMul", [self.reshape(qg, 1, hkv, g * c, hd), kt])
        scores = f"layers.{i}.{scores_t.name}"
        if self.cfg.query_pre_attn_scalar is None:  # q·k / √hd, as the float forward
            b.node("Div", [raw, b.const(np.float32(math.sqrt(hd)))], self.name(scores))
        else:  # q·k · query_pre_attn_scalar^-0.5 (Gemma 3)
            b.node("Mul", [raw, b.const(np.float32(self.cfg.attn_scale))], self.name(scores))
        masked = b.node("Add", [self.read(scores), self.masks[self.sliding[i]]])
        probs = f"layers.{i}.{probs_t.name}"
        b.node("Softmax", [masked], self.name(probs), axis=-1)
        ctx = b.node("MatMul", [self.read(probs), cache["value"]])
        ctx = b.node("Transpose", [self.reshape(ctx, 1, hkv, g, c, hd)], perm=[0, 3, 1, 2, 4])
        b.node("Reshape", [ctx, b.const([1, c, hkv * g * hd], np.int64)], out)

    def layer(self, graph: Graph, i: int, x: str) -> str:
        """One decoder layer's ops; returns the value of its output."""
        env = {graph.layer_input: x}
        made: Made = {}  # how each tensor was made
        for op in graph.layer:
            ins = [env[name] for name in op.ins]
            ours = f"layers.{i}.{op.out_name}"
            out = self.name(ours)
            if "muxq" in self.plan.outliers.get(ours, {}):
                out = unshifted(out)
            self.emit(i, op, ins, out, made)
            made[op.out_name] = (op, ins)
            env[op.out_name] = self.read(ours)
        return env[graph.layer[-1].out_name]

    def model(self, graph: Graph) -> None:
        """The model's ops in order (MODEL_NODES); the layers op runs every decoder layer."""

        env: dict[str, str] = {}
        for op in graph.model:
            emit = MODEL_NODES.get(op.kind)
            if emit is None:  # LAYER_ONLY_KINDS
                raise QnpuError(f"the ONNX exporter does not know the model op {op.kind.value!r}")
            env[op.out_name] = emit(self, graph, op, env.get(op.ins[0], ""))


Made = dict[str, tuple[Op, list[str]]]  # a layer's tensor -> the op that made it, its inputs


def _rmsnorm_nodes(w: _Writer, i: int, op: Op, ins: list[str], out: str, made: Made) -> None:
    gain_name = f"model.layers.{i}.{op.gain}.weight"
    w.rmsnorm(ins[0], w.p["layers"][op.gain][i], gain_name, out)


def _linear_nodes(w: _Writer, i: int, op: Op, ins: list[str], out: str, made: Made) -> None:
    layers = w.p["layers"]
    bias = layers[op.bias][i] if op.bias and op.bias in layers else None
    w_ours = f"layers.{i}.{op.weight_name}"
    extra = w._extra(i, op, ins[0], made)
    w.linear(ins[0], layers[op.weight_name][i], w_ours, bias, out, extra)


def _rope_nodes(w: _Writer, i: int, op: Op, ins: list[str], out: str, made: Made) -> None:
    layers = w.p["layers"]
    norm = None
    if op.head_norm in layers:
        gain_name = f"model.layers.{i}.self_attn.{op.head_norm}.weight"
        norm = (layers[op.head_norm][i], gain_name)
    w.rope(i, ins[0], w.heads[op.heads], out, norm)


def _attention_nodes(w: _Writer, i: int, op: Op, ins: list[str], out: str, made: Made) -> None:
    q, k, v = ins
    w.attention(i, op, q, k, v, out)


def _binary_nodes(w: _Writer, i: int, op: Op, ins: list[str], out: str, made: Made) -> None:
    """Add and Mul: the ONNX op of the kind's name."""
    w.b.node(op.kind.capitalize(), ins, out)


def _lut_nodes(w: _Writer, i: int, op: Op, ins: list[str], out: str, made: Made) -> None:
    emit = LUT_NODES.get(op.fn)
    if emit is None:
        fn = f" ({op.fn})" if op.fn else ""
        raise QnpuError(f"the ONNX exporter does not know the layer op {op.kind.value!r}{fn}")
    emit(w.b, ins[0], out)


def _silu_nodes(b: _Builder, x: str, out: str) -> None:
    b.node("Mul", [x, b.node("Sigmoid", [x])], out)


def _gelu_tanh_nodes(b: _Builder, x: str, out: str) -> None:
    """x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³))), in primitive ops (jax.nn.gelu's
    approximate form, transformers' gelu_pytorch_tanh)."""
    cube = b.node("Mul", [b.node("Mul", [x, x]), x])
    inner = b.node("Add", [x, b.node("Mul", [cube, b.const(np.float32(0.044715))])])
    arg = b.node("Mul", [inner, b.const(np.float32(math.sqrt(2 / math.pi)))])
    one_plus = b.node("Add", [b.node("Tanh", [arg]), b.const(np.float32(1.0))])
    b.node("Mul", [b.node("Mul", [x, b.const(np.float32(0.5))]), one_plus], out)


# The ONNX nodes of each elementwise function a LUT op computes (`Op.fn`)
LUT_NODES: dict[str, Callable[[_Builder, str, str], None]] = {
    "silu": _silu_nodes,
    "gelu_tanh": _gelu_tanh_nodes,
}


# The ONNX nodes of each layer op (`_Writer.emit`).
LAYER_NODES: dict[OpKind, Callable[[_Writer, int, Op, list[str], str, Made], None]] = {
    OpKind.RMSNORM: _rmsnorm_nodes,
    OpKind.LINEAR: _linear_nodes,
    OpKind.ROPE: _rope_nodes,
    OpKind.ATTENTION: _attention_nodes,
    OpKind.ADD: _binary_nodes,
    OpKind.LUT: _lut_nodes,
    OpKind.MUL: _binary_nodes,
}
check_handlers(LAYER_NODES, "the ONNX exporter (layer ops)", MODEL_ONLY_KINDS)


def _embed_nodes(w: _Writer, graph: Graph, op: Op, x: str) -> str:
    """The rows come in: the graph input of that name."""
    return w.read(op.out_name)


def _layers_nodes(w: _Writer, graph: Graph, op: Op, x: str) -> str:
    for i in range(w.cfg.num_layers):
        x = w.layer(graph, i, x)
    return x


def _final_norm_nodes(w: _Writer, graph: Graph, op: Op, x: str) -> str:
    out = w.name(op.out_name)
    w.rmsnorm(x, w.p[op.gain], f"{_module(out)}.weight", out)
    return w.read(op.out_name)


def _lm_head_nodes(w: _Writer, graph: Graph, op: Op, x: str) -> str:
    """The logits are not quantized."""
    head = np.asarray(lm_head_weight(w.p), np.float32)
    w.linear(x, head, op.weight_name, None, "logits")
    return "logits"


# The ONNX nodes of each model op (`_Writer.model`): each returns its output's value.
MODEL_NODES: dict[OpKind, Callable[[_Writer, Graph, Op, str], str]] = {
    OpKind.EMBED: _embed_nodes,
    OpKind.LAYERS: _layers_nodes,
    OpKind.RMSNORM: _final_norm_nodes,
    OpKind.LINEAR: _lm_head_nodes,
}
check_handlers(MODEL_NODES, "the ONNX exporter (model ops)", LAYER_ONLY_KINDS)


def build_graph(params: Any, cfg: Any, plan: OnnxPlan, *, name: str, graph: Graph = GRAPH) -> Any:
    """The ONNX ModelProto of one chunk size (`plan.chunk`), float or QDQ (`plan.encodings`).

    `params` are the effective float params of the model (`QuantizedModel.params()`: norms
    fused, rotations and smoothing in the weights). Every op kind of `graph` is translated;
    an op this exporter does not know is refused by name.
    """
    from onnx import TensorProto, helper

    c, s = plan.chunk, plan.max_context
    cache_shape = [1, cfg.num_kv_heads, s, cfg.head_dim]
    inputs = [
        helper.make_tensor_value_info(
            aimet_name(embed_output(graph), "hf", graph), TensorProto.FLOAT, [1, c, cfg.hidden_size]
        ),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, c]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, c, cfg.vocab_size])]
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            inputs.append(
                helper.make_tensor_value_info(f"past_{kind}.{i}", TensorProto.FLOAT, cache_shape)
            )
            outputs.append(
                helper.make_tensor_value_info(f"present_{kind}.{i}", TensorProto.FLOAT, cache_shape)
            )
    writer = _Writer(params, cfg, plan, graph)
    writer.model(graph)
    return _model(writer.b, inputs, outputs, name)


def embed_output(graph: Graph = GRAPH) -> str:
    """Our name of the embedding op's output: the graphs' input (the looked-up rows)."""
    return next(op.out_name for op in graph.model if op.kind == OpKind.EMBED)


def embed_table(graph: Graph = GRAPH) -> str:
    return next(op.weight_name for op in graph.model if op.kind == OpKind.EMBED)


def _module(onnx_name: str) -> str:
    """`model.norm.output` -> `model.norm`."""
    return onnx_name.rsplit(".", 1)[0]


def _model(b: _Builder, inputs: list[Any], outputs: list[Any], name: str) -> Any:
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        v if isinstance(v, TensorProto) else numpy_helper.from_array(v, k)
        for k, v in b.inits.items()
    ]
    g = helper.make_graph(b.nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(
        g,
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="qnpu_jax",
        doc_string=f"{FORMAT_GRAPH} as ONNX",
    )
    model.ir_version = 10
    return model


def onnx_encodings(
    table: Mapping[str, Any], num_layers: int, version: str = "1.0.0", graph: Graph = GRAPH
) -> dict[str, Any]:
    """The AIMET encodings of `table` named by the ONNX tensors (`aimet_name`, "hf"): every
    tensor but the embedding table, which the host reads (its codes and scales are files of
    their own), plus the cache inputs and outputs on their K/V tensor's grid. A shadow or
    MUXQ input is one grid per tensor in the graph (the clamped input, MUXQ's Body), its
    channels are structure; a shadow path's overflow gets an entry of its own."""

    outliers = outlier_entries(table)
    inside = {
        k: {f: v for f, v in e.items() if f not in OUTLIER_KEYS} if k in outliers else e
        for k, e in table.items()
        if k != embed_table(graph)
    }
    obj = aimet_encodings(inside, version=version, names="hf", graph=graph)
    acts = obj["activation_encodings"]

    def add(name: str, entries: Any) -> None:
        if isinstance(acts, list):  # 1.0.0: named entries
            acts.append({**copy.deepcopy(entries), "name": name})
        else:  # 0.6.1: name -> entries
            acts[name] = copy.deepcopy(entries)

    for i in range(num_layers):
        for kind, tensor in CACHE_TENSORS.items():
            source = aimet_name(f"layers.{i}.{tensor}", "hf", graph)
            for side in ("past", "present"):
                add(f"{side}_{kind}.{i}", entries_of_obj(obj, source))
    params = obj["param_encodings"]
    for ours, e in outliers.items():
        if "shadow_channels" in e:
            name = overflow_name(aimet_name(ours, "hf", graph))
            one = aimet_encodings(
                {ours: overflow_entry(e)}, version=version, names="hf", graph=graph
            )
            add(name, entries_of_obj(one, aimet_name(ours, "hf", graph)))
        for reader in reader_weights(ours, graph):
            weight = aimet_name(reader, "hf", graph)
            if isinstance(params, list):
                source = next(p for p in params if p["name"] == weight)
                params.append({**copy.deepcopy(source), "name": rows_name(weight)})
            else:
                params[rows_name(weight)] = copy.deepcopy(params[weight])
    return obj


def reader_weights(ours: str, graph: Graph = GRAPH) -> list[str]:
    """Our names of the weights of the linears of `graph` that read input tensor `ours`
    (`layers.i.X`)."""
    _, i, tensor = ours.split(".")
    ops = (op for op in graph.layer if op.kind == OpKind.LINEAR and op.ins[0] == tensor)
    return [f"layers.{i}.{op.weight_name}" for op in ops]


def entries_of_obj(obj: Mapping[str, Any], name: str) -> Any:
    """The activation entry (1.0.0) or entries (0.6.1) named `name` of an encodings object."""
    acts = obj["activation_encodings"]
    if isinstance(acts, list):
        return next(e for e in acts if e["name"] == name)
    return acts[name]


def embedding_files(model: Any, table: Mapping[str, Any]) -> dict[str, bytes]:
    """The embedding table as the host looks rows up: float (float graphs) and its integer
    codes with per-row scales (QDQ graphs: row = codes · scale, the fake-quant rows). The
    graphs' input is the embedding op's output, so a model's embedding scale (Gemma 3's
    √hidden) is in the float rows and in the row scales, not in the codes."""
    name = embed_table()
    w = np.asarray(model.params()[name], np.float32)
    times = np.float32(model.cfg.embed_scale)
    entry = table[name]
    bits = int(entry["bits"])
    scale = np.asarray(entry["scale"], np.float32)
    zp = np.asarray(entry["zero_point"], np.int64)
    if entry["axis"] != 0 or scale.size != w.shape[0] or zp.any():
        raise QnpuError(f"{name}: the ONNX export needs symmetric per-row table encodings")
    inv = (1.0 / scale).astype(np.float32)[:, None]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = np.clip(np.rint(w * inv), lo, hi).astype(np.int8 if bits <= 8 else np.int16)
    return {
        EMBED_FILES["float"]: _npy_bytes(w * times),
        EMBED_FILES["codes"]: _npy_bytes(codes),
        EMBED_FILES["scale"]: _npy_bytes(scale * times),
    }


def graph_tensor_names(model: Any) -> tuple[set[str], set[str]]:
    """(activation names: node outputs and graph inputs, initializer names) of a ModelProto."""
    acts = {o for node in model.graph.node for o in node.output}
    acts |= {i.name for i in model.graph.input}
    return acts, {t.name for t in model.graph.initializer}


def serialize(models: Mapping[str, Any], data_file: str) -> dict[str, bytes]:
    """The files of graphs sharing one external-data file: each model's initializers larger
    than 1 KiB go to `data_file` once (graphs sharing an initializer name share its bytes)."""
    from onnx import external_data_helper

    blob = io.BytesIO()
    placed: dict[str, tuple[int, int, bytes]] = {}
    files: dict[str, bytes] = {}
    for fname, model in models.items():
        for t in model.graph.initializer:
            raw = t.raw_data
            if len(raw) < 1024:
                continue
            if t.name in placed and placed[t.name][2] != _digest(raw):
                raise QnpuError(f"initializer {t.name} differs between the graphs")
            if t.name not in placed:
                pad = (-blob.tell()) % 64
                blob.write(b"\0" * pad)
                placed[t.name] = (blob.tell(), len(raw), _digest(raw))
                blob.write(raw)
            offset, length, _ = placed[t.name]
            external_data_helper.set_external_data(t, data_file, offset=offset, length=length)
            t.ClearField("raw_data")
            t.data_location = t.EXTERNAL
        files[fname] = model.SerializeToString()
    files[data_file] = blob.getvalue()
    return files


def require_export_extra(*modules: str) -> None:
    """A QnpuError naming EXPORT_EXTRA when any of `modules` ("onnx", "onnxruntime") does not
    import: checked before a command's slow part, not as a traceback in the middle of it."""
    missing = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise QnpuError(
            f"ONNX export and evaluation need {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed: {EXPORT_EXTRA}"
        )


def _digest(data: bytes) -> bytes:

    return hashlib.sha256(data).digest()


def check_models(directory: Path) -> None:
    """onnx.checker (full check, shape inference included) on every graph of an export."""
    import onnx

    for fname in GRAPH_FILES.values():
        path = Path(directory) / fname
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except Exception as e:  # onnx raises its own ValidationError / InferenceError
            raise QnpuError(f"{path}: {e}") from e


# MatMul of two activations on onnxruntime's QNN EP, HTP backend (its operator table): the
# input type pairs it documents. uint16 x uint16 is absent: its MatMul builder requantizes the
# second input to uint8 unless (recent onnxruntime-qnn) it is symmetric uint16 (docs/deploy.md).
QNN_HTP_ACTIVATION_MATMUL = {("uint8", "uint8"), ("uint8", "uint16"), ("uint16", "uint8")}
_LAYOUT_OPS = {"Reshape", "Transpose", "ScatterElements", "Squeeze", "Unsqueeze", "Expand"}


# The ai.onnx ops that onnxruntime's QNN execution provider lists as supported (its
# "Supported ONNX operators" table, onnxruntime-qnn 2.x), those the exporter can emit.
QNN_EP_OPS = frozenset(
    [
        "Add",
        "Concat",
        "DequantizeLinear",
        "Div",
        "Expand",
        "Gather",
        "LessOrEqual",
        "MatMul",
        "Mul",
        "Neg",
        "QuantizeLinear",
        "Reciprocal",
        "ReduceMean",
        "Reshape",
        "Round",
        "ScatterElements",
        "Sigmoid",
        "Softmax",
        "Split",
        "Sqrt",
        "Sub",
        "Tile",
        "Transpose",
        "Unsqueeze",
        "Where",
    ]
)


def op_inventory(graph: Any) -> dict[str, dict[str, int]]:
    """{side: {op type: nodes}} of a graph (`node_side`), with "unlisted": the ops outside
    QNN_EP_OPS (none in the exporter's graphs; a test holds it)."""
    out: dict[str, dict[str, int]] = {NPU_SIDE: {}, CPU_SIDE: {}, "unlisted": {}}
    for node in graph.node:
        side = out[node_side(node)]
        side[node.op_type] = side.get(node.op_type, 0) + 1
        if node.op_type not in QNN_EP_OPS:
            out["unlisted"][node.op_type] = out["unlisted"].get(node.op_type, 0) + 1
    return {k: dict(sorted(v.items())) for k, v in out.items()}


def activation_matmuls(graph: Any) -> list[dict[str, Any]]:
    """Every MatMul of a QDQ graph whose two inputs are quantized activations (attention's
    Q·Kᵀ and P·V): its output, the quantized tensors it reads, their code types and zero
    points, and whether onnxruntime's QNN EP documents the pair for the HTP backend. Inputs
    are traced back through layout ops to their DequantizeLinear."""
    from onnx import helper, numpy_helper

    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}

    def source(name: str) -> Any:
        node = producer.get(name)
        while node is not None and node.op_type in _LAYOUT_OPS:
            node = producer.get(node.input[0])
        return node if node is not None and node.op_type == "DequantizeLinear" else None

    found = []
    for node in graph.node:
        if node.op_type != "MatMul":
            continue
        dq = [source(x) for x in node.input]
        if any(d is None or d.input[0] in inits for d in dq):
            continue  # a float input or a weight
        types, zero_points, tensors = [], [], []
        for d in dq:
            quantize = producer[d.input[0]]
            tensors.append(quantize.input[0])
            zp = inits[d.input[2]]
            types.append(helper.tensor_dtype_to_np_dtype(zp.data_type).name)
            zero_points.append(int(numpy_helper.to_array(zp).reshape(-1)[0]))
        found.append(
            {
                "output": node.output[0],
                "inputs": tensors,
                "types": types,
                "zero_points": zero_points,
                "qnn_htp_documented": tuple(types) in QNN_HTP_ACTIVATION_MATMUL,
            }
        )
    return found


def export_onnx(
    model: Any,
    out_dir: Path | str,
    tokenizer: Any,
    *,
    chunk: int = 64,
    max_context: int | None = None,
    version: str = "1.0.0",
    source: Mapping[str, Any] | None = None,
    announce: Callable[[str], None] | None = None,
) -> Path:
    """Write the ONNX export of a calibrated `QuantizedModel` to `out_dir` (module docstring).
    `announce` is told when each phase starts (the CLI prints it)."""

    out = Path(os.path.abspath(out_dir))
    check_destination(out)
    cfg = model.cfg
    prefix = tuple(model.prefix)
    max_context = context_positions(cfg, len(prefix), max_context)
    if not 1 <= chunk <= max_context - len(prefix):
        raise QnpuError(
            f"the prefill chunk must be in 1..{max_context - len(prefix)} (the context of "
            f"{max_context} after a {len(prefix)}-token prefix), got {chunk}"
        )
    say = announce or (lambda message: None)
    say("the encodings and the transformed weights")
    table = run_encodings(model.require_plan(), model.require_state(), cfg)
    params = model.params()
    graph = graph_of(cfg, params)
    files: dict[str, bytes] = {}
    for kind in ("float", "qdq"):
        say(f"the {kind} graphs: prefill of {chunk} tokens and decode, {max_context} positions")
        graphs = {}
        for role, c in (("prefill", chunk), ("decode", 1)):
            plan = OnnxPlan(
                c,
                max_context,
                table if kind == "qdq" else None,
                outlier_entries(table),
                {} if kind == "qdq" else table,
            )
            graphs[GRAPH_FILES[(kind, role)]] = build_graph(
                params, cfg, plan, name=f"{kind}_{role}", graph=graph
            )
        if kind == "qdq":
            pairs = activation_matmuls(graphs[GRAPH_FILES[(kind, "prefill")]].graph)
        files |= serialize(graphs, DATA_FILES[kind])
    encodings: dict[str, Any] = {"file": ENCODINGS_FILE, "version": version}
    files[ENCODINGS_FILE] = _json_bytes(onnx_encodings(table, cfg.num_layers, version, graph))
    say("the sink prefix's K/V, the embeddings and the tokenizer")
    files[PREFIX_FILE] = _npy_bytes(prefix_kv(model))
    files |= embedding_files(model, table)
    files["tokenizer.json"] = tokenizer.backend.to_str().encode()
    manifest = {
        "onnx": {
            "format": FORMAT,
            "graph": FORMAT_GRAPH,
            "opset": OPSET,
            "chunk": chunk,
            "max_context": max_context,
            "prefix_tokens": list(prefix),
            "num_layers": cfg.num_layers,
            "vocab_size": cfg.vocab_size,
            "graphs": {f"{k}_{r}": f for (k, r), f in GRAPH_FILES.items()},
            "encodings": encodings,
            "prefix_kv": PREFIX_FILE,
            "input": aimet_name(embed_output(graph), "hf", graph),
            "embedding": {**EMBED_FILES, "table": aimet_name(embed_table(graph), "hf", graph)},
            "activation_matmuls": pairs,
            "float_weights": "gptq_codes" if model.weight_codes else "transformed",
        },
        "tokenizer": tokenizer_info(tokenizer),
        "source": dict(source or {"model": model.source}),
    }
    say(f"writing {len(files)} files ({sum(map(len, files.values())) / 2**20:.0f} MiB) to {out}")
    return write_artifact(out, manifest, {}, files=files)


def export_run_onnx(run_dir: Path | str, out_dir: Path | str, **kwargs: Any) -> Path:
    """The ONNX export of a finished `qnpu quantize` run (`kwargs` as `export_onnx`)."""

    check_export_destination(run_dir, out_dir)  # refuse before the slow part, too
    (kwargs.get("announce") or (lambda message: None))(f"reading and verifying the run {run_dir}")
    run = load_run(Path(run_dir))
    source = {"run": Path(run_dir).name, "method": run.config.method, "model": run.model.source}
    return export_onnx(run.model, out_dir, run.tokenizer, source=source, **kwargs)


def prefix_kv(model: Any) -> np.ndarray:
    """The sink prefix's K/V [2 (float, fake-quant), 2 (K, V), L, Hkv, P, hd] as the float
    and the fake-quant model compute them (the prefix runs in float; fake-quant quantizes only
    its K/V, and runs it on the weights before GPTQ's rounding where the model has such)."""

    cfg, p = model.cfg, len(model.prefix)
    if not p:
        return np.zeros((2, 2, cfg.num_layers, cfg.num_kv_heads, 0, cfg.head_dim), np.float32)
    params = model.params()
    unrounded = model.prefix_params()
    plan = model.require_plan()
    state = effective_state(plan, model.require_state())
    tokens = jnp.asarray([model.prefix], jnp.int32)
    out = []
    for taps in (None, CacheOnlyTaps(FakeQuantTaps(plan))):
        if taps is not None and unrounded is not None:
            params = unrounded
        _, cache, _ = jax.jit(
            lambda params, state, tokens, taps=taps: forward_tapped(
                params, tokens, init_cache(cfg, 1, p), jnp.int32(0), state, cfg=cfg, taps=taps
            )
        )(params, state, tokens)
        out.append(np.stack([np.asarray(cache["k"])[:, 0], np.asarray(cache["v"])[:, 0]]))
    return np.stack(out).astype(np.float32)


def _json_bytes(obj: Any) -> bytes:

    return (json.dumps(obj, indent=1) + "\n").encode()


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()
