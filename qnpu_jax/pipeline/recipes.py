"""Recipes: methods as chains of steps, in the spirit of `optax.chain`.

    recipe = chain(fuse_norms(), hadamard_rotations(key), plan(w_bits=4, a_bits=8),
                   calibrate(), gptq())
    model = recipe(QuantizedModel.from_float(...), calibration)

`rtn`, `quarot`, `spinquant`, `quantnpu` and `mobilequant` build the shipped methods from a
`QuantizeConfig` (`for_config` picks by `config.method`); `qnpu quantize` runs them, timed and
resumable. `RECIPES` holds one per method spec (`pipeline.methods.METHODS`), checked at import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    GLOBAL_ACTS,
    LAYER_ACTS,
    LINEAR_OUTPUTS,
    PROBS,
    ROTATED_INPUTS,
    UNROTATED_INPUT,
    UNROTATED_OUTPUT,
    Graph,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import GRAPH, graph_of
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.methods import SCALE_LEARNING_METHODS, check_recipes, method_spec
from qnpu_jax.pipeline.quantized_model import QuantizedModel
from qnpu_jax.pipeline.steps import (
    ANY_GRAPH_STEPS,
    STAGE1_TENSORS,
    Calibration,
    Context,
    Step,
    calibrate,
    choose_rotation,
    equalize,
    fuse_norms,
    gptq,
    hadamard_rotations,
    muxq,
    plan,
    promote,
    shadow_outliers,
    smooth_mlp,
    split_residual,
    stage1,
    stage1_plan,
)
from qnpu_jax.quant.plan import WEIGHTS, QuantPlan, QuantRule, default_plan


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """Steps applied in order. `on_step(index, step)` is told before each one runs."""

    steps: tuple[Step, ...]

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)

    def check_graph(self, cfg: ModelConfig) -> None:
        """Refuse, before anything runs, a step that reads LLaMA's graph on a model of another
        graph (each such step refuses too, but only once the model is loaded)."""
        if graph_of(cfg) is GRAPH:
            return
        names = list(dict.fromkeys(s.name for s in self.steps if s.name not in ANY_GRAPH_STEPS))
        if names:
            steps = ", ".join(names)
            generic = ", ".join(sorted(ANY_GRAPH_STEPS))
            raise QnpuError(
                f"steps {steps} are not supported for {cfg.architecture} yet: a recipe on its "
                f"graph runs {generic} only (--method rtn)"
            )

    def __call__(
        self,
        model: QuantizedModel,
        data: Calibration,
        context: Context | None = None,
        *,
        on_step: Callable[[int, Step], None] | None = None,
    ) -> QuantizedModel:
        for i, step in enumerate(self.steps):
            if on_step is not None:
                on_step(i, step)
            model = step(model, data, context)
        return model


def chain(*steps: Step | Recipe) -> Recipe:
    """One recipe of `steps` (recipes among them are spliced in)."""
    flat: list[Step] = []
    for s in steps:
        if isinstance(s, Recipe):
            flat += s.steps
        elif isinstance(s, Step):
            flat.append(s)
        else:
            raise QnpuError(f"chain takes steps and recipes, got {type(s).__name__}")
    return Recipe(tuple(flat))


def run_keys(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(calibration windows, start rotations, stage-1 data) keys of a run with `seed`."""
    calib_key, rotation_key, data_key = jax.random.split(jax.random.key(seed), 3)
    return calib_key, rotation_key, data_key


def config_keys(config: QuantizeConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`run_keys` of a config, each source from its own seed (`QuantizeConfig.source_seed`):
    with none set, `run_keys(config.seed)`."""
    return (
        run_keys(config.source_seed("calib_seed"))[0],
        run_keys(config.source_seed("rotation_seed"))[1],
        run_keys(config.source_seed("data_seed"))[2],
    )


def rotation_keys(config: QuantizeConfig) -> list[jax.Array]:
    """The `rotation_candidates` keys a config chooses its R1/R2 from: the run's own rotation
    key first, so one candidate is the run without the choice."""
    own = config_keys(config)[1]
    n = config.rotation_candidates
    others = list(jax.random.split(jax.random.fold_in(own, 1), n - 1)) if n > 1 else []
    return [own, *others]


def _rotation_score(config: QuantizeConfig) -> list[Step]:
    """What a rotation candidate is judged on: the model stage 1 would start from (the
    equivalent transforms, the plan with its initializers, a static calibration), without the
    sensitivity scans."""
    return [*_start(config), calibrate()]


def aware_init(bits: int) -> str:
    """The rotation-and-bit-width-aware initializer of a rotated input or a weight at `bits`."""
    return "mean_std" if bits <= 4 else "max_min"


def init_rules(w_bits: int, a_bits: int) -> list[QuantRule]:
    """Rotation-and-bit-width-aware initialization (§4.2, Tables 4–6): mean ± 3σ for rotated
    activations and per-channel weights at 4 bits, Max-Min at 8 bits and for every unrotated
    tensor (down_proj input, linear outputs, K/V, ...)."""
    return [
        QuantRule(pattern=f"layers/({'|'.join(ROTATED_INPUTS)})", init=aware_init(a_bits)),
        QuantRule(pattern=f"layers/({'|'.join(WEIGHTS)})", init=aware_init(w_bits)),
    ]


def with_aware_init(rules: Sequence[QuantRule]) -> list[QuantRule]:
    """`rules`, each that sets the bits of rotated inputs or weights without an init of its own
    followed by the aware init for those bits: down_proj's weights at 8 bits in a W4 plan
    start from Max-Min, not from the 4-bit mean ± 3σ clip (on Gemma 3 that clip, kept by stage
    1, cost more than its 4-bit weights: docs/results.md, "down_proj's 8-bit weights on a
    4-bit clip").
    Per-layer bits keep the plan's init."""
    out: list[QuantRule] = []
    for rule in rules:
        out.append(rule)
        if rule.bits is None or rule.init is not None:
            continue
        names = [n for n in (*ROTATED_INPUTS, *WEIGHTS) if rule.matches(f"layers/{n}")]
        if names:
            out.append(QuantRule(pattern=f"layers/({'|'.join(names)})", init=aware_init(rule.bits)))
    return out


def plan_rules(config: QuantizeConfig) -> list[QuantRule]:
    """The rules of a config's plan: scope, the method's initializers, then the user's."""
    rules: list[QuantRule] = []
    if config.scope == "linears":  # Table 2: the linears' weights, inputs and outputs only
        keep = "|".join((*STAGE1_TENSORS, *LINEAR_OUTPUTS))
        rules.append(QuantRule(pattern=f"(?!layers/({keep})$).*", quantize=False))
    spec = method_spec(config.method)
    aware = spec.aware_init and config.init_scheme == "aware"
    if aware:
        rules += init_rules(config.bits.w, config.bits.a)
    if spec.weight_init is not None:  # mobilequant: learned clipping starts from the MSE clip
        rules.append(QuantRule(pattern=f"layers/({'|'.join(WEIGHTS)})", init=spec.weight_init))
    if config.mobilequant.asymmetric_weights:  # MobileQuant's main setting (Table 7: symmetric)
        rules.append(QuantRule(pattern=f"layers/({'|'.join(WEIGHTS)})", symmetric=False))
    if config.mobilequant.asymmetric_activations:  # MobileQuant's ARL: a learned offset
        layer = "|".join(a for a in LAYER_ACTS if a != PROBS)
        rules.append(
            QuantRule(pattern=f"layers/({layer})|{'|'.join(GLOBAL_ACTS)}", symmetric=False)
        )
    if config.weights.block is not None:
        rules.append(
            QuantRule(
                pattern=f"layers/({'|'.join(WEIGHTS)})",
                block=config.weights.block,
                block_scale_bits=config.weights.block_scale_bits,
            )
        )
    return rules + (with_aware_init(config.rules) if aware else list(config.rules))


def plan_options(config: QuantizeConfig) -> dict[str, Any]:
    """The bit-widths and rules a config's plan is built from (`default_plan`'s options)."""
    return {
        "w_bits": config.bits.w,
        "a_bits": config.bits.a,
        "kv_bits": config.bits.kv,
        "down_in_bits": config.bits.down_in,
        "rules": plan_rules(config),
        "simulation": config.simulation,
    }


def _start(config: QuantizeConfig) -> list[Step]:
    """The steps between the rotations and the scans: smoothing, equalization, the plan."""
    steps = [smooth_mlp(config.smooth_mlp)] if config.smooth_mlp is not None else []
    if config.mobilequant.equalize is not None:
        steps.append(equalize(config.mobilequant.equalize))
    return [*steps, plan(**plan_options(config))]


# promotions scanned on the final model, after stage 1 (a stage-2 tensor); the others before it
PROMOTED_AFTER_STAGE1 = (UNROTATED_OUTPUT,)


def _before_stage1(config: QuantizeConfig, rotated: bool) -> list[Step]:
    steps: list[Step] = []
    if rotated:
        keys = rotation_keys(config)
        rotations = (
            choose_rotation(keys, _rotation_score(config))
            if len(keys) > 1
            else hadamard_rotations(keys[0])
        )
        steps += [fuse_norms(), rotations]
    steps += _start(config)
    promoted = config.promoted().items()
    return steps + [promote(t, share) for t, share in promoted if t not in PROMOTED_AFTER_STAGE1]


def outlier_steps(config: QuantizeConfig) -> list[Step]:
    """The down_proj input's outlier mechanism of `config` (mllm-NPU's shadow outliers or
    MUXQ): steps on a calibrated model."""
    o = config.outliers
    if o.shadow_clip is not None:
        return [shadow_outliers(UNROTATED_INPUT, o.shadow_clip, o.shadow_keep)]
    if o.muxq_exp is not None:
        return [muxq(UNROTATED_INPUT, o.muxq_exp, o.muxq_threshold)]
    return []


def after_stage1(config: QuantizeConfig) -> list[Step]:
    """Everything after stage 1: the down_proj output promotion (scanned on the final model),
    stage 2's calibration, the residual split, GPTQ, then the down_proj input's outlier step."""
    promoted = config.promoted().items()
    steps = [promote(t, share) for t, share in promoted if t in PROMOTED_AFTER_STAGE1]
    steps.append(calibrate())
    if config.outliers.residual_split is not None:  # before GPTQ: its Hessians see the grid
        steps.append(split_residual(config.outliers.residual_split))
    if config.weights.rounding == "gptq":
        steps.append(gptq_step(config))
    return steps + outlier_steps(config)


def gptq_key(config: QuantizeConfig) -> jax.Array | None:
    """The key that draws GPTQ's windows beyond the calibration's (the calibration key folded
    with 1); None where `gptq_windows` is unset (the calibration windows alone)."""
    if config.weights.gptq_windows is None:
        return None
    return jax.random.fold_in(config_keys(config)[0], 1)


def gptq_windows_of(config: QuantizeConfig, data: Calibration) -> np.ndarray:
    """The windows GPTQ's Hessians are taken over under `config`, from its calibration."""
    key, count = gptq_key(config), config.weights.gptq_windows
    if key is None or count is None:
        return np.asarray(data.windows)
    return data.first_windows(count, key)


def gptq_step(config: QuantizeConfig) -> Step:
    """GPTQ as `config` asks (its dampening, column order, windows (`gptq_windows_of`) and
    passes)."""
    w = config.weights
    key = gptq_key(config)
    return gptq(
        w.gptq_damp,
        act_order=w.gptq_act_order,
        windows=w.gptq_windows,
        key=key,
        passes=w.gptq_passes,
    )


def _stage1(config: QuantizeConfig, *, learn_scales: bool) -> Step:
    s1 = config.stage1
    if not learn_scales:  # SpinQuant: per-token dynamic activations, weights' RTN follows R
        s1 = dataclasses.replace(s1, activation_mode="dynamic", lr_scale=0.0)
    return stage1(
        s1,
        config_keys(config)[2],
        learn_scales=learn_scales,
        selective=bool(config.mobilequant.selective),
        learn_down_in=config.learn_down_in,
        weight_clipping=bool(config.mobilequant.weight_clipping),
    )


def rtn(config: QuantizeConfig) -> Recipe:
    """Round-to-nearest with static Max-Min calibration: no rotations, no training."""
    return chain(*_before_stage1(config, rotated=False), *after_stage1(config))


def quarot(config: QuantizeConfig) -> Recipe:
    """QuaRot: fused norms and randomized Hadamard R1/R2, then static calibration."""
    return chain(*_before_stage1(config, rotated=True), *after_stage1(config))


def spinquant(config: QuantizeConfig) -> Recipe:
    """SpinQuant: Hadamard start, rotations learned under dynamic per-token quantization."""
    return chain(
        *_before_stage1(config, rotated=True),
        _stage1(config, learn_scales=False),
        *after_stage1(config),
    )


def quantnpu(config: QuantizeConfig) -> Recipe:
    """Quant.npu: aware initialization, stage 1 learns rotations and the selective scales
    under static quantization, stage 2 calibrates the rest and keeps the learned scales."""
    return chain(
        *_before_stage1(config, rotated=True),
        _stage1(config, learn_scales=True),
        *after_stage1(config),
    )


def mobilequant(config: QuantizeConfig) -> Recipe:
    """MobileQuant: no rotations; every linear pair's equivalent scales (SmoothQuant-
    initialized), the weights' clip factors and every activation's asymmetric range learned
    end to end in stage 1, then static calibration of the rest."""
    return chain(
        *_before_stage1(config, rotated=False),
        _stage1(config, learn_scales=True),
        *after_stage1(config),
    )


# {method: its recipe}: the function named as the method, one per spec (`methods.METHODS`)
RECIPES: dict[str, Callable[[QuantizeConfig], Recipe]] = {
    recipe.__name__: recipe for recipe in (rtn, quarot, spinquant, quantnpu, mobilequant)
}
check_recipes(RECIPES)


def for_config(config: QuantizeConfig) -> Recipe:
    """The recipe of `config.method` built from `config`."""
    return RECIPES[config.method](config)


def describe(recipe: Recipe) -> list[dict[str, Any]]:
    """The steps of `recipe` as {"name", "args"} rows (what a run records before it starts)."""
    return [{"name": s.name, "args": dict(s.args)} for s in recipe]


def build_plan(
    config: QuantizeConfig,
    num_layers: int,
    layer_bits: Mapping[str, Sequence[int]] | None = None,
    *,
    graph: Graph = GRAPH,
) -> QuantPlan:
    """The plan a config's recipe ends with on a model of `graph`, given the per-layer bits
    its promotions chose ({tensor: bits per layer}, a tensor of `Promotions`; one left out:
    not promoted): for studies that vary one piece of it."""
    made = default_plan(num_layers, **plan_options(config), graph=graph)
    chosen = (layer_bits or {}).items()
    return made.apply([QuantRule(pattern=f"layers/{t}", layer_bits=tuple(b)) for t, b in chosen])


def config_stage1_plan(plan: QuantPlan, config: QuantizeConfig) -> QuantPlan:
    """The stage-1 plan of a config's recipe (`steps.stage1_plan` with its options)."""
    return stage1_plan(
        plan,
        selective=bool(config.mobilequant.selective),
        learn=config.method in SCALE_LEARNING_METHODS,
        learn_down_in=config.learn_down_in,
    )
