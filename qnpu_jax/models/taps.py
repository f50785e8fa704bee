"""The forward under a quantization plan: fake-quant (static or dynamic) and calibration taps.

Quantizer state is a pytree shaped like the plan:
    {"layers": {name: {"scale", "zero_point", "qmin", "qmax"}},   # leading layer axis
     "outer":  {name: {"scale", "zero_point", "qmin", "qmax"}}}
Per-channel weight scales keep their broadcast shape ([L, out, 1] for a layer weight [L, out,
in]; per-block ones are [L, out, in // block]); qmin/qmax are arrays ([L] per layer) so
per-layer bit-widths share one compiled program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    ATTENTION_TENSORS,
    EMBED_TABLE,
    KV_TENSORS,
    PROBS,
    SHADOW_RANGE,
    Graph,
    channel_mask,
    layer_widths,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import (
    MATMUL_DTYPES,
    Params,
    Tap,
    embed_rows,
    forward_tapped,
    init_cache,
    next_token_nll,
    no_aux,
    no_tap,
    target_nll,
)
from qnpu_jax.quant.fake_quant import (
    dynamic_fake_quant,
    fake_quant,
    positive_scale,
    round_ste,
)
from qnpu_jax.quant.init import update_range_stats
from qnpu_jax.quant.plan import QuantPlan, TensorQuant, is_weight
from qnpu_jax.quant.spec import block_view, lpbq_split
from qnpu_jax.quant.state import Encoding, QuantState, state_key

MODES = ("static", "dynamic")


@dataclasses.dataclass(frozen=True)
class FakeQuantTaps:
    """Fake-quantize every tensor of `plan`.

    mode "static": every tensor at its stored static encoding (what the NPU runs).
    mode "dynamic": activations per token and weights per output channel with on-the-fly
    Max-Min scales (the SpinQuant-style baseline: while rotations are learned, the weights'
    RTN scales follow the rotated weights).
    `lsq_grad_scaling` multiplies scale/zero-point gradients by 1/sqrt(N·Qmax).
    `local_loss`: the auxiliary output holds, per learnable activation quantizer, the local
    quantization error of eq. (3), ‖DQ(Q(x)) − x‖² / ‖x‖² with x held constant (only s, z
    move), as {"local_error": {name: scalar}} per layer.
    The plan's `simulation` "device": the forward computes what the integer contract computes
    where float differs (`ir.graph.SIMULATIONS`). Ties round to even in both: the device's
    requantization rounds halves up, but most float32 ties are not ties in its exact integer
    arithmetic, and rounding them up biases the codes (`qnpu study op_gap`).
    """

    plan: QuantPlan
    mode: str = "static"
    lsq_grad_scaling: bool = False
    cfg: ModelConfig | None = None  # needed only for lsq_grad_scaling (elements per scale)
    local_loss: bool = False
    matmul_dtype: str = "float32"  # the linears' operands ("bfloat16": stage 1's bf16 option)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise QnpuError(f"unknown fake-quant mode {self.mode!r}; known: {MODES}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise QnpuError(f"matmul_dtype must be one of {MATMUL_DTYPES}")
        if self.lsq_grad_scaling and self.cfg is None:
            raise QnpuError("lsq_grad_scaling needs the model config")
        shadowed = [p for p, tq in self.plan.entries if tq.shadow_channels is not None]
        if self.mode == "dynamic" and shadowed:
            raise QnpuError(f"dynamic fake quantization has no shadow channels ({shadowed})")

    @property
    def simulation(self) -> str:
        return self.plan.simulation

    def _tap(self, prefix: str, state: dict[str, Any]) -> tuple[Tap, Callable[[], Any]]:
        local: dict[str, jax.Array] = {}

        def tap(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
            path = prefix + name
            tq = self.plan.get(path)
            if tq is None:
                return x
            s = state[name]
            shape, block = x.shape, tq.block if is_weight(path) else None
            blocked = block is not None
            if block is not None:  # per-block weight [out, in]: per-row quantization of
                x = block_view(x, block)  # [out, nb, block]
            # qmin/qmax are traced per-layer arrays: per-layer bit-widths apply in every mode.
            if self.mode == "dynamic" and name != PROBS:
                bits = jnp.log2(s.qmax - s.qmin + 1.0)
                y = dynamic_fake_quant(x, bits, axis=-1)  # weights: per out row (or block)
                return y.reshape(shape) if blocked else y
            scale, zero_point = s.scale, s.zero_point
            if tq.learnable:
                scale = positive_scale(scale)
            else:
                scale, zero_point = jax.lax.stop_gradient((scale, zero_point))
            # (dynamic mode, above, quantizes an LPBQ weight per block with float scales:
            # SpinQuant's rotations are learned on that grid, the deployed one is LPBQ's)
            if tq.block_scale_bits is not None:  # LPBQ: what the device's block scales are
                channel, k = lpbq_split(scale, tq.block_scale_bits, jnp, round_ste)
                scale = channel * k
            if blocked:
                scale, zero_point = scale[..., None], zero_point[..., None]
            grad_scale: Any = 1.0
            if self.lsq_grad_scaling and self.cfg is not None:
                n = _elements_per_scale(name, tq, self.cfg, x)
                grad_scale = jax.lax.rsqrt(n * jnp.maximum(s.qmax, 1.0))  # LSQ 1/√(N·Qmax)
            args = (scale, zero_point, s.qmin, s.qmax)
            if self.local_loss and tq.learnable and not is_weight(path):
                x0 = jax.lax.stop_gradient(x)
                err = fake_quant(x0, *args, grad_scale=grad_scale) - x0
                local[name] = jnp.sum(err * err) / jnp.maximum(jnp.sum(x0 * x0), 1e-30)
            y = fake_quant(x, *args, grad_scale=grad_scale)
            return y.reshape(shape) if blocked else y

        def aux() -> dict[str, Any]:
            return {"local_error": dict(local)} if self.local_loss else {}

        return tap, aux

    def layer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        return self._tap("layers/", state)

    def outer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        tap, aux = self._tap("", state)
        return tap, lambda: {"outer": aux()}

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        rows = embed_rows(table, tokens)
        tq = self.plan.get(EMBED_TABLE)
        if tq is None:
            return rows
        s = state[EMBED_TABLE]  # per-row scales [V, 1]: gather the rows' own encodings
        return fake_quant(
            rows,
            jnp.take(s.scale, tokens, axis=0),
            jnp.take(s.zero_point, tokens, axis=0),
            s.qmin,
            s.qmax,
        )


def effective_state(plan: QuantPlan, state: QuantState) -> QuantState:
    """The state with each learnable scale as the forward uses it (`positive_scale`): what an
    export must read, since a raw learned scale may have stepped past zero."""
    out: QuantState = {"layers": dict(state["layers"]), "outer": dict(state["outer"])}
    for path, tq in plan.entries:
        if not tq.learnable:
            continue
        group, name = state_key(path)
        entry = out[group][name]
        out[group][name] = entry.replace(scale=positive_scale(entry.scale))
    return out


def _elements_per_scale(name: str, tq: TensorQuant, cfg: ModelConfig, x: jax.Array) -> int:
    """N of the LSQ gradient scale: elements sharing one scale within one sample (token)."""
    if is_weight(name):  # a layer weight by its name, or embed_tokens / lm_head
        # per block: `block` inputs; per channel: one output row of `in` elements; per
        # tensor: the whole weight (x is the blocked view [out, nb, block] for a per-block one)
        return int(x.shape[-1]) if tq.axis is not None else int(x.size)
    if name in ATTENTION_TENSORS:  # [B, Hkv, G, T, S]: all heads' scores of one query
        return cfg.num_heads * int(x.shape[-1])
    return layer_widths(cfg.dims).get(name, cfg.hidden_size)


def state_entry(
    tq: TensorQuant,
    scale: np.ndarray,
    zero_point: np.ndarray,
    layers: int | None,
    width: int | None = None,
) -> Encoding:
    """One tensor's state; `layers` set for a `layers/` tensor (qmin/qmax become [L]). With
    shadow channels, qmin/qmax are per channel [L, width]: the shadow channels' bounds are
    `SHADOW_BITS` wide (their overflow is added back, not clipped)."""
    bounds: tuple[Any, Any]
    if layers is None:
        qmin, qmax = tq.qrange(tq.bits)
        bounds = (np.float32(qmin), np.float32(qmax))
    else:
        ranges = [tq.qrange(tq.bits_for_layer(i)) for i in range(layers)]
        bounds = (
            np.array([r[0] for r in ranges], np.float32),
            np.array([r[1] for r in ranges], np.float32),
        )
        if tq.shadow_channels is not None:
            bounds = shadow_bounds(tq.shadow_channels, *bounds, width)
    return Encoding(
        scale=jnp.asarray(scale, jnp.float32),
        zero_point=jnp.asarray(zero_point, jnp.float32),
        qmin=jnp.asarray(bounds[0]),
        qmax=jnp.asarray(bounds[1]),
    )


def shadow_bounds(
    channels: tuple[tuple[int, ...], ...], qmin: np.ndarray, qmax: np.ndarray, width: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel bounds [L, width] from per-layer ones [L]: the listed channels get the
    signed `SHADOW_BITS` range."""
    if width is None:
        raise QnpuError("a tensor with shadow channels needs its width for per-channel bounds")
    if len(channels) != len(qmin):
        raise QnpuError(f"shadow channels for {len(channels)} layers, bounds for {len(qmin)}")
    mask = channel_mask(channels, width)
    lo = np.where(mask, SHADOW_RANGE[0], np.asarray(qmin, np.float32)[:, None])
    hi = np.where(mask, SHADOW_RANGE[1], np.asarray(qmax, np.float32)[:, None])
    return lo.astype(np.float32), hi.astype(np.float32)


# The sink prefix's K/V are the only prefix tensors the device holds: they sit in its cache.
CACHE_TENSORS = frozenset(KV_TENSORS)


@dataclasses.dataclass(frozen=True)
class CacheOnlyTaps:
    """`inner` applied to the K/V cache tensors only; everything else passes in float.

    Runs the sink prefix, which is computed offline in float and of which the device keeps
    only the (quantized) K/V cache entries.
    """

    inner: Any

    def layer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        tap, aux = self.inner.layer(state)

        def cache_only(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
            return tap(name, x, where) if name in CACHE_TENSORS else x

        return cache_only, aux

    def outer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        return no_tap, no_aux

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        return embed_rows(table, tokens)


def _carry_state(taps: Any, state: Any, aux: Any) -> Any:
    """The tap state after the prefix: observers continue from the prefix's statistics."""
    if isinstance(taps, ObserveTaps):
        return {"layers": {**state["layers"], **aux["layers"]}, "outer": state["outer"]}
    return state


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix", "remat", "graph"))
def tapped_forward(
    params: Params,
    tap_state: Any,
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    taps: Any,
    prefix: tuple[int, ...] = (),
    remat: bool = False,
    residual_rotation: jax.Array | None = None,
    graph: Graph | None = None,
    teacher: Params | None = None,
    prefix_params: Params | None = None,
    head_at: jax.Array | None = None,
) -> tuple[jax.Array, Any]:
    """Full-sequence forward under `taps`: logits [B, T, V] and the taps' auxiliary output.

    `prefix`: sink tokens placed before every sequence (positions 0..P-1). The model puts its
    massive "attention sink" activations on the first position; with the prefix computed
    offline in float (PrefixQuant), only its K/V cache entries are quantized, and the static
    ranges of every device-computed tensor exclude the sink. `tokens` start at position P.
    `taps=None` is the float model; `remat` recomputes layers in the backward pass;
    `residual_rotation` as in `forward_tapped` (tables left unrotated, rotated on the fly);
    `teacher` as there (block-wise errors against float params, the prefix included).
    `prefix_params`: the float params the offline prefix runs on, where `params` hold
    weights rounded off the grid's nearest codes (GPTQ's; default: `params`, whose weights
    the prefix then takes in float since its taps quantize only the K/V cache).
    `head_at` [B, K]: logits [B, K, V] at those positions of `tokens` only (`forward_tapped`).
    """
    b, t = tokens.shape
    n = len(prefix)
    cache = init_cache(cfg, b, n + t)
    if teacher is not None:
        cache |= {f"teacher_{k}": v for k, v in init_cache(cfg, b, n + t).items()}
    start = jnp.int32(0)
    if n:
        sink = jnp.broadcast_to(jnp.asarray(prefix, jnp.int32), (b, n))
        prefix_taps = CacheOnlyTaps(taps) if taps is not None else None
        _, cache, prefix_aux = forward_tapped(
            params if prefix_params is None else prefix_params,
            sink,
            cache,
            start,
            tap_state,
            cfg=cfg,
            taps=prefix_taps,
            residual_rotation=residual_rotation,
            graph=graph,
            teacher=teacher,
        )
        if taps is not None:
            tap_state = _carry_state(taps, tap_state, prefix_aux)
        start = jnp.int32(n)
    logits, _, aux = forward_tapped(
        params,
        tokens,
        cache,
        start,
        tap_state,
        cfg=cfg,
        taps=taps,
        remat=remat,
        residual_rotation=residual_rotation,
        graph=graph,
        teacher=teacher,
        head_at=head_at,
    )
    return logits, aux


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix", "graph"))
def tapped_token_nll(
    params: Params,
    tap_state: Any,
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    taps: Any,
    prefix: tuple[int, ...] = (),
    graph: Graph | None = None,
    prefix_params: Params | None = None,
) -> jax.Array:
    """Next-token NLL [B, T-1] of tokens[:, 1:] under `taps` (logits never leave the jit).

    With a `prefix` the first token is conditioned on it too, but it is still not scored, so
    runs with and without a prefix predict the same tokens. (The argmax, unused, compiles away.)
    """
    return tapped_nll_argmax(
        params, tap_state, tokens, cfg=cfg, taps=taps, prefix=prefix, graph=graph,
        prefix_params=prefix_params,
    )[0]  # fmt: skip


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix", "graph"))
def tapped_nll_argmax(
    params: Params,
    tap_state: Any,
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    taps: Any,
    prefix: tuple[int, ...] = (),
    graph: Graph | None = None,
    prefix_params: Params | None = None,
) -> tuple[jax.Array, jax.Array]:
    """NLL of tokens[:, 1:] and the argmax prediction at each of those positions [B, T-1]."""
    logits, _ = tapped_forward(
        params,
        tap_state,
        tokens,
        cfg=cfg,
        taps=taps,
        prefix=prefix,
        graph=graph,
        prefix_params=prefix_params,
    )
    return next_token_nll(logits, tokens), jnp.argmax(logits[:, :-1], axis=-1)


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix", "graph"))
def tapped_span_nll_argmax(
    params: Params,
    tap_state: Any,
    tokens: jax.Array,
    head_at: jax.Array,
    *,
    cfg: ModelConfig,
    taps: Any,
    prefix: tuple[int, ...] = (),
    graph: Graph | None = None,
    prefix_params: Params | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`tapped_nll_argmax` at K positions of each row [B, K] (`head_at`, each < T-1): the NLL
    of tokens[b, head_at[b, k] + 1] and the argmax there, with lm_head run on those positions
    alone (zero-shot scoring reads a few continuation tokens of each row)."""
    logits, _ = tapped_forward(
        params,
        tap_state,
        tokens,
        cfg=cfg,
        taps=taps,
        prefix=prefix,
        graph=graph,
        prefix_params=prefix_params,
        head_at=head_at,
    )
    target = jnp.take_along_axis(tokens, head_at + 1, axis=1)
    return target_nll(logits, target), jnp.argmax(logits, axis=-1)


@dataclasses.dataclass(frozen=True)
class ObserveTaps:
    """Accumulate calibration statistics (RangeStats) of the activations `paths` name.

    The tap state is the running statistics ({"layers": {name: stacked stats}, "outer": ...});
    the auxiliary output is the updated statistics in the same layout. Tensors pass unchanged.
    """

    paths: frozenset[str]

    def _tap(self, prefix: str, state: dict[str, Any]) -> tuple[Tap, Callable[[], Any]]:
        updated: dict[str, Any] = {}

        def tap(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
            if prefix + name in self.paths:
                updated[name] = update_range_stats(state[name], x, where=where)
            return x

        return tap, lambda: updated

    def layer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        return self._tap("layers/", state)

    def outer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        tap, updated = self._tap("", state)
        return tap, lambda: {"outer": updated()}

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        return embed_rows(table, tokens)


@dataclasses.dataclass(frozen=True)
class CaptureTaps:
    """Return the raw values of the per-layer activations `names` (plan names such as
    "attn_in", "down_in") as the auxiliary output, {"layers": {name: [L, B, T, ...]}}; every
    tensor passes unchanged. The histograms of Figures 5–6 need the values themselves, which
    the calibration statistics of `ObserveTaps` summarize away."""

    names: frozenset[str]

    def reduce(self, x: jax.Array) -> jax.Array:
        return x

    def layer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        captured: dict[str, jax.Array] = {}

        def tap(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
            if name in self.names:
                captured[name] = self.reduce(x)
            return x

        return tap, lambda: dict(captured)

    def outer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        return no_tap, no_aux

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        return embed_rows(table, tokens)


@dataclasses.dataclass(frozen=True)
class ChannelAbsMaxTaps(CaptureTaps):
    """The float forward, returning each per-layer tensor of `names` reduced to its max |x|
    per channel (the last axis) over batch and positions: {"layers": {name: [L, C]}}."""

    def reduce(self, x: jax.Array) -> jax.Array:
        rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        return jnp.max(jnp.abs(rows), axis=0)


@dataclasses.dataclass(frozen=True)
class HessianTaps:
    """`inner`'s forward, returning Σ xᵀx over the tokens of the per-layer tensors `names`
    (linear inputs such as "attn_in", "down_in") as {"layers": {name: [L, in, in]}}. x is
    taken after `inner`'s tap, i.e. the input the linear multiplies (fake-quantized when
    `inner` quantizes it): the Hessians of GPTQ (`qnpu_jax.quant.gptq`)."""

    inner: Any
    names: frozenset[str]

    @property
    def simulation(self) -> str:
        return str(getattr(self.inner, "simulation", "fake"))

    def layer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        inner_tap, _ = self.inner.layer(state)
        hessians: dict[str, jax.Array] = {}

        def tap(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
            y = inner_tap(name, x, where)
            if name in self.names:
                rows = y.reshape(-1, y.shape[-1]).astype(jnp.float32)
                hessians[name] = rows.T @ rows
            return y

        return tap, lambda: dict(hessians)

    def outer(self, state: Any) -> tuple[Tap, Callable[[], Any]]:
        tap, _ = self.inner.outer(state)
        return tap, no_aux

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        return self.inner.embed(state, table, tokens)


# Sink prefixes (PrefixQuant): tokens placed before every sequence, their K/V computed
# offline. "bos_newline" adds a newline after BOS: without it, some first tokens after BOS
# become a second attention sink (|down_proj output| up to ~15,000 on SmolLM2 against ~1,100
# elsewhere), and one such window in the calibration set sets every static range after it
# (docs/results.md, "Seed stability").
SINK_PREFIXES = ("none", "bos", "bos_newline")


def sink_prefix(name: str, tokenizer: Any) -> tuple[int, ...]:
    """The sink prefix a name stands for: "none" → (), "bos" → (the tokenizer's BOS id,),
    "bos_newline" → BOS then the tokens of "\\n"."""
    if name == "none":
        return ()
    if name not in SINK_PREFIXES:
        raise QnpuError(f"unknown sink prefix {name!r}; known: {', '.join(SINK_PREFIXES)}")
    if tokenizer.bos_token_id is None:
        raise QnpuError(f"prefix {name!r}: the tokenizer has no BOS token")
    ids: tuple[int, ...] = (int(tokenizer.bos_token_id),)
    if name == "bos_newline":
        newline = tuple(int(t) for t in tokenizer.encode("\n", add_bos=False))
        if not newline:
            raise QnpuError(f"prefix {name!r}: the tokenizer encodes a newline as no token")
        ids += newline
    return ids


def prefix_name(ids: Sequence[int], tokenizer: Any) -> str:
    """The name of `SINK_PREFIXES` whose tokens are `ids`, else "tokens [ids]"."""
    for name in SINK_PREFIXES:
        try:
            if sink_prefix(name, tokenizer) == tuple(int(i) for i in ids):
                return name
        except QnpuError:
            continue
    return f"tokens {[int(i) for i in ids]}"
