"""The integer graph of the artifact: its op list and fixed-point constants (pure data).

Shared by the exporter, the numpy emulator and the JAX integer forward; imports nothing
heavy, so the emulator stays free of JAX. docs/artifact.md describes every op.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError

# /2: the activation columns follow the op order (/1 had silu_out before up_out)
FORMAT_GRAPH = "qnpu-llama-int/2"
# /3: /2 plus channel lists of linear inputs (shadow channels `graph.shadow`, MUXQ channels
# `graph.muxq`, which may also name a residual add's output: the residual split) and
# asymmetric weights (`graph.weight_zero_points`, the linears with a zero point per row);
# written only when a plan has them, so a /2 reader refuses what it would run wrong, and
# this one reads both
FORMAT_GRAPH_CHANNELS = "qnpu-llama-int/3"
NORM_FRACTION_BITS = 8  # F: the RMSNorm root carries F fractional bits
NORM_UNIT_BITS = 16  # K: the normalized value carries K fractional bits before requantizing
ROPE_FRACTION_BITS = 14  # Q14 cos/sin
# Qwen3's per-head RMSNorm before RoPE writes a signed 16-bit intermediate (±HEAD_NORM_MAX)
# at a per-layer scale max|γ|·√hd / HEAD_NORM_MAX, the largest value a normalized head can
# take: it never clips, and RoPE's products stay as small as for a 16-bit input.
HEAD_NORM_MAX = (1 << 15) - 1
# mllm-NPU's shadow outliers: a shadow channel's codes are signed SHADOW_BITS-bit (exact in
# float32), so the overflow r = q − clamp(q) the shadow path adds back is never clipped in use.
SHADOW_BITS = 24
SHADOW_RANGE = (-(1 << (SHADOW_BITS - 1)), (1 << (SHADOW_BITS - 1)) - 1)
# MUXQ: an outlier channel's codes are its value >> exp (at most this) in the Body tensor
MUXQ_MAX_EXP = 8
# weight codes are int8 (4-bit ones packed); an asymmetric weight's row zero points too
WEIGHT_CODE_RANGE = (-128, 127)
LOGITS_SCALE = 2.0**-16  # int32 logits: real logit = code · 2^-16
LOGITS_RANGE = (-(2**31), 2**31 - 1)
# How a fake-quant forward computes the ops between quantizers (`QuantPlan.simulation`):
# "fake" in float32; "device" with this contract's own tables and grids where they differ
# from float (Q14 RoPE, the integer softmax's exp and probability grids).
SIMULATIONS = ("fake", "device")


class OpKind(enum.StrEnum):
    """The kinds of op of the graph; a value is the op's name in the artifact's op list."""

    EMBED = "embed"
    LAYERS = "layers"
    RMSNORM = "rmsnorm"
    LINEAR = "linear"
    ROPE = "rope"
    ATTENTION = "attention"
    ADD = "add"
    LUT = "lut"
    MUL = "mul"


OPS = tuple(OpKind)
# The kinds of the model's op list only: a per-layer interpreter declares them not handled.
MODEL_ONLY_KINDS = frozenset({OpKind.EMBED, OpKind.LAYERS})
# The kinds of a layer's op list only: a model-level interpreter declares them not handled.
LAYER_ONLY_KINDS = frozenset(OpKind) - MODEL_ONLY_KINDS - {OpKind.RMSNORM, OpKind.LINEAR}


def check_handlers(
    table: Mapping[Any, object], who: str, not_handled: Iterable[OpKind] = ()
) -> None:
    """Refuse an interpreter's dispatch table unless its keys and the kinds it declares
    `not_handled` are each OpKind exactly once (run at import: a new kind fails loudly)."""
    skipped = frozenset(not_handled)
    unknown = sorted(repr(k) for k in (*table, *skipped) if not isinstance(k, OpKind))
    missing = [k.value for k in OpKind if k not in table and k not in skipped]
    both = [k.value for k in OpKind if k in table and k in skipped]
    problems = [
        f"{what}: {', '.join(kinds)}"
        for what, kinds in (
            ("no handler for op kinds", missing),
            ("keys that are not op kinds", unknown),
            ("op kinds both handled and declared not handled", both),
        )
        if kinds
    ]
    if problems:
        raise ValueError(f"{who}: {'; '.join(problems)}")


def op_kind(value: Any, what: str) -> OpKind:
    """An op list entry's "op" as an OpKind; QnpuError "`what` 'value' ..." for anything else."""
    try:
        return OpKind(value)
    except ValueError:
        raise QnpuError(f"{what} {value!r}: no such op kind ({', '.join(OpKind)})") from None


# The architectures with a per-head RMSNorm of q and k before RoPE (q_norm / k_norm)
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3")
# The sliding-window layers' RoPE tables (`<LOCAL_ROPE>.cos` / `.sin`; Gemma 3's local base)
LOCAL_ROPE = "rope_local"
# a layer's attention (a model config's `layer_types` entry): over every key before the
# query, or over the last `sliding_window` of them
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"

# The default bit-width of a tensor: a plan option (`w_bits`, `a_bits`, `kv_bits`,
# `down_in_bits` for the unrotated input), fixed bits, or the softmax output's fixed encoding.
UNROTATED_ROLE = "unrotated"
SOFTMAX_ROLE = "softmax"  # 16-bit unsigned, scale 1/65535 (docs/design.md §3)
BITS_ROLES = ("weight", "act", "kv", UNROTATED_ROLE, "8", "16", SOFTMAX_ROLE)


# The width of an activation (its last axis), by the model dimension it has.
WIDTHS = ("hidden", "q", "kv", "ffn", "")


@dataclass(frozen=True)
class Tensor:
    """A quantized tensor of the graph: our name, its Hugging Face module name (AIMET's name
    of it, relative to the layer or the model), the role that sets its default bits, and for
    an activation its width (a linear's weight shape is [width(out), width(in)])."""

    name: str
    hf: str
    bits: str
    width: str = ""

    def __post_init__(self) -> None:
        if self.bits not in BITS_ROLES:
            raise ValueError(f"tensor {self.name}: bits role {self.bits!r} not in {BITS_ROLES}")
        if self.width not in WIDTHS:
            raise ValueError(f"tensor {self.name}: width {self.width!r} not in {WIDTHS}")


@dataclass(frozen=True)
class Op:
    """One op: its kind, input values, output tensor (None: not quantized, the int32 logits)
    and the prefix of its integer constants in the artifact. `weight` is the linear's or the
    embedding's parameter (a quantized tensor; its name is the float parameter's), `gain` the
    norm's float parameter, `bias` a linear's optional float bias, `inner` the tensors an op
    quantizes inside (attention: scores and probabilities), `heads` the head count RoPE
    splits by ("q" or "kv"), `fn` a LUT's function, `head_norm` the per-head RMSNorm gain a
    RoPE op applies first when the model has one (Qwen3's q_norm / k_norm)."""

    kind: OpKind
    ins: tuple[str, ...]
    out: Tensor | None
    const: str
    weight: Tensor | None = None
    gain: str = ""
    bias: str = ""
    inner: tuple[Tensor, ...] = ()
    heads: str = ""
    fn: str = ""
    head_norm: str = ""
    value: str = ""  # the output's name when it is not a quantized tensor of its own

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", OpKind(self.kind))
        except ValueError:
            raise ValueError(f"unknown op kind {self.kind!r}") from None

    @property
    def out_name(self) -> str:
        return self.out.name if self.out is not None else self.value

    @property
    def weight_name(self) -> str:
        if self.weight is None:
            raise ValueError(f"the {self.kind} op {self.const} has no weight")
        return self.weight.name

    def to_json(self) -> dict[str, Any]:
        """The artifact's op entry (manifest `graph.ops`)."""
        return {
            "op": self.kind.value,
            "in": list(self.ins),
            "out": self.out_name,
            "const": self.const,
        }


@dataclass(frozen=True)
class Graph:
    """The integer graph: the model's ops and one decoder layer's, in execution order. The
    float forward's taps, the plan's tensors and default bits, the exporter's constants and op
    list, the AIMET names and the rotation/smoothing tables are all read from it."""

    layer: tuple[Op, ...]
    model: tuple[Op, ...]
    layer_input: str = "x"  # a layer's input: embed_out for layer 0, the previous layer's output

    def __post_init__(self) -> None:
        names = [t.name for t in self.layer_tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"a layer tensor is named twice: {names}")
        for op in (*self.layer, *self.model):
            if not op.out_name:
                raise ValueError(f"the {op.kind} op {op.const} has no output name")
            if op.kind == OpKind.LAYERS and op.out_name != self.layer[-1].out_name:
                raise ValueError("the layers op's output is the last layer op's output")

    def ops(self, kind: OpKind) -> tuple[Op, ...]:
        return tuple(op for op in self.layer if op.kind == kind)

    def producer(self, name: str) -> Op:
        """The layer op whose output is the layer value `name`."""
        return next(op for op in self.layer if op.out_name == name)

    @property
    def layer_weights(self) -> tuple[Tensor, ...]:
        return tuple(op.weight for op in self.layer if op.weight is not None)

    @property
    def layer_acts(self) -> tuple[Tensor, ...]:
        """The layer's activations with an encoding, in graph order."""
        return tuple(t for op in self.layer for t in (*op.inner, op.out) if t is not None)

    @property
    def layer_tensors(self) -> tuple[Tensor, ...]:
        return self.layer_weights + self.layer_acts

    @property
    def global_acts(self) -> tuple[Tensor, ...]:
        return tuple(op.out for op in self.model if op.out is not None and op.kind != OpKind.LAYERS)

    @property
    def global_tensors(self) -> tuple[Tensor, ...]:
        """The model-level quantized tensors in graph order (weights before their output)."""
        out: list[Tensor] = []
        for op in self.model:
            if op.kind == OpKind.LAYERS:
                continue
            out += [t for t in (op.weight, op.out) if t is not None]
        return tuple(out)

    @property
    def linear_io(self) -> dict[str, tuple[str, str]]:
        """Each linear's weight -> (input, output) tensor: {"q_proj": ("attn_in", "q_out"), ...}."""
        return {op.weight_name: (op.ins[0], op.out_name) for op in self.ops(OpKind.LINEAR)}

    @property
    def stream_values(self) -> frozenset[str]:
        """The residual stream's values: the layer's input and every add's output."""
        return frozenset({self.layer_input, *(op.out_name for op in self.ops(OpKind.ADD))})

    @property
    def linear_inputs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(i for i, _ in self.linear_io.values()))

    @property
    def linear_outputs(self) -> tuple[str, ...]:
        return tuple(o for _, o in self.linear_io.values())

    def ops_json(self) -> dict[str, list[dict[str, Any]]]:
        return {
            "model": [op.to_json() for op in self.model],
            "layer": [op.to_json() for op in self.layer],
        }


def _t(name: str, hf: str, bits: str, width: str = "hidden") -> Tensor:
    return Tensor(name, hf, bits, width)


def _linear(ins: str, out: Tensor, weight: str, hf_module: str, bias: str = "") -> Op:
    w = Tensor(weight, f"{hf_module}.weight", "weight")
    return Op(OpKind.LINEAR, (ins,), out, f"layers.{weight}", weight=w, bias=bias)


# The LLaMA decoder layer and model of graph FORMAT_GRAPH (docs/artifact.md describes each op).
GRAPH = Graph(
    layer=(
        Op(
            OpKind.RMSNORM,
            ("x",),
            _t("attn_in", "input_layernorm.output", "act"),
            "layers.attn_norm",
            gain="input_layernorm",
        ),
        _linear(
            "attn_in",
            _t("q_out", "self_attn.q_proj.output", "8", "q"),
            "q_proj",
            "self_attn.q_proj",
            "q_bias",
        ),
        _linear(
            "attn_in",
            _t("k_out", "self_attn.k_proj.output", "8", "kv"),
            "k_proj",
            "self_attn.k_proj",
            "k_bias",
        ),
        _linear(
            "attn_in",
            _t("v_out", "self_attn.v_proj.output", "kv", "kv"),
            "v_proj",
            "self_attn.v_proj",
            "v_bias",
        ),
        Op(
            OpKind.ROPE,
            ("q_out",),
            _t("q_rope", "self_attn.q_rope.output", "8", "q"),
            "layers.q_rope",
            heads="q",
            head_norm="q_norm",
        ),
        Op(
            OpKind.ROPE,
            ("k_out",),
            _t("k_rope", "self_attn.k_rope.output", "kv", "kv"),
            "layers.k_rope",
            heads="kv",
            head_norm="k_norm",
        ),
        Op(
            OpKind.ATTENTION,
            ("q_rope", "k_rope", "v_out"),
            _t("attn_out", "self_attn.o_proj.input", "act", "q"),
            "layers",
            inner=(
                _t("scores", "self_attn.scores.output", "16", ""),
                _t("probs", "self_attn.softmax.output", SOFTMAX_ROLE, ""),
            ),
        ),
        _linear(
            "attn_out", _t("o_out", "self_attn.o_proj.output", "8"), "o_proj", "self_attn.o_proj"
        ),
        Op(
            OpKind.ADD,
            ("x", "o_out"),
            _t("resid_attn", "post_attention_layernorm.input", "16"),
            "layers.resid_attn",
        ),
        Op(
            OpKind.RMSNORM,
            ("resid_attn",),
            _t("mlp_in", "post_attention_layernorm.output", "act"),
            "layers.mlp_norm",
            gain="post_attention_layernorm",
        ),
        # D.2: the SiLU input has a non-zero mean; it stays wide
        _linear(
            "mlp_in",
            _t("gate_out", "mlp.gate_proj.output", "16", "ffn"),
            "gate_proj",
            "mlp.gate_proj",
        ),
        _linear("mlp_in", _t("up_out", "mlp.up_proj.output", "8", "ffn"), "up_proj", "mlp.up_proj"),
        Op(
            OpKind.LUT,
            ("gate_out",),
            _t("silu_out", "mlp.act_fn.output", "16", "ffn"),
            "layers.silu",
            fn="silu",
        ),
        Op(
            OpKind.MUL,
            ("silu_out", "up_out"),
            _t("down_in", "mlp.down_proj.input", UNROTATED_ROLE, "ffn"),
            "layers.down_in",
        ),
        _linear(
            "down_in", _t("down_out", "mlp.down_proj.output", "8"), "down_proj", "mlp.down_proj"
        ),
        Op(
            OpKind.ADD,
            ("resid_attn", "down_out"),
            _t("resid_mlp", "output", "16"),
            "layers.resid_mlp",
        ),
    ),
    model=(
        Op(
            OpKind.EMBED,
            ("tokens",),
            _t("embed_out", "model.embed_tokens.output", "16"),
            "embed",
            weight=Tensor("embed_tokens", "model.embed_tokens.weight", "8"),
        ),
        Op(OpKind.LAYERS, ("embed_out",), None, "layers", value="resid_mlp"),  # the last layer's
        Op(
            OpKind.RMSNORM,
            ("resid_mlp",),
            _t("final_norm_out", "model.norm.output", "16"),
            "final_norm",
            gain="norm",
        ),
        Op(
            OpKind.LINEAR,
            ("final_norm_out",),
            None,
            "lm_head",
            weight=Tensor("lm_head", "lm_head.weight", "8"),
            value="logits",
        ),
    ),
)


def _gemma3_graph() -> Graph:
    """Gemma 3's decoder layer: GRAPH's attention and gated MLP (the LUT is tanh-GELU), with
    RMSNorms of the attention output and of the MLP output before each joins the residual,
    and the pre-MLP norm's gain named as Gemma names it (`pre_feedforward_layernorm`; Gemma's
    `post_attention_layernorm` is the attention output's norm). The model ops are GRAPH's (the
    embedding's √hidden scale is the forward's, `ModelConfig.embed_scale`)."""
    by_out = {op.out_name: op for op in GRAPH.layer}
    # o_proj's and down_proj's outputs are a post-norm's inputs, not the residual stream's:
    # no rotation reaches them (max/rms 13-57 on the real model) and the norm rescales their
    # error with them; at 8 bits they cost QuaRot W8A8 1.23x -> 1.53x float (docs/results.md,
    # session 43), so they stay at 16 bits (A8W8 matmuls with a 16-bit output)
    for name in ("o_out", "down_out"):
        op = by_out[name]
        assert op.out is not None
        by_out[name] = dataclasses.replace(op, out=dataclasses.replace(op.out, bits="16"))
    layer = (
        *(by_out[n] for n in ("attn_in", "q_out", "k_out", "v_out", "q_rope", "k_rope")),
        by_out["attn_out"],
        by_out["o_out"],
        Op(
            OpKind.RMSNORM,
            ("o_out",),
            _t("attn_post", "post_attention_layernorm.output", "16"),
            "layers.attn_post_norm",
            gain="post_attention_layernorm",
        ),
        Op(
            OpKind.ADD,
            ("x", "attn_post"),
            _t("resid_attn", "pre_feedforward_layernorm.input", "16"),
            "layers.resid_attn",
        ),
        Op(
            OpKind.RMSNORM,
            ("resid_attn",),
            _t("mlp_in", "pre_feedforward_layernorm.output", "act"),
            "layers.mlp_norm",
            gain="pre_feedforward_layernorm",
        ),
        by_out["gate_out"],
        by_out["up_out"],
        Op(
            OpKind.LUT,
            ("gate_out",),
            _t("gelu_out", "mlp.act_fn.output", "16", "ffn"),
            "layers.gelu",
            fn="gelu_tanh",
        ),
        Op(
            OpKind.MUL,
            ("gelu_out", "up_out"),
            _t("down_in", "mlp.down_proj.input", UNROTATED_ROLE, "ffn"),
            "layers.down_in",
        ),
        by_out["down_out"],
        Op(
            OpKind.RMSNORM,
            ("down_out",),
            _t("mlp_post", "post_feedforward_layernorm.output", "16"),
            "layers.mlp_post_norm",
            gain="post_feedforward_layernorm",
        ),
        Op(
            OpKind.ADD,
            ("resid_attn", "mlp_post"),
            _t("resid_mlp", "output", "16"),
            "layers.resid_mlp",
        ),
    )
    return Graph(layer=layer, model=GRAPH.model)


def with_rotation_linears(graph: Graph) -> Graph:
    """`graph` with a hidden×hidden linear between each norm of the residual stream and the
    linears reading it (Gemma 3's two pre-norms): the linear reads the norm's output, kept at
    16 bits and weighted by its gain, and the old readers read the linear's output instead,
    at the norm output's old bits. R1 rotates that output (an online rotation on the NPU,
    issue 54: docs/design.md, "Gemma 3's residual stream"), so the linear holds R1 and its
    readers R1ᵀ; the residual stream, the tables and the post-norms stay as they are. The
    linear's weight is named `<norm output>_proj`; it starts as the identity
    (`transforms.add_rotation_linears`)."""
    stream = graph.stream_values
    readers = {i for i, _ in graph.linear_io.values()}
    layer: list[Op] = []
    renamed: dict[str, str] = {}
    for op in graph.layer:
        if op.kind == OpKind.LINEAR:
            op = dataclasses.replace(op, ins=tuple(renamed.get(n, n) for n in op.ins))
        pre_norm = op.kind == OpKind.RMSNORM and op.ins[0] in stream and op.out_name in readers
        if not pre_norm or op.out is None:
            layer.append(op)
            continue
        # the gain stays in the norm, so its output keeps the channels' range: 16 bits
        layer.append(dataclasses.replace(op, out=dataclasses.replace(op.out, bits="16")))
        hf = op.out.hf.rsplit(".", 1)[0]
        out = _t(f"{op.out_name}_rot", f"{hf}.rotation.output", op.out.bits)
        layer.append(_linear(op.out_name, out, f"{op.out_name}_proj", f"{hf}.rotation"))
        renamed[op.out_name] = out.name
    return Graph(layer=tuple(layer), model=graph.model, layer_input=graph.layer_input)


def rotation_linears(graph: Graph) -> tuple[str, ...]:
    """The linears `with_rotation_linears` put after a norm of the residual stream (they hold
    R1 online): a linear reading a norm of the stream whose output other linears read."""
    stream = graph.stream_values
    norms = {op.out_name for op in graph.ops(OpKind.RMSNORM) if op.ins[0] in stream}
    inputs = {i for i, _ in graph.linear_io.values()}
    return tuple(w for w, (i, o) in graph.linear_io.items() if i in norms and o in inputs)


# Gemma 3 (text): the float forward, the params' layout, the HF names, plans, calibration,
# the fake-quant forward, the outlier steps, the integer artifact and the ONNX export read it
# (the module tables below are GRAPH's, LLaMA's semantics: equalization reads them).
GEMMA3_GRAPH = _gemma3_graph()
# Gemma 3 with a linear after each pre-norm: the graph R1 rotates (online, at the linears'
# inputs: its post-norms' weighted outputs join the residual, which R1 cannot rotate)
GEMMA3_ROTATION_GRAPH = with_rotation_linears(GEMMA3_GRAPH)
# The graph of each architecture whose decoder layer is not GRAPH's (`models.llama.graph_of`).
ARCHITECTURE_GRAPHS = {"gemma3": GEMMA3_GRAPH}
# ... and the variant its params select when they hold the rotation linears' weights
ROTATION_GRAPHS = {"gemma3": GEMMA3_ROTATION_GRAPH}
# the weights that variant adds (the rotation linears'), by architecture
ROTATION_WEIGHTS = {arch: rotation_linears(g) for arch, g in ROTATION_GRAPHS.items()}
# Every graph other than GRAPH by the name a plan.json writes it under
NAMED_GRAPHS = {
    **ARCHITECTURE_GRAPHS,
    **{f"{arch}-rotation-linears": g for arch, g in ROTATION_GRAPHS.items()},
}


def artifact_graph(model: Mapping[str, Any], ops: Any) -> Graph:
    """The graph of an artifact whose manifest holds model config `model` and op list `ops`:
    GRAPH for the LLaMA family; for an architecture with a graph of its own (Gemma 3), that
    graph or its variant with rotation linears, the one `ops` is. QnpuError otherwise."""
    arch = model.get("architecture", "llama")
    own = ARCHITECTURE_GRAPHS.get(arch, GRAPH)
    candidates = (own, ROTATION_GRAPHS[arch]) if arch in ROTATION_GRAPHS else (own,)
    for graph in candidates:
        if graph.ops_json() == ops:
            return graph
    name = FORMAT_GRAPH if own is GRAPH else f"{FORMAT_GRAPH} of {arch}"
    raise QnpuError(f"the op list differs from graph {name}")


def graph_ops() -> dict[str, list[dict[str, Any]]]:
    """The artifact's op list of the model and of one decoder layer ("in" names are
    environment values)."""
    return GRAPH.ops_json()


# Tables of the shipped graph, read from GRAPH:
LAYER_ACTS = tuple(t.name for t in GRAPH.layer_acts)  # order of `layers.act.*` columns
GLOBAL_ACTS = tuple(t.name for t in GRAPH.global_acts)  # order of `act.*` entries
LAYER_INPUT = GRAPH.layer_input
LINEAR_IO = GRAPH.linear_io
LINEARS = tuple(LINEAR_IO)  # the decoder layer's weights
LINEAR_OUTPUTS = GRAPH.linear_outputs
LINEAR_INPUTS = GRAPH.linear_inputs
# The linear inputs that may carry shadow or MUXQ channels: those a requantizing op writes
# channel by channel (norm outputs, the down_proj input), not attention's head-major output.
CHANNEL_INPUTS = tuple(
    op.out_name
    for op in GRAPH.layer
    if op.kind in (OpKind.RMSNORM, OpKind.MUL) and op.out_name in LINEAR_INPUTS
)
# The residual stream's quantized values (each add's output: the layer input is the last
# one's): MUXQ channels there are the residual split (`steps.split_residual`), read back
# times 2^exp by the adds and norms that read them, with no Aux term.
RESIDUAL_OUTPUTS = tuple(op.out_name for op in GRAPH.ops(OpKind.ADD))
MUXQ_TENSORS = CHANNEL_INPUTS + RESIDUAL_OUTPUTS
# R1 rotates the norms' outputs (q/k/v and gate/up inputs), R2 the attention output (o_proj
# input); the down_proj input, a product of two linear outputs, stays unrotated.
ROTATED_INPUTS = tuple(
    op.out_name for op in GRAPH.layer if op.kind in (OpKind.RMSNORM, OpKind.ATTENTION)
)
KV_TENSORS = GRAPH.ops(OpKind.ATTENTION)[0].ins[1:]  # the K and V cache
# Tensors inside attention, over key positions (scores, probabilities): no channel axis.
ATTENTION_TENSORS = tuple(t.name for t in GRAPH.ops(OpKind.ATTENTION)[0].inner)
# The float model's global parameters: the embedding table, lm_head and the final norm's gain.
EMBED_TABLE = next(op for op in GRAPH.model if op.kind == OpKind.EMBED).weight_name
LM_HEAD = next(op for op in GRAPH.model if op.kind == OpKind.LINEAR).weight_name
FINAL_NORM = next(op for op in GRAPH.model if op.kind == OpKind.RMSNORM).gain
SCORES, PROBS = ATTENTION_TENSORS  # the requantized scores; the softmax's fixed-encoding output
# The one linear input no rotation reaches (a product of two values: down_proj's input), the
# linear that reads it and that linear's output: what Quant.npu's scan promotes to 16 bits.
(UNROTATED_INPUT,) = (i for i, _ in LINEAR_IO.values() if i not in ROTATED_INPUTS)
UNROTATED_LINEAR = next(w for w, (i, _) in LINEAR_IO.items() if i == UNROTATED_INPUT)
UNROTATED_OUTPUT = LINEAR_IO[UNROTATED_LINEAR][1]
# The MLP's input (gate_proj's and up_proj's): the rotated input whose 4-bit grid costs most
# at W4A4 (docs/changelog.md), which `mlp_in_mixed_precision` promotes layer by layer.
MLP_INPUT = LINEAR_IO["gate_proj"][0]
# The o_proj input (attention's output): the next costliest 4-bit input at W4A4, which
# `attn_out_mixed_precision` promotes.
ATTN_OUTPUT_INPUT = LINEAR_IO["o_proj"][0]


# The float model's transforms, read from the graph: each norm's gain folds into the linears
# reading its output; R1 rotates those inputs and the outputs of the linears writing the
# residual stream (the inputs of the adds); R2 rotates V (attention's third input) and the
# input of the linear reading the attention output.
def norm_readers(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Each norm of the residual stream (its input is the layer's input or an add's output)
    -> the linears reading its output: its gain folds into them, and R1 rotates their inputs.
    Gemma 3's post-norms normalize a block's output, not the stream, and keep their gains; so
    do norms read by a rotation linear (`with_rotation_linears`): Gemma 3's pre-norm gains
    are near zero on the stream's massive channels, and folded before a rotation they would
    spread those channels over every rotated input (docs/results.md, session 43)."""
    stream = graph.stream_values
    io = graph.linear_io
    online = set(rotation_linears(graph))
    readers = {
        op.gain: tuple(w for w, (i, _) in io.items() if i == op.out_name)
        for op in graph.ops(OpKind.RMSNORM)
        if op.ins[0] in stream
    }
    return {g: ws for g, ws in readers.items() if ws and not online.intersection(ws)}


def residual_readers(graph: Graph) -> tuple[str, ...]:
    """The linears reading a norm of the residual stream (R1 rotates their columns)."""
    return tuple(w for linears in norm_readers(graph).values() for w in linears)


def residual_writers(graph: Graph) -> tuple[str, ...]:
    """The linears whose output a residual add reads (R1 rotates their rows)."""
    adds = graph.ops(OpKind.ADD)
    return tuple(w for w, (_, o) in graph.linear_io.items() if any(o in op.ins for op in adds))


@dataclasses.dataclass(frozen=True)
class R1Targets:
    """Where R1 goes in a graph. `readers`' columns rotate (W ← W R1) and `writers`' rows
    (W ← R1ᵀ W); `tables`: R1 rotates the residual stream itself, so the embedding table and
    lm_head rotate too and the final norm folds into lm_head. Without `tables` R1 is online:
    the rotation linears (`writers`) rotate their norms' outputs and `readers` read those."""

    readers: tuple[str, ...]
    writers: tuple[str, ...]
    tables: bool


def r1_targets(graph: Graph) -> R1Targets:
    """Where R1 goes in `graph`: online where it has rotation linears, else on the stream."""
    online = rotation_linears(graph)
    if online:
        outs = {graph.linear_io[w][1] for w in online}
        readers = tuple(w for w, (i, _) in graph.linear_io.items() if i in outs)
        return R1Targets(readers, online, tables=False)
    return R1Targets(residual_readers(graph), residual_writers(graph), tables=True)


def rotated_inputs_of(graph: Graph) -> tuple[str, ...]:
    """The linear inputs a rotation reaches, in graph order: those R1 rotates (its readers'
    inputs, `r1_targets`) and attention's output (R2). GRAPH's are `ROTATED_INPUTS`."""
    rotated = {graph.linear_io[w][0] for w in r1_targets(graph).readers}
    rotated |= {op.out_name for op in graph.ops(OpKind.ATTENTION)}
    return tuple(op.out_name for op in graph.layer if op.out_name in rotated)


def residual_rotation_blocker(graph: Graph) -> str | None:
    """Why R1 cannot rotate `graph`'s residual stream, or None: every add's input must be
    the residual or a linear's output (a norm's weighted output does not commute with R1)."""
    linear_outputs = {o for _, o in graph.linear_io.values()}
    layer_values = graph.stream_values
    for op in graph.ops(OpKind.ADD):
        for name in op.ins:
            if name not in linear_outputs and name not in layer_values:
                return f"{name} (a {graph.producer(name).kind.value} output) joins the residual"
    return None


NORM_READERS = norm_readers(GRAPH)
RESIDUAL_WRITERS = residual_writers(GRAPH)
V_LINEAR = next(w for w, (_, o) in LINEAR_IO.items() if o == GRAPH.ops(OpKind.ATTENTION)[0].ins[2])
O_LINEAR = next(
    w for w, (i, _) in LINEAR_IO.items() if i == GRAPH.ops(OpKind.ATTENTION)[0].out_name
)
LINEAR_BIAS = {op.weight_name: op.bias for op in GRAPH.ops(OpKind.LINEAR) if op.bias}
# Qwen3's per-head norms of q and k (`ModelConfig.qk_norm`), by the RoPE op that applies them
HEAD_NORMS = tuple(op.head_norm for op in GRAPH.ops(OpKind.ROPE) if op.head_norm)
# Channel smoothing folds s into the linear writing one factor of that product (rows / s) and
# the linear reading it (columns · s): up_proj → down_proj.
SMOOTHED_LINEARS = (
    next(
        w
        for w, (_, o) in LINEAR_IO.items()
        for op in GRAPH.layer
        if op.out_name == UNROTATED_INPUT and o in op.ins
    ),
    UNROTATED_LINEAR,
)


def layer_widths(dims: dict[str, int], graph: Graph = GRAPH) -> dict[str, int]:
    """The last-axis size of each layer activation with a channel axis (and of the layer
    input), from the model's `dims` {"hidden", "q", "kv", "ffn"}."""
    out = {t.name: dims[t.width] for t in graph.layer_acts if t.width}
    return out | {graph.layer_input: dims["hidden"]}


def model_widths(model: dict[str, Any]) -> dict[str, int]:
    """`layer_widths`'s dims from an artifact's model config (a manifest's "model")."""
    hd = model["head_dim"]
    return {
        "hidden": model["hidden_size"],
        "q": model["num_heads"] * hd,
        "kv": model["num_kv_heads"] * hd,
        "ffn": model["intermediate_size"],
    }


def channel_mask(lists: Any, width: int) -> np.ndarray:
    """bool [L, width]: True on each layer's listed channels (a plan's shadow or MUXQ lists,
    or an artifact's −1 padded rows: negative entries are skipped)."""

    mask = np.zeros((len(lists), width), bool)
    for layer, chans in enumerate(lists):
        used = [int(c) for c in chans if c >= 0]
        if used and max(used) >= width:
            raise QnpuError(
                f"channel {max(used)} (layer {layer}) is past the tensor's width {width}"
            )
        mask[layer, used] = True
    return mask


_I8_16_32 = ("int8", "int16", "int32")
_I32 = ("int32",)


@dataclass(frozen=True)
class _Expected:
    """`expected_tensors`' inputs (an artifact's model config and graph section, the sizes
    read from them) and the table it fills."""

    model: dict[str, Any]
    graph: dict[str, Any]
    n: int
    d: int
    hd: int
    hkv: int
    v: int
    width: dict[str, int]
    out: dict[str, Any]

    def norm(self, const: str, lead: tuple[int, ...], width: int | None = None) -> None:
        width = self.d if width is None else width
        self.out[f"{const}.sign"] = ((*lead, width), ("int8",))
        self.out[f"{const}.M"] = ((*lead, width), _I32)
        self.out[f"{const}.shift"] = ((*lead, width), _I32)
        self.out[f"{const}.eps"] = (lead, ("int64",))


def _expect_layer_linear(e: _Expected, op: Op) -> None:
    n, c = e.n, op.const
    o, i = e.width[op.out_name], e.width[op.ins[0]]
    e.out[f"{c}.weight"] = ((n, o, i), ("int8",))
    e.out[f"{c}.M"] = ((n, o), _I32)
    e.out[f"{c}.shift"] = ((n, o), _I32)
    if e.model.get("attention_bias") and op.bias:
        e.out[f"{c}.bias"] = ((n, o), _I32)


def _expect_layer_rmsnorm(e: _Expected, op: Op) -> None:
    e.norm(op.const, (e.n,))


def _expect_scalar_requant(e: _Expected, op: Op) -> None:
    """RoPE and the product: one multiplier and shift per layer (RoPE: a head norm first)."""
    e.out[f"{op.const}.M"] = ((e.n,), _I32)
    e.out[f"{op.const}.shift"] = ((e.n,), _I32)
    if op.head_norm and e.model.get("architecture") in QK_NORM_ARCHITECTURES:
        e.norm(f"{op.const}.norm", (e.n,), e.hd)


def _expect_add(e: _Expected, op: Op) -> None:
    for k in ("Ma", "Mb", "shift"):
        e.out[f"{op.const}.{k}"] = ((e.n,), _I32)


def _expect_lut(e: _Expected, op: Op) -> None:
    e.out[f"{op.const}.lut"] = ((e.n, None), _I8_16_32)


def _expect_attention(e: _Expected, op: Op) -> None:
    n, hd, hkv = e.n, e.hd, e.hkv
    for k in ("scores", "pv"):
        e.out[f"layers.{k}.M"] = ((n,), _I32)
        e.out[f"layers.{k}.shift"] = ((n,), _I32)
    e.out["layers.softmax.exp_lut"] = ((n, 1 << 16), ("uint16",))
    p = len(e.graph["prefix_tokens"])
    if p:
        e.out["layers.prefix.k"] = ((n, hkv, p, hd), _I8_16_32)
        e.out["layers.prefix.v"] = ((n, hkv, p, hd), _I8_16_32)


def _expect_embed(e: _Expected, op: Op) -> None:
    v, d = e.v, e.d
    e.out[f"{op.const}.table"] = ((v, d), ("int8",))
    e.out[f"{op.const}.M"] = ((v,), _I32)
    e.out[f"{op.const}.shift"] = ((v,), _I32)


def _expect_layers(e: _Expected, op: Op) -> None:
    """The layers op has no constants of its own: its layer ops have them."""


def _expect_model_rmsnorm(e: _Expected, op: Op) -> None:
    e.norm(op.const, ())


def _expect_model_linear(e: _Expected, op: Op) -> None:
    v, d = e.v, e.d
    e.out[f"{op.const}.weight"] = ((v, d), ("int8",))
    e.out[f"{op.const}.M"] = ((v,), _I32)
    e.out[f"{op.const}.shift"] = ((v,), _I32)


_ExpectFn = Callable[[_Expected, Op], None]
# The tensors each op of a layer and of the model holds (`expected_tensors`).
EXPECTED_LAYER: dict[OpKind, _ExpectFn] = {
    OpKind.RMSNORM: _expect_layer_rmsnorm,
    OpKind.LINEAR: _expect_layer_linear,
    OpKind.ROPE: _expect_scalar_requant,
    OpKind.ATTENTION: _expect_attention,
    OpKind.ADD: _expect_add,
    OpKind.LUT: _expect_lut,
    OpKind.MUL: _expect_scalar_requant,
}
check_handlers(EXPECTED_LAYER, "expected_tensors (layer ops)", MODEL_ONLY_KINDS)
EXPECTED_MODEL: dict[OpKind, _ExpectFn] = {
    OpKind.EMBED: _expect_embed,
    OpKind.LAYERS: _expect_layers,
    OpKind.RMSNORM: _expect_model_rmsnorm,
    OpKind.LINEAR: _expect_model_linear,
}
check_handlers(EXPECTED_MODEL, "expected_tensors (model ops)", LAYER_ONLY_KINDS)


def expected_tensors(
    model: dict[str, Any], graph: dict[str, Any], ops: Graph = GRAPH
) -> dict[str, Any]:
    """name -> (shape, allowed dtypes) of every tensor an artifact of graph `ops` must hold, op
    by op.

    A None dimension is free (LUT lengths follow the input's bit-width, checked when used).
    Optional tensors (q/k/v biases, the sink prefix's K/V, the sliding layers' RoPE tables)
    are listed when the config or the graph says they exist.
    """
    n, d = model["num_layers"], model["hidden_size"]
    hd, hkv = model["head_dim"], model["num_kv_heads"]
    v = model["vocab_size"]
    width = layer_widths(model_widths(model), ops)
    out: dict[str, Any] = {}
    for field in ("zero_point", "qmin", "qmax"):
        out[f"layers.act.{field}"] = ((n, len(ops.layer_acts)), _I32)
        out[f"act.{field}"] = ((len(ops.global_acts),), _I32)
    e = _Expected(model, graph, n, d, hd, hkv, v, width, out)
    for op in ops.layer:
        EXPECTED_LAYER[op.kind](e, op)
    for op in ops.model:
        EXPECTED_MODEL[op.kind](e, op)
    for name, k in (graph.get("shadow") or {}).items():  # hot channels per layer, −1 padded
        out[f"layers.shadow.{name}.channels"] = ((n, k), _I32)
    for name, entry in (graph.get("muxq") or {}).items():  # outlier channels, −1 padded
        out[f"layers.muxq.{name}.channels"] = ((n, entry["channels"]), _I32)
    for const in graph.get("weight_zero_points") or []:  # asymmetric weights: z_w per row
        key = f"{const}.weight"
        if key not in out or not const.startswith("layers."):
            raise ValueError(f"weight zero points of {const!r}, which is no layer linear")
        out[f"{const}.weight_zero_point"] = ((n, out[key][0][1]), _I32)
    tables = ("rope", LOCAL_ROPE) if any(sliding_layers(model)) else ("rope",)
    for table in tables:
        out[f"{table}.cos"] = ((graph["max_context"], hd), ("int16",))
        out[f"{table}.sin"] = ((graph["max_context"], hd), ("int16",))
    return out


def sliding_layers(model: Mapping[str, Any]) -> tuple[bool, ...]:
    """Whether each layer of an artifact's model config attends in a sliding window of
    `model["sliding_window"]` keys (Gemma 3's `layer_types`); none when it has no types."""
    types = model.get("layer_types") or ()
    return tuple(t == SLIDING_ATTENTION for t in types) or (False,) * int(model["num_layers"])


def check_room(filled: int, new: int, max_context: int) -> None:
    """Refuse `new` positions after `filled` ones past the artifact's maximum context, before
    any of them runs."""

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
