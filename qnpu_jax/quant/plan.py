"""Quantization plans: for every quantizable tensor of the integer graph, how it is quantized.

Tensor paths are `layers/NAME` for tensors inside each decoder layer (stacked along the layer
axis) and a bare `NAME` for the rest. One encoding per tensor, not per consumer: q/k/v share
their input quantizer (`layers/attn_in`), gate/up share theirs (`layers/mlp_in`), the K cache
is `layers/k_rope` and the V cache is `layers/v_out`.

A plan is built from the default table of docs/design.md §3 and rules matched on the path
(`QuantRule`), in the style of Qwix's regex-selected rules. Per-layer bit-widths (mixed
precision) live in `TensorQuant.layer_bits`, which becomes qmin/qmax arrays, so one compiled
program serves every layer.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.fieldtypes import check_field_types
from qnpu_jax.ir.graph import (
    CHANNEL_INPUTS,
    EMBED_TABLE,
    GRAPH,
    LAYER_ACTS,
    LINEARS,
    LM_HEAD,
    MUXQ_MAX_EXP,
    MUXQ_TENSORS,
    NAMED_GRAPHS,
    PROBS,
    SIMULATIONS,
    SOFTMAX_ROLE,
    UNROTATED_INPUT,
    UNROTATED_ROLE,
    Graph,
    Tensor,
    channel_mask,
)
from qnpu_jax.quant.init import RANGE_INITS
from qnpu_jax.quant.spec import QuantSpec, qrange
from qnpu_jax.quant.state import is_layer_path

# a plan entry's initializer: one computed from calibration data, or "fixed" (the softmax
# probabilities' encoding)
INIT_METHODS = (*RANGE_INITS, "fixed")

# The tensors of the shipped graph (`ir.graph.GRAPH`), in graph order.
WEIGHTS = LINEARS  # the decoder layer's weights
LAYER_ACTIVATIONS = LAYER_ACTS  # its activations with an encoding
GLOBAL_TENSORS = tuple(t.name for t in GRAPH.global_tensors)  # embedding, final norm, lm_head
# A probability code p means p / (2^16 − 1): the integer softmax's fixed output encoding.
PROBS_SCALE_DENOMINATOR = 2**16 - 1


def all_paths(graph: Graph = GRAPH) -> tuple[str, ...]:
    """Every plan path of `graph`: `layers/NAME` per layer tensor, then the global ones."""
    return (
        *(f"layers/{t.name}" for t in graph.layer_tensors),
        *(t.name for t in graph.global_tensors),
    )


def _weight_names(graphs: Iterable[Graph]) -> tuple[frozenset[str], frozenset[str]]:
    """The layer weights' and the model weights' names of `graphs`."""
    graphs = tuple(graphs)
    layer = frozenset(t.name for g in graphs for t in g.layer_weights)
    model = frozenset(op.weight.name for g in graphs for op in g.model if op.weight is not None)
    return layer, model


# every graph's (a name is a weight in all graphs that have it, or in none)
_ANY_GRAPH_WEIGHTS = _weight_names((GRAPH, *NAMED_GRAPHS.values()))


def is_weight(path: str, graph: Graph | None = None) -> bool:
    """Whether plan path `path` is a weight of `graph` (None: of any graph)."""
    layer, model = _ANY_GRAPH_WEIGHTS if graph is None else _weight_names((graph,))
    return path.removeprefix("layers/") in layer or path in model


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorQuant:
    """How one tensor is quantized.

    `axis` is the per-channel axis of a weight stored [out, in] (0: one scale per output row),
    None for per-tensor. `layer_bits`, for a `layers/` tensor, overrides `bits` layer by layer.
    `block` (a layer weight, per channel): one scale per output row and block of `block`
    inputs instead of one per row. `block_scale_bits` makes those block scales AIMET's LPBQ: a
    float scale per row times an integer per block in [1, 2^block_scale_bits]
    (`spec.lpbq_split`), which an integer engine folds into the codes (k·q, int8).
    `shadow_channels` (a linear's input activation; mllm-NPU's shadow outlier execution): per
    layer, the channels whose codes are not clamped to the tensor's range but carried at
    `SHADOW_BITS` (the device clamps them and adds back the overflow r = q − clamp(q) on a
    shadow path, `docs/pipeline.md`); an empty tuple: none in that layer.
    `muxq_channels` with `muxq_exp` (MUXQ): per layer, the outlier channels whose codes hold
    x >> muxq_exp (the tensor's state scale is then per channel, s·2^exp on them); on a linear
    input the device adds (2^exp − 1) times their matmul (the Aux term) to the Body matmul, on
    a residual add's output (the residual split) its readers take those codes times 2^exp.
    `headroom` (a symmetric activation): its calibrated range times this factor, so that
    values beyond what the calibration windows reached are not clipped; a 16-bit grid has the
    resolution to spare (2: one bit of it).
    """

    bits: int
    symmetric: bool = True
    signed: bool = True
    axis: int | None = None
    init: str = "max_min"
    learnable: bool = False
    layer_bits: tuple[int, ...] | None = None
    block: int | None = None
    block_scale_bits: int | None = None
    shadow_channels: tuple[tuple[int, ...], ...] | None = None
    muxq_channels: tuple[tuple[int, ...], ...] | None = None
    muxq_exp: int | None = None
    headroom: float = 1.0

    def __post_init__(self) -> None:
        check_headroom(self.headroom)
        object.__setattr__(self, "headroom", float(self.headroom))
        if self.layer_bits is not None:  # a list would make the plan unhashable under jit
            object.__setattr__(self, "layer_bits", tuple(self.layer_bits))
        for field in ("shadow_channels", "muxq_channels"):
            if getattr(self, field) is not None:
                object.__setattr__(self, field, _channel_lists(getattr(self, field), field))
        if (self.muxq_channels is None) != (self.muxq_exp is None):
            raise QnpuError("muxq_channels and muxq_exp come together")
        if self.muxq_exp is not None and (
            isinstance(self.muxq_exp, bool)
            or not isinstance(self.muxq_exp, int)
            or not 1 <= self.muxq_exp <= MUXQ_MAX_EXP
        ):
            raise QnpuError(
                f"muxq_exp must be an integer in 1..{MUXQ_MAX_EXP}, got {self.muxq_exp!r}"
            )
        if self.muxq_channels is not None and self.shadow_channels is not None:
            raise QnpuError("a tensor takes shadow channels or MUXQ channels, not both")
        check_block_fields(self.block, self.block_scale_bits)
        if self.block is not None and self.axis != 0:
            raise QnpuError("per-block weights need per-channel scales (axis 0)")
        for b in (self.bits, *(self.layer_bits or ())):
            if isinstance(b, bool) or not isinstance(b, int) or not 2 <= b <= 16:
                raise QnpuError(f"bit-width must be an integer in 2..16, got {b!r}")
        if self.init not in INIT_METHODS:
            raise QnpuError(f"unknown initializer {self.init!r}; known: {', '.join(INIT_METHODS)}")
        if self.init == "fixed" and self.learnable:
            raise QnpuError("a tensor with a fixed encoding cannot be learnable")
        if self.axis is not None and (isinstance(self.axis, bool) or self.axis != 0):
            raise QnpuError(f"per-channel axis must be 0 (output channels), got {self.axis!r}")

    @property
    def lpbq(self) -> bool:
        return self.block_scale_bits is not None

    def muxq_multipliers(self, width: int) -> np.ndarray:
        """Per layer and channel [L, width] int64: 2^muxq_exp on the MUXQ channels, else 1
        (the tensor's per-channel scale is its Body scale times these)."""
        if self.muxq_channels is None or self.muxq_exp is None:
            raise QnpuError("this tensor has no MUXQ channels")
        return np.where(channel_mask(self.muxq_channels, width), 1 << self.muxq_exp, 1)

    def bits_for_layer(self, layer: int) -> int:
        return self.layer_bits[layer] if self.layer_bits is not None else self.bits

    def qrange(self, bits: int) -> tuple[int, int]:
        return qrange(bits, self.signed)

    def spec(self, layer: int | None = None) -> QuantSpec:
        """The QuantSpec of this tensor (of one layer, when bits differ by layer)."""
        bits = self.bits if layer is None else self.bits_for_layer(layer)
        return QuantSpec(bits=bits, symmetric=self.symmetric, signed=self.signed, axis=self.axis)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantRule:
    """Override fields of every tensor whose path fully matches `pattern` (a regex).

    A tensor removed by an earlier rule (`quantize=False`) and re-added by a later one starts
    from the W8A8 default table.
    """

    pattern: str
    bits: int | None = None
    symmetric: bool | None = None
    axis: int | None = -1  # -1: leave unchanged (None is a meaningful value: per-tensor)
    init: str | None = None
    learnable: bool | None = None
    layer_bits: tuple[int, ...] | None = None
    block: int | None = None  # 0: back to one scale per row (None: leave unchanged)
    block_scale_bits: int | None = None  # 0: float block scales (None: leave unchanged)
    quantize: bool | None = None  # False removes the tensor from the plan (kept in float)
    headroom: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise QnpuError(f"rule pattern must be a string, got {self.pattern!r}")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise QnpuError(f"bad rule pattern {self.pattern!r}: {e}") from e
        if isinstance(self.layer_bits, list):
            object.__setattr__(self, "layer_bits", tuple(self.layer_bits))
        check_field_types(self, "rule ")
        if self.headroom is not None:
            check_headroom(self.headroom)
        if self.block not in (None, 0):
            check_block_fields(self.block, None)
        if self.block_scale_bits not in (None, 0):
            check_block_fields(self.block or BLOCK_SIZES[0], self.block_scale_bits)

    def matches(self, path: str) -> bool:
        return re.fullmatch(self.pattern, path) is not None


@dataclasses.dataclass(frozen=True)
class QuantPlan:
    """Path -> TensorQuant for every tensor that is quantized (absent = kept in float).

    Stored as a sorted tuple of pairs so the plan is hashable (a static jit argument).
    `simulation`: how the fake-quant forward computes the ops between quantizers, "fake"
    (float32) or "device" (the integer contract's tables and grids where they differ from
    float: `FakeQuantTaps`, `ir.graph.SIMULATIONS`).
    """

    entries: tuple[tuple[str, TensorQuant], ...]
    num_layers: int
    graph: Graph = dataclasses.field(default=GRAPH, repr=False)  # whose tensors it quantizes
    simulation: str = "device"

    def __post_init__(self) -> None:
        if self.simulation not in SIMULATIONS:
            raise QnpuError(
                f"unknown simulation {self.simulation!r}; known: {', '.join(SIMULATIONS)}"
            )
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int):
            raise QnpuError(f"num_layers must be an integer, got {self.num_layers!r}")
        if self.num_layers < 1:
            raise QnpuError(f"num_layers must be positive, got {self.num_layers}")
        paths = [p for p, _ in self.entries]
        if len(set(paths)) != len(paths):
            raise QnpuError("a plan lists some tensor path twice")
        # Canonical order: equal plans compare and hash equal (one jit compilation).
        object.__setattr__(self, "entries", tuple(sorted(self.entries, key=lambda e: e[0])))
        known = set(all_paths(self.graph))
        for path, tq in self.entries:
            if path not in known:
                raise QnpuError(f"unknown tensor path {path!r} in plan")
            _check_combination(path, tq, self.num_layers)

    def get(self, path: str) -> TensorQuant | None:
        return dict(self.entries).get(path)

    def __contains__(self, path: object) -> bool:
        return any(p == path for p, _ in self.entries)

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.entries)

    def with_entries(self, entries: Iterable[tuple[str, TensorQuant]]) -> QuantPlan:
        """This plan (layers, graph, simulation) over other tensors."""
        return dataclasses.replace(self, entries=tuple(entries))

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form; `QuantPlan.from_dict` reads it back to an equal plan. The graph is
        named (`ir.graph.NAMED_GRAPHS`) where it is not GRAPH (plans of GRAPH read as before)."""
        out: dict[str, object] = {
            "num_layers": self.num_layers,
            "simulation": self.simulation,
            "tensors": {
                path: {  # a default headroom is left out: such plans read as before it
                    k: list(v) if isinstance(v, tuple) else v
                    for k, v in dataclasses.asdict(tq).items()
                    if not (k == "headroom" and v == 1.0)
                }
                for path, tq in self.entries
            },
        }
        names = [a for a, g in NAMED_GRAPHS.items() if g is self.graph]
        if self.graph is not GRAPH:
            if not names:
                raise QnpuError("a plan over a graph of no architecture cannot be written")
            out["graph"] = names[0]
        return out

    @classmethod
    def from_dict(cls, data: object) -> QuantPlan:
        # plans written before `simulation` existed have no such key: they were "fake"; a
        # plan of GRAPH has no "graph"
        optional = {"simulation", "graph"}
        if not isinstance(data, dict) or set(data) - optional != {"num_layers", "tensors"}:
            raise QnpuError(
                "a plan is a mapping with keys 'num_layers', 'tensors', 'simulation' and "
                "(another architecture's) 'graph'"
            )
        graph = GRAPH
        if "graph" in data:
            if data["graph"] not in NAMED_GRAPHS:
                raise QnpuError(
                    f"plan 'graph' {data['graph']!r} is not one of {sorted(NAMED_GRAPHS)}"
                )
            graph = NAMED_GRAPHS[data["graph"]]
        tensors = data["tensors"]
        if not isinstance(tensors, dict):
            raise QnpuError("plan 'tensors' must map tensor paths to their quantization")
        fields = {f.name for f in dataclasses.fields(TensorQuant)}
        entries = []
        for path, tq in tensors.items():
            if not isinstance(tq, dict) or set(tq) - fields:
                raise QnpuError(f"plan entry {path!r}: keys must be among {sorted(fields)}")
            entries.append((path, TensorQuant(**tq)))
        return cls(
            tuple(entries), data["num_layers"], graph, simulation=data.get("simulation", "fake")
        )

    def apply(self, rules: Iterable[QuantRule]) -> QuantPlan:
        """A new plan with `rules` applied in order; a rule matching nothing is an error."""
        table = dict(self.entries)
        defaults = dict(_default_table(8, 8, 8, 8, self.graph))
        for rule in rules:
            matched = [p for p in all_paths(self.graph) if rule.matches(p)]
            if not matched:
                raise QnpuError(
                    f"rule pattern {rule.pattern!r} matches no tensor; paths look like "
                    "'layers/down_in', 'layers/q_proj', 'lm_head'"
                )
            for path in matched:
                if rule.quantize is False:
                    table.pop(path, None)
                    continue
                base = table.get(path) or defaults[path]
                changes = {
                    f: getattr(rule, f)
                    for f in ("bits", "symmetric", "init", "learnable", "layer_bits", "headroom")
                    if getattr(rule, f) is not None
                }
                if rule.axis != -1:
                    changes["axis"] = rule.axis
                for f in ("block", "block_scale_bits"):  # 0 clears the field
                    value = getattr(rule, f)
                    if value is not None:
                        changes[f] = value or None
                if rule.block == 0 and not rule.block_scale_bits:  # no blocks, no LPBQ
                    changes["block_scale_bits"] = None
                try:
                    table[path] = dataclasses.replace(base, **changes)
                except QnpuError as e:
                    raise QnpuError(f"{path}: {e}") from e
        return self.with_entries(sorted(table.items()))


def _channel_lists(value: object, field: str) -> tuple[tuple[int, ...], ...]:
    """Per-layer channel indices as sorted tuples of distinct non-negative integers."""
    if not isinstance(value, (list, tuple)):
        raise QnpuError(f"{field} must be one list of channels per layer, got {value!r}")
    out = []
    for layer, chans in enumerate(value):
        if not isinstance(chans, (list, tuple)) or any(
            isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in chans
        ):
            raise QnpuError(f"{field} (layer {layer}): channel indices are integers >= 0")
        if list(chans) != sorted(set(chans)):
            raise QnpuError(f"{field} (layer {layer}): indices must be sorted and distinct")
        out.append(tuple(chans))
    return tuple(out)


MAX_HEADROOM = 256.0  # 8 bits of a 16-bit grid


def check_headroom(value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not 1.0 <= value <= MAX_HEADROOM
    ):
        raise QnpuError(f"headroom must be a number in [1, {MAX_HEADROOM:g}], got {value!r}")


BLOCK_SIZES = (16, 32, 64, 128, 256)
MAX_LPBQ_BITS = 8  # k·q of an LPBQ weight must stay an int8 code


def check_block_fields(block: object, scale_bits: object) -> None:
    if block is not None and (
        isinstance(block, bool) or not isinstance(block, int) or block not in BLOCK_SIZES
    ):
        raise QnpuError(f"block must be one of {BLOCK_SIZES} (or null), got {block!r}")
    if scale_bits is None:
        return
    if block is None:
        raise QnpuError("block_scale_bits (LPBQ) needs a block size")
    if isinstance(scale_bits, bool) or not isinstance(scale_bits, int) or not 2 <= scale_bits <= 8:
        raise QnpuError(f"block_scale_bits must be an integer in 2..8, got {scale_bits!r}")


def _check_combination(path: str, tq: TensorQuant, num_layers: int) -> None:
    name = path.removeprefix("layers/")
    if tq.block is not None:
        if not (is_weight(path) and is_layer_path(path)):
            raise QnpuError(f"{path}: per-block scales apply to the decoder layers' weights only")
        if tq.init == "percentile":  # a 2048-bin histogram per block of a few inputs
            raise QnpuError(f"{path}: per-block weights take no 'percentile' initialization")
        widest = max(tq.layer_bits or (tq.bits,))
        if tq.block_scale_bits is not None and widest + tq.block_scale_bits > MAX_LPBQ_BITS:
            raise QnpuError(
                f"{path}: LPBQ at {widest} bits with {tq.block_scale_bits}-bit block scales "
                f"decompresses to {widest + tq.block_scale_bits} bits; at most "
                f"{MAX_LPBQ_BITS} (int8 codes)"
            )
    for field, allowed, what in (
        ("shadow_channels", CHANNEL_INPUTS, "a linear's input written channel by channel"),
        ("muxq_channels", MUXQ_TENSORS, "such an input or a residual add's output"),
    ):
        lists = getattr(tq, field)
        if lists is None:
            continue
        if not is_layer_path(path) or name not in allowed:
            raise QnpuError(f"{path}: {field} belong to {what} ({', '.join(allowed)})")
        if len(lists) != num_layers:
            raise QnpuError(f"{path}: {field} has {len(lists)} entries for {num_layers} layers")
    if tq.layer_bits is not None:
        if not is_layer_path(path):
            raise QnpuError(f"{path}: per-layer bits apply to layers/ tensors only")
        if len(tq.layer_bits) != num_layers:
            raise QnpuError(
                f"{path}: layer_bits has {len(tq.layer_bits)} entries for {num_layers} layers"
            )
    if not is_weight(path) and tq.axis is not None:
        raise QnpuError(f"{path}: static activations are per-tensor (axis must be None)")
    if tq.headroom != 1.0 and (is_weight(path) or not tq.symmetric or tq.init == "fixed"):
        raise QnpuError(
            f"{path}: headroom widens a symmetric calibrated activation's range (a weight's "
            "range is exact)"
        )
    if name == PROBS:
        if tq.signed or tq.init != "fixed" or tq.bits != 16 or tq.layer_bits is not None:
            raise QnpuError(
                f"{path}: softmax probabilities use the fixed unsigned 16-bit encoding of the "
                "integer softmax"
            )
    elif not tq.signed:
        raise QnpuError(f"{path}: only softmax probabilities are unsigned")
    elif tq.init == "fixed":
        raise QnpuError(f"{path}: only softmax probabilities have a fixed encoding")
    if name == UNROTATED_INPUT and min(tq.layer_bits or (tq.bits,)) < 8:
        raise QnpuError(f"{path}: the unrotated down_proj input is never below 8 bits")
    if is_weight(path) and not tq.symmetric and not (is_layer_path(path) and tq.axis == 0):
        raise QnpuError(
            f"{path}: only the decoder linears' per-channel weights may be asymmetric (a zero "
            "point per row, the z_w·Σx term of the integer matmul)"
        )
    if is_weight(path) and not tq.symmetric and tq.block is not None:
        raise QnpuError(f"{path}: per-block weights are symmetric")
    if not is_weight(path) and tq.init == "mse":
        raise QnpuError(
            f"{path}: 'mse' initialization needs sample data and is supported for weights only"
        )
    if path == EMBED_TABLE and tq.axis is None:
        raise QnpuError("embed_tokens: the embedding table is quantized per row (axis 0)")
    if tq.init == "percentile" and path in (EMBED_TABLE, LM_HEAD):
        raise QnpuError(f"{path}: per-row percentile histograms of the vocabulary are too large")


def _default_quant(t: Tensor, weight: bool, bits_of: dict[str, int]) -> TensorQuant:
    """docs/design.md §3: a tensor's default quantizer from its role in the graph; weights are
    per output channel (the embedding table per row)."""
    if t.bits == SOFTMAX_ROLE:
        return TensorQuant(bits=16, signed=False, init="fixed")
    bits = bits_of[t.bits] if t.bits in bits_of else int(t.bits)
    return TensorQuant(bits=bits, axis=0 if weight else None)


def _default_table(
    w_bits: int, a_bits: int, kv_bits: int, down_in_bits: int, graph: Graph = GRAPH
) -> list[tuple[str, TensorQuant]]:
    bits_of = {"weight": w_bits, "act": a_bits, "kv": kv_bits, UNROTATED_ROLE: down_in_bits}
    paths = all_paths(graph)
    tensors = (*graph.layer_tensors, *graph.global_tensors)
    return [
        (p, _default_quant(t, is_weight(p, graph), bits_of))
        for p, t in zip(paths, tensors, strict=True)
    ]


def default_plan(
    num_layers: int,
    *,
    w_bits: int = 8,
    a_bits: int = 8,
    kv_bits: int = 8,
    down_in_bits: int = 8,
    rules: Sequence[QuantRule] = (),
    graph: Graph = GRAPH,
    simulation: str = "device",
) -> QuantPlan:
    """docs/design.md §3's table at W`w_bits` A`a_bits` KV`kv_bits` for the tensors of `graph`,
    then `rules`."""
    table = _default_table(w_bits, a_bits, kv_bits, down_in_bits, graph)
    return QuantPlan(tuple(sorted(table)), num_layers, graph, simulation).apply(rules)


def uniform_plan(num_layers: int, bits: int) -> QuantPlan:
    """Every tensor (but the fixed-encoding probabilities) at `bits` — e.g. the 16-bit check."""
    plan = default_plan(num_layers)
    entries = tuple(
        (p, tq if p == f"layers/{PROBS}" else dataclasses.replace(tq, bits=bits))
        for p, tq in plan.entries
    )
    return plan.with_entries(entries)
