"""The `qnpu quantize` run configuration: frozen dataclasses, validated on construction.

A YAML file is one flat mapping of keys (docs/config.md): `KEYS` says where each lives in the
nested `QuantizeConfig` (`w_bits` is `config.bits.w`, `mixed_precision` is
`config.promotions.down_in`); nested `stage1:` maps onto `Stage1Config`, `mesh:` onto
`MeshConfig`, `rules:` is a list of `QuantRule` fields applied after the method's defaults.
Unknown keys are errors. `RANGES` holds every number key's range.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from flax import traverse_util

from qnpu_jax.errors import QnpuError, shown
from qnpu_jax.fieldtypes import check_type, field_hints
from qnpu_jax.files import read_text
from qnpu_jax.ir.graph import MUXQ_MAX_EXP, SIMULATIONS, UNROTATED_INPUT
from qnpu_jax.limits import MAX_CALIB_WINDOWS, MAX_CONFIG_BYTES, MAX_SEED, check_at_most
from qnpu_jax.mesh import MeshConfig
from qnpu_jax.models.taps import SINK_PREFIXES
from qnpu_jax.pipeline.methods import (
    METHOD_NAMES,
    METHOD_OFF,
    ROTATING_METHODS,
    SCALE_LEARNING_METHODS,
    Method,
    method_spec,
)
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.stage1 import Stage1Config
from qnpu_jax.quant.plan import QuantRule, check_block_fields

# the quantization methods' names (`methods.METHODS` holds their specs); `Method`,
# `ROTATING_METHODS` and `SCALE_LEARNING_METHODS` come from there too
METHODS: tuple[Method, ...] = METHOD_NAMES
InitScheme = Literal["aware", "max_min"]
INIT_SCHEMES: tuple[InitScheme, ...] = typing.get_args(InitScheme)
Scope = Literal["full", "linears"]
SCOPES: tuple[Scope, ...] = typing.get_args(Scope)
WeightRounding = Literal["rtn", "gptq"]
WEIGHT_ROUNDINGS: tuple[WeightRounding, ...] = typing.get_args(WeightRounding)
# The random sources a run draws from, each seeded by `seed` unless its own key is set.
SOURCE_SEEDS = ("rotation_seed", "calib_seed", "data_seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bits:
    """Bit-widths of the plan (docs/design.md §3)."""

    w: int = 4  # the decoder linears' weights
    a: int = 8  # the activations
    kv: int = 8  # the K/V cache
    down_in: int = 8  # base precision of the down_proj inputs (16: the paper's Table 1)

    @property
    def name(self) -> str:
        """ "W4A8KV8"."""
        return f"W{self.w}A{self.a}KV{self.kv}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Promotions:
    """Per scanned tensor (each field named as the tensor, `ir.graph`), the share of layers
    whose tensor eq. (4)'s sensitivity scan promotes to 16 bits (0: none)."""

    down_in: float = 0.10  # the paper's mixed precision
    down_out: float = 0.0  # scanned on the final model, after stage 1 (not the paper)
    mlp_in: float = 0.0  # gate/up input, before stage 1 (not the paper)
    attn_out: float = 0.0  # o_proj input, before stage 1 (not the paper)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weights:
    """How the linear weights are rounded and scaled."""

    rounding: WeightRounding = "rtn"  # "gptq": GPTQ codes on the same grid after stage 2
    gptq_damp: float = 0.01  # GPTQ's dampening, a share of the Hessian's mean diagonal
    gptq_act_order: bool = False  # GPTQ rounds the columns by decreasing H_ii
    # GPTQ's Hessians from this many windows of the calibration text: the calibration windows,
    # then more drawn from the text (None: the calibration windows alone)
    gptq_windows: int | None = None
    # GPTQ's passes: each after the first takes its Hessians with the last pass's codes in
    # place (the inputs the rounded layers before a linear feed it)
    gptq_passes: int = 1
    # scales per block of inputs (16..256; None: per channel), and with block_scale_bits the
    # block scales in AIMET's LPBQ form (integer · per-channel)
    block: int | None = None
    block_scale_bits: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outliers:
    """The outlier steps after stage 2: the down_proj input's mllm-NPU shadow path
    (`shadow_clip` set) or MUXQ (`muxq_exp` set), which exclude each other, and the residual
    stream's split (`residual_split` set)."""

    shadow_clip: float | None = None  # clip percentile of the shadow path; None: off
    shadow_keep: float = 0.15  # share of layers that keep a shadow path (mllm-NPU: 15%)
    muxq_exp: int | None = None  # MUXQ's shift of the outlier channels; None: off
    muxq_threshold: float = 6.0  # |x| above which a channel is an outlier (LLM.int8's 6)
    # the residual stream's channels above 1/this of each layer's largest on a coarser grid
    residual_split: float | None = None  # None: off


@dataclasses.dataclass(frozen=True, kw_only=True)
class MobileQuantOptions:
    """MobileQuant's options, open to every method; null takes the method's default (its
    spec's `defaults`, `methods.METHODS`), resolved on the config's construction."""

    equalize: float | None = None  # SmoothQuant α initializing every pair's equivalent scales
    weight_clipping: bool | None = None  # learnable weight clipping in stage 1 (OmniQuant LWC)
    asymmetric_activations: bool | None = None  # zero points on every activation
    asymmetric_weights: bool | None = None  # a zero point per linear weight row
    selective: bool | None = None  # False: linear outputs and K/V are learned in stage 1 too


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """The calibration text and the window length (calibration, stage 1, evaluation)."""

    calib: str = "wiki"  # the `wiki` calib split, or a user's calibration text
    seq_len: int = 512
    windows: int = 16  # stage 2 calibration and the sensitivity scans


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """The evaluation sets."""

    data: tuple[str, ...] = ("wiki",)
    windows: int | None = 64  # cap per evaluation set (None: every window)


if set(METHOD_OFF) != {f.name for f in dataclasses.fields(MobileQuantOptions)}:
    raise ValueError("methods.METHOD_OFF: name exactly MobileQuantOptions' fields")

GROUPS: dict[str, type] = {
    "bits": Bits,
    "promotions": Promotions,
    "weights": Weights,
    "outliers": Outliers,
    "mobilequant": MobileQuantOptions,
    "data": DataConfig,
    "eval": EvalConfig,
}
# Every YAML key, in the order a config is written: where it lives, "group.field" or a
# field of QuantizeConfig itself. from_dict, to_dict, replace, the checks and docs/config.md
# go by it.
KEYS: dict[str, str] = {
    "model": "model",
    "method": "method",
    "w_bits": "bits.w",
    "a_bits": "bits.a",
    "kv_bits": "bits.kv",
    "down_in_bits": "bits.down_in",
    "mixed_precision": "promotions.down_in",
    "down_out_mixed_precision": "promotions.down_out",
    "mlp_in_mixed_precision": "promotions.mlp_in",
    "attn_out_mixed_precision": "promotions.attn_out",
    "learn_down_in": "learn_down_in",
    "init_scheme": "init_scheme",
    "selective": "mobilequant.selective",
    "scope": "scope",
    "weight_rounding": "weights.rounding",
    "gptq_damp": "weights.gptq_damp",
    "gptq_act_order": "weights.gptq_act_order",
    "gptq_windows": "weights.gptq_windows",
    "gptq_passes": "weights.gptq_passes",
    "smooth_mlp": "smooth_mlp",
    "weight_block": "weights.block",
    "weight_block_scale_bits": "weights.block_scale_bits",
    "shadow_outliers": "outliers.shadow_clip",
    "shadow_keep": "outliers.shadow_keep",
    "muxq_exp": "outliers.muxq_exp",
    "muxq_threshold": "outliers.muxq_threshold",
    "residual_split": "outliers.residual_split",
    "equalize": "mobilequant.equalize",
    "weight_clipping": "mobilequant.weight_clipping",
    "asymmetric_activations": "mobilequant.asymmetric_activations",
    "asymmetric_weights": "mobilequant.asymmetric_weights",
    "prefix": "prefix",
    "simulation": "simulation",
    "seed": "seed",
    "rotation_seed": "rotation_seed",
    "rotation_candidates": "rotation_candidates",
    "calib_seed": "calib_seed",
    "data_seed": "data_seed",
    "calib_data": "data.calib",
    "seq_len": "data.seq_len",
    "calib_windows": "data.windows",
    "eval_data": "eval.data",
    "eval_windows": "eval.windows",
    "stage1": "stage1",
    "rules": "rules",
    "mesh": "mesh",
}


def _place(key: str) -> tuple[str, str]:
    """(group, field) of a key ("" for a field of QuantizeConfig)."""
    group, _, field = KEYS[key].rpartition(".")
    return group, field


@dataclasses.dataclass(frozen=True)
class Range:
    """Where a number key's value must lie: `low`..`high` (None: no bound), each end open or
    closed. An error says it "in [0, 1]" (integers: "in 2..16") or "positive"."""

    low: float
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    noun: str = ""  # "a percentile": what the value is, in the error
    why: str = ""

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def says(self, integer: bool) -> str:
        if self.high is None:
            positive = (self.low, self.low_open) == (0, True) or (integer and self.low == 1)
            return "positive" if positive else f"{'>' if self.low_open else '>='} {self.low}"
        if integer:
            return f"in {self.low}..{self.high}"
        left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"in {left}{self.low}, {self.high}{right}"


_SEED = Range(0, MAX_SEED, noun="an integer", why="32 bits")
_SHARE = Range(0, 1, low_open=True, high_open=True)
# every number key's range (null, where its type allows it, is always in range)
RANGES: dict[str, Range] = {
    "w_bits": Range(2, 16),
    "a_bits": Range(2, 16),
    "kv_bits": Range(2, 16),
    "down_in_bits": Range(8, 16, why="the unrotated down_proj input is never below 8 bits"),
    "mixed_precision": Range(0, 1),
    "down_out_mixed_precision": Range(0, 1),
    "mlp_in_mixed_precision": Range(0, 1),
    "attn_out_mixed_precision": Range(0, 1),
    "gptq_damp": _SHARE,
    "gptq_windows": Range(1),
    "gptq_passes": Range(1, 4, why="each pass is one Hessian pass over GPTQ's windows and GPTQ"),
    "smooth_mlp": _SHARE,
    "shadow_outliers": Range(0, 100, low_open=True, noun="a percentile"),
    "shadow_keep": Range(0, 1, low_open=True),
    "muxq_exp": Range(1, MUXQ_MAX_EXP),
    "muxq_threshold": Range(0, low_open=True),
    "residual_split": Range(1, low_open=True),
    "equalize": _SHARE,
    "seed": _SEED,
    "rotation_seed": _SEED,
    "rotation_candidates": Range(1, 64),
    "calib_seed": _SEED,
    "data_seed": _SEED,
    "seq_len": Range(2),
    "calib_windows": Range(1),
    "eval_windows": Range(1),
}


def key_hint(key: str) -> Any:
    """The type of a key's value (its field's annotation)."""
    group, field = _place(key)
    return field_hints(GROUPS[group] if group else QuantizeConfig)[field]


def _arms(hint: Any) -> tuple[Any, ...]:
    """The types of a union hint (`int | None`: int, NoneType); others: none."""
    return typing.get_args(hint) if typing.get_origin(hint) is not Literal else ()


def key_defaults() -> dict[str, Any]:
    """{key: its default as written, before a method resolves the nulls}."""
    out = {}
    for key in KEYS:
        group, name = _place(key)
        fields = dataclasses.fields(GROUPS[group] if group else QuantizeConfig)
        f = next(f for f in fields if f.name == name)
        factory = f.default_factory
        out[key] = f.default if factory is dataclasses.MISSING else factory()
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """What `qnpu quantize` does (docs/config.md names every key). Method recipes:

    - rtn: static round-to-nearest, Max-Min everywhere, no rotation (ExecuTorch-like);
    - quarot: fixed randomized Hadamard R1/R2, then static Max-Min calibration;
    - spinquant: R1/R2 learned under dynamic per-token activations (weights RTN), then
      static Max-Min calibration of everything (the mismatch the paper points out);
    - quantnpu: sensitivity-guided mixed precision, stage 1 (rotations + input-activation and
      weight scales under static fake quantization, rotation-and-bit-width-aware init),
      stage 2 (static calibration of the rest).
    `weight_rounding: gptq` (any method; not in the paper) re-chooses the linear weights'
    integer codes with GPTQ on the scales stage 2 ends with. `smooth_mlp: α` (any method;
    MobileQuant's SmoothQuant-Edge) moves range from the unrotated down_proj input into
    down_proj's weight columns, fused offline into up_proj/down_proj before everything else.
    `down_out_mixed_precision: p` (any method; not in the paper) runs eq. (4)'s scan on the
    down_proj outputs of the final model (after stage 1, before stage 2) and moves the most
    sensitive p of them to 16 bits: the layers that write massive activations into the residual
    stream. `mlp_in_mixed_precision: p` (any method; not in the paper) runs the same scan on the
    gate/up input before stage 1, at its planned bits, and moves the most sensitive p of those
    layers to 16 bits (at W4A4 the costliest 4-bit tensor); `attn_out_mixed_precision: p` does
    the same for the o_proj input (the next one). `shadow_outliers: P` (any method;
    mllm-NPU) clips the down_proj input at the P-th percentile of its calibration values in the
    `shadow_keep` share of layers where outliers matter most and carries the channels that
    overflow on a shadow path (after stage 2).
    `muxq_exp: e` (any method; MUXQ) shifts the down_proj input's channels whose calibration
    |x| exceeds `muxq_threshold` right by e bits into the Body tensor and adds (2^e − 1)·Aux·W
    back (after stage 2). `residual_split: D` (any method; not in the papers) puts each
    residual add's output on two grids after stage 2's calibration: per layer, the channels
    whose calibration |x| exceeds 1/D of the layer's largest (Gemma 3's massive channels) hold
    x >> e, every other channel a grid from their own range; the adds and norms reading the
    stream shift them back (docs/artifact.md, "The residual split").
    - mobilequant (MobileQuant): no rotations; SmoothQuant-initialized equivalent scaling of
      every linear pair (`equalize`), learnable weight clipping and learned asymmetric
      activation ranges (all activations, `selective: false`), trained end to end in stage 1.
    `equalize: α` (any method) scales every linear pair (norm → q/k/v, norm → gate/up, v → o,
    up → down) by SmoothQuant's rule with strength α, in the rotated basis; stage 1 learns
    the factors where the recipe has one. `weight_clipping` (stage-1 methods): the linear
    weights' scales are clip factors sigmoid(γ) of each row's current range, learned in stage
    1 (OmniQuant's LWC: they follow the weights while rotations and scalings move them).
    `asymmetric_activations`: every activation but the softmax output gets a zero point;
    `asymmetric_weights`: every decoder linear weight row a zero point (the integer matmul
    subtracts z_w·Σx). Null `equalize`, `weight_clipping`, `asymmetric_activations`,
    `asymmetric_weights` and `selective` take the method's default (mobilequant: 0.5, true,
    true, true, false; the others: off, false, false, false, true).

    Built from flat keys with `QuantizeConfig.of(w_bits=4, ...)` or `from_dict`, changed
    with `config.replace(a_bits=4)`.
    """

    model: str = "smollm2-135m"
    method: Method = "quantnpu"
    bits: Bits = dataclasses.field(default_factory=Bits)
    promotions: Promotions = dataclasses.field(default_factory=Promotions)
    learn_down_in: bool = True  # §4.3.1's literal text; Appendix E argues for False
    init_scheme: InitScheme = "aware"  # quantnpu: rotation-and-bit-width-aware, or Max-Min
    scope: Scope = "full"  # "linears": only the linears' weights, inputs, outputs (Table 2)
    weights: Weights = dataclasses.field(default_factory=Weights)
    smooth_mlp: float | None = None  # α of up→down channel smoothing; None: off (the paper)
    outliers: Outliers = dataclasses.field(default_factory=Outliers)
    mobilequant: MobileQuantOptions = dataclasses.field(default_factory=MobileQuantOptions)
    prefix: str = "bos"  # sink prefix computed offline (PrefixQuant); "none": the paper
    # what the fake-quant forward computes between quantizers (stage 1, evaluation, GPTQ):
    # "device" the integer contract's softmax and RoPE tables; "fake" plain float32
    simulation: str = "device"
    seed: int = 0
    # one random source seeded apart from `seed` (None: `seed`): the Hadamard signs, the
    # calibration windows, stage 1's batches; for crossing the sources (docs/changelog.md)
    rotation_seed: int | None = None
    rotation_candidates: int = 1  # >1: R1/R2 from the best of that many by calibration loss
    calib_seed: int | None = None
    data_seed: int | None = None
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    stage1: Stage1Config = dataclasses.field(default_factory=Stage1Config)
    rules: tuple[QuantRule, ...] = ()
    # where it runs (`qnpu_jax.mesh`): {data, fsdp} axis sizes, null = automatic; a run may
    # resume on another mesh
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self) -> None:
        for name, group in GROUPS.items():  # the groups, then every key's type: the checks
            check_type(getattr(self, name), group, name)  # below compare values
        for key in KEYS:
            check_type(self.value(key), key_hint(key), key)
        for key, known in CHOICES.items():
            if self.value(key) not in known:
                raise QnpuError(
                    f"unknown {key} {shown(self.value(key))}; known: {', '.join(known)}"
                )
        defaults = method_spec(self.method).defaults
        unset = {k: v for k, v in defaults.items() if getattr(self.mobilequant, k) is None}
        object.__setattr__(self, "mobilequant", dataclasses.replace(self.mobilequant, **unset))
        for key, allowed in RANGES.items():
            value, hint = self.value(key), key_hint(key)
            if value is not None and not allowed.holds(value):
                null = "null or " if type(None) in _arms(hint) else ""
                noun = f"{allowed.noun} " if allowed.noun else ""
                says = allowed.says(int in (*_arms(hint), hint))
                why = f" ({allowed.why})" if allowed.why else ""
                raise QnpuError(f"{key} must be {null}{noun}{says}{why}, got {shown(value)}")
        why = "every window runs through every calibration pass"
        check_at_most(self.data.windows, MAX_CALIB_WINDOWS, "calib_windows", why)
        if self.weights.gptq_windows is not None:
            why = "every window runs through GPTQ's Hessian pass"
            check_at_most(self.weights.gptq_windows, MAX_CALIB_WINDOWS, "gptq_windows", why)
        try:  # the plan's own validation, with the config's names
            check_block_fields(self.weights.block, self.weights.block_scale_bits)
        except QnpuError as e:
            raise QnpuError(f"weight_block / weight_block_scale_bits: {e}") from e
        for broken, message in self._conflicts():
            if broken:
                raise QnpuError(message)

    def _conflicts(self) -> tuple[tuple[bool, str], ...]:
        """(whether it holds, what is wrong) of every combination of keys a config refuses."""
        m, o, w = self.mobilequant, self.outliers, self.weights
        blocked = w.block is not None or any(r.block for r in self.rules)
        return (
            (
                bool(m.weight_clipping) and self.method not in SCALE_LEARNING_METHODS,
                f"weight_clipping is learned with the static scales in stage 1, which method "
                f"{self.method} does not do (methods that do: "
                f"{', '.join(SCALE_LEARNING_METHODS)})",
            ),
            (
                m.equalize is not None and self.smooth_mlp is not None,
                "equalize scales the up→down pair that smooth_mlp fixes: choose one",
            ),
            (
                bool(m.asymmetric_activations) and o.muxq_exp is not None,
                "muxq_exp needs a symmetric down_proj input (asymmetric_activations)",
            ),
            (
                o.muxq_exp is not None and o.shadow_clip is not None,
                "shadow_outliers and muxq_exp both change down_in: choose one",
            ),
            (
                bool(m.asymmetric_activations) and o.residual_split is not None,
                "residual_split needs a symmetric residual stream (asymmetric_activations)",
            ),
            (
                blocked and w.rounding == "gptq",
                "weight_rounding gptq does not support per-block weights",
            ),
            (
                w.gptq_act_order and w.rounding != "gptq",
                "gptq_act_order orders GPTQ's columns: it needs weight_rounding gptq",
            ),
            (
                w.gptq_windows is not None and w.rounding != "gptq",
                "gptq_windows sets GPTQ's calibration: it needs weight_rounding gptq",
            ),
            (
                w.gptq_passes > 1 and w.rounding != "gptq",
                "gptq_passes repeats GPTQ: it needs weight_rounding gptq",
            ),
            (
                blocked and bool(m.asymmetric_weights),
                "asymmetric_weights: per-block weights are symmetric",
            ),
            (
                blocked and bool(m.weight_clipping),
                "weight_clipping learns per-row clip factors: not per-block weights",
            ),
            (
                self.rotation_candidates > 1 and self.method not in ROTATING_METHODS,
                f"rotation_candidates: method {self.method} has no rotations",
            ),
            (
                self.promotions.down_out > 0 and not m.selective,
                "down_out_mixed_precision needs selective: true (the scan runs after stage 1, "
                "which must not learn the down_proj output scales)",
            ),
        )

    def value(self, key: str) -> Any:
        """The value of the YAML key `key` (`KEYS`)."""
        group, field = _place(key)
        return getattr(getattr(self, group) if group else self, field)

    def flat(self) -> dict[str, Any]:
        """{key: value} of every YAML key, as Python values (what `of` takes)."""
        return {key: self.value(key) for key in KEYS}

    @classmethod
    def of(cls, **keys: Any) -> QuantizeConfig:
        """A config from YAML keys given as Python values (`stage1` a Stage1Config, `rules` a
        tuple of QuantRule), the others at their defaults."""
        unknown = sorted(set(keys) - set(KEYS))
        if unknown:
            raise QnpuError(f"unknown config key(s) {unknown}; known: {sorted(KEYS)}")
        own: dict[str, Any] = {}
        grouped: dict[str, dict[str, Any]] = {name: {} for name in GROUPS}
        for key, value in keys.items():
            group, field = _place(key)
            (grouped[group] if group else own)[field] = value
        return cls(**own, **{name: GROUPS[name](**kw) for name, kw in grouped.items()})

    def replace(self, **keys: Any) -> QuantizeConfig:
        """This config with the YAML keys `keys` changed, validated again (the method's
        defaults stay as resolved, as with `dataclasses.replace`)."""
        return self.of(**{**self.flat(), **keys})

    def source_seed(self, name: str) -> int:
        """The seed of one random source (`SOURCE_SEEDS`): its own, else `seed`."""
        value = getattr(self, name)
        return self.seed if value is None else int(value)

    def promoted(self) -> dict[str, float]:
        """{tensor: share} of the promotions the recipe runs (`Promotions`): those above 0, the
        down_proj input's only at 8 bits."""
        shares = dataclasses.asdict(self.promotions)
        return {
            tensor: share
            for tensor, share in shares.items()
            if share > 0 and (tensor != UNROTATED_INPUT or self.bits.down_in == 8)
        }

    def summary(self) -> dict[str, Any]:
        """What every report on a run repeats about it: method, bits, prefix, seq_len and the
        options beyond the paper (weight rounding, up→down smoothing, per-block weights)."""
        o, m, w = self.outliers, self.mobilequant, self.weights
        return {
            "method": self.method,
            "bits": self.bits.name,
            "prefix": self.prefix,
            "simulation": self.simulation,
            "seq_len": self.data.seq_len,
            "weight_rounding": w.rounding,
            "smooth_mlp": self.smooth_mlp,
            "weight_block": w.block,
            "weight_block_scale_bits": w.block_scale_bits,
            "shadow_outliers": o.shadow_clip,
            "shadow_keep": o.shadow_keep if o.shadow_clip is not None else None,
            "muxq_exp": o.muxq_exp,
            "muxq_threshold": o.muxq_threshold if o.muxq_exp is not None else None,
            "residual_split": o.residual_split,
            "equalize": m.equalize,
            "weight_clipping": m.weight_clipping,
            "asymmetric_activations": m.asymmetric_activations,
            "asymmetric_weights": m.asymmetric_weights,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizeConfig:
        """A config from its YAML mapping (`to_dict`'s form)."""
        if not isinstance(data, Mapping):
            raise QnpuError(f"a config must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise QnpuError(f"unknown config key(s) {unknown}; known: {sorted(KEYS)}")
        values = dict(data)
        if "stage1" in values:
            stage1 = values["stage1"]
            if not isinstance(stage1, Mapping):
                raise QnpuError("stage1 must be a mapping")
            s1_known = {f.name for f in dataclasses.fields(Stage1Config)}
            s1_unknown = sorted(set(stage1) - s1_known)
            if s1_unknown:
                raise QnpuError(f"unknown stage1 key(s) {s1_unknown}; known: {sorted(s1_known)}")
            values["stage1"] = Stage1Config(**stage1)
        if "mesh" in values:
            values["mesh"] = _mesh_config(values["mesh"])
        if "rules" in values:
            rules = values["rules"] or []
            r_known = {f.name for f in dataclasses.fields(QuantRule)}
            parsed = []
            for rule in rules:
                if not isinstance(rule, Mapping) or set(rule) - r_known:
                    raise QnpuError(
                        f"bad rule {shown(rule)}: a rule is a mapping with keys from "
                        f"{sorted(r_known)}"
                    )
                parsed.append(QuantRule(**rule))
            values["rules"] = tuple(parsed)
        if "eval_data" in values and isinstance(values["eval_data"], list):
            values["eval_data"] = tuple(values["eval_data"])
        return cls.of(**values)

    def to_dict(self) -> dict[str, Any]:
        """The config as its YAML mapping, every key in `KEYS` order."""
        out = self.flat()
        out["eval_data"] = list(self.eval.data)
        out["stage1"] = dataclasses.asdict(self.stage1)
        out["mesh"] = dataclasses.asdict(self.mesh)
        out["rules"] = [
            {
                k: list(v) if isinstance(v, tuple) else v
                for k, v in dataclasses.asdict(r).items()
                if v is not None and k != "axis"
            }
            | ({"axis": r.axis} if r.axis != -1 else {})
            for r in self.rules
        ]
        return out


def differing_keys(a: QuantizeConfig, b: QuantizeConfig) -> list[str]:
    """Where two configs differ, one "key: A -> B" a key (stage1.* and mesh.* keys by their
    dotted names; `rules` as a whole), in the configs' key order: what an error names when a
    config must equal another but for a few keys."""
    flat_a, flat_b = (traverse_util.flatten_dict(c.to_dict(), sep=".") for c in (a, b))
    return [
        f"{key}: {shown(flat_a.get(key))} -> {shown(flat_b.get(key))}"
        for key in [*flat_a, *(k for k in flat_b if k not in flat_a)]
        if flat_a.get(key) != flat_b.get(key)
    ]


# the keys whose value is one of a few names: the Literal ones, and two named elsewhere
CHOICES: dict[str, tuple[str, ...]] = {
    key: typing.get_args(key_hint(key))
    for key in KEYS
    if typing.get_origin(key_hint(key)) is Literal
} | {"prefix": SINK_PREFIXES, "simulation": SIMULATIONS}


def _mesh_config(value: Any) -> MeshConfig:
    """`mesh:` as a mapping {data, fsdp}, "DATAxFSDP", "auto" or null."""
    if value is None:
        return MeshConfig()
    if isinstance(value, str):
        return MeshConfig.parse(value)
    if not isinstance(value, Mapping):
        raise QnpuError(f"mesh must be a mapping {{data, fsdp}} or DATAxFSDP, got {shown(value)}")
    known = {f.name for f in dataclasses.fields(MeshConfig)}
    if set(value) - known:
        raise QnpuError(f"unknown mesh key(s) {sorted(set(value) - known)}; known: {sorted(known)}")
    return MeshConfig(**value)


SHIPPED_CONFIGS = "qnpu_jax.configs"  # the top-level configs/, installed as this package
_BITS = re.compile(r"w(\d+)a(\d+)(?:kv(\d+))?")


def shipped_configs() -> dict[str, Any]:
    """{name: resource} of the configs shipped inside the package (name = file stem)."""
    root = resources.files(SHIPPED_CONFIGS)
    if not root.is_dir():
        return {}
    return {
        entry.name.removesuffix(".yaml"): entry
        for entry in root.iterdir()
        if entry.name.endswith(".yaml")
    }


def _names_a_file(spec: str | Path) -> bool:
    """Whether a config spec (--config, `base:`) is a file that exists: a file, not a name."""
    path = Path(spec)
    return path.exists() and not path.is_dir()


def _shipped_name(spec: str | Path, configs: Mapping[str, Any]) -> str | None:
    """The shipped config among `configs` that `spec` names (NAME or NAME.yaml, no folder)."""
    name = str(spec).removesuffix(".yaml")
    return name if "/" not in str(spec) and name in configs else None


def shipped_variants(spec: str, model: str) -> list[str]:
    """The shipped configs that change the shipped config `spec` names (read as --config is:
    a file that exists is a file, and has none) for `model`: their `base` is that config and
    their `model` is `model` (gemma3-270m-quantnpu-w4a8 for smollm2-135m-quantnpu-w4a8 and
    gemma3-270m). `qnpu quantize --config NAME --model MODEL` names them."""
    configs = shipped_configs()
    name = None if _names_a_file(spec) else _shipped_name(spec, configs)
    if name is None:
        return []
    out = []
    for other in sorted(configs):
        try:
            data = _read_one_config(other, shipped=True)[1]
        except QnpuError:  # an edited installed copy: loading it by name says what is wrong
            continue
        if data.get(BASE_KEY) == name and data.get("model") == model:
            out.append(other)
    return out


def _expanded_size(data: Any, limit: int) -> int:
    """The size of `data` with every alias expanded (each value 1, a string its length too),
    counted only until it passes `limit`: an alias bomb is never walked whole."""
    size, stack = 0, [data]
    while stack and size <= limit:
        item = stack.pop()
        size += 1
        if isinstance(item, str | bytes):
            size += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set):
            stack.extend(item)
    return size


class _DuplicateKey(Exception):
    """A mapping of a config names one key twice (the message names it and both lines)."""


# a float as Python writes it, with an exponent or a point: YAML 1.1 reads 1e-3, 5E-4, 1e6 and
# -.5 as strings (its floats need a point, and a sign in the exponent)
_PYTHON_FLOAT = re.compile(
    r"^[-+]?(?=[0-9]*\.?[0-9])(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?$"
)


class _ConfigLoader(yaml.SafeLoader):
    """YAML's safe loader less two surprises: every float literal Python accepts is a float
    (inf and nan stay words, which the config's types refuse), and a mapping that names a
    key twice is refused instead of keeping the last."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue  # `<<` merges may be overridden, as YAML says
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in lines:
                raise _DuplicateKey(f"key {key!r} appears twice, on lines {lines[key]} and {line}")
            lines[key] = line
        return super().construct_mapping(node, deep)


_ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float", _PYTHON_FLOAT, list("-+.0123456789"))


def load_yaml(text: str, where: str) -> Any:
    """The YAML (or JSON) document `text` (`_ConfigLoader`: Python's float literals, no key
    twice); a document that its aliases expand past MAX_CONFIG_BYTES (`qnpu_jax.limits`: an
    alias bomb) is a QnpuError naming `where`."""
    try:
        data = yaml.load(text, Loader=_ConfigLoader)  # a SafeLoader
    except _DuplicateKey as e:
        raise QnpuError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise QnpuError(f"{where}: not YAML ({e})") from e
    if _expanded_size(data, MAX_CONFIG_BYTES) > MAX_CONFIG_BYTES:
        raise QnpuError(
            f"{where}: more than {MAX_CONFIG_BYTES} bytes of values once YAML aliases are "
            "expanded, the most a config may hold (qnpu_jax.limits)"
        )
    return data


BASE_KEY = "base"  # a config's key naming the config it changes (`read_config_data`)
MAX_BASE_DEPTH = 8
_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def _merged(base: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """`own`'s keys over `base`'s; `stage1` and `mesh` are merged key by key (a mesh given as
    "DATAxFSDP" counts as its mapping), any other value (a `rules` list too) replaces the
    base's."""
    out = dict(base)
    for key, value in own.items():
        below = out.get(key)
        if key == "mesh":
            below = _mesh_config(below).to_dict() if isinstance(below, str) else below
            value = _mesh_config(value).to_dict() if isinstance(value, str) else value
        if key in ("stage1", "mesh") and isinstance(below, Mapping) and isinstance(value, Mapping):
            out[key] = {**below, **value}
        else:
            out[key] = value
    return out


def _base_spec(base: Any, where: str, folder: Path | None) -> Path | str:
    """What `base: VALUE` of the config at `where` names: a YAML file (VALUE ends in .yaml,
    .yml or .json, or holds a "/") in the folder of the file that names it (`folder`; a
    shipped config, folder None, names shipped configs only), else a shipped config."""
    if not isinstance(base, str) or not base.strip():
        raise QnpuError(
            f"{where}: {BASE_KEY} must name a shipped config or a YAML file, got {shown(base)}"
        )
    shipped = shipped_configs()
    if base.endswith(_FILE_SUFFIXES) or "/" in base:
        path = None if folder is None else folder / base
        if path is None or not path.is_file():
            looked = "a shipped config names only shipped ones" if path is None else f"no {path}"
            hint = " (a shipped config is named without .yaml)" if base[:-5] in shipped else ""
            raise QnpuError(f"{where}: {BASE_KEY} {base!r}: {looked}{hint}")
        return path
    if base not in shipped:
        raise QnpuError(
            f"{where}: {BASE_KEY} {base!r} is not a shipped config (a file is named by its "
            f"path, ending in .yaml; shipped: {', '.join(sorted(shipped))})"
        )
    return base


def read_config_data(spec: str | Path) -> tuple[str, dict[str, Any]]:
    """(where, mapping) of a config: a YAML (or JSON) file of at most MAX_CONFIG_BYTES, or a
    shipped config's name. A config with `base: NAME|FILE` (`_base_spec`) is that config with
    its own keys over it (`_merged`), up to MAX_BASE_DEPTH configs deep, a cycle refused;
    `where` then names the chain ("a.yaml, on base shipped config NAME")."""
    return _resolved(_read_one_config(spec), ())


def _resolved(
    read: tuple[str, dict[str, Any], Path | None], chain: tuple[str, ...]
) -> tuple[str, dict[str, Any]]:
    where, data, folder = read
    seen = str(Path(where).resolve()) if folder is not None else where
    if seen in chain:
        cycle = " -> ".join((*chain[chain.index(seen) :], seen))
        raise QnpuError(f"{chain[0]}: its {BASE_KEY} keys form a cycle: {cycle}")
    if BASE_KEY not in data:
        return where, data
    if len(chain) + 1 >= MAX_BASE_DEPTH:
        raise QnpuError(f"{where}: more than {MAX_BASE_DEPTH} configs deep in {BASE_KEY} keys")
    base = _base_spec(data[BASE_KEY], where, folder)
    below_where, below = _resolved(_read_one_config(base, shipped=isinstance(base, str)),
                                   (*chain, seen))  # fmt: skip
    own = {k: v for k, v in data.items() if k != BASE_KEY}
    return f"{where}, on base {below_where}", _merged(below, own)


def _read_one_config(
    spec: str | Path, shipped: bool = False
) -> tuple[str, dict[str, Any], Path | None]:
    """(where, mapping, the file's folder or None for a shipped config) of one config, its
    `base` key unresolved; `shipped`: `spec` is a shipped config's name, never a file."""
    path = Path(spec)
    folder = None
    if not shipped and _names_a_file(spec):  # a FIFO or a device is refused
        where, text = str(path), read_text(path, what="config file", limit=MAX_CONFIG_BYTES)
        folder = path.parent
    else:
        configs = shipped_configs()
        name = _shipped_name(spec, configs)
        if name is None:
            raise QnpuError(
                f"config file not found: {spec} (nor a shipped config of that name; shipped: "
                f"{', '.join(sorted(configs))})"
            )
        where, text = f"shipped config {name}", configs[name].read_text()
    data = load_yaml(text, where)
    if data is None:
        raise QnpuError(
            f"{where}: the config file is empty (name at least the model and the method; "
            "`qnpu configs` lists complete examples)"
        )
    if not isinstance(data, dict):
        raise QnpuError(f"{where}: a config must be a mapping, got {type(data).__name__}")
    return where, data, folder


def parse_bits(text: str) -> dict[str, int]:
    """ "w4a8" / "W4A8KV8" -> {"w_bits": 4, "a_bits": 8[, "kv_bits": 8]}."""
    m = _BITS.fullmatch(text.strip().lower())
    if not m:
        raise QnpuError(f"bits {text!r}: expected wXaY or wXaYkvZ, e.g. w4a8 or w4a8kv8")
    out = {"w_bits": int(m.group(1)), "a_bits": int(m.group(2))}
    if m.group(3):
        out["kv_bits"] = int(m.group(3))
    return out


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`data` with each "KEY=VALUE" applied: VALUE is YAML, KEY may be dotted ("stage1.steps").
    Unknown keys are left for the config's own validation to name."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in data.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise QnpuError(f"--set {shown(item)}: expected KEY=VALUE (e.g. stage1.steps=120)")
        value = load_yaml(text, f"--set {shown(item)}")
        parts = key.strip().split(".")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] not in ("stage1", "mesh")):
            raise QnpuError(f"--set {shown(item)}: only stage1.KEY and mesh.KEY may be dotted")
        if len(parts) == 2:
            inner = out.get(parts[0]) or {}
            if isinstance(inner, str) and parts[0] == "mesh":
                inner = _mesh_config(inner).to_dict()
            if not isinstance(inner, Mapping):
                raise QnpuError(f"--set {shown(item)}: {parts[0]} is not a mapping")
            out[parts[0]] = {**inner, parts[1]: value}
        else:
            out[parts[0]] = value
    return out


def load_config(
    spec: str | Path | None,
    overrides: Sequence[str] = (),
    updates: Mapping[str, Any] | None = None,
) -> QuantizeConfig:
    """A config from a YAML (or JSON) file or a shipped config's name (None: the defaults),
    with `updates` (plain values) and then `--set` style `overrides` applied; errors name the
    source."""
    where, data = read_config_data(spec) if spec is not None else ("the default config", {})
    try:
        return QuantizeConfig.from_dict(apply_overrides({**data, **(updates or {})}, overrides))
    except (QnpuError, TypeError) as e:
        raise QnpuError(f"{where}: {e}") from e


def read_run_config(run: RunDir) -> QuantizeConfig:
    """The QuantizeConfig of the run in `run` (its config.yaml), read without loading the run."""
    return load_config(run.require_config())
