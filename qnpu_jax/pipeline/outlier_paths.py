"""Answers to activation outliers that keep per-tensor static activations (issue: the seeds'
outlier mechanisms as steps).

mllm-NPU's shadow outlier execution: a linear's input is quantized per tensor at a clipped
scale (a percentile of its calibration values); the NPU runs the matmul on the clamped codes,
and a shadow path adds back the overflow r = q − clamp(q) of the few "hot" channels that had
any, with those channels' weight rows only, in the layers where outliers matter most
(importance = the largest |x| over the scale; the top `keep` share of layers). The sum equals
the matmul of the unclamped codes exactly; in the plan the hot channels' codes are simply
not clamped (`TensorQuant.shadow_channels`, `SHADOW_BITS` wide).

MUXQ: the outlier channels of a linear's input (largest |x| over the calibration above a
threshold; the paper's |x| > 6 of LLM.int8(), fixed offline for a static NPU) are shifted
right by `exp` bits into the Body tensor, which is quantized per tensor; an auxiliary
matrix Aux = Body's outlier columns restores them: X = Body + (2^exp − 1)·Aux, and
Y = Body·W + (2^exp − 1)·Aux·W, all in integers. In the plan the Body's per-tensor scale s
becomes a per-channel scale s·2^exp on the outlier channels (`TensorQuant.muxq_channels`).

The residual split: MUXQ's Body encoding on a residual add's output, without an Aux. Gemma 3's
residual stream carries a few massive channels (up to ~10^5 where the others stay under
~650); on one 16-bit grid their range makes the step coarse for every other channel. Split,
the massive channels' codes hold x >> exp, the rest sit on a grid from the others' range, and
the adds and norms reading the stream take the split channels back times 2^exp, exactly
(docs/artifact.md, "The residual split").
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import MUXQ_MAX_EXP
from qnpu_jax.quant.plan import TensorQuant


@dataclasses.dataclass(frozen=True)
class ShadowChoice:
    """Which layers keep a shadow path and which channels it carries, from calibration."""

    kept_layers: tuple[int, ...]
    channels: tuple[tuple[int, ...], ...]  # per layer; empty where no shadow
    importance: tuple[float, ...]  # per layer: max |x| / clipped scale (0: not eligible)


def choose_shadows(
    absmax: np.ndarray,
    clip_scale: np.ndarray,
    clip_zero_point: np.ndarray,
    tq: TensorQuant,
    keep: float,
) -> ShadowChoice:
    """The layers and hot channels of a shadow path (pure).

    `absmax` [L, C]: each channel's largest |x| over the calibration; `clip_scale`,
    `clip_zero_point` [L]: the clipped encoding of each layer. A channel is hot when its
    largest |x| would leave the code range at that encoding; the ceil(keep·L) layers of
    largest importance (ties: lower layer first) keep a shadow path, among the layers at
    8 bits or fewer (a promoted 16-bit layer needs none)."""
    if not 0.0 < keep <= 1.0:
        raise QnpuError(f"shadow outliers: keep must be in (0, 1], got {keep}")
    absmax = np.asarray(absmax, np.float64)
    n = absmax.shape[0]
    scale = np.asarray(clip_scale, np.float64).reshape(n)
    zero = np.asarray(clip_zero_point, np.float64).reshape(n)
    if not (np.all(np.isfinite(absmax)) and np.all(scale > 0)):
        raise QnpuError("shadow outliers: channel ranges must be finite and scales positive")
    eligible = [i for i in range(n) if tq.bits_for_layer(i) <= 8]
    importance = [float(absmax[i].max() / scale[i]) if i in eligible else 0.0 for i in range(n)]
    order = sorted(eligible, key=lambda i: (-importance[i], i))
    kept = tuple(sorted(order[: math.ceil(round(keep * n, 9))]))
    channels: list[tuple[int, ...]] = []
    for i in range(n):
        if i not in kept:
            channels.append(())
            continue
        qmin, qmax = tq.qrange(tq.bits_for_layer(i))
        room = min(qmax - zero[i], zero[i] - qmin)  # the codes either sign of x may take
        channels.append(tuple(int(c) for c in np.nonzero(np.rint(absmax[i] / scale[i]) > room)[0]))
    return ShadowChoice(kept, tuple(channels), tuple(importance))


def shadow_summary(choice: ShadowChoice) -> dict[str, Any]:
    """What a run records of its shadow choice."""
    return {
        "kept_layers": list(choice.kept_layers),
        "channels_per_layer": [len(c) for c in choice.channels],
        "importance": list(choice.importance),
    }


def shadow_matmul(
    codes: np.ndarray,
    weight: np.ndarray,
    qmin: np.ndarray,
    qmax: np.ndarray,
    channels: tuple[int, ...],
) -> np.ndarray:
    """Σ_c q_c·w_c as the device computes it with a shadow path, exactly (int64): the NPU's
    matmul of the clamped codes, plus the overflow r = q − clamp(q) of the shadow `channels`
    times their weight rows only. `codes` [..., C] centered integer codes, `weight` [C, out],
    `qmin`/`qmax` [C] the clamp range; an overflow outside `channels` is an error (the
    device would lose it)."""
    q = np.asarray(codes, np.int64)
    clamped = np.clip(q, np.asarray(qmin, np.int64), np.asarray(qmax, np.int64))
    residual = q - clamped
    outside = np.ones(q.shape[-1], bool)
    outside[list(channels)] = False
    if np.any(residual[..., outside]):
        raise QnpuError("codes overflow outside the shadow channels")
    w = np.asarray(weight, np.int64)
    idx = list(channels)
    return clamped @ w + residual[..., idx] @ w[idx]


@dataclasses.dataclass(frozen=True)
class MuxqChoice:
    """MUXQ's outlier channels per layer and the largest |Body| of each layer."""

    channels: tuple[tuple[int, ...], ...]
    body_absmax: tuple[float, ...]


def choose_muxq(
    absmax: np.ndarray, exp: int, threshold: float, tq: TensorQuant | None = None
) -> MuxqChoice:
    """The channels whose largest |x| exceeds `threshold` (pure), and each layer's largest
    |Body| once they are shifted right by `exp` bits; with `tq`, only in the layers at 8 bits
    or fewer (a promoted 16-bit layer needs no Body)."""
    if not threshold > 0:
        raise QnpuError(f"MUXQ: the outlier threshold must be positive, got {threshold}")
    absmax = np.asarray(absmax, np.float64)
    if not np.all(np.isfinite(absmax)):
        raise QnpuError("MUXQ: channel ranges must be finite")
    hot = absmax > threshold
    if tq is not None:
        narrow = np.array([tq.bits_for_layer(i) <= 8 for i in range(len(absmax))])
        hot &= narrow[:, None]
    body = np.where(hot, absmax / float(1 << exp), absmax)
    channels = tuple(tuple(int(c) for c in np.nonzero(row)[0]) for row in hot)
    return MuxqChoice(channels, tuple(float(b) for b in body.max(axis=1)))


def muxq_split(x: np.ndarray, channels: tuple[int, ...], exp: int) -> tuple[np.ndarray, np.ndarray]:
    """(Body, Aux) of `x` [..., C]: Body has the outlier `channels` divided by 2^exp, Aux is
    Body's outlier columns; x = Body + (2^exp − 1)·Aux on them, exactly (powers of two)."""
    body = np.array(x, copy=True)
    idx = list(channels)
    body[..., idx] = body[..., idx] / float(1 << exp)
    return body, body[..., idx]


@dataclasses.dataclass(frozen=True)
class ResidualSplit:
    """The residual split of one residual add's output: its split channels per layer, the
    tensor's one exp, and each layer's largest |Body|."""

    channels: tuple[tuple[int, ...], ...]
    exp: int
    body_absmax: tuple[float, ...]


def choose_residual_split(absmax: np.ndarray, div: float) -> ResidualSplit:
    """The residual split from the per-channel calibration ranges [L, C] (pure): per layer,
    the channels whose largest |x| exceeds 1/`div` of the layer's largest (none where that is
    every channel); the smallest exp
    (1..MUXQ_MAX_EXP) that brings every layer's split channels down to its other channels'
    largest; each layer's largest |Body| with them shifted."""
    if not div > 1:
        raise QnpuError(f"residual split: div must be above 1, got {div}")
    absmax = np.asarray(absmax, np.float64)
    if absmax.ndim != 2 or not np.all(np.isfinite(absmax)):
        raise QnpuError("residual split: channel ranges must be finite, [layers, channels]")
    top = absmax.max(axis=1, keepdims=True)
    hot = absmax > top / div
    hot[hot.all(axis=1)] = False  # no channel stands out: no split in that layer
    rest = np.where(hot, 0.0, absmax).max(axis=1)
    split = hot.any(axis=1)
    ratio = top[split, 0] / np.maximum(rest[split], top[split, 0] / 2.0**MUXQ_MAX_EXP)
    exp = min(max(math.ceil(math.log2(float(ratio.max(initial=2.0)))), 1), MUXQ_MAX_EXP)
    body = np.where(hot, absmax / float(1 << exp), absmax).max(axis=1)
    channels = tuple(tuple(int(c) for c in np.nonzero(row)[0]) for row in hot)
    return ResidualSplit(channels, exp, tuple(float(b) for b in body))
