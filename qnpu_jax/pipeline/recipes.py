"""Recipes: methods as chains of steps, in the spirit of `optax.chain`.

    recipe = chain(fuse_norms(), hadamard_rotations(key), plan(w_bits=4, a_bits=8),
                   calibrate(), gptq())
    model = recipe(QuantizedModel.from_float(...), calibration)

`rtn`, `quarot`, `spinquant` and `quantnpu` build the shipped methods from a `QuantizeConfig`
(`for_config` picks by `config.method`); `qnpu quantize` runs them, timed and resumable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    ATTN_OUTPUT_INPUT,
    GLOBAL_ACTS,
    LAYER_ACTS,
    LINEAR_OUTPUTS,
    MLP_INPUT,
    PROBS,
    ROTATED_INPUTS,
    UNROTATED_INPUT,
    UNROTATED_OUTPUT,
)
from qnpu_jax.pipeline.config import SCALE_LEARNING_METHODS, QuantizeConfig
from qnpu_jax.pipeline.quantized_model import QuantizedModel
from qnpu_jax.pipeline.steps import (
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


def init_rules(w_bits: int, a_bits: int) -> list[QuantRule]:
    """Rotation-and-bit-width-aware initialization (§4.2, Tables 4–6): mean ± 3σ for rotated
    activations and per-channel weights at 4 bits, Max-Min at 8 bits and for every unrotated
    tensor (down_proj input, linear outputs, K/V, ...)."""
    act = "mean_std" if a_bits <= 4 else "max_min"
    weight = "mean_std" if w_bits <= 4 else "max_min"
    return [
        QuantRule(pattern=f"layers/({'|'.join(ROTATED_INPUTS)})", init=act),
        QuantRule(pattern=f"layers/({'|'.join(WEIGHTS)})", init=weight),
    ]


def plan_rules(config: QuantizeConfig) -> list[QuantRule]:
    """The rules of a config's plan: scope, the method's initializers, then the user's."""
    rules: list[QuantRule] = []
    if config.scope == "linears":  # Table 2: the linears' weights, inputs and outputs only
        keep = "|".join((*STAGE1_TENSORS, *LINEAR_OUTPUTS))
        rules.append(QuantRule(pattern=f"(?!layers/({keep})$).*", quantize=False))
    if config.method == "quantnpu" and config.init_scheme == "aware":
        rules += init_rules(config.w_bits, config.a_bits)
    if config.method == "mobilequant":  # learned clipping starts from the MSE-best clip
        rules.append(QuantRule(pattern=f"layers/({'|'.join(WEIGHTS)})", init="mse"))
    if config.asymmetric_weights:  # MobileQuant's main setting (its Table 7: symmetric)
        rules.append(QuantRule(pattern=f"layers/({'|'.join(WEIGHTS)})", symmetric=False))
    if config.asymmetric_activations:  # MobileQuant's ARL: a learned offset on every one
        layer = "|".join(a for a in LAYER_ACTS if a != PROBS)
        rules.append(
            QuantRule(pattern=f"layers/({layer})|{'|'.join(GLOBAL_ACTS)}", symmetric=False)
        )
    if config.weight_block is not None:
        rules.append(
            QuantRule(
                pattern=f"layers/({'|'.join(WEIGHTS)})",
                block=config.weight_block,
                block_scale_bits=config.weight_block_scale_bits,
            )
        )
    return rules + list(config.rules)


def plan_options(config: QuantizeConfig) -> dict[str, Any]:
    """The bit-widths and rules a config's plan is built from (`default_plan`'s options)."""
    return {
        "w_bits": config.w_bits,
        "a_bits": config.a_bits,
        "kv_bits": config.kv_bits,
        "down_in_bits": config.down_in_bits,
        "rules": plan_rules(config),
        "simulation": config.simulation,
    }


def _start(config: QuantizeConfig) -> list[Step]:
    """The steps between the rotations and the scans: smoothing, equalization, the plan."""
    steps = [smooth_mlp(config.smooth_mlp)] if config.smooth_mlp is not None else []
    if config.equalize is not None:
        steps.append(equalize(config.equalize))
    return [*steps, plan(**plan_options(config))]


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
    if config.mixed_precision > 0 and config.down_in_bits == 8:
        steps.append(promote(UNROTATED_INPUT, config.mixed_precision))
    if config.mlp_in_mixed_precision > 0:
        steps.append(promote(MLP_INPUT, config.mlp_in_mixed_precision))
    if config.attn_out_mixed_precision > 0:
        steps.append(promote(ATTN_OUTPUT_INPUT, config.attn_out_mixed_precision))
    return steps


def outlier_steps(config: QuantizeConfig) -> list[Step]:
    """The down_proj input's outlier mechanism of `config` (mllm-NPU's shadow outliers or
    MUXQ): steps on a calibrated model."""
    if config.shadow_outliers is not None:
        return [shadow_outliers(UNROTATED_INPUT, config.shadow_outliers, config.shadow_keep)]
    if config.muxq_exp is not None:
        return [muxq(UNROTATED_INPUT, config.muxq_exp, config.muxq_threshold)]
    return []


def after_stage1(config: QuantizeConfig) -> list[Step]:
    """Everything after stage 1: the down_proj output promotion (scanned on the final model),
    stage 2's calibration, GPTQ, then the outlier step."""
    steps: list[Step] = []
    if config.down_out_mixed_precision > 0:  # a stage-2 tensor: scanned on the final model
        steps.append(promote(UNROTATED_OUTPUT, config.down_out_mixed_precision))
    steps.append(calibrate())
    if config.weight_rounding == "gptq":
        steps.append(gptq(config.gptq_damp))
    return steps + outlier_steps(config)


def _stage1(config: QuantizeConfig, *, learn_scales: bool) -> Step:
    s1 = config.stage1
    if not learn_scales:  # SpinQuant: per-token dynamic activations, weights' RTN follows R
        s1 = dataclasses.replace(s1, activation_mode="dynamic", lr_scale=0.0)
    return stage1(
        s1,
        config_keys(config)[2],
        learn_scales=learn_scales,
        selective=bool(config.selective),
        learn_down_in=config.learn_down_in,
        weight_clipping=bool(config.weight_clipping),
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


RECIPES: dict[str, Callable[[QuantizeConfig], Recipe]] = {
    "rtn": rtn,
    "quarot": quarot,
    "spinquant": spinquant,
    "quantnpu": quantnpu,
    "mobilequant": mobilequant,
}


def for_config(config: QuantizeConfig) -> Recipe:
    """The recipe of `config.method` built from `config`."""
    try:
        return RECIPES[config.method](config)
    except KeyError:
        raise QnpuError(f"unknown method {config.method!r}; known: {sorted(RECIPES)}") from None


def describe(recipe: Recipe) -> list[dict[str, Any]]:
    """The steps of `recipe` as {"name", "args"} rows (what a run records before it starts)."""
    return [{"name": s.name, "args": dict(s.args)} for s in recipe]


def build_plan(
    config: QuantizeConfig,
    num_layers: int,
    down_in_bits: tuple[int, ...] | None = None,
    down_out_bits: tuple[int, ...] | None = None,
    mlp_in_bits: tuple[int, ...] | None = None,
    attn_out_bits: tuple[int, ...] | None = None,
) -> QuantPlan:
    """The plan a config's recipe ends with, given the per-layer bits its promotions chose
    (None: no promotion of that tensor): for studies that vary one piece of it."""
    made = default_plan(num_layers, **plan_options(config))
    promoted = [
        (UNROTATED_INPUT, down_in_bits),
        (UNROTATED_OUTPUT, down_out_bits),
        (MLP_INPUT, mlp_in_bits),
        (ATTN_OUTPUT_INPUT, attn_out_bits),
    ]
    return made.apply(
        [QuantRule(pattern=f"layers/{n}", layer_bits=b) for n, b in promoted if b is not None]
    )


def config_stage1_plan(plan: QuantPlan, config: QuantizeConfig) -> QuantPlan:
    """The stage-1 plan of a config's recipe (`steps.stage1_plan` with its options)."""
    return stage1_plan(
        plan,
        selective=bool(config.selective),
        learn=config.method in SCALE_LEARNING_METHODS,
        learn_down_in=config.learn_down_in,
    )
