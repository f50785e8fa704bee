"""Weight rounding after stage 2: round-to-nearest (the paper) or GPTQ onto the same grid.

`gptq_round_weights` collects every linear input's Hessian in one calibration pass of the
fake-quant model (all tensors at their static encodings, weights round-to-nearest) and then
re-chooses the integer codes of every quantized linear weight with GPTQ, keeping the run's
scales. The run stores those codes (`learned/weight_codes`), and `load_run` rebuilds the
weights from them, so evaluation and export see exactly these codes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import layer_widths
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params
from qnpu_jax.models.taps import FakeQuantTaps, HessianTaps, QuantState, tapped_forward
from qnpu_jax.quant.gptq import gptq_layers
from qnpu_jax.quant.plan import QuantPlan


def linear_inputs(plan: QuantPlan) -> dict[str, str]:
    """The tensor each decoder-layer linear of the plan's graph multiplies, by weight."""
    return {name: io[0] for name, io in plan.graph.linear_io.items()}


def rounded_weights(plan: QuantPlan) -> tuple[str, ...]:
    """The decoder-layer linears whose weights the plan quantizes (GPTQ's targets)."""
    names = tuple(n for n in linear_inputs(plan) if plan.get(f"layers/{n}") is not None)
    blocked = [n for n in names if getattr(plan.get(f"layers/{n}"), "block", None) is not None]
    if blocked:  # GPTQ's column sweep here runs on one scale per row
        raise QnpuError(f"GPTQ rounding does not support per-block weights ({blocked[0]})")
    return names


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix"))
def _hessian_step(
    params: Params,
    state: QuantState,
    tokens: jax.Array,
    totals: dict[str, jax.Array],
    prefix_params: Params | None,
    *,
    cfg: ModelConfig,
    taps: HessianTaps,
    prefix: tuple[int, ...],
) -> dict[str, jax.Array]:
    _, aux = tapped_forward(
        params, state, tokens, cfg=cfg, taps=taps, prefix=prefix, prefix_params=prefix_params
    )
    return {name: totals[name] + aux["layers"][name] for name in totals}


def collect_hessians(
    params: Params,
    state: QuantState,
    plan: QuantPlan,
    cfg: ModelConfig,
    windows: np.ndarray,
    *,
    prefix: tuple[int, ...] = (),
    prefix_params: Params | None = None,
    progress: bool = False,
) -> dict[str, jax.Array]:
    """Σ xᵀx [L, in, in] of every input a quantized linear weight multiplies, over `windows`,
    with x as the fake-quant model feeds it to the linear. `prefix_params`: as for
    `tapped_forward` (the weights before rounding, where `params` hold GPTQ's codes)."""
    inputs = linear_inputs(plan)
    names = frozenset(inputs[n] for n in rounded_weights(plan))
    taps = HessianTaps(FakeQuantTaps(plan), names)
    widths = layer_widths(cfg.dims, plan.graph)
    totals = {}
    for name in sorted(names):
        width = widths[name]
        totals[name] = jnp.zeros((cfg.num_layers, width, width), jnp.float32)
    for i in tqdm(range(len(windows)), desc="gptq hessians", disable=not progress):
        tokens = jnp.asarray(windows[i : i + 1])
        totals = _hessian_step(
            params, state, tokens, totals, prefix_params, cfg=cfg, taps=taps, prefix=prefix
        )
    return totals


def check_gptq_tokens(
    plan: QuantPlan, cfg: ModelConfig, windows_shape: tuple[int, ...], prefix_len: int = 0
) -> None:
    """Refuse a calibration of fewer tokens (windows × (prefix + length)) than the widest
    input of a linear that GPTQ rounds."""
    widths, reads = layer_widths(cfg.dims, plan.graph), linear_inputs(plan)
    inputs = {n: widths[reads[n]] for n in rounded_weights(plan)}
    if not inputs:
        return
    widest = max(inputs, key=lambda n: inputs[n])
    n, t = int(windows_shape[0]), int(windows_shape[1])
    tokens = n * (t + prefix_len)
    if tokens < inputs[widest]:
        raise QnpuError(
            f"gptq: {n} calibration windows of {t} tokens (+{prefix_len} prefix) give {tokens} "
            f"token rows, fewer than the {inputs[widest]} inputs of {widest}: its Hessian is "
            f"singular and GPTQ would fit the calibration text; calibrate on at least "
            f"{inputs[widest]} tokens (more windows or a longer seq_len)"
        )


def gptq_weight_codes(
    params: Params,
    state: QuantState,
    plan: QuantPlan,
    hessians: dict[str, jax.Array],
    *,
    damp: float = 0.01,
    act_order: bool = False,
    progress: bool = False,
) -> dict[str, np.ndarray]:
    """GPTQ codes {linear: int8 [L, out, in]} of every quantized linear weight, on the grid
    of `state` (scales and zero points unchanged), given `collect_hessians`' Hessians."""
    codes: dict[str, np.ndarray] = {}
    inputs = linear_inputs(plan)
    for name in tqdm(rounded_weights(plan), desc="gptq", disable=not progress):
        s = state["layers"][name]
        q = gptq_layers(
            params["layers"][name],
            hessians[inputs[name]],
            s.scale,
            s.zero_point,
            s.qmin,
            s.qmax,
            damp=damp,
            act_order=act_order,
        )
        dtype = np.int8 if float(jnp.max(s.qmax)) < 128 else np.int16
        codes[name] = np.asarray(q).astype(dtype)
    return codes


def hessians_with_codes(
    params: Params,
    state: QuantState,
    plan: QuantPlan,
    cfg: ModelConfig,
    windows: np.ndarray,
    codes: dict[str, Any],
    *,
    prefix: tuple[int, ...] = (),
    progress: bool = False,
) -> dict[str, jax.Array]:
    """`collect_hessians` of the model with `codes` in place (a GPTQ pass after the first):
    each linear's Hessian sees the inputs the rounded linears before it feed it. The sink
    prefix runs on `params`, the weights before rounding, as it is deployed (computed
    offline in float)."""
    rounded = weights_from_codes(params, state, codes)
    return collect_hessians(
        rounded, state, plan, cfg, windows, prefix=prefix, prefix_params=params, progress=progress
    )


def gptq_round_weights(
    params: Params,
    state: QuantState,
    plan: QuantPlan,
    cfg: ModelConfig,
    windows: np.ndarray,
    *,
    damp: float = 0.01,
    act_order: bool = False,
    passes: int = 1,
    prefix: tuple[int, ...] = (),
    progress: bool = False,
) -> dict[str, np.ndarray]:
    """`gptq_weight_codes` with Hessians from `windows` (calibration) of the fake-quant model;
    each of `passes` after the first takes them with the last pass's codes in place
    (`hessians_with_codes`) and rounds `params` again. Fewer calibration tokens than a
    linear's inputs leave its Hessian singular: GPTQ then fits the calibration text, not the
    model (README's recipe on 4 × 128 tokens gave perplexity 525,980 against RTN's 159), so
    that is refused."""
    if passes < 1:
        raise QnpuError(f"gptq: passes must be at least 1, got {passes}")
    check_gptq_tokens(plan, cfg, np.asarray(windows).shape, len(prefix))
    hessians = collect_hessians(params, state, plan, cfg, windows, prefix=prefix, progress=progress)
    codes = gptq_weight_codes(
        params, state, plan, hessians, damp=damp, act_order=act_order, progress=progress
    )
    for _ in range(passes - 1):
        hessians = hessians_with_codes(
            params, state, plan, cfg, windows, codes, prefix=prefix, progress=progress
        )
        codes = gptq_weight_codes(
            params, state, plan, hessians, damp=damp, act_order=act_order, progress=progress
        )
    return codes


def weights_from_codes(params: Params, state: QuantState, codes: dict[str, Any]) -> Params:
    """`params` with each linear in `codes` replaced by its dequantized codes (on the grid)."""
    layers = dict(params["layers"])
    for name, q in codes.items():
        s = state["layers"][name]
        layers[name] = (jnp.asarray(q, jnp.float32) - s.zero_point) * s.scale
    return {**params, "layers": layers}
