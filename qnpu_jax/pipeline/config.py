"""The `qnpu quantize` run configuration: one frozen dataclass, validated on construction.

A YAML file maps onto it key for key; nested `stage1:` maps onto `Stage1Config`, `rules:` is a
list of `QuantRule` fields applied after the method's defaults. Unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from qnpu_jax.errors import QnpuError, shown
from qnpu_jax.fieldtypes import check_field_types
from qnpu_jax.files import read_text
from qnpu_jax.ir.graph import MUXQ_MAX_EXP, SIMULATIONS
from qnpu_jax.limits import MAX_CALIB_WINDOWS, MAX_CONFIG_BYTES, check_seed
from qnpu_jax.mesh import MeshConfig
from qnpu_jax.models.taps import SINK_PREFIXES
from qnpu_jax.pipeline.stage1 import Stage1Config
from qnpu_jax.quant.plan import QuantRule, check_block_fields

METHODS = ("rtn", "quarot", "spinquant", "quantnpu", "mobilequant")
# methods whose stage 1 learns static scales (and with them weight clipping)
SCALE_LEARNING_METHODS = ("quantnpu", "mobilequant")
ROTATING_METHODS = ("quarot", "spinquant", "quantnpu")  # their recipes start from Hadamard R1/R2
# mobilequant's defaults of the options left null (other methods: off)
MOBILEQUANT_DEFAULTS = {
    "equalize": 0.5,
    "weight_clipping": True,
    "asymmetric_activations": True,
    "asymmetric_weights": True,
    "selective": False,
}
METHOD_OFF = {
    "equalize": None,
    "weight_clipping": False,
    "asymmetric_activations": False,
    "asymmetric_weights": False,
    "selective": True,
}
INIT_SCHEMES = ("aware", "max_min")
SCOPES = ("full", "linears")
WEIGHT_ROUNDINGS = ("rtn", "gptq")
# The random sources a run draws from, each seeded by `seed` unless its own key is set.
SOURCE_SEEDS = ("rotation_seed", "calib_seed", "data_seed")


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """What `qnpu quantize` does. Method recipes:

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
    back (after stage 2).
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
    """

    model: str = "smollm2-135m"
    method: str = "quantnpu"
    w_bits: int = 4
    a_bits: int = 8
    kv_bits: int = 8
    down_in_bits: int = 8  # base precision of the down_proj inputs (16: the paper's Table 1)
    mixed_precision: float = 0.10  # share of down_proj inputs promoted to 16 bits
    down_out_mixed_precision: float = 0.0  # share of down_proj outputs promoted (not the paper)
    mlp_in_mixed_precision: float = 0.0  # share of gate/up inputs promoted (not the paper)
    attn_out_mixed_precision: float = 0.0  # share of o_proj inputs promoted (not the paper)
    learn_down_in: bool = True  # §4.3.1's literal text; Appendix E argues for False
    init_scheme: str = "aware"  # quantnpu: rotation-and-bit-width-aware, or Max-Min everywhere
    selective: bool | None = None  # False: linear outputs and K/V are learned in stage 1 too
    scope: str = "full"  # "linears": only the linears' weights, inputs, outputs (Table 2)
    weight_rounding: str = "rtn"  # "gptq": GPTQ codes on the same grid after stage 2
    gptq_damp: float = 0.01  # GPTQ's dampening, a share of the Hessian's mean diagonal
    smooth_mlp: float | None = None  # α of up→down channel smoothing; None: off (the paper)
    # the decoder linears' weights per block of inputs (16..256; None: per channel), and with
    # weight_block_scale_bits the block scales in AIMET's LPBQ form (integer · per-channel)
    weight_block: int | None = None
    weight_block_scale_bits: int | None = None
    shadow_outliers: float | None = None  # clip percentile of down_in's shadow path; None: off
    shadow_keep: float = 0.15  # share of layers that keep a shadow path (mllm-NPU: 15%)
    muxq_exp: int | None = None  # MUXQ's shift of down_in's outlier channels; None: off
    muxq_threshold: float = 6.0  # |x| above which a channel is an outlier (LLM.int8's 6)
    equalize: float | None = None  # SmoothQuant α initializing every pair's equivalent scales
    weight_clipping: bool | None = None  # learnable weight clipping in stage 1 (OmniQuant LWC)
    asymmetric_activations: bool | None = None  # zero points on every activation
    asymmetric_weights: bool | None = None  # a zero point per linear weight row
    prefix: str = "bos"  # sink prefix computed offline (PrefixQuant); "none": the paper
    # what the fake-quant forward computes between quantizers (stage 1, evaluation, GPTQ):
    # "device" the integer contract's softmax and RoPE tables; "fake" plain float32
    simulation: str = "device"
    seed: int = 0
    # one random source seeded apart from `seed` (None: `seed`): the Hadamard signs, the
    # calibration windows, stage 1's batches; for crossing the sources (docs/results.md)
    rotation_seed: int | None = None
    rotation_candidates: int = 1  # >1: R1/R2 from the best of that many by calibration loss
    calib_seed: int | None = None
    data_seed: int | None = None
    calib_data: str = "wiki"  # the `wiki` calib split, or a user's calibration text
    seq_len: int = 512
    calib_windows: int = 16  # stage 2 calibration and the sensitivity scan
    eval_data: tuple[str, ...] = ("wiki",)
    eval_windows: int | None = 64  # cap per evaluation set (None: every window)
    stage1: Stage1Config = dataclasses.field(default_factory=Stage1Config)
    rules: tuple[QuantRule, ...] = ()
    # where it runs (`qnpu_jax.mesh`): {data, fsdp} axis sizes, null = automatic; a run may
    # resume on another mesh
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    def __post_init__(self) -> None:
        check_field_types(self)  # every key's type first: the checks below compare values
        if self.method not in METHODS:
            raise QnpuError(f"unknown method {shown(self.method)}; known: {', '.join(METHODS)}")
        defaults = MOBILEQUANT_DEFAULTS if self.method == "mobilequant" else METHOD_OFF
        for name, default in defaults.items():
            if getattr(self, name) is None:  # null: the method's default, recorded as such
                object.__setattr__(self, name, default)
        if self.equalize is not None and (
            isinstance(self.equalize, bool)
            or not isinstance(self.equalize, int | float)
            or not 0 < self.equalize < 1
        ):
            raise QnpuError(f"equalize must be null or in (0, 1), got {shown(self.equalize)}")
        for name in ("weight_clipping", "asymmetric_activations", "asymmetric_weights"):
            if not isinstance(getattr(self, name), bool):
                raise QnpuError(
                    f"{name} must be true, false or null, got {shown(getattr(self, name))}"
                )
        if self.weight_clipping and self.method not in SCALE_LEARNING_METHODS:
            raise QnpuError(
                f"weight_clipping is learned with the static scales in stage 1, which method "
                f"{self.method} does not do (methods that do: {', '.join(SCALE_LEARNING_METHODS)})"
            )
        if self.equalize is not None and self.smooth_mlp is not None:
            raise QnpuError("equalize scales the up→down pair that smooth_mlp fixes: choose one")
        if self.asymmetric_activations and self.muxq_exp is not None:
            raise QnpuError("muxq_exp needs a symmetric down_proj input (asymmetric_activations)")
        if self.init_scheme not in INIT_SCHEMES:
            raise QnpuError(f"unknown init_scheme {shown(self.init_scheme)}; known: {INIT_SCHEMES}")
        if self.scope not in SCOPES:
            raise QnpuError(f"unknown scope {shown(self.scope)}; known: {SCOPES}")
        if self.weight_rounding not in WEIGHT_ROUNDINGS:
            raise QnpuError(
                f"unknown weight_rounding {shown(self.weight_rounding)}; known: {WEIGHT_ROUNDINGS}"
            )
        if not isinstance(self.gptq_damp, int | float) or not 0 < self.gptq_damp < 1:
            raise QnpuError(f"gptq_damp must be in (0, 1), got {shown(self.gptq_damp)}")
        if self.smooth_mlp is not None and (
            isinstance(self.smooth_mlp, bool)
            or not isinstance(self.smooth_mlp, int | float)
            or not 0 < self.smooth_mlp < 1
        ):
            raise QnpuError(f"smooth_mlp must be null or in (0, 1), got {shown(self.smooth_mlp)}")
        if self.shadow_outliers is not None and (
            isinstance(self.shadow_outliers, bool)
            or not isinstance(self.shadow_outliers, int | float)
            or not 0 < self.shadow_outliers <= 100
        ):
            raise QnpuError(
                f"shadow_outliers must be null or a percentile in (0, 100], got "
                f"{shown(self.shadow_outliers)}"
            )
        if (
            isinstance(self.shadow_keep, bool)
            or not isinstance(self.shadow_keep, int | float)
            or not 0 < self.shadow_keep <= 1
        ):
            raise QnpuError(f"shadow_keep must be in (0, 1], got {shown(self.shadow_keep)}")
        if self.muxq_exp is not None and (
            isinstance(self.muxq_exp, bool)
            or not isinstance(self.muxq_exp, int)
            or not 1 <= self.muxq_exp <= MUXQ_MAX_EXP
        ):
            raise QnpuError(
                f"muxq_exp must be null or in 1..{MUXQ_MAX_EXP}, got {shown(self.muxq_exp)}"
            )
        if (
            isinstance(self.muxq_threshold, bool)
            or not isinstance(self.muxq_threshold, int | float)
            or not self.muxq_threshold > 0
        ):
            raise QnpuError(f"muxq_threshold must be positive, got {shown(self.muxq_threshold)}")
        if self.muxq_exp is not None and self.shadow_outliers is not None:
            raise QnpuError("shadow_outliers and muxq_exp both change down_in: choose one")
        for name in ("learn_down_in", "selective"):
            if not isinstance(getattr(self, name), bool):
                raise QnpuError(f"{name} must be true or false, got {shown(getattr(self, name))}")
        try:  # the plan's own validation, with the config's names
            check_block_fields(self.weight_block, self.weight_block_scale_bits)
        except QnpuError as e:
            raise QnpuError(f"weight_block / weight_block_scale_bits: {e}") from e
        blocked = self.weight_block is not None or any(r.block for r in self.rules)
        if blocked and self.weight_rounding == "gptq":
            raise QnpuError("weight_rounding gptq does not support per-block weights")
        if blocked and self.asymmetric_weights:
            raise QnpuError("asymmetric_weights: per-block weights are symmetric")
        if blocked and self.weight_clipping:
            raise QnpuError("weight_clipping learns per-row clip factors: not per-block weights")
        if self.prefix not in SINK_PREFIXES:
            raise QnpuError(
                f"unknown prefix {shown(self.prefix)}; known: {', '.join(SINK_PREFIXES)}"
            )
        if self.simulation not in SIMULATIONS:
            raise QnpuError(
                f"unknown simulation {shown(self.simulation)}; known: {', '.join(SIMULATIONS)}"
            )
        for name in ("w_bits", "a_bits", "kv_bits", "down_in_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= 16:
                raise QnpuError(f"{name} must be an integer in [2, 16], got {shown(value)}")
        if self.down_in_bits < 8:
            raise QnpuError("down_in_bits: the unrotated down_proj input is never below 8 bits")
        check_seed(self.seed)
        for name in SOURCE_SEEDS:
            if getattr(self, name) is not None:
                check_seed(getattr(self, name), name)
        value = self.rotation_candidates
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
            raise QnpuError(
                f"rotation_candidates must be an integer in [1, 64], got {shown(value)}"
            )
        if value > 1 and self.method not in ROTATING_METHODS:
            raise QnpuError(f"rotation_candidates: method {self.method} has no rotations")
        for name in ("seq_len", "calib_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise QnpuError(f"{name} must be a non-negative integer, got {shown(value)}")
        if self.seq_len < 2 or self.calib_windows < 1:
            raise QnpuError("seq_len must be >= 2 and calib_windows >= 1")
        if self.calib_windows > MAX_CALIB_WINDOWS:
            raise QnpuError(
                f"calib_windows must be at most {MAX_CALIB_WINDOWS}, got {self.calib_windows} "
                "(every window runs through every calibration pass)"
            )
        for name in (
            "mixed_precision",
            "down_out_mixed_precision",
            "mlp_in_mixed_precision",
            "attn_out_mixed_precision",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
                raise QnpuError(f"{name} must be in [0, 1], got {shown(value)}")
        if self.down_out_mixed_precision > 0 and not self.selective:
            raise QnpuError(
                "down_out_mixed_precision needs selective: true (the scan runs after stage 1, "
                "which must not learn the down_proj output scales)"
            )
        if self.eval_windows is not None and (
            isinstance(self.eval_windows, bool)
            or not isinstance(self.eval_windows, int)
            or self.eval_windows < 1
        ):
            raise QnpuError(
                f"eval_windows must be a positive integer or null, got {shown(self.eval_windows)}"
            )
        if not isinstance(self.eval_data, tuple) or not all(
            isinstance(d, str) for d in self.eval_data
        ):
            raise QnpuError(f"eval_data must be a list of data specs, got {shown(self.eval_data)}")
        if not isinstance(self.stage1, Stage1Config):
            raise QnpuError("stage1 must be a Stage1Config")
        if not isinstance(self.mesh, MeshConfig):
            raise QnpuError("mesh must be a MeshConfig")

    def source_seed(self, name: str) -> int:
        """The seed of one random source (`SOURCE_SEEDS`): its own, else `seed`."""
        value = getattr(self, name)
        return self.seed if value is None else int(value)

    @property
    def bits_name(self) -> str:
        """ "W4A8KV8"."""
        return f"W{self.w_bits}A{self.a_bits}KV{self.kv_bits}"

    def summary(self) -> dict[str, Any]:
        """What every report on a run repeats about it: method, bits, prefix, seq_len and the
        options beyond the paper (weight rounding, up→down smoothing, per-block weights)."""
        return {
            "method": self.method,
            "bits": self.bits_name,
            "prefix": self.prefix,
            "simulation": self.simulation,
            "seq_len": self.seq_len,
            "weight_rounding": self.weight_rounding,
            "smooth_mlp": self.smooth_mlp,
            "weight_block": self.weight_block,
            "weight_block_scale_bits": self.weight_block_scale_bits,
            "shadow_outliers": self.shadow_outliers,
            "shadow_keep": self.shadow_keep if self.shadow_outliers is not None else None,
            "muxq_exp": self.muxq_exp,
            "muxq_threshold": self.muxq_threshold if self.muxq_exp is not None else None,
            "equalize": self.equalize,
            "weight_clipping": self.weight_clipping,
            "asymmetric_activations": self.asymmetric_activations,
            "asymmetric_weights": self.asymmetric_weights,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizeConfig:
        if not isinstance(data, Mapping):
            raise QnpuError(f"a config must be a mapping, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise QnpuError(f"unknown config key(s) {unknown}; known: {sorted(known)}")
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
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["eval_data"] = list(self.eval_data)
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


def load_yaml(text: str, where: str) -> Any:
    """`yaml.safe_load(text)` (YAML or JSON); a document that its aliases expand past
    MAX_CONFIG_BYTES (`qnpu_jax.limits`: an alias bomb) is a QnpuError naming `where`."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise QnpuError(f"{where}: not YAML ({e})") from e
    if _expanded_size(data, MAX_CONFIG_BYTES) > MAX_CONFIG_BYTES:
        raise QnpuError(
            f"{where}: more than {MAX_CONFIG_BYTES} bytes of values once YAML aliases are "
            "expanded, the most a config may hold (qnpu_jax.limits)"
        )
    return data


def read_config_data(spec: str | Path) -> tuple[str, dict[str, Any]]:
    """(where, mapping) of a config: a YAML (or JSON) file of at most MAX_CONFIG_BYTES, or a
    shipped config's name."""
    path = Path(spec)
    if path.exists() and not path.is_dir():  # a FIFO or a device is refused, never read
        where, text = str(path), read_text(path, what="config file", limit=MAX_CONFIG_BYTES)
    else:
        shipped = shipped_configs()
        name = str(spec).removesuffix(".yaml")
        if "/" in str(spec) or name not in shipped:
            raise QnpuError(
                f"config file not found: {spec} (nor a shipped config of that name; shipped: "
                f"{', '.join(sorted(shipped))})"
            )
        where, text = f"shipped config {name}", shipped[name].read_text()
    data = load_yaml(text, where)
    if data is None:
        raise QnpuError(
            f"{where}: the config file is empty (name at least the model and the method; "
            "`qnpu configs` lists complete examples)"
        )
    if not isinstance(data, dict):
        raise QnpuError(f"{where}: a config must be a mapping, got {type(data).__name__}")
    return where, data


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
