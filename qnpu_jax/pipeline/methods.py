"""The quantization methods: one `MethodSpec` each, the one place that names them.

Every table about the methods is derived from `METHODS`: the config's `method` choices, its
option defaults and refusals (`pipeline.config`), the key reference (`config_doc`), the plan
rules a method adds (`recipes.plan_rules`), the report's labels (`report.table`) and the
methods whose stage-1 flags a study keeps (`studies.compare_methods`). `recipes.RECIPES`
holds each method's recipe and is checked against `METHODS` at import (`check_recipes`). A
new method is one recipe function, one spec and one shipped YAML config (docs/pipeline.md,
"Adding a method")."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant.plan import INIT_METHODS

# the method names, for typing; checked below to be exactly `METHODS`' keys, in order
Method = Literal["rtn", "quarot", "spinquant", "quantnpu", "mobilequant"]

# The options any method may set (`config.MobileQuantOptions`, the YAML keys of the same
# names) and their value when neither the config nor the method's spec sets one: off.
METHOD_OFF: Mapping[str, Any] = MappingProxyType(
    {
        "equalize": None,
        "weight_clipping": False,
        "asymmetric_activations": False,
        "asymmetric_weights": False,
        "selective": True,
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MethodSpec:
    """What the code knows about one method besides its recipe (`recipes.RECIPES`)."""

    name: Method  # the config's `method`
    label: str  # its name in reports and tables
    rotates: bool = False  # the recipe starts from fused norms and Hadamard R1/R2
    has_stage1: bool = False  # the recipe runs stage 1 (the `stage1:` keys matter)
    learns_scales: bool = False  # stage 1 learns static scales (and so weight clipping)
    aware_init: bool = False  # `init_scheme: aware` adds the rotation-and-bit-aware init rules
    weight_init: str | None = None  # the linear weights' initializer in the plan (None: plan's)
    # the options (`METHOD_OFF`'s keys) this method sets otherwise when a config leaves them null
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.options) - set(METHOD_OFF))
        if unknown:
            raise ValueError(
                f"method {self.name}: unknown option(s) {unknown}; known: {', '.join(METHOD_OFF)}"
            )
        if self.learns_scales and not self.has_stage1:
            raise ValueError(f"method {self.name}: learns_scales needs has_stage1")
        if self.weight_init is not None and self.weight_init not in INIT_METHODS:
            raise ValueError(f"method {self.name}: unknown weight_init {self.weight_init!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def defaults(self) -> dict[str, Any]:
        """{option: value} a config's null options take under this method."""
        return {**METHOD_OFF, **self.options}


# static round-to-nearest, Max-Min everywhere, no rotation (ExecuTorch-like)
RTN = MethodSpec(name="rtn", label="RTN")
# fixed randomized Hadamard R1/R2, then static Max-Min calibration
QUAROT = MethodSpec(name="quarot", label="QuaRot", rotates=True)
# R1/R2 learned under dynamic per-token activations, then static Max-Min calibration
SPINQUANT = MethodSpec(name="spinquant", label="SpinQuant", rotates=True, has_stage1=True)
# the paper: stage 1 learns rotations and static scales from the aware initialization
QUANTNPU = MethodSpec(
    name="quantnpu",
    label="Quant.npu",
    rotates=True,
    has_stage1=True,
    learns_scales=True,
    aware_init=True,
)
# no rotations; equivalent scaling, clip factors and asymmetric ranges learned end to end in
# stage 1 (learned clipping starts from the MSE-best clip)
MOBILEQUANT = MethodSpec(
    name="mobilequant",
    label="MobileQuant",
    has_stage1=True,
    learns_scales=True,
    weight_init="mse",
    options={
        "equalize": 0.5,
        "weight_clipping": True,
        "asymmetric_activations": True,
        "asymmetric_weights": True,
        "selective": False,
    },
)
_SPECS = (RTN, QUAROT, SPINQUANT, QUANTNPU, MOBILEQUANT)
# {name: spec}, in the order configs, docs and errors list the methods
METHODS: Mapping[str, MethodSpec] = MappingProxyType({s.name: s for s in _SPECS})

# derived tables
METHOD_NAMES: tuple[Method, ...] = tuple(s.name for s in _SPECS)
ROTATING_METHODS: tuple[Method, ...] = tuple(s.name for s in _SPECS if s.rotates)
STAGE1_METHODS: tuple[Method, ...] = tuple(s.name for s in _SPECS if s.has_stage1)
SCALE_LEARNING_METHODS: tuple[Method, ...] = tuple(s.name for s in _SPECS if s.learns_scales)
METHOD_LABELS: Mapping[str, str] = MappingProxyType({s.name: s.label for s in _SPECS})


def method_spec(method: str) -> MethodSpec:
    """The spec of a method; a name without one is a QnpuError naming the known methods."""
    spec = METHODS.get(method)
    if spec is None:
        raise QnpuError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    return spec


def _check_table(keys: Mapping[Any, object] | tuple[Any, ...], who: str, what: str) -> None:
    """Refuse a table about the methods unless its keys are exactly `METHODS`' names."""
    names = list(METHODS)
    missing = [m for m in names if m not in keys]
    unknown = sorted(repr(k) for k in keys if k not in METHODS)
    problems = [
        f"{label}: {', '.join(items)}"
        for label, items in (
            (f"methods without {what}", missing),
            ("names without a method spec (qnpu_jax.pipeline.methods)", unknown),
        )
        if items
    ]
    if problems:
        raise ValueError(f"{who}: {'; '.join(problems)}")


def check_recipes(table: Mapping[Any, object], who: str = "recipes.RECIPES") -> None:
    """Refuse a recipe table unless it has one recipe for each method spec and no other (run at
    import, as `ir.graph.check_handlers` checks the op tables: a new method fails loudly)."""
    _check_table(table, who, "a recipe")


_check_table(typing.get_args(Method), "methods.Method", "a name in the Method literal")
if typing.get_args(Method) != METHOD_NAMES:
    raise ValueError("methods.Method: list the methods in METHODS' order")
