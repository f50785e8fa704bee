"""Static calibration: encodings of every tensor of a plan from weights and calibration text.

Activations are observed on the float model (the params given, e.g. already fused and
rotated) over calibration windows, their statistics accumulated in float32 across batches;
weights get their per-channel encodings from the weights themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import ATTENTION_TENSORS, EMBED_TABLE, Graph, layer_widths
from qnpu_jax.mesh import data_size, host_array, host_tree, local_value, put_batch, replicated
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params, lm_head_weight
from qnpu_jax.models.taps import (
    CaptureTaps,
    ChannelAbsMaxTaps,
    ObserveTaps,
    QuantState,
    state_entry,
    tapped_forward,
)
from qnpu_jax.quant.fake_quant import check_scales
from qnpu_jax.quant.init import (
    RangeStats,
    init_range_stats,
    mse_scale,
    scale_from_stats,
    update_range_stats,
)
from qnpu_jax.quant.plan import (
    LAYER_ACTIVATIONS,
    PROBS_SCALE_DENOMINATOR,
    QuantPlan,
    TensorQuant,
    is_weight,
)
from qnpu_jax.quant.spec import block_view, check_block
from qnpu_jax.quant.state import is_layer_path, state_key, with_entry

ScaleZeroPoint = tuple[np.ndarray, np.ndarray]  # (scale, zero_point)


def _observed_paths(plan: QuantPlan) -> frozenset[str]:
    return frozenset(p for p, tq in plan.entries if not is_weight(p) and tq.init != "fixed")


def _empty_stats(plan: QuantPlan, paths: frozenset[str], num_layers: int) -> dict[str, Any]:
    layers: dict[str, RangeStats] = {}
    outer: dict[str, RangeStats] = {}
    for path in paths:
        tq = plan.get(path)
        assert tq is not None
        stats = init_range_stats((1,), num_bins=2048 if tq.init == "percentile" else 0)
        group, name = state_key(path)
        if group == "layers":
            layers[name] = jax.tree.map(lambda a: jnp.stack([a] * num_layers), stats)
        else:
            outer[name] = stats
    return {"layers": layers, "outer": outer}


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix", "graph"))
def _observe_step(
    params: Params,
    stats: Any,
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    taps: ObserveTaps,
    prefix: tuple[int, ...],
    graph: Graph,
    prefix_params: Params | None = None,
) -> Any:
    _, aux = tapped_forward(
        params,
        stats,
        tokens,
        cfg=cfg,
        taps=taps,
        prefix=prefix,
        graph=graph,
        prefix_params=prefix_params,
    )
    return aux


def collect_activation_stats(
    params: Params,
    cfg: ModelConfig,
    plan: QuantPlan,
    windows: np.ndarray,
    *,
    batch_size: int = 1,
    progress: bool = False,
    prefix: tuple[int, ...] = (),
    graph: Graph | None = None,
    mesh: Mesh | None = None,
    prefix_params: Params | None = None,
) -> dict[str, Any]:
    """RangeStats of every calibrated activation of `plan` over `windows` [N, T] (each after
    the sink `prefix`, whose K/V count towards the cache ranges), the forward read from
    `graph`; on `mesh`, `batch_size` windows at a time split along its data axis.
    `prefix_params`: the float params the prefix runs on where not `params`
    (`QuantizedModel.prefix_params`)."""
    paths = _observed_paths(plan)
    taps = ObserveTaps(paths)
    stats = _empty_stats(plan, paths, cfg.num_layers)
    if mesh is not None:  # where the step's outputs live: else its second call compiles again
        stats = jax.device_put(stats, replicated(mesh))
    if len(windows) == 0:
        raise QnpuError("no calibration windows")
    # The last batch may be smaller (one more compilation): every window counts once.
    for i in tqdm(range(0, len(windows), batch_size), desc="calibrate", disable=not progress):
        batch = put_batch(mesh, windows[i : i + batch_size])
        stats = _observe_step(
            params,
            stats,
            batch,
            cfg=cfg,
            taps=taps,
            prefix=prefix,
            graph=graph,
            prefix_params=prefix_params,
        )
    return host_tree(stats)  # on this host, also when the mesh spans several


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix", "layer"))
def _capture_step(
    params: Params,
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    taps: CaptureTaps,
    prefix: tuple[int, ...],
    layer: int,
    prefix_params: Params | None = None,
) -> dict[str, jax.Array]:
    _, aux = tapped_forward(
        params, None, tokens, cfg=cfg, taps=taps, prefix=prefix, prefix_params=prefix_params
    )
    return {name: x[layer] for name, x in aux["layers"].items()}


def capture_activations(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    names: tuple[str, ...],
    *,
    layer: int,
    batch_size: int = 1,
    prefix: tuple[int, ...] = (),
    prefix_params: Params | None = None,
) -> dict[str, np.ndarray]:
    """The float values of the activations `names` of decoder `layer` over `windows` [N, T]
    (after the sink `prefix`, which is not captured): {name: [N, T, width]}. The same forward
    and windows as `collect_activation_stats`, keeping the values instead of statistics."""
    unknown = sorted(set(names) - set(LAYER_ACTIVATIONS))
    if unknown:
        raise QnpuError(f"unknown layer activation(s) {unknown}; known: {LAYER_ACTIVATIONS}")
    if not 0 <= layer < cfg.num_layers:
        raise QnpuError(f"layer {layer} is out of range: the model has {cfg.num_layers}")
    if len(windows) == 0:
        raise QnpuError("no windows to capture activations on")
    taps = CaptureTaps(frozenset(names))
    parts: dict[str, list[np.ndarray]] = {name: [] for name in names}
    for i in range(0, len(windows), batch_size):
        batch = jnp.asarray(windows[i : i + batch_size])
        out = _capture_step(
            params,
            batch,
            cfg=cfg,
            taps=taps,
            prefix=prefix,
            layer=layer,
            prefix_params=prefix_params,
        )
        for name in names:
            x = np.asarray(out[name], np.float32)
            parts[name].append(x.reshape(x.shape[0], x.shape[1], -1))  # heads → one width
    return {name: np.concatenate(parts[name]) for name in names}


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix"))
def _absmax_step(
    params: Params,
    running: dict[str, jax.Array],
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    taps: ChannelAbsMaxTaps,
    prefix: tuple[int, ...],
    prefix_params: Params | None = None,
) -> dict[str, jax.Array]:
    _, aux = tapped_forward(
        params, None, tokens, cfg=cfg, taps=taps, prefix=prefix, prefix_params=prefix_params
    )
    return {name: jnp.maximum(running[name], aux["layers"][name]) for name in running}


def channel_absmax(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    names: tuple[str, ...],
    *,
    batch_size: int = 1,
    prefix: tuple[int, ...] = (),
    prefix_params: Params | None = None,
) -> dict[str, np.ndarray]:
    """Per-channel max |x| [L, C] of the per-layer activations `names` over `windows` [N, T]
    (after the sink `prefix`, which is not counted), on the same forward as the calibration."""
    channels = tuple(n for n in LAYER_ACTIVATIONS if n not in ATTENTION_TENSORS)
    unknown = sorted(set(names) - set(channels))
    if unknown:  # scores/probs: the last axis is key position, with masked entries
        raise QnpuError(f"no channel ranges for {unknown}; known: {channels}")
    if len(windows) == 0:
        raise QnpuError("no windows to measure channel ranges on")
    taps = ChannelAbsMaxTaps(frozenset(names))
    first = jnp.asarray(windows[:batch_size])
    shapes = jax.eval_shape(
        lambda t: tapped_forward(
            params, None, t, cfg=cfg, taps=taps, prefix=prefix, prefix_params=prefix_params
        )[1],
        first,
    )["layers"]
    running = {name: jnp.zeros(shapes[name].shape, jnp.float32) for name in names}
    for i in range(0, len(windows), batch_size):
        batch = jnp.asarray(windows[i : i + batch_size])
        running = _absmax_step(
            params,
            running,
            batch,
            cfg=cfg,
            taps=taps,
            prefix=prefix,
            prefix_params=prefix_params,
        )
    out = {name: np.asarray(x) for name, x in running.items()}
    for name, x in out.items():
        if not np.all(np.isfinite(x)):
            raise QnpuError(f"calibration produced non-finite values in {name}")
    return out


def _encoding(path: str, layer: int | None, compute: Callable[[], Any]) -> ScaleZeroPoint:
    """Run one initializer; its errors name the tensor (and layer) they are about."""
    try:
        scale, zero_point = compute()
    except QnpuError as e:
        raise QnpuError(f"{path}{'' if layer is None else f' (layer {layer})'}: {e}") from e
    return np.asarray(host_array(scale), np.float32), np.asarray(host_array(zero_point), np.float32)


def _stack(per_layer: list[ScaleZeroPoint]) -> ScaleZeroPoint:
    return np.stack([e[0] for e in per_layer]), np.stack([e[1] for e in per_layer])


def _encoding_from_stats(
    path: str, stats: RangeStats, tq: TensorQuant, layer: int | None
) -> ScaleZeroPoint:
    scale, zero_point = _encoding(
        path, layer, lambda: scale_from_stats(stats, tq.init, tq.spec(layer))
    )
    return scale * np.float32(tq.headroom), zero_point  # headroom: symmetric (zero point 0)


@partial(jax.jit, static_argnames=("axis", "num_bins"))
def _weight_range_stats(w: jax.Array, *, axis: int | None, num_bins: int) -> RangeStats:
    """A weight's statistics as one program. Run eagerly, each of update_range_stats' ops on
    a sharded weight is a multi-device computation of its own, and XLA:CPU's host-platform
    devices deadlock when dispatch runs more computations ahead than a device admits (one
    device's launch waits for a slot on the thread pool its peers hold at an all-reduce)."""
    return update_range_stats(init_range_stats(w.shape, axis=axis, num_bins=num_bins), w, axis=axis)


def _weight_encoding(path: str, w: jax.Array, tq: TensorQuant, layer: int | None) -> ScaleZeroPoint:
    """Per-channel (or per-tensor) encoding of `w` [out, in]; a per-block weight is encoded
    per row of its blocks, [out · nb, block], and its scales come back as [out, nb]."""
    spec = tq.spec(layer)
    if tq.block is not None:
        where = path if layer is None else f"{path} (layer {layer})"
        nb = check_block(tq.block, int(w.shape[-1]), where)
        rows = block_view(w, tq.block).reshape(-1, tq.block)
        scale, zero_point = _weight_encoding(
            path, rows, dataclasses.replace(tq, block=None, block_scale_bits=None), layer
        )
        return scale.reshape(-1, nb), zero_point.reshape(-1, nb)

    def compute() -> Any:
        if tq.init == "mse":
            return mse_scale(w, spec)
        bins = 2048 if tq.init == "percentile" else 0
        return scale_from_stats(
            _weight_range_stats(w, axis=spec.axis, num_bins=bins), tq.init, spec
        )

    return _encoding(path, layer, compute)


def weight_encodings(
    params: Params, cfg: ModelConfig, plan: QuantPlan
) -> dict[str, ScaleZeroPoint]:
    """Encodings of every weight in `plan` (stacked over layers for `layers/` weights)."""
    out: dict[str, ScaleZeroPoint] = {}
    for path, tq in plan.entries:
        if not is_weight(path):
            continue
        group, name = state_key(path)
        if group == "layers":
            stacked = local_value(params["layers"][name])
            out[path] = _stack(
                [_weight_encoding(path, stacked[i], tq, i) for i in range(cfg.num_layers)]
            )
        else:
            w = params[EMBED_TABLE] if path == EMBED_TABLE else lm_head_weight(params)
            out[path] = _weight_encoding(path, local_value(w), tq, None)
    return out


def reencode_weight(
    params: Params, cfg: ModelConfig, state: QuantState, path: str, tq: TensorQuant
) -> QuantState:
    """`state` with the weight `path` re-encoded from the weights under `tq` (pure; the
    other entries are shared, not copied)."""
    if not is_weight(path):
        raise QnpuError(f"{path} is not a weight")
    single = QuantPlan(((path, tq),), cfg.num_layers)
    scale, zero_point = weight_encodings(params, cfg, single)[path]
    layers = cfg.num_layers if is_layer_path(path) else None
    return with_entry(state, path, state_entry(tq, scale, zero_point, layers=layers))


def activation_encodings(
    stats: Mapping[str, Any], plan: QuantPlan, num_layers: int
) -> dict[str, ScaleZeroPoint]:
    out: dict[str, ScaleZeroPoint] = {}
    for name, layer_stats in stats["layers"].items():
        path = f"layers/{name}"
        tq = plan.get(path)
        assert tq is not None
        out[path] = _stack(
            [
                _encoding_from_stats(path, jax.tree.map(lambda a, i=i: a[i], layer_stats), tq, i)
                for i in range(num_layers)
            ]
        )
    for path, outer_stats in stats["outer"].items():
        tq = plan.get(path)
        assert tq is not None
        out[path] = _encoding_from_stats(path, outer_stats, tq, None)
    return out


def build_state(
    plan: QuantPlan, cfg: ModelConfig, encodings: Mapping[str, ScaleZeroPoint]
) -> QuantState:
    """Assemble the quantizer state of `plan` from (scale, zero_point) of every tensor."""
    state: QuantState = {"layers": {}, "outer": {}}
    for path, tq in plan.entries:
        if tq.init == "fixed":  # softmax probabilities: p / (2^16 − 1)
            shape = (cfg.num_layers,) if is_layer_path(path) else ()
            enc = (
                np.full(shape, 1.0 / PROBS_SCALE_DENOMINATOR, np.float32),
                np.zeros(shape, np.float32),
            )
        elif path in encodings:
            enc = encodings[path]
        else:
            raise QnpuError(f"no encoding for {path}")
        layers = cfg.num_layers if is_layer_path(path) else None
        group, name = state_key(path)
        width = layer_widths(cfg.dims).get(name)
        state[group][name] = state_entry(tq, *enc, layers=layers, width=width)
    check_scales(
        {g: {name: entry.scale for name, entry in state[g].items()} for g in state},
        "calibrated scale",
    )
    return state


def calibrate(
    params: Params,
    cfg: ModelConfig,
    plan: QuantPlan,
    windows: np.ndarray,
    *,
    batch_size: int | None = None,
    progress: bool = False,
    prefix: tuple[int, ...] = (),
    graph: Graph | None = None,
    mesh: Mesh | None = None,
    prefix_params: Params | None = None,
) -> QuantState:
    """Static encodings of every tensor in `plan`: weights from the weights, activations from
    statistics of the float model of `graph` over calibration `windows` (after the sink
    `prefix`); on `mesh`, the windows split along its data axis (`batch_size` None: as many
    as it has devices). `prefix_params`: the float params the prefix runs on where not
    `params` (`QuantizedModel.prefix_params`)."""
    stats = collect_activation_stats(
        params,
        cfg,
        plan,
        windows,
        batch_size=batch_size or data_size(mesh),
        progress=progress,
        prefix=prefix,
        graph=graph,
        mesh=mesh,
        prefix_params=prefix_params,
    )
    encodings = weight_encodings(params, cfg, plan) | activation_encodings(
        stats, plan, cfg.num_layers
    )
    return build_state(plan, cfg, encodings)
