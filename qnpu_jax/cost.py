"""A cost model of a quantization plan on a mobile NPU: exact counts per op, and a latency
estimate that is a MODEL, not a measurement.

Counts (`plan_costs`), op by op of the model's graph (`ir.graph.GRAPH`; Gemma 3's) at the
plan's bit-widths, layer by layer (promoted layers included): MACs by operand precision pair
("A8W4": 8-bit activations times 4-bit weights; "A16A8": 16-bit probabilities times 8-bit V;
"F" for a tensor the plan keeps in float), bytes of weights, activations and KV cache moved, LUT
lookups, requantizations, and the work that runs off the NPU (MACs on the CPU and the
synchronizations they need).

Latency (`latency`): a roofline per op, max(MACs × time per MAC of its pair, bytes × time per
byte), summed, plus the CPU-NPU synchronization of ops that need one. The per-MAC and per-byte
times and the 16-bit factor are fitted (`fit_device`) so that this same model reproduces
MobileQuant's Table 6 (TinyLlama-1.1B on a Snapdragon 8 Gen 3 HTP, the SM8650 Quant.npu also
measures on): full W8A8 prompt encoding of 256 tokens 89 ms, W8A16 510 ms, W8A8 generation at
1024 tokens 42 ms per token. Quant.npu gives float against integer MACs (Table 3: integer
2.0× float) and per-block weights against per-channel (W4A8 per-tensor about 1.2× faster than
W4A16 per-block); mllm-NPU the synchronization (29.7% of end-to-end latency with shadow
outliers in every layer). Every constant is in `DeviceModel` with its source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    MODEL_ONLY_KINDS,
    UNROTATED_INPUT,
    UNROTATED_OUTPUT,
    Graph,
    Op,
    OpKind,
    check_handlers,
    layer_widths,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import graph_of, graphs_of, rotated_graph
from qnpu_jax.pipeline.config import load_config
from qnpu_jax.pipeline.methods import ROTATING_METHODS
from qnpu_jax.pipeline.mixed_precision import mixed_layer_bits
from qnpu_jax.pipeline.recipes import build_plan
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.quant.plan import QuantPlan, TensorQuant, is_weight, uniform_plan

FLOAT = "F"  # a tensor the plan keeps in float (fp16 on the device: 2 bytes)
FLOAT_BYTES = 2.0
SCALE_BYTES = 8  # a per-row requantization: int32 multiplier and shift
BLOCK_SCALE_BYTES = 2  # a float (fp16) scale per block

# MobileQuant Table 6 (TinyLlama-1.1B-Chat, Snapdragon 8 Gen 3 HTP), seconds
ANCHOR_MODEL = "tinyllama-1.1b"
ANCHOR_PROMPT = 256
ANCHOR_W8A8_PREFILL_S = 0.089
ANCHOR_W8A16_PREFILL_S = 0.510
ANCHOR_DECODE_CONTEXT = 1024
ANCHOR_W8A8_DECODE_S = 0.042


@dataclasses.dataclass(frozen=True)
class Phase:
    """A pass of the model: `tokens` queries at positions `first`, `first` + 1, ... (the
    positions before are cached), run `chunk` queries at a time (1: decode steps), lm_head on
    `logit_tokens` of them (generation needs the prompt's last one). The attention's counts
    (`key_visits`, `kv_reads`; `window`: a sliding layer's) and how often every weight is
    read (`weight_reads`: once per chunk) follow from these."""

    name: str
    tokens: int
    first: int
    chunk: int
    logit_tokens: int

    def __post_init__(self) -> None:
        if min(self.tokens, self.chunk, self.logit_tokens) < 1 or self.first < 0:
            raise QnpuError(f"phase {self.name}: every count must be at least 1")
        if self.logit_tokens > self.tokens:
            raise QnpuError(f"phase {self.name}: lm_head runs on at most every token")

    def _chunks(self) -> list[tuple[int, int]]:
        """Each pass's queries as [start, end) positions."""
        starts = range(self.first, self.first + self.tokens, self.chunk)
        return [(s, min(s + self.chunk, self.first + self.tokens)) for s in starts]

    @property
    def weight_reads(self) -> int:
        return len(self._chunks())

    def key_visits(self, window: int | None = None) -> int:
        """The keys the queries attend to, summed over them: the query at position p sees
        p + 1 keys (causal), or at most `window`."""
        a, b = self.first + 1, self.first + self.tokens  # sum of min(k, window), k in [a, b]
        w = b if window is None else window
        low_end = min(b, w)
        low = (a + low_end) * (low_end - a + 1) // 2 if a <= low_end else 0
        return low + max(0, b - max(a, w + 1) + 1) * w

    def kv_reads(self, window: int | None = None) -> int:
        """The cache positions read, once per pass: those up to the pass's last query,
        from the first one that any of its queries sees."""
        w = None if window is None else window - 1
        return sum(e - (0 if w is None else max(0, s - w)) for s, e in self._chunks())

    def to_json(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "key_visits": self.key_visits(),
            "kv_reads": self.kv_reads(),
            "weight_reads": self.weight_reads,
        }


def _positive(name: str, value: int, least: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise QnpuError(f"{name} must be an integer >= {least}, got {value!r}")


def prefill(
    tokens: int, chunk: int | None = None, prefix: int = 0, *, all_logits: bool = False
) -> Phase:
    """Prompt encoding of `tokens` after `prefix` cached positions, in chunks of `chunk`
    (None: one pass) as the artifact's engines run it; lm_head on the last position only, or
    on every one with `all_logits` (scoring, perplexity)."""
    _positive("prefill tokens", tokens)
    _positive("prefix", prefix, 0)
    step = tokens if chunk is None else chunk
    _positive("chunk", step)
    return Phase("prefill", tokens, prefix, step, tokens if all_logits else 1)


def decode(prompt: int, steps: int, prefix: int = 0) -> Phase:
    """`steps` greedy steps after a `prompt`-token prefill: step j attends to prefix+prompt+j
    keys and reads every weight once."""
    _positive("prompt", prompt, 0)
    _positive("decode steps", steps)
    _positive("prefix", prefix, 0)
    return Phase("decode", steps, prefix + prompt, 1, steps)


@dataclasses.dataclass(frozen=True)
class OpCost:
    """One op's work in one phase (`layer` None: a model-level op)."""

    layer: int | None
    name: str
    kind: OpKind
    macs: Mapping[str, int]
    weight_bytes: float = 0.0
    act_bytes: float = 0.0
    kv_bytes: float = 0.0
    lut_lookups: int = 0
    requants: int = 0
    per_block: bool = False
    cpu_macs: int = 0  # MACs off the NPU (float, on the CPU)
    syncs: int = 0  # CPU→NPU synchronizations (merging a CPU result into the NPU's)
    cross_bytes: float = 0.0  # bytes moved between the NPU and the CPU (either way)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.act_bytes + self.kv_bytes


def _bits(tq: TensorQuant | None, layer: int) -> int | None:
    return None if tq is None else tq.bits_for_layer(layer)


def _label(bits: int | None) -> str:
    return FLOAT if bits is None else str(bits)


def _size(bits: int | None) -> float:
    return FLOAT_BYTES if bits is None else bits / 8


def _check_plan(plan: QuantPlan, cfg: ModelConfig) -> None:
    if not any(plan.graph is g for g in graphs_of(cfg)):
        raise QnpuError(
            f"the plan is over another graph than the model's ({cfg.architecture}): the cost "
            "model counts the model's own ops"
        )
    if plan.num_layers != cfg.num_layers:
        raise QnpuError(f"the plan has {plan.num_layers} layers, the model config {cfg.num_layers}")


ActBits = Callable[[str, int], int | None]


@dataclasses.dataclass(frozen=True)
class _LayerCost:
    """What the counts of one layer's ops read: the plan, the model, the phase, the widths
    of the layer's values and the bits of each (`act_bits(name, layer)`)."""

    plan: QuantPlan
    cfg: ModelConfig
    phase: Phase
    widths: Mapping[str, int]
    act_bits: ActBits
    layer: int


def _cost_linear(c: _LayerCost, op: Op, ins: list[int | None], o: int | None) -> OpCost:
    layer, widths, t = c.layer, c.widths, c.phase.tokens
    width = widths[op.out_name]
    wq = c.plan.get(f"layers/{op.weight_name}")
    cost = _linear_cost(layer, op, ins[0], o, wq, widths[op.ins[0]], width, t, c.phase.weight_reads)
    source = c.plan.get(f"layers/{op.ins[0]}")
    hot = source.shadow_channels[layer] if source and source.shadow_channels else ()
    if hot:  # mllm-NPU: the overflow of the hot channels, on the CPU, merged back
        moved = _shadow_bytes(c, op.ins[0], len(hot), width, o)
        cost = dataclasses.replace(cost, cpu_macs=t * len(hot) * width, syncs=1, cross_bytes=moved)
    aux = source.muxq_channels[layer] if source and source.muxq_channels else ()
    if aux:  # MUXQ: the Aux matmul of the outlier channels, on the NPU
        macs = {p: n + t * len(aux) * width for p, n in cost.macs.items()}
        cost = dataclasses.replace(cost, macs=macs)
    if wq is not None and not wq.symmetric:  # z_w·Σx: a row sum and a product
        extra = t * (widths[op.ins[0]] + width)  # per output, on the NPU
        macs = {p: n + extra for p, n in cost.macs.items()}
        cost = dataclasses.replace(cost, macs=macs)
    return cost


def _cost_attention(c: _LayerCost, op: Op, ins: list[int | None], o: int | None) -> OpCost:
    return _attention_cost(c.plan, c.cfg, c.layer, op, ins, o, c.phase)


def _cost_elementwise(c: _LayerCost, op: Op, ins: list[int | None], o: int | None) -> OpCost:
    """An element-wise op: its input and output codes move."""
    t, width = c.phase.tokens, c.widths[op.out_name]
    moved = sum(_size(b) * c.widths[n] for b, n in zip(ins, op.ins, strict=True))
    return OpCost(
        c.layer,
        op.out_name,
        op.kind,
        {},
        act_bytes=t * (moved + _size(o) * width),
        requants=t * width if o is not None else 0,
    )


def _cost_lut(c: _LayerCost, op: Op, ins: list[int | None], o: int | None) -> OpCost:
    """An element-wise op with a table lookup per output element."""
    cost = _cost_elementwise(c, op, ins, o)
    return dataclasses.replace(cost, lut_lookups=c.phase.tokens * c.widths[op.out_name])


# The counts of each layer op (`plan_costs`; the model's ops are counted after the layers).
LAYER_COSTS: dict[OpKind, Callable[[_LayerCost, Op, list[int | None], int | None], OpCost]] = {
    OpKind.RMSNORM: _cost_elementwise,
    OpKind.LINEAR: _cost_linear,
    OpKind.ROPE: _cost_elementwise,
    OpKind.ATTENTION: _cost_attention,
    OpKind.ADD: _cost_elementwise,
    OpKind.LUT: _cost_lut,
    OpKind.MUL: _cost_elementwise,
}
check_handlers(LAYER_COSTS, "the cost model (layer ops)", MODEL_ONLY_KINDS)


def plan_costs(plan: QuantPlan, cfg: ModelConfig, phase: Phase) -> tuple[OpCost, ...]:
    """Every op's counts in `phase`, layer ops first (layer by layer, graph order), then the
    model's (embedding, final norm, lm_head)."""
    _check_plan(plan, cfg)
    graph = plan.graph
    widths = layer_widths(cfg.dims, graph)
    t = phase.tokens
    layer_input = graph.layer_input
    embed_op, _, norm_op, head_op = graph.model
    assert embed_op.out is not None and norm_op.out is not None

    def act_bits(name: str, layer: int) -> int | None:
        if name == layer_input:  # the previous layer's output, or the embedding's
            if layer == 0:
                return _bits(plan.get(embed_op.out.name), 0)  # type: ignore[union-attr]
            return act_bits(graph.layer[-1].out_name, layer - 1)
        return _bits(plan.get(f"layers/{name}"), layer)

    out: list[OpCost] = []
    for layer in range(cfg.num_layers):
        c = _LayerCost(plan, cfg, phase, widths, act_bits, layer)
        for op in graph.layer:
            ins = [act_bits(n, layer) for n in op.ins]
            out.append(LAYER_COSTS[op.kind](c, op, ins, act_bits(op.out_name, layer)))
    # the model's ops: embedding rows gathered, the final norm, lm_head
    d = cfg.hidden_size
    table = plan.get(embed_op.weight_name)
    e_out = _bits(plan.get(embed_op.out.name), 0)
    out.append(
        OpCost(
            None,
            embed_op.out.name,
            OpKind.EMBED,
            {},
            weight_bytes=t * d * _size(_bits(table, 0))
            + (t * SCALE_BYTES if table is not None else 0),
            act_bytes=t * d * _size(e_out),
            requants=t * d if e_out is not None else 0,
        )
    )
    n = phase.logit_tokens  # the final norm and lm_head run where logits are needed
    last = act_bits(graph.layer[-1].out_name, cfg.num_layers - 1)
    n_out = _bits(plan.get(norm_op.out.name), 0)
    out.append(
        OpCost(
            None,
            norm_op.out.name,
            OpKind.RMSNORM,
            {},
            act_bytes=n * d * (_size(last) + _size(n_out)),
            requants=n * d if n_out is not None else 0,
        )
    )
    head = plan.get(head_op.weight_name)
    reads = min(phase.weight_reads, n)  # lm_head's weights: once per chunk or step with logits
    out.append(_linear_cost(None, head_op, n_out, 32, head, d, cfg.vocab_size, n, reads))
    return tuple(out)


def _linear_cost(
    layer: int | None,
    op: Op,
    a: int | None,
    o: int | None,
    wq: TensorQuant | None,
    n_in: int,
    n_out: int,
    tokens: int,
    weight_reads: int,
) -> OpCost:
    w = _bits(wq, 0 if layer is None else layer)
    rows_bytes = n_out * n_in * _size(w)
    if wq is not None:
        rows_bytes += n_out * SCALE_BYTES
        if wq.block is not None:  # a scale per block: LPBQ's are k-bit integers
            per = wq.block_scale_bits / 8 if wq.lpbq else BLOCK_SCALE_BYTES  # type: ignore[operator]
            rows_bytes += n_out * (n_in // wq.block) * per
    t = tokens
    return OpCost(
        layer,
        op.out_name,
        OpKind.LINEAR,
        {f"A{_label(a)}W{_label(w)}": t * n_in * n_out},
        weight_bytes=weight_reads * rows_bytes,
        act_bytes=t * (n_in * _size(a) + n_out * _size(o)),
        requants=t * n_out if o is not None else 0,
        per_block=wq is not None and wq.block is not None,
    )


def _attention_cost(
    plan: QuantPlan,
    cfg: ModelConfig,
    layer: int,
    op: Op,
    ins: list[int | None],
    o: int | None,
    phase: Phase,
) -> OpCost:
    q, k, v = ins
    scores_t, probs_t = op.inner
    s = _bits(plan.get(f"layers/{scores_t.name}"), layer)
    p = _bits(plan.get(f"layers/{probs_t.name}"), layer)
    hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    window = cfg.sliding_window if cfg.sliding_layers[layer] else None
    visits = phase.key_visits(window) * hq  # one score (and one probability) per head and key
    macs = {f"A{_label(q)}A{_label(k)}": visits * hd}
    pv = f"A{_label(p)}A{_label(v)}"
    macs[pv] = macs.get(pv, 0) + visits * hd
    t = phase.tokens
    return OpCost(
        layer,
        op.out_name,
        OpKind.ATTENTION,
        macs,
        act_bytes=t * hq * hd * (_size(q) + _size(o)) + visits * (_size(s) + _size(p)),
        kv_bytes=phase.kv_reads(window) * hkv * hd * (_size(k) + _size(v)),
        lut_lookups=visits,  # the exp table
        requants=visits * (s is not None) + t * hq * hd * (o is not None),
    )


def _shadow_bytes(c: _LayerCost, x: str, hot: int, width: int, out_bits: int | None) -> float:
    """Bytes a shadow path moves for `t` tokens, as the ONNX export lays it out: to the CPU
    what it recomputes the hot channels of linear input `x` from (the Mul's two inputs on
    those channels; a norm's whole input row) and the NPU's int32 accumulator [t, width];
    back to the NPU the linear's output codes (linears sharing `x` count its inputs each)."""
    graph, widths, layer = c.plan.graph, c.widths, c.layer
    producer = graph.producer(x)
    width = next(
        widths[op.out_name] for op in graph.layer if op.kind == OpKind.LINEAR and op.ins[0] == x
    )
    if producer.kind == OpKind.MUL:
        inputs = sum(hot * (c.act_bits(n, layer) or 32) for n in producer.ins) / 8
    else:
        inputs = widths[producer.ins[0]] * (c.act_bits(producer.ins[0], layer) or 32) / 8
    return c.phase.tokens * (inputs + width * 4 + width * (out_bits or 32) / 8)


def totals(costs: Iterable[OpCost]) -> dict[str, Any]:
    """Sums over ops: MACs by pair, bytes by kind, LUT lookups, requantizations, off-NPU work."""
    macs: dict[str, int] = {}
    out: dict[str, Any] = {
        "weight_bytes": 0.0,
        "act_bytes": 0.0,
        "kv_bytes": 0.0,
        "lut_lookups": 0,
        "requants": 0,
        "per_block_macs": 0,
        "cpu_macs": 0,
        "syncs": 0,
        "cross_bytes": 0.0,
    }
    for c in costs:
        for pair, n in c.macs.items():
            macs[pair] = macs.get(pair, 0) + n
        for key in ("weight_bytes", "act_bytes", "kv_bytes", "lut_lookups", "requants"):
            out[key] += getattr(c, key)
        out["per_block_macs"] += sum(c.macs.values()) if c.per_block else 0
        out["cpu_macs"] += c.cpu_macs
        out["syncs"] += c.syncs
        out["cross_bytes"] += c.cross_bytes
    return {"macs": dict(sorted(macs.items())), "npu_macs": sum(macs.values()), **out}


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """The latency model's constants (see the module docstring for their sources).

    `mac_s`: seconds per 8-bit × ≤8-bit MAC; `byte_s`: seconds per byte moved; `a16`: the MAC
    time factor of one 16-bit operand (both 16-bit: `a16` squared, an assumption: the seeds
    measure no 16 × 16 matmul); `float_mac`: float MACs against integer ones (Quant.npu Table
    3); `per_block`: per-block weights against per-channel (Quant.npu §1); `cpu_mac_s`:
    seconds per MAC run on the CPU; `sync_fraction`: the latency share that synchronizing a
    CPU path into every linear of every layer adds (mllm-NPU §3.3: 29.7%)."""

    mac_s: float
    byte_s: float
    a16: float
    float_mac: float = 2.0
    per_block: float = 1.2
    cpu_mac_s: float = 0.0  # mllm-NPU: the shadow's CPU work hides behind the NPU's
    sync_fraction: float = 0.297

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, float | int) and v >= 0 and v == v and v != float("inf")):
                raise QnpuError(f"device model: {f.name} must be a finite number >= 0, got {v!r}")
        if self.mac_s <= 0 or self.byte_s <= 0:
            raise QnpuError("device model: mac_s and byte_s must be positive")

    def pair_factor(self, pair: str) -> float:
        """The time of one MAC of `pair` ("A8W4", "A16A8", "AFWF", ...) in 8-bit MACs."""
        left, right = pair[1:].replace("W", "A").split("A")
        if FLOAT in (left, right):
            return self.float_mac
        return self.a16 ** sum(int(b) > 8 for b in (left, right))


def op_seconds(cost: OpCost, device: DeviceModel) -> float:
    """One op's modelled time on the NPU: the slower of its MACs and its bytes."""
    compute = sum(n * device.pair_factor(p) for p, n in cost.macs.items()) * device.mac_s
    if cost.per_block:
        compute *= device.per_block
    return max(compute, cost.bytes * device.byte_s)


def latency(costs: Iterable[OpCost], device: DeviceModel, num_linears: int) -> dict[str, float]:
    """Modelled seconds of a phase: the NPU's roofline per op summed, the CPU's MACs, and the
    synchronizations (`sync_fraction` of the NPU time, scaled by the share of the model's
    `num_linears` linears that synchronize)."""
    costs = tuple(costs)
    npu = sum(op_seconds(c, device) for c in costs)
    syncs = sum(c.syncs for c in costs)
    sync = device.sync_fraction * npu * min(syncs / num_linears, 1.0) if num_linears else 0.0
    cpu = sum(c.cpu_macs for c in costs) * device.cpu_mac_s
    return {"npu_s": npu, "cpu_s": cpu, "sync_s": sync, "total_s": npu + cpu + sync}


def num_linears(cfg: ModelConfig, graph: Graph | None = None) -> int:
    """The linears of the model (layers' and lm_head; `graph`: default `graph_of(cfg)`): what
    a shadow path could attach to."""
    return cfg.num_layers * len((graph or graph_of(cfg)).ops(OpKind.LINEAR)) + 1


def _solve(f: Any, target: float, lo: float, hi: float) -> float:
    """x in [lo, hi] with f(x) = target for f increasing (bisection on a log scale)."""
    if not f(lo) <= target <= f(hi):
        raise QnpuError(f"cost model fit: target {target} outside [{f(lo)}, {f(hi)}]")
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo * hi) ** 0.5


def anchor_plans(cfg: ModelConfig) -> dict[str, QuantPlan]:
    """MobileQuant Table 6's settings on the anchor model: full W8A8 (every tensor 8-bit but
    the softmax's probabilities, 16-bit in this graph) and W8A16 (weights 8-bit, every
    activation 16-bit)."""
    sixteen = uniform_plan(cfg.num_layers, 16)
    w8a16 = sixteen.with_entries(
        (p, dataclasses.replace(tq, bits=8) if is_weight(p) else tq) for p, tq in sixteen.entries
    )
    return {"w8a8": uniform_plan(cfg.num_layers, 8), "w8a16": w8a16}


def fit_device(cfg: ModelConfig, **fixed: float) -> DeviceModel:
    """The device model whose roofline reproduces MobileQuant Table 6 on `cfg` (the anchor
    model, `ANCHOR_MODEL`): bytes/s from W8A8 generation at 1024 tokens, the 8-bit MAC time
    from W8A8 prompt encoding and the 16-bit factor from W8A16 prompt encoding, fitted in turn
    until all three hold. `fixed` sets the other fields."""
    plans = anchor_plans(cfg)
    n_lin = num_linears(cfg)
    pre = prefill(ANCHOR_PROMPT)
    dec = decode(ANCHOR_DECODE_CONTEXT - 1, 1)
    w8a8_pre = plan_costs(plans["w8a8"], cfg, pre)
    w8a8_dec = plan_costs(plans["w8a8"], cfg, dec)
    w8a16_pre = plan_costs(plans["w8a16"], cfg, pre)
    fit = {"mac_s": 1e-13, "byte_s": 1e-11, "a16": 1.0}

    def run(costs: tuple[OpCost, ...], **kw: float) -> float:
        return latency(costs, DeviceModel(**{**fixed, **fit, **kw}), n_lin)["total_s"]

    for _ in range(50):
        before = dict(fit)
        fit["byte_s"] = _solve(lambda x: run(w8a8_dec, byte_s=x), ANCHOR_W8A8_DECODE_S, 1e-15, 1e-6)
        fit["mac_s"] = _solve(lambda x: run(w8a8_pre, mac_s=x), ANCHOR_W8A8_PREFILL_S, 1e-18, 1e-9)
        fit["a16"] = _solve(lambda x: run(w8a16_pre, a16=x), ANCHOR_W8A16_PREFILL_S, 1.0, 1e3)
        if all(abs(fit[k] / before[k] - 1) < 1e-12 for k in fit):
            return DeviceModel(**{**fixed, **fit})
    raise QnpuError("cost model fit: the three anchors did not converge")


def devices(anchor: ModelConfig) -> dict[str, DeviceModel]:
    """The two readings of the seeds' 16-bit activation cost, both on `fit_device`'s times:
    "mobilequant-table6" (`a16` fitted to W8A16 against W8A8 prompt encoding: one 16-bit
    operand costs several 8-bit MACs; per-block weights 1.2× per Quant.npu) and
    "quantnpu-table3" (Quant.npu Table 3: A16 per-block W4 at 1.67× float against A8
    per-channel W4 at 2.0×, the whole 1.2× put on the 16-bit activations, per-block free)."""
    fitted = fit_device(anchor)
    return {
        "mobilequant-table6": fitted,
        "quantnpu-table3": dataclasses.replace(fitted, a16=2.0 / 1.67, per_block=1.0),
    }


def phase_report(
    plan: QuantPlan, cfg: ModelConfig, phase: Phase, readings: Mapping[str, DeviceModel]
) -> dict[str, Any]:
    """The costs of `plan` on `cfg` in one `phase` as `qnpu cost` reports them: the phase's
    fields under "phase", the `totals` of its counts, and under "latency" the modelled
    latency (`latency`) with each device model of `readings` (`devices`), by its name."""
    costs = plan_costs(plan, cfg, phase)
    sums = totals(costs)
    lat = {k: latency(costs, d, num_linears(cfg, plan.graph)) for k, d in readings.items()}
    return {"phase": phase.to_json(), **sums, "latency": lat}


# the plan `qnpu cost` prices: a finished run's, or the one a config's recipe ends with


@dataclasses.dataclass(frozen=True)
class PricedPlan:
    """A plan to price with its model: `source` says where the plan came from (a run, or a
    config with its method and bits) and `model_name` names the model."""

    plan: QuantPlan
    cfg: ModelConfig
    source: str
    model_name: str


def run_plan(
    run_dir: Path, architecture: Callable[[str], ModelConfig], model: str | None = None
) -> PricedPlan:
    """The plan of the finished run in `run_dir`, on the model its model.json records, or on
    `architecture(model)` when `model` is given (`architecture`: a name or config.json to a
    ModelConfig, `memory_plan.model_architecture`)."""
    run = RunDir(run_dir)
    plan = run.read_plan()
    if model is not None:
        cfg = architecture(model)
        if plan.num_layers != cfg.num_layers:  # a per-layer plan prices only its own depth
            raise QnpuError(
                f"run {run_dir}: its plan covers {plan.num_layers} layers and {model} has "
                f"{cfg.num_layers}; price it on its own model (without --model) or on a model "
                f"of {plan.num_layers} layers"
            )
        return PricedPlan(plan, cfg, f"run {run_dir}", model)
    meta = run.read_model_json()
    try:
        data = dict(meta["config"])
        cfg = ModelConfig.from_json(data)
    except (TypeError, KeyError) as e:
        raise QnpuError(f"{run.model_json_path}: its model config is unreadable ({e})") from e
    return PricedPlan(plan, cfg, f"run {run_dir}", str(meta["source"]))


def config_plan(
    config: str | None,
    overrides: Sequence[str],
    architecture: Callable[[str], ModelConfig],
    model: str | None = None,
) -> PricedPlan:
    """The plan the recipe of `config` (a shipped name, a YAML file or None: the defaults,
    with `overrides` as KEY=VALUE) ends with, on `architecture(model or config.model)`. Its
    promotions take the right number of layers (which ones is the scan's: only the counts
    matter here); shadow or MUXQ channels, chosen in calibration, are not in it."""
    loaded = load_config(config, overrides)
    where = f"config {config}" if config else "the default config"
    cfg = architecture(model or loaded.model)
    n = cfg.num_layers
    ranked = [float(n - i) for i in range(n)]  # which layers is the scan's: only counts matter
    graph = rotated_graph(cfg) if loaded.method in ROTATING_METHODS else graph_of(cfg)
    # a scan promotes from the tensor's bits in the plan (Gemma 3's down_out: 16 already)
    unpromoted = build_plan(loaded, n, graph=graph)
    promoted = {}
    for tensor, share in loaded.promoted().items():
        planned = unpromoted.get(f"layers/{tensor}")
        if planned is None:
            raise QnpuError(f"{where}: its plan does not quantize layers/{tensor}")
        promoted[tensor] = mixed_layer_bits(ranked, share, planned.bits)
    plan = build_plan(loaded, n, promoted, graph=graph)
    what = f"{where} ({loaded.method} {loaded.bits.name})"
    if loaded.outliers.shadow_clip is not None or loaded.outliers.muxq_exp is not None:
        what += (
            "; its shadow or MUXQ channels are chosen in calibration and are not counted here "
            "(`qnpu cost --run` of a run counts them)"
        )
    return PricedPlan(plan, cfg, what, model or loaded.model)


def plan_summary(plan: QuantPlan, num_layers: int) -> str:
    """A plan in a line: its size, its weights' bits and its 16-bit activations (the down_proj
    input and output, then the others by how many of the `num_layers` layers hold them)."""

    weights = sorted({tq.bits for p, tq in plan.entries if is_weight(p)})
    parts = [
        f"{len(plan.entries)} quantized tensors",
        f"weights {'/'.join(map(str, weights)) or 'float'}-bit",
    ]
    for name, what in ((UNROTATED_INPUT, "inputs"), (UNROTATED_OUTPUT, "outputs")):
        tq = plan.get(f"layers/{name}")
        if tq is not None:
            sixteen = sum(tq.bits_for_layer(i) == 16 for i in range(num_layers))
            parts.append(f"down_proj {what} 16-bit in {sixteen} of {num_layers} layers")
    down = {f"layers/{UNROTATED_INPUT}", f"layers/{UNROTATED_OUTPUT}"}
    by_count: dict[int, list[str]] = {}  # the other 16-bit layer activations, by layer count
    for path, tq in plan.entries:
        if path.startswith("layers/") and not is_weight(path) and path not in down:
            sixteen = sum(tq.bits_for_layer(i) == 16 for i in range(num_layers))
            if sixteen:
                by_count.setdefault(sixteen, []).append(path.removeprefix("layers/"))
    for sixteen, names in sorted(by_count.items(), reverse=True):
        parts.append(f"{', '.join(names)} 16-bit in {sixteen} of {num_layers} layers")
    return ", ".join(parts)
