"""AIMET encodings (schema 1.0.0 or 0.6.1) from the "encodings" table of the integer artifact.

The table maps our tensor names (`layers.{i}.q_proj`, `layers.{i}.scores`, `embed_tokens`, ...)
to `{"bits", "signed", "symmetric", "axis", "scale", "zero_point"}` with the contract
real = scale·(q − zero_point), q in [−2^(b−1), 2^(b−1)−1] (signed) or [0, 2^b−1] (unsigned).

AIMET (and QNN, `Qnn_BwScaleOffset_t`) writes real = scale·(u + offset) with u on the
*unsigned* grid [0, 2^b−1] in both file schemas (aimet_onnx `AffineEncoding._to_0_6_1` /
`_to_1_0_0`: "encoding offset assumes uint"). A signed code q is the unsigned code
u = q + 2^(b−1), so

    offset = −zero_point − 2^(b−1)   (signed)        offset = −zero_point   (unsigned)
    min = scale·offset,  max = scale·(offset + 2^b − 1)

e.g. signed symmetric 8-bit: offset −128, min −128·scale, max 127·scale; the unsigned 16-bit
softmax output (scale 1/65535): offset 0, min 0, max 1. `is_sym` follows AIMET's own rule:
signed codes and every zero point 0. docs/aimet.md has the naming table and the sources.

Imports only the standard library, numpy, `qnpu_jax.errors` and `qnpu_jax.files` (no jax):
it runs next to the numpy-only emulator.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import read_bytes_bounded, write_bytes_atomic
from qnpu_jax.ir.graph import GRAPH, Graph, Op, OpKind

VERSIONS = ("1.0.0", "0.6.1")
NAMINGS = ("hf", "native")
MIN_BITS = 2
MAX_BITS = 16


@dataclass(frozen=True)
class _Names:
    """Our tensor names of a graph and their Hugging Face LlamaForCausalLM names ("hf"
    naming), read from the graph description. Parameters are the state-dict keys; activations
    are `<module>.output` / `<module>.input`, or a descriptive pseudo-module under the layer
    for ops that are not modules in HF (RoPE, the score matmul, softmax)."""

    head: tuple[str, ...]  # model tensors before the layers (embedding table, its output)
    layer: tuple[str, ...]  # a layer's weights, then its activations, in graph order
    tail: tuple[str, ...]  # model tensors after the layers (final norm output, lm_head)
    weights: frozenset[str]  # parameters (AIMET param_encodings), layer and global
    hf: dict[str, str]  # our name (layer-relative for layer tensors) -> HF name

    @classmethod
    def of(cls, graph: Graph) -> _Names:
        split = [op.kind for op in graph.model].index(OpKind.LAYERS)

        def tensors(ops: tuple[Op, ...]) -> tuple[str, ...]:
            return tuple(t.name for op in ops for t in (op.weight, op.out) if t is not None)

        weights = [t.name for t in graph.layer_weights]
        weights += [op.weight.name for op in graph.model if op.weight is not None]
        return cls(
            tensors(graph.model[:split]),
            tuple(t.name for t in graph.layer_tensors),
            tensors(graph.model[split + 1 :]),
            frozenset(weights),
            {t.name: t.hf for t in (*graph.layer_tensors, *graph.global_tensors)},
        )


_SHIPPED = _Names.of(GRAPH)
LAYER_WEIGHTS = tuple(t.name for t in GRAPH.layer_weights)
LAYER_ACTIVATIONS = tuple(t.name for t in GRAPH.layer_acts)
GLOBAL_HEAD = _SHIPPED.head
GLOBAL_TAIL = _SHIPPED.tail

_LAYER_RE = re.compile(r"layers\.(0|[1-9][0-9]*)\.([a-z_]+)")
_ENTRY_KEYS = ("bits", "signed", "symmetric", "axis", "scale", "zero_point")
# mllm-NPU's shadow channels and MUXQ's shifted channels of a linear input (the encodings
# table of `qnpu_jax.export.exporter`): no AIMET form
OUTLIER_KEYS = ("shadow_channels", "muxq")


def _parse(tensor: str, n: _Names = _SHIPPED) -> tuple[int, int, int]:
    """Sort key (group, layer, position) of one of our tensor names; QnpuError if unknown."""
    if not isinstance(tensor, str):
        raise QnpuError(f"tensor names must be strings, got {tensor!r}")
    if tensor in n.head:
        return 0, 0, n.head.index(tensor)
    if tensor in n.tail:
        return 2, 0, n.tail.index(tensor)
    m = _LAYER_RE.fullmatch(tensor)
    if m is not None and m.group(2) in n.layer:
        return 1, int(m.group(1)), n.layer.index(m.group(2))
    raise QnpuError(f"unknown tensor name {tensor!r} in the encodings table")


def is_param(tensor: str, graph: Graph = GRAPH) -> bool:
    """True for weights (AIMET param_encodings), False for activations."""
    n = _Names.of(graph)
    _parse(tensor, n)
    return tensor.rsplit(".", 1)[-1] in n.weights


def tensor_names(num_layers: int, graph: Graph = GRAPH) -> list[str]:
    """Every tensor name of a `num_layers`-layer model of `graph`, in graph order."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise QnpuError(f"num_layers must be a non-negative int, got {num_layers!r}")
    n = _Names.of(graph)
    layer = [f"layers.{i}.{t}" for i in range(num_layers) for t in n.layer]
    return [*n.head, *layer, *n.tail]


def aimet_name(tensor: str, names: str = "hf", graph: Graph = GRAPH) -> str:
    """The AIMET tensor name of one of our tensors: "hf" (Hugging Face module naming, see
    docs/aimet.md) or "native" (our name unchanged)."""
    if names not in NAMINGS:
        raise QnpuError(f"unknown naming {names!r}; expected one of {', '.join(NAMINGS)}")
    n = _Names.of(graph)
    _parse(tensor, n)
    if names == "native":
        return tensor
    if tensor in n.head or tensor in n.tail:
        return n.hf[tensor]
    _, layer, short = tensor.split(".")
    return f"model.layers.{layer}.{n.hf[short]}"


def _bool(tensor: str, key: str, value: object) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise QnpuError(f"{tensor}: {key} must be a bool, got {value!r}")
    return bool(value)


def _numbers(tensor: str, key: str, value: object) -> list[float]:
    """A flat list or 1-d array of real numbers (bools and strings refused) as floats."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not (
            np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)
        ):
            raise QnpuError(f"{tensor}: {key} must be a 1-d numeric array, got {value.dtype}")
        return [float(v) for v in value]
    if not isinstance(value, list | tuple):
        raise QnpuError(f"{tensor}: {key} must be a list of numbers, got {value!r}")
    for v in value:
        if isinstance(v, bool | np.bool_) or not isinstance(v, int | float | np.number):
            raise QnpuError(f"{tensor}: {key} holds a non-number {v!r}")
    return [float(v) for v in value]


def _checked(tensor: str, entry: object, graph: Graph = GRAPH) -> dict[str, Any]:
    """Validate one table entry; QnpuError naming the tensor on anything malformed."""
    if not isinstance(entry, Mapping):
        raise QnpuError(f"{tensor}: encoding entry must be a mapping, got {type(entry).__name__}")
    missing = [k for k in _ENTRY_KEYS if k not in entry]
    if missing:
        raise QnpuError(f"{tensor}: encoding entry lacks {', '.join(missing)}")
    outliers = [k for k in OUTLIER_KEYS if k in entry]
    if outliers:
        raise QnpuError(
            f"{tensor}: {outliers[0]} has no AIMET encoding (AIMET's activation encodings are "
            "one grid per tensor, clamped on every channel; the integer artifact and the ONNX "
            "QDQ graph carry them)"
        )
    bits = entry["bits"]
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer):
        raise QnpuError(f"{tensor}: bits must be an integer, got {bits!r}")
    if not MIN_BITS <= int(bits) <= MAX_BITS:
        raise QnpuError(f"{tensor}: bits must be in [{MIN_BITS}, {MAX_BITS}], got {bits}")
    signed = _bool(tensor, "signed", entry["signed"])
    symmetric = _bool(tensor, "symmetric", entry["symmetric"])
    axis = entry["axis"]
    if axis is not None and (isinstance(axis, bool) or axis != 0):
        raise QnpuError(f"{tensor}: axis must be 0 (per output row) or None, got {axis!r}")
    if axis is not None and not is_param(tensor, graph):
        raise QnpuError(f"{tensor}: per-channel (axis 0) encodings are only exported for weights")
    scale = _numbers(tensor, "scale", entry["scale"])
    zero_point = _numbers(tensor, "zero_point", entry["zero_point"])
    if not scale:
        raise QnpuError(f"{tensor}: scale is empty")
    if axis is None and len(scale) != 1:
        raise QnpuError(f"{tensor}: per-tensor (axis None) needs 1 scale, got {len(scale)}")
    if len(zero_point) != len(scale):
        raise QnpuError(
            f"{tensor}: {len(zero_point)} zero points for {len(scale)} scales (need one each)"
        )
    for s in scale:
        if not (math.isfinite(s) and s > 0):
            raise QnpuError(f"{tensor}: scales must be finite and positive, got {s!r}")
    for z in zero_point:
        if not (math.isfinite(z) and z == int(z)):
            raise QnpuError(f"{tensor}: zero points must be integers, got {z!r}")
    zps = [int(z) for z in zero_point]
    if symmetric and any(zps):
        raise QnpuError(f"{tensor}: symmetric encoding with a non-zero zero point")
    return {
        "bits": int(bits),
        "signed": signed,
        "axis": axis,
        "scale": scale,
        "zero_point": zps,
        **_checked_blocks(tensor, entry, len(scale), symmetric and signed),
    }


def _checked_blocks(tensor: str, entry: Mapping[str, Any], n_scales: int, sym: bool) -> dict:
    """The optional per-block fields: `block` (inputs per block; `scale` then lists the
    [out, nb] block scales row-major), or with `block_scale_bits` AIMET's LPBQ (`scale` per
    row, `block_scale` the integer block scales [out, nb] in [1, 2^block_scale_bits])."""
    block = entry.get("block")
    if block is None:
        if entry.get("block_scale") is not None or entry.get("block_scale_bits") is not None:
            raise QnpuError(f"{tensor}: block scales without a block size")
        return {}
    if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
        raise QnpuError(f"{tensor}: block must be a positive integer, got {block!r}")
    if entry.get("axis") != 0 or not sym:
        raise QnpuError(f"{tensor}: per-block encodings are symmetric signed, per row (axis 0)")
    if not _LAYER_RE.fullmatch(tensor):
        raise QnpuError(f"{tensor}: per-block encodings are for the decoder layers' weights")
    out: dict[str, Any] = {"block": int(block)}
    bits, ints = entry.get("block_scale_bits"), entry.get("block_scale")
    if bits is None and ints is None:
        return out
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or not 2 <= bits <= 8:
        raise QnpuError(f"{tensor}: block_scale_bits must be an integer in 2..8, got {bits!r}")
    k = _numbers(tensor, "block_scale", ints)
    if not k or len(k) % n_scales:
        raise QnpuError(f"{tensor}: {len(k)} block scales for {n_scales} rows")
    if any(v != int(v) or not 1 <= v <= 1 << int(bits) for v in k):
        raise QnpuError(f"{tensor}: block scales must be integers in [1, 2^{int(bits)}]")
    return out | {"block_scale_bits": int(bits), "block_scale": [int(v) for v in k]}


def _offsets(e: Mapping[str, Any]) -> list[int]:
    """AIMET offsets (real = scale·(u + offset), u unsigned) of our zero points."""
    shift = 1 << (e["bits"] - 1) if e["signed"] else 0
    return [-z - shift for z in e["zero_point"]]


def _is_sym(e: Mapping[str, Any]) -> bool:
    # AIMET's rule (aimet_onnx AffineEncoding): signed codes with every offset 0 in signed form.
    return bool(e["signed"] and not any(e["zero_point"]))


def _entry_1_0_0(name: str, e: Mapping[str, Any]) -> dict[str, Any]:
    if "block_scale" in e:  # LPBQ: AIMET's decompressed width is bits + block-scale bits
        bw = e["bits"] + e["block_scale_bits"]
        return {
            "name": name,
            "dtype": "INT",
            "enc_type": "LPBQ",
            "bw": bw,
            "compressed_bw": e["bits"],
            "is_sym": True,
            "scale": list(e["scale"]),
            "offset": [-(1 << (bw - 1))] * len(e["scale"]),
            "per_block_int_scale": list(e["block_scale"]),
            "block_size": e["block"],
        }
    if "block" in e:
        return {
            "name": name,
            "dtype": "INT",
            "enc_type": "PER_BLOCK",
            "bw": e["bits"],
            "is_sym": _is_sym(e),
            "scale": list(e["scale"]),
            "offset": _offsets(e),
            "block_size": e["block"],
        }
    return {
        "name": name,
        "dtype": "INT",
        "enc_type": "PER_TENSOR" if e["axis"] is None else "PER_CHANNEL",
        "bw": e["bits"],
        "is_sym": _is_sym(e),
        "scale": list(e["scale"]),
        "offset": _offsets(e),
    }


def _entry_0_6_1(name: str, e: Mapping[str, Any]) -> list[dict[str, Any]]:
    if "block" in e:
        raise QnpuError(f"{name}: schema 0.6.1 has no per-block encodings; write 1.0.0")
    top = (1 << e["bits"]) - 1
    sym = str(_is_sym(e))
    return [
        {
            "bitwidth": e["bits"],
            "dtype": "int",
            "is_symmetric": sym,
            "min": s * o,
            "max": s * (o + top),
            "offset": o,
            "scale": s,
        }
        for s, o in zip(e["scale"], _offsets(e), strict=True)
    ]


def aimet_encodings(
    encodings: Mapping[str, Mapping[str, Any]],
    *,
    version: str = "1.0.0",
    names: str = "hf",
    graph: Graph = GRAPH,
) -> dict[str, Any]:
    """The JSON-ready AIMET encodings object of our encodings table.

    `version` "1.0.0" (lists of named entries, one entry per tensor with per-channel scale and
    offset lists) or "0.6.1" (dicts name -> list of one entry per channel, with min/max);
    `names` "hf" (Hugging Face module naming, docs/aimet.md) or "native" (our names).
    Weights go to `param_encodings`, everything else to `activation_encodings`, in graph order.
    Raises QnpuError on an unknown version or naming, an unknown tensor name or a malformed
    entry (naming the tensor).
    """
    if version not in VERSIONS:
        raise QnpuError(
            f"unknown AIMET encoding version {version!r}; expected one of {', '.join(VERSIONS)}"
        )
    if names not in NAMINGS:
        raise QnpuError(f"unknown naming {names!r}; expected one of {', '.join(NAMINGS)}")
    if not isinstance(encodings, Mapping):
        raise QnpuError(f"encodings must be a mapping, got {type(encodings).__name__}")
    n = _Names.of(graph)
    for tensor in encodings:
        _parse(tensor, n)
    ordered = sorted(encodings, key=lambda t: _parse(t, n))
    checked = {t: _checked(t, encodings[t], graph) for t in ordered}
    if version == "1.0.0":
        acts: list[dict[str, Any]] = []
        params: list[dict[str, Any]] = []
        for t, e in checked.items():
            target = params if is_param(t, graph) else acts
            target.append(_entry_1_0_0(aimet_name(t, names, graph), e))
        return {
            "version": version,
            "activation_encodings": acts,
            "param_encodings": params,
            "excluded_layers": [],
        }
    act_map: dict[str, list[dict[str, Any]]] = {}
    param_map: dict[str, list[dict[str, Any]]] = {}
    for t, e in checked.items():
        target_map = param_map if is_param(t, graph) else act_map
        target_map[aimet_name(t, names, graph)] = _entry_0_6_1(t, e)
    return {"version": version, "activation_encodings": act_map, "param_encodings": param_map}


# The top-level keys of each version's file as `write_aimet` writes them, in order.
_WRITTEN_KEYS = (
    ["version", "activation_encodings", "param_encodings", "excluded_layers"],
    ["version", "activation_encodings", "param_encodings"],
)


def _dump(obj: Mapping[str, Any]) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def check_encodings_destination(path: Path) -> None:
    """Refuse to replace `path` unless it is absent or an encodings file `write_aimet` wrote:
    AIMET encodings in exactly its layout (keys, order, indentation). A user's file, AIMET's
    own export or a hand-edited file is left alone."""
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    refuse = (
        f"{path} exists and is not an encodings file that qnpu wrote ({{}}); refusing to "
        "replace it (move it away, or choose another --out)"
    )
    if path.is_symlink():
        raise QnpuError(refuse.format("it is a symlink"))
    try:
        data = read_bytes_bounded(path, what="encodings file")
        doc = json.loads(data)
    except (QnpuError, ValueError) as e:
        raise QnpuError(refuse.format(e)) from e
    ours = isinstance(doc, dict) and list(doc) in _WRITTEN_KEYS and _dump(doc) == data
    if not ours:
        raise QnpuError(refuse.format("not in the layout qnpu writes"))


def write_aimet(
    path: Path,
    encodings: Mapping[str, Mapping[str, Any]],
    *,
    version: str = "1.0.0",
    names: str = "hf",
    graph: Graph = GRAPH,
) -> Path:
    """Write `aimet_encodings(encodings, version=..., names=..., graph=...)` to `path`
    atomically (the file for `qnn-onnx-converter --quantization_overrides`)."""
    obj = aimet_encodings(encodings, version=version, names=names, graph=graph)
    return write_bytes_atomic(Path(path), _dump(obj))
