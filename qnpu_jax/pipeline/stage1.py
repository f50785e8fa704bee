"""Stage 1: joint gradient optimization of R1, per-layer R2 and the learnable static scales,
and of the equivalent scales and weight clip factors where the model has them (MobileQuant).

The trainable pytree is {"r1": [D, D], "r2": [L, hd, hd], "scales": {group: {name: {...}}}}
with only the plan's learnable tensors in "scales" (the zero point only where asymmetric);
an unrotated model has no "r1"/"r2". "equalization": {pair: log s [L, C]} holds the linear
pairs' equivalent scales (`transforms.equalize`), "clip": {weight: γ [L, out, 1]} the
weights' clip logits (learnable weight clipping: the weight scale is sigmoid(γ) times the
row's current max |w| over qmax, so it follows the weights as rotations and scalings move
them). Rotations and scalings are applied to the float params inside the loss, so gradients
reach them through every weight; Cayley SGD keeps rotations orthogonal, plain SGD moves the
scales, Adam the equalization and clip parameters (all cosine-decayed,
`optax.multi_transform`). The step is one jitted pure function
`(state, batch) -> (state, metrics)`; gradient accumulation is a `lax.scan` over micro-batches,
and `remat` recomputes each decoder layer in the backward pass.
"""

from __future__ import annotations

import dataclasses
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from tqdm import tqdm

from qnpu_jax.data import sample_windows
from qnpu_jax.errors import QnpuError, first_line
from qnpu_jax.fieldtypes import check_field_types
from qnpu_jax.files import iter_jsonl
from qnpu_jax.ir.graph import EMBED_TABLE, LM_HEAD, r1_targets
from qnpu_jax.limits import MAX_CALIB_WINDOWS, check_at_most
from qnpu_jax.mesh import (
    batch_sharding,
    check_batch,
    host_array,
    is_primary,
    param_shardings,
    place,
    replicated,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import MATMUL_DTYPES, Params, graph_of, next_token_nll
from qnpu_jax.models.taps import FakeQuantTaps, QuantState, tapped_forward
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.quant.fake_quant import log_to_scale, positive_scale, round_ste, scale_to_log
from qnpu_jax.quant.plan import WEIGHTS, QuantPlan
from qnpu_jax.quant.state import state_key
from qnpu_jax.rotation import cayley_sgd
from qnpu_jax.transforms import apply_rotations, equalize

ACTIVATION_MODES = ("static", "dynamic")
# "end_to_end": the model's next-token cross-entropy (Quant.npu, MobileQuant); "block": the
# mean over layers of each decoder layer's output MSE against the float layer on the same
# float input (OmniQuant's block-wise objective, trained in parallel over the layers)
# "kl": distillation, the mean KL(float model || fake-quant model) of each token's next-token
# distribution (the float model's logits computed in the step, without gradient)
OBJECTIVES = ("end_to_end", "block", "kl")
# "linear": the parameter is the scale (the paper; eq. (1) and LSQ gradients as written).
# "log": the parameter is log s, so a step is relative to s and s stays positive: one lr then
# suits scales of very different sizes (W4 weight rows ~1e-3, activations ~1e-1).
SCALE_PARAMS = ("linear", "log")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage1Config:
    steps: int = 60
    batch_size: int = 2
    grad_accum: int = 1
    lr_rotation: float = 0.1
    lr_scale: float = 0.01
    momentum: float = 0.0  # the paper: plain SGD (and Cayley SGD) with cosine decay
    local_loss_fraction: float = 0.25  # eq. (3) during the first 25% of steps (paper: 128/512)
    local_loss_weight: float = 1.0
    lsq_grad_scaling: bool = True
    learn_rotations: bool = True
    activation_mode: str = "static"  # "dynamic": SpinQuant's per-token training
    scale_param: str = "linear"  # how scales are parameterized (SCALE_PARAMS)
    remat: bool = True
    checkpoint_every: int = 10
    # the linears' matmul operands in the stage-1 forward ("bfloat16": the paper's bf16
    # training; R1/R2 and the scales stay float32 master copies either way)
    compute_dtype: str = "float32"
    lr_equalization: float = 0.01  # Adam's lr for equivalent scales and clip logits
    objective: str = "end_to_end"  # OBJECTIVES
    # checkpoint selection: every `select_every` steps (0: off, keep the last step) score the
    # trained parameters by the stage-1 model's cross-entropy on `select_windows` held-out
    # windows (the calibration text's tail, which training then never draws) and keep the
    # best, the starting point included
    select_every: int = 0
    select_windows: int = 4

    def __post_init__(self) -> None:
        check_field_types(self, "stage 1 ")
        for name in ("steps", "batch_size", "grad_accum", "checkpoint_every", "select_windows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise QnpuError(f"stage 1 {name} must be a positive integer, got {value!r}")
        if self.select_every < 0:
            raise QnpuError(
                f"stage 1 select_every must be >= 0 (0: keep the last step), "
                f"got {self.select_every}"
            )
        check_at_most(
            self.select_windows,
            MAX_CALIB_WINDOWS,
            "stage 1 select_windows",
            "the held-out windows checkpoint selection scores",
        )
        check_at_most(
            self.batch_size * self.grad_accum,
            MAX_CALIB_WINDOWS,
            "stage 1 batch_size x grad_accum",
            "the windows one step draws from the calibration text",
        )
        for name in ("lr_rotation", "lr_scale", "local_loss_weight", "lr_equalization"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value >= 0:
                raise QnpuError(f"stage 1 {name} must be a number >= 0, got {value!r}")
        if not 0.0 <= self.momentum < 1.0:
            raise QnpuError(f"stage 1 momentum must be in [0, 1), got {self.momentum}")
        if not 0.0 <= self.local_loss_fraction <= 1.0:
            raise QnpuError(
                f"stage 1 local_loss_fraction must be in [0, 1], got {self.local_loss_fraction}"
            )
        if self.compute_dtype not in MATMUL_DTYPES:
            raise QnpuError(
                f"stage 1 compute_dtype must be one of {MATMUL_DTYPES}, got {self.compute_dtype!r}"
            )
        if self.scale_param not in SCALE_PARAMS:
            raise QnpuError(
                f"stage 1 scale_param must be one of {SCALE_PARAMS}, got {self.scale_param!r}"
            )
        if self.objective not in OBJECTIVES:
            raise QnpuError(
                f"stage 1 objective must be one of {OBJECTIVES}, got {self.objective!r}"
            )
        if self.activation_mode not in ACTIVATION_MODES:
            raise QnpuError(
                f"stage 1 activation_mode must be one of {ACTIVATION_MODES}, "
                f"got {self.activation_mode!r}"
            )

    @property
    def local_loss_steps(self) -> int:
        return round(self.local_loss_fraction * self.steps)


def learnable_scales(
    state: QuantState, plan: QuantPlan, scale_param: str = "linear", skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The trainable part of a quantizer state: scales (and asymmetric zero points) of the
    plan's learnable tensors but the layer tensors `skip` (clipped weights, whose scales
    come from their clip logits), each scale as its `scale_param` parameter."""
    out: dict[str, Any] = {"layers": {}, "outer": {}}
    for path, tq in plan.entries:
        if not tq.learnable or path.removeprefix("layers/") in skip:
            continue
        group, name = state_key(path)
        entry = state[group][name]
        scale = entry.scale
        out[group][name] = {"scale": scale_to_log(scale) if scale_param == "log" else scale}
        if not tq.symmetric:
            out[group][name]["zero_point"] = entry.zero_point
    return out


def scales_from_params(scales: dict[str, Any], scale_param: str) -> dict[str, Any]:
    """The inverse of `learnable_scales`' parameterization: the scales themselves."""
    if scale_param == "linear":
        return scales
    return {
        group: {
            name: {k: log_to_scale(v) if k == "scale" else v for k, v in fields.items()}
            for name, fields in entries.items()
        }
        for group, entries in scales.items()
    }


def learned_scales(scales: dict[str, Any], scale_param: str) -> dict[str, Any]:
    """The scales a trained forward used, ready to store and export: positive_scale of the
    linear parameter (a raw one may have stepped past 0), exp of the log one."""
    out = scales_from_params(scales, scale_param)
    return {
        group: {
            name: {k: positive_scale(v) if k == "scale" else v for k, v in fields.items()}
            for name, fields in entries.items()
        }
        for group, entries in out.items()
    }


def merge_scales(state: QuantState, scales: dict[str, Any]) -> QuantState:
    """`state` with the trained entries of `scales` written over it (a new pytree)."""
    out: QuantState = {g: dict(state[g]) for g in state}
    for group, entries in scales.items():
        for name, fields in entries.items():
            out[group][name] = state[group][name].replace(**fields)
    return out


def make_optimizer(config: Stage1Config) -> optax.GradientTransformation:
    rot_lr = optax.cosine_decay_schedule(config.lr_rotation, config.steps)
    scale_lr = optax.cosine_decay_schedule(config.lr_scale, config.steps)
    transform_lr = optax.cosine_decay_schedule(config.lr_equalization, config.steps)
    rotation = (
        cayley_sgd(rot_lr, momentum=config.momentum)
        if config.learn_rotations
        else optax.set_to_zero()
    )
    scale = optax.sgd(scale_lr, momentum=config.momentum or None)
    labels = {
        "r1": "rotation",
        "r2": "rotation",
        "scales": "scale",
        "equalization": "transform",
        "clip": "transform",
    }
    return optax.multi_transform(
        {"rotation": rotation, "scale": scale, "transform": optax.adam(transform_lr)},
        lambda tree: {k: jax.tree.map(lambda _, k=k: labels[k], v) for k, v in tree.items()},
    )


CLIP_RANGE = (0.05, 0.995)  # the clip factors a calibrated scale may start from


def _logit(c: jax.Array) -> jax.Array:
    c = jnp.clip(c, *CLIP_RANGE)
    return jnp.log(c) - jnp.log1p(-c)


def _row_range(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(min(row, 0), max(row, 0)) of a weight [L, out, in], keepdims: the range a clip
    factor shrinks (through 0, so an asymmetric zero point stays on the code grid)."""
    lo = jnp.minimum(jnp.min(w, axis=-1, keepdims=True), 0.0)
    hi = jnp.maximum(jnp.max(w, axis=-1, keepdims=True), 0.0)
    return lo, hi


def clip_logits(params: Params, state: QuantState, plan: QuantPlan) -> dict[str, Any]:
    """{weight: {"max": γ [L, out, 1]} (and "min": β for an asymmetric weight)} of every
    quantized layer weight, starting where its current encoding clips: sigmoid(γ)·max(row)
    (and sigmoid(β)·min(row)) is the range the scale (and zero point) cover, each factor
    limited to `CLIP_RANGE`; a symmetric weight clips max |row|."""
    out: dict[str, Any] = {}
    for path, tq in plan.entries:
        name = path.removeprefix("layers/")
        if name not in WEIGHTS:
            continue
        if tq.block is not None or tq.axis != 0:
            raise QnpuError(f"{path}: weight clipping learns per-row scales")
        entry = state["layers"][name]
        w = params["layers"][name]
        s = positive_scale(entry.scale)
        qmin, qmax = entry.qmin[:, None, None], entry.qmax[:, None, None]
        if tq.symmetric:
            absmax = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
            out[name] = {"max": _logit(s * qmax / absmax)}
            continue
        lo, hi = _row_range(w)
        z = entry.zero_point
        out[name] = {
            "max": _logit((qmax - z) * s / jnp.where(hi > 0, hi, 1.0)),
            "min": _logit((qmin - z) * s / jnp.where(lo < 0, lo, -1.0)),
        }
    return out


def clipped_weight_scales(
    params: Params, clip: dict[str, Any], state: QuantState
) -> dict[str, Any]:
    """The clipped weights' encodings as a `merge_scales` tree: symmetric, the scale
    sigmoid(γ)·max|row|/qmax; asymmetric, the range [sigmoid(β)·min, sigmoid(γ)·max] over
    the code range, its zero point rounded with a straight-through gradient."""
    layers = {}
    for name, factors in clip.items():
        w = params["layers"][name]
        entry = state["layers"][name]
        qmin, qmax = entry.qmin[:, None, None], entry.qmax[:, None, None]
        if "min" not in factors:
            absmax = jnp.max(jnp.abs(w), axis=-1, keepdims=True)
            layers[name] = {"scale": jax.nn.sigmoid(factors["max"]) * absmax / qmax}
            continue
        lo, hi = _row_range(w)
        lo, hi = jax.nn.sigmoid(factors["min"]) * lo, jax.nn.sigmoid(factors["max"]) * hi
        scale = positive_scale((hi - lo) / (qmax - qmin))
        layers[name] = {"scale": scale, "zero_point": round_ste(qmin - lo / scale)}
    return {"layers": layers}


def transformed_params(base: Params, cfg: ModelConfig, trainable: dict[str, Any], **kw: Any) -> Any:
    """`base` rotated by the trainable R1/R2 (if any) and scaled by its equivalent scales
    (if any): the float params the stage-1 forward quantizes (`kw`: `apply_rotations`')."""
    params = base
    if "r1" in trainable:
        params = apply_rotations(params, cfg, trainable["r1"], trainable["r2"], **kw)
    if "equalization" in trainable:
        params = equalize(params, cfg, jax.tree.map(jnp.exp, trainable["equalization"]))
    return params


def init_train_state(
    r1: jax.Array | None,
    r2: jax.Array | None,
    state: QuantState,
    plan: QuantPlan,
    config: Stage1Config,
    *,
    equalization: dict[str, jax.Array] | None = None,
    clip: dict[str, jax.Array] | None = None,
) -> dict[str, Any]:
    """The initial trainable tree (`r1`/`r2` None: an unrotated model; `equalization`: the
    pairs' scales s to learn as log s; `clip`: clip logits of the weights they replace as
    learned scales) with its optimizer state."""
    skip = tuple(clip or ())
    trainable: dict[str, Any] = {"scales": learnable_scales(state, plan, config.scale_param, skip)}
    if r1 is not None:
        trainable |= {"r1": r1, "r2": r2}
    if equalization:
        trainable["equalization"] = {k: jnp.log(v) for k, v in equalization.items()}
    if clip:
        trainable["clip"] = dict(clip)
    return {
        "params": trainable,
        "opt_state": make_optimizer(config).init(trainable),
        "step": jnp.zeros((), jnp.int32),
    }


def distillation_kl(teacher_logits: jax.Array, logits: jax.Array) -> jax.Array:
    """KL(teacher || student) of each position's next-token distribution [..., V] -> [...]."""
    log_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
    log_s = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)


def stage1_loss(
    trainable: dict[str, Any],
    base_params: Params,
    frozen_state: QuantState,
    tokens: jax.Array,
    local_weight: jax.Array,
    *,
    cfg: ModelConfig,
    taps: FakeQuantTaps,
    prefix: tuple[int, ...],
    remat: bool,
    scale_param: str = "linear",
    float_tables: bool = False,
    objective: str = "end_to_end",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Next-token cross-entropy of the fake-quant model plus `local_weight` × eq. (3); with
    `objective` "block", the mean block error against the float layers replaces the
    cross-entropy (which is still reported: the float teacher's, a constant); with "kl", the
    mean KL divergence from the float model's next-token distributions does (distillation;
    the fake-quant model's cross-entropy is still reported).

    `float_tables` (the plan quantizes neither embed_tokens nor lm_head): R1 rotates the
    gathered embedding rows and the final hidden state instead of both [V, D] tables, the
    same function at a fraction of the FLOPs (4·V·D² a step for SmolLM2: ~22% of it).
    """
    r1 = trainable.get("r1")
    params = transformed_params(base_params, cfg, trainable, tables=not float_tables)
    # an online R1 (rotation linears: `ir.graph.r1_targets`) leaves the tables alone
    rotates_tables = r1_targets(graph_of(cfg, params)).tables
    state = merge_scales(frozen_state, scales_from_params(trainable["scales"], scale_param))
    if "clip" in trainable:
        state = merge_scales(state, clipped_weight_scales(params, trainable["clip"], state))
    logits, aux = tapped_forward(
        params,
        state,
        tokens,
        cfg=cfg,
        taps=taps,
        prefix=prefix,
        remat=remat,
        residual_rotation=r1 if float_tables and r1 is not None and rotates_tables else None,
        teacher=jax.lax.stop_gradient(params) if objective == "block" else None,
    )
    ce = jnp.mean(next_token_nll(logits, tokens))
    errors = [jnp.mean(e) for e in jax.tree.leaves(aux.get("layers", {}).get("local_error", {}))]
    local = jnp.mean(jnp.stack(errors)) if errors else jnp.zeros((), jnp.float32)
    if objective == "block":
        fit = jnp.mean(aux["layers"]["block_error"])
    elif objective == "kl":
        teacher_logits, _ = tapped_forward(
            jax.lax.stop_gradient(base_params), None, tokens, cfg=cfg, taps=None, prefix=prefix
        )
        fit = jnp.mean(distillation_kl(jax.lax.stop_gradient(teacher_logits), logits))
    else:
        fit = ce
    return fit + local_weight * local, {"ce": ce, "local": local}


def _stage1_loss_fn(
    cfg: ModelConfig,
    plan: QuantPlan,
    config: Stage1Config,
    prefix: tuple[int, ...],
    *,
    training: bool,
) -> Any:
    """`stage1_loss` bound to the run's model and plan; not `training`: the end-to-end
    cross-entropy alone (no eq. (3) terms, no remat, no teacher), what checkpoint selection
    scores."""
    taps = FakeQuantTaps(
        plan,
        mode=config.activation_mode,
        lsq_grad_scaling=config.lsq_grad_scaling,
        cfg=cfg,
        local_loss=training and config.local_loss_steps > 0 and config.activation_mode == "static",
        matmul_dtype=config.compute_dtype,
    )
    return partial(
        stage1_loss,
        cfg=cfg,
        taps=taps,
        prefix=prefix,
        remat=config.remat and training,
        scale_param=config.scale_param,
        float_tables=plan.get(EMBED_TABLE) is None and plan.get(LM_HEAD) is None,
        objective=config.objective if training else "end_to_end",
    )


def make_held_out_score(
    cfg: ModelConfig, plan: QuantPlan, config: Stage1Config, prefix: tuple[int, ...] = ()
) -> jax.stages.Wrapped:
    """`(trainable, windows [N, T], base_params, frozen_state) -> mean cross-entropy` of the
    stage-1 fake-quant model over the windows (one window at a time), jitted: the score of
    checkpoint selection."""
    loss_fn = _stage1_loss_fn(cfg, plan, config, prefix, training=False)

    def score(
        trainable: dict[str, Any], windows: jax.Array, base_params: Params, frozen: QuantState
    ) -> jax.Array:
        def one(tokens: jax.Array) -> jax.Array:
            return loss_fn(trainable, base_params, frozen, tokens[None], jnp.float32(0.0))[0]

        return jnp.mean(jax.lax.map(one, windows))

    return jax.jit(score)


def held_out_split(ids: np.ndarray, seq_len: int, windows: int) -> tuple[np.ndarray, np.ndarray]:
    """(the ids stage 1 trains on, the held-out windows [windows, seq_len]): the text's last
    windows × seq_len tokens, cut into consecutive windows, are held out."""
    held = windows * seq_len
    if len(ids) < held + seq_len:
        raise QnpuError(
            f"checkpoint selection holds out {windows} windows of {seq_len} tokens, and the "
            f"calibration text has {len(ids)} tokens: too few to train on the rest"
        )
    tail = np.asarray(ids[len(ids) - held :], dtype=np.int32)
    return ids[: len(ids) - held], tail.reshape(windows, seq_len)


def train_step(
    cfg: ModelConfig, plan: QuantPlan, config: Stage1Config, prefix: tuple[int, ...] = ()
) -> Any:
    """The pure step `(train_state, batch [A, B, T], base_params, frozen_state) ->
    (train_state, metrics)` (`make_train_step` jits it)."""
    optimizer = make_optimizer(config)
    loss_fn = _stage1_loss_fn(cfg, plan, config, prefix, training=True)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(
        train_state: dict[str, Any], batch: jax.Array, base_params: Params, frozen: QuantState
    ) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        trainable = train_state["params"]
        in_local = train_state["step"] < config.local_loss_steps
        local_weight = jnp.where(in_local, config.local_loss_weight, 0.0)

        def micro(carry: Any, tokens: jax.Array) -> tuple[Any, Any]:
            (loss, parts), grads = grad_fn(trainable, base_params, frozen, tokens, local_weight)
            summed = jax.tree.map(jnp.add, carry, grads)
            return summed, (loss, parts["ce"], parts["local"])

        zeros = jax.tree.map(jnp.zeros_like, trainable)
        grads, (loss, ce, local) = jax.lax.scan(micro, zeros, batch)
        grads = jax.tree.map(lambda g: g / batch.shape[0], grads)
        updates, opt_state = optimizer.update(grads, train_state["opt_state"], trainable)
        new = {
            **train_state,  # "best" (checkpoint selection) passes through
            "params": optax.apply_updates(trainable, updates),
            "opt_state": opt_state,
            "step": train_state["step"] + 1,
        }
        metrics = {
            "loss": jnp.mean(loss),
            "ce": jnp.mean(ce),
            "local": jnp.mean(local),
            "local_weight": local_weight,
            "grad_norm": optax.tree.norm(grads),
        }
        return new, metrics

    return step


def step_shardings(
    mesh: Mesh, train_state: Any, base_params: Any, frozen_state: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(in_shardings, out_shardings) of the step on `mesh`: the trainable parameters, their
    optimizer state, the frozen base and quantizer state along `fsdp` (`mesh.param_shardings`),
    the batch [A, B, T] split on B along `data`, the metrics replicated."""
    state = param_shardings(mesh, train_state)
    ins = (
        state,
        batch_sharding(mesh, 3, axis=1),
        param_shardings(mesh, base_params),
        param_shardings(mesh, frozen_state),
    )
    return ins, (state, replicated(mesh))


def make_train_step(
    cfg: ModelConfig,
    plan: QuantPlan,
    config: Stage1Config,
    prefix: tuple[int, ...] = (),
    *,
    mesh: Mesh | None = None,
    like: tuple[Any, Any, Any] | None = None,
) -> jax.stages.Wrapped:
    """`train_step` jitted; on `mesh`, with the explicit shardings of `step_shardings` for
    trees shaped like `like` = (train_state, base_params, frozen_state) (arrays or
    ShapeDtypeStructs). Bind the constants with functools.partial for `(state, batch)`."""
    step = train_step(cfg, plan, config, prefix)
    if mesh is None:
        return jax.jit(step)
    if like is None:
        raise ValueError("make_train_step on a mesh needs `like` (the trees it shards)")
    ins, outs = step_shardings(mesh, *like)
    return jax.jit(step, in_shardings=ins, out_shardings=outs)


def step_batch(
    ids: np.ndarray, step: int, config: Stage1Config, seq_len: int, key: jax.Array
) -> np.ndarray:
    """The calibration windows of `step` [A, B, T]: a function of (key, step) only, so a
    resumed run sees the same data as an uninterrupted one."""
    count = config.grad_accum * config.batch_size
    windows = sample_windows(ids, seq_len, count, jax.random.fold_in(key, step))
    return windows.reshape(config.grad_accum, config.batch_size, seq_len)


def _checkpoint_manager(directory: Path, config: Stage1Config) -> Any:

    options = ocp.CheckpointManagerOptions(
        save_interval_steps=config.checkpoint_every, max_to_keep=2, create=True
    )
    return ocp.CheckpointManager(directory.resolve(), options=options)


def _append_metrics(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _trim_metrics(path: Path, last_step: int) -> None:
    """Drop metric lines past the restored checkpoint (the killed run's unsaved steps)."""
    if not path.exists():
        return
    kept = [json.dumps(row) for _, row in iter_jsonl(path) if row.get("step", 0) <= last_step]
    path.write_text("".join(line + "\n" for line in kept))


@dataclasses.dataclass(frozen=True, eq=False)
class Stage1Problem:
    """What stage 1 trains and on what: the model config, the stage-1 plan, the schedule, the
    frozen base params and quantizer state the train state is applied to, the sink prefix,
    and the calibration token ids that `step_batch` draws each step's windows of `seq_len`
    from with `key`."""

    cfg: ModelConfig
    plan: QuantPlan
    config: Stage1Config
    base_params: Params
    frozen_state: QuantState
    calib_ids: np.ndarray
    seq_len: int
    key: jax.Array
    prefix: tuple[int, ...] = ()


def _on_mesh(
    mesh: Mesh, train_state: dict[str, Any], problem: Stage1Problem
) -> tuple[dict[str, Any], Stage1Problem]:
    """The train state, base params and frozen state placed by `step_shardings`."""
    check_batch(mesh, problem.config.batch_size, "stage 1 batch_size")
    like = (train_state, problem.base_params, problem.frozen_state)
    (state_sh, _, base_sh, frozen_sh), _ = step_shardings(mesh, *like)
    placed = dataclasses.replace(
        problem,
        base_params=place(problem.base_params, base_sh),
        frozen_state=place(problem.frozen_state, frozen_sh),
    )
    return place(train_state, state_sh), placed


def _restored(manager: Any, train_state: dict[str, Any], run_dir: Path) -> dict[str, Any]:
    """The latest checkpoint in `run_dir` restored into `train_state`'s shardings (and the
    metrics trimmed to it), or `train_state` with no metrics where there is none."""
    metrics_path = run_dir / RunDir.STAGE1_METRICS
    latest = manager.latest_step()
    if latest is None:
        if is_primary() and metrics_path.exists():
            metrics_path.unlink()
        return train_state
    try:
        restored = manager.restore(latest, args=ocp.args.StandardRestore(train_state))
    except Exception as e:  # orbax/tensorstore raise many types; all mean "unreadable"
        raise QnpuError(
            f"{run_dir / RunDir.STAGE1_CHECKPOINTS / str(latest)}: cannot restore the "
            f"stage-1 checkpoint ({first_line(e)}); delete that step's folder to resume from "
            "the one before"
        ) from e
    if is_primary():
        _trim_metrics(metrics_path, latest)
    return restored


def run_stage1(
    train_state: dict[str, Any],
    problem: Stage1Problem,
    *,
    run_dir: Path,
    progress: bool = True,
    stop_after: int | None = None,
    mesh: Mesh | None = None,
) -> dict[str, Any]:
    """Train `problem` to its `config.steps`, checkpointing every `checkpoint_every` steps in
    run_dir/checkpoints and appending per-step metrics to run_dir/metrics.jsonl (the names
    `RunDir` gives stage 1's work directory, a run's stage1/).

    With `config.select_every`, the state carries "best" = {"params", "loss", "step"}: the
    trainable tree with the lowest held-out cross-entropy so far (`held_out_split`; scored at
    the start, every `select_every` steps and at the last step, each score a metrics line's
    "held_out_ce"), and the returned state's "params" are the best's.

    If run_dir holds a checkpoint, training continues from the latest one; the result equals
    an uninterrupted run's, and the checkpoint may come from another mesh (orbax restores it
    into this mesh's shardings). `stop_after` ends early after that step (tests use it as a
    kill). On `mesh`, every tree is placed by `step_shardings` first.
    """

    if mesh is not None:
        train_state, problem = _on_mesh(mesh, train_state, problem)
    config, base, frozen = problem.config, problem.base_params, problem.frozen_state
    calib_ids = problem.calib_ids
    selecting = config.select_every > 0
    if selecting:
        calib_ids, held_out = held_out_split(calib_ids, problem.seq_len, config.select_windows)
        score_fn = make_held_out_score(problem.cfg, problem.plan, config, problem.prefix)
        held = jnp.asarray(held_out)
        train_state = {
            **train_state,
            "best": {
                "params": train_state["params"],
                "loss": jnp.asarray(jnp.inf, jnp.float32),
                "step": jnp.zeros((), jnp.int32),
            },
        }

    def select(state: dict[str, Any]) -> tuple[dict[str, Any], float]:
        loss = float(host_array(score_fn(state["params"], held, base, frozen)))
        if not loss < float(host_array(state["best"]["loss"])):
            return state, loss
        best = {"params": state["params"], "loss": jnp.float32(loss), "step": state["step"]}
        return {**state, "best": best}, loss

    manager = _checkpoint_manager(run_dir / RunDir.STAGE1_CHECKPOINTS, config)
    metrics_path = run_dir / RunDir.STAGE1_METRICS
    primary = is_primary()  # one process writes the metrics (orbax coordinates the rest)
    train_state = _restored(manager, train_state, run_dir)
    step_fn = make_train_step(
        problem.cfg, problem.plan, config, problem.prefix, mesh=mesh,
        like=(train_state, base, frozen),
    )  # fmt: skip
    batch_in = batch_sharding(mesh, 3, axis=1) if mesh is not None else None
    start = int(train_state["step"])
    if selecting and start == 0:
        train_state, loss = select(train_state)
        if primary:
            _append_metrics(metrics_path, {"step": 0, "held_out_ce": loss})
    bar = tqdm(total=config.steps, initial=start, desc="stage 1", disable=not progress)
    try:
        for step in range(start, config.steps):
            t0 = time.perf_counter()
            windows = step_batch(calib_ids, step, config, problem.seq_len, problem.key)
            batch = jax.device_put(windows, batch_in) if batch_in else jnp.asarray(windows)
            train_state, metrics = step_fn(train_state, batch, base, frozen)
            values = {k: float(host_array(v)) for k, v in metrics.items()}
            if not np.isfinite(values["loss"]):
                raise QnpuError(f"stage 1: non-finite loss at step {step + 1}")
            record = {"step": step + 1, **values, "seconds": time.perf_counter() - t0}
            if selecting and ((step + 1) % config.select_every == 0 or step + 1 == config.steps):
                train_state, record["held_out_ce"] = select(train_state)
            if primary:
                _append_metrics(metrics_path, record)
            manager.save(step + 1, args=ocp.args.StandardSave(train_state))
            bar.update(1)
            bar.set_postfix(loss=f"{values['loss']:.4f}", ce=f"{values['ce']:.4f}")
            if stop_after is not None and step + 1 >= stop_after:
                break
        done = int(train_state["step"])
        if done == config.steps and manager.latest_step() != done:
            manager.save(done, args=ocp.args.StandardSave(train_state), force=True)
    finally:
        manager.wait_until_finished()
        manager.close()
        bar.close()
    if selecting:
        return {**train_state, "params": train_state["best"]["params"]}
    return train_state
