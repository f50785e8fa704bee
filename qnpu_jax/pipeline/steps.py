"""Steps: pure functions `QuantizedModel -> QuantizedModel`, each recorded in the model.

A step is made by a factory that takes its options (and RNG keys) explicitly, e.g.
`hadamard_rotations(key)` or `promote("down_in", 0.10)`; the step records the arguments it was
made with, named by the factory's signature (`step_factory`). Calling it with a model and the
calibration data returns a new model with the step's name, arguments and report appended to
`model.steps`, so a saved model says how it was made. Recipes (`pipeline.recipes`) chain steps.

    model = steps.calibrate()(steps.plan(w_bits=4, a_bits=8)(model, data), data)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ParamSpec

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qnpu_jax.data import load_documents, sample_windows, tokenize_documents
from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    CHANNEL_INPUTS,
    GRAPH,
    KV_TENSORS,
    MUXQ_MAX_EXP,
    UNROTATED_INPUT,
    Graph,
    OpKind,
    layer_widths,
)
from qnpu_jax.mesh import place_params
from qnpu_jax.models.llama import Params
from qnpu_jax.models.taps import state_entry
from qnpu_jax.pipeline.calibrate import calibrate as calibrate_state
from qnpu_jax.pipeline.calibrate import channel_absmax, collect_activation_stats
from qnpu_jax.pipeline.mixed_precision import check_scanned, mixed_layer_bits, tensor_sensitivity
from qnpu_jax.pipeline.outlier_paths import (
    choose_muxq,
    choose_residual_split,
    choose_shadows,
    shadow_summary,
)
from qnpu_jax.pipeline.quantized_model import QuantizedModel
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.stage1 import (
    Stage1Config,
    Stage1Problem,
    clip_logits,
    clipped_weight_scales,
    init_train_state,
    learned_scales,
    merge_scales,
    run_stage1,
    transformed_params,
)
from qnpu_jax.pipeline.weight_rounding import gptq_round_weights
from qnpu_jax.quant.init import scale_from_stats
from qnpu_jax.quant.plan import QuantPlan, QuantRule, TensorQuant, default_plan
from qnpu_jax.quant.state import by_path, from_paths, get_entry, with_entry
from qnpu_jax.transforms import (
    EQUALIZED,
    randomized_hadamard_rotations,
    reader_absmax,
    smoothing_scales,
)
from qnpu_jax.transforms import fuse_norms as fuse_norm_weights
from qnpu_jax.transforms.equalize import grouped_max

# Stage1Config keys newer than the runs' records: {key: default}
STAGE1_LATER_KEYS = {
    "compute_dtype": "float32",
    "lr_equalization": 0.01,
    "objective": "end_to_end",
    "select_every": 0,
    "select_windows": 4,
}


def stage1_tensors(graph: Graph) -> tuple[str, ...]:
    """The linears' weights and inputs of `graph`: the tensors stage 1 quantizes (and learns)."""
    return (*graph.linear_io, *graph.linear_inputs)


STAGE1_TENSORS = stage1_tensors(GRAPH)  # LLaMA's


@dataclasses.dataclass(frozen=True)
class Calibration:
    """A recipe's calibration text: its token ids (stage 1 draws batches from them) and the
    calibration windows [N, T] (static ranges, scans, smoothing)."""

    ids: np.ndarray
    windows: np.ndarray

    def __post_init__(self) -> None:
        if np.asarray(self.windows).ndim != 2 or len(self.windows) == 0:
            raise QnpuError("calibration windows must be a non-empty [N, T] array of token ids")

    @property
    def seq_len(self) -> int:
        return int(np.asarray(self.windows).shape[1])

    @classmethod
    def from_text(
        cls, spec: str, tokenizer: Any, *, seq_len: int, windows: int, key: jax.Array
    ) -> Calibration:
        """`windows` random windows of `seq_len` tokens (drawn with `key`) of the text `spec`
        names (`qnpu_jax.data.load_documents`; "wiki": its calib split)."""

        split = "calib" if spec == "wiki" else None
        ids = tokenize_documents(load_documents(spec, split), tokenizer)
        return cls(ids, sample_windows(ids, seq_len, windows, key))

    def first_windows(self, count: int, key: jax.Array) -> np.ndarray:
        """`count` windows [count, T]: the calibration windows first, then windows drawn from
        the text with `key` (so the same count gives the calibration windows themselves)."""
        have = np.asarray(self.windows)
        if count <= len(have):
            return have[:count]
        more = sample_windows(np.asarray(self.ids), self.seq_len, count - len(have), key)
        return np.concatenate([have, more])


@dataclasses.dataclass(frozen=True)
class Context:
    """How a step runs, not what it computes: a working directory for checkpoints (stage 1
    resumes from it; None: a temporary one), progress bars, and the device mesh that stage 1,
    calibration and the sensitivity scan run on (None: the default device)."""

    workdir: Path | None = None
    progress: bool = False
    mesh: Mesh | None = None


StepFn = Callable[[QuantizedModel, Calibration, Context], tuple[QuantizedModel, Any]]


@dataclasses.dataclass(frozen=True, eq=False)
class Step:
    """A named, recorded model transformation. `describe` is its phase announcement;
    `resumable` steps are long and continue from their checkpoints in the working dir."""

    name: str
    args: Mapping[str, Any]
    fn: StepFn
    describe: str
    resumable: bool = False

    @property
    def label(self) -> str:
        """The step's name, with the tensor for a per-tensor step (timings, files)."""
        tensor = self.args.get("tensor")
        return f"{self.name}_{tensor}" if tensor else self.name

    def __call__(
        self, model: QuantizedModel, data: Calibration, context: Context | None = None
    ) -> QuantizedModel:
        new, info = self.fn(model, data, context or Context())
        return new.record(self.name, self.args, info)


# The steps that read only the model's own graph (its tensors, taps, norms' readers and the
# residual stream's writers; up→down smoothing: the gated MLP's up_proj and down_proj, which
# every graph names alike); the others equalize or add paths through LLaMA's graph
# (`check_llama_graph`).
ANY_GRAPH_STEPS = frozenset(
    {
        "plan",
        "promote",
        "calibrate",
        "fuse_norms",
        "hadamard_rotations",
        "choose_rotation",
        "smooth_mlp",
        "stage1",
        "gptq",
        "shadow_outliers",
        "muxq",
        "split_residual",
    }
)


P = ParamSpec("P")


def _recorded(value: Any) -> Any:
    """An argument as a step records it (JSON): an RNG key as its data, a step as its name, a
    rule or stage 1's config as its fields."""
    if isinstance(value, jax.Array):
        return np.asarray(jax.random.key_data(value)).tolist()
    if isinstance(value, Step):
        return value.name
    if isinstance(value, Stage1Config):
        recorded = dataclasses.asdict(value)
        # keys added after runs were made are recorded only off their default, so that a run
        # saved before them still resumes (its recorded steps must equal the recipe's)
        for name, default in STAGE1_LATER_KEYS.items():
            if recorded[name] == default:
                del recorded[name]
        return recorded
    if isinstance(value, QuantRule):
        return dataclasses.asdict(value)
    if isinstance(value, list | tuple):
        return [_recorded(v) for v in value]
    return value


def step_factory(
    *, resumable: bool = False, only_if_set: tuple[str, ...] = ()
) -> Callable[[Callable[P, tuple[StepFn, str]]], Callable[P, Step]]:
    """Makes a function of a step's options that returns (fn, its phase announcement) a step
    factory: the step is named after the function and records the arguments of the call,
    bound to the function's signature (with its defaults). The `only_if_set` ones are
    recorded only off their default: runs made before them still resume."""

    def wrap(factory: Callable[P, tuple[StepFn, str]]) -> Callable[P, Step]:
        signature = inspect.signature(factory)

        @functools.wraps(factory)
        def make(*args: P.args, **kwargs: P.kwargs) -> Step:
            fn, describe = factory(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            recorded = {
                name: _recorded(value)
                for name, value in bound.arguments.items()
                if name not in only_if_set or value != signature.parameters[name].default
            }
            return Step(factory.__name__, recorded, fn, describe, resumable)

        return make

    return wrap


@step_factory()
def fuse_norms() -> tuple[StepFn, str]:
    """Fold the RMSNorm weights into the following linears (needed before rotations)."""

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        if m.transforms.fused_norms:
            raise QnpuError("fuse_norms: the norms are fused already")
        if m.transforms.rotated or m.transforms.mlp_smoothing is not None:
            raise QnpuError("fuse_norms comes before rotations and smoothing")
        fuse_norm_weights(m.base, m.cfg)  # refuses a model it cannot fuse, now
        return m.with_transforms(m.transforms.replace(fused_norms=True)), None

    return fn, "fusing the norms into the linears"


@step_factory()
def hadamard_rotations(key: jax.Array) -> tuple[StepFn, str]:
    """Randomized Hadamard R1 (residual stream) and per-head R2 (o_proj input) from `key`."""

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        if not m.transforms.fused_norms:
            raise QnpuError("hadamard_rotations needs fused norms: put fuse_norms() first")
        if m.transforms.rotated:
            raise QnpuError("hadamard_rotations: the model is rotated already")
        r1, r2 = randomized_hadamard_rotations(m.cfg, key)
        return m.with_transforms(m.transforms.replace(r1=r1, r2=r2)), None

    return fn, "randomized Hadamard rotations R1/R2"


@step_factory()
def choose_rotation(
    keys: Sequence[jax.Array], score: Sequence[Step], windows: int = 4
) -> tuple[StepFn, str]:
    """Randomized Hadamard R1/R2 from the best of `keys`: each candidate rotates the model,
    `score`'s steps (e.g. the plan and a calibration) quantize a copy of it, and the one whose
    fake-quant model has the lowest perplexity on the first `windows` calibration windows is
    kept (the rotated model, not the scored copy)."""
    if len(keys) < 1:
        raise QnpuError("choose_rotation needs at least one key")
    if windows < 1:
        raise QnpuError(f"choose_rotation: windows must be >= 1, got {windows}")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        best: tuple[float, int, QuantizedModel] | None = None
        ppls = []
        for i, key in enumerate(keys):
            rotated = hadamard_rotations(key)(m, data, ctx)
            scored = rotated
            for step in score:
                scored = step(scored, data, ctx)
            ppl = float(scored.perplexity(np.asarray(data.windows)[:windows])["ppl"])
            ppls.append(ppl)
            if best is None or ppl < best[0]:
                best = (ppl, i, rotated)
        assert best is not None
        _, chosen, rotated = best
        kept = m.with_transforms(rotated.transforms)
        return kept, {"candidate_ppl": ppls, "chosen": chosen, "windows": windows}

    return fn, f"randomized Hadamard rotations R1/R2, the best of {len(keys)} by calibration loss"


@step_factory()
def smooth_mlp(alpha: float) -> tuple[StepFn, str]:
    """MobileQuant/SmoothQuant-style up→down smoothing with strength `alpha`, from the down_proj
    input ranges of the current model (rotations commute with it) over the calibration."""
    if not 0.0 <= alpha <= 1.0:
        raise QnpuError(f"smooth_mlp: alpha must be in [0, 1], got {alpha}")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        if m.transforms.mlp_smoothing is not None:
            raise QnpuError("smooth_mlp: the model is smoothed already")
        params = m.unrounded_params()  # the new transforms drop GPTQ's codes
        x = UNROTATED_INPUT
        absmax = channel_absmax(params, m.cfg, data.windows, (x,), prefix=m.prefix)
        scales = smoothing_scales(absmax[x], reader_absmax(params, m.cfg, x), alpha)
        t = m.transforms.replace(mlp_smoothing=scales, mlp_smoothing_alpha=float(alpha))
        return m.with_transforms(t), None

    return fn, f"MLP smoothing (alpha {alpha})"


@step_factory()
def equalize(alpha: float = 0.5, pairs: Sequence[str] = tuple(EQUALIZED)) -> tuple[StepFn, str]:
    """Equivalent scaling of the linear pairs `pairs` (default: every pair of
    `transforms.EQUALIZED`), each initialized by SmoothQuant's rule with strength `alpha` from
    the current model's input ranges over the calibration and its readers' weight columns (in
    the rotated basis when the model is rotated: put it after the rotations). A stage 1 after
    it learns the factors."""
    if isinstance(alpha, bool) or not 0.0 < alpha < 1.0:
        raise QnpuError(f"equalize: alpha must be in (0, 1), got {alpha!r}")
    chosen = tuple(pairs)
    unknown = sorted(set(chosen) - set(EQUALIZED))
    if unknown or not chosen:
        raise QnpuError(f"equalize: pairs must be among {sorted(EQUALIZED)}, got {list(chosen)}")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        if m.transforms.equalization:
            raise QnpuError("equalize: the model is equalized already")
        params = m.unrounded_params()  # the new transforms drop GPTQ's codes
        absmax = channel_absmax(params, m.cfg, data.windows, chosen, prefix=m.prefix)
        scales = {
            name: smoothing_scales(
                grouped_max(name, jnp.asarray(absmax[name]), m.cfg),
                reader_absmax(params, m.cfg, name),
                alpha,
            )
            for name in chosen
        }
        info = {
            name: {
                "min": float(jnp.min(s)),
                "median": float(jnp.median(s)),
                "max": float(jnp.max(s)),
            }
            for name, s in scales.items()
        }
        return m.with_transforms(m.transforms.replace(equalization=scales)), info

    return fn, f"equivalent scaling of {', '.join(chosen)} (α {alpha})"


@step_factory()
def plan(
    *,
    w_bits: int = 4,
    a_bits: int = 8,
    kv_bits: int = 8,
    down_in_bits: int = 8,
    rules: Sequence[QuantRule] = (),
    simulation: str = "device",
) -> tuple[StepFn, str]:
    """The deployment plan: docs/design.md §3's table at these bit-widths, then `rules` in order;
    `simulation`: what the fake-quant forward computes between quantizers (`QuantPlan`)."""

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        made = default_plan(
            m.cfg.num_layers,
            w_bits=w_bits,
            a_bits=a_bits,
            kv_bits=kv_bits,
            down_in_bits=down_in_bits,
            rules=list(rules),
            simulation=simulation,
            graph=m.transforms.graph(m.cfg),
        )
        return m.replace(plan=made, state=None, weight_codes=None), None

    return fn, f"plan W{w_bits}A{a_bits}KV{kv_bits} ({simulation} simulation)"


@step_factory()
def promote(tensor: str, fraction: float) -> tuple[StepFn, str]:
    """Eq. (4)'s sensitivity scan of the per-layer activation `tensor` on the current model,
    at the tensor's base bits in the plan, then the top `fraction` of layers at 16 bits and
    the others at the base bits (a per-layer-bits rule on the plan). A tensor planned at 16
    bits (Gemma 3's down_out) is at 16 bits in every layer whatever the scan says: it gets
    that rule without a scan, and its info says so (`skipped`, no layer promoted)."""
    if not 0.0 < fraction <= 1.0:
        raise QnpuError(f"promote: fraction must be in (0, 1], got {fraction}")
    check_scanned(tensor)

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        current = m.require_plan()
        planned = current.get(f"layers/{tensor}")
        if planned is None:
            raise QnpuError(f"promote: the plan does not quantize layers/{tensor}")
        info: dict[str, Any]
        if planned.bits >= 16:
            # e.g. Gemma 3's down_out (ir.graph): every layer ends at 16 bits whatever a scan
            # at 16 bits would measure, so none runs
            bits: Sequence[int] = (planned.bits,) * m.cfg.num_layers
            info = {
                "ratios": [],
                "bits_measured": None,
                "fraction": fraction,
                "promoted_layers": [],
                "layer_bits": list(bits),
                "skipped": f"layers/{tensor} is planned at {planned.bits} bits: no scan",
            }
        else:
            scan = tensor_sensitivity(
                place_params(ctx.mesh, m.unrounded_params()),  # the new plan drops GPTQ's codes
                m.cfg,
                data.windows,
                tensor,
                bits=planned.bits,
                prefix=m.prefix,
                mesh=ctx.mesh,
            )
            # a promotion the plan already holds is replaced, not added to
            bits = mixed_layer_bits(scan.ratios, fraction, planned.bits)
            info = {
                "ratios": list(scan.ratios),
                "bits_measured": scan.bits,
                "fraction": fraction,
                "promoted_layers": [i for i, b in enumerate(bits) if b == 16],
                "layer_bits": list(bits),
            }
        rule = QuantRule(pattern=f"layers/{tensor}", layer_bits=tuple(bits))
        return m.replace(plan=current.apply([rule]), state=None, weight_codes=None), info

    return fn, f"sensitivity scan (eq. 4) of layers/{tensor}"


def stage1_plan(
    plan: QuantPlan, *, selective: bool = True, learn: bool = True, learn_down_in: bool = True
) -> QuantPlan:
    """Selective optimization: only the linears' input activations and weights are quantized
    (and learnable with `learn`) in stage 1; everything else, lm_head included, stays float.
    Without `selective`, the linear outputs and the K/V cache are learned in stage 1 too
    (MobileQuant's activation range learning)."""
    graph = plan.graph
    names = stage1_tensors(graph)
    if not selective:
        names = (*names, *graph.linear_outputs, *KV_TENSORS)
    keep = {f"layers/{n}" for n in names}
    entries = []
    for path, tq in plan.entries:
        if path not in keep:
            continue
        learnable = learn and (path != f"layers/{UNROTATED_INPUT}" or learn_down_in)
        entries.append((path, dataclasses.replace(tq, learnable=learnable)))
    return plan.with_entries(entries)


@step_factory(resumable=True, only_if_set=("weight_clipping",))
def stage1(
    config: Stage1Config,
    key: jax.Array,
    *,
    learn_scales: bool = True,
    selective: bool = True,
    learn_down_in: bool = True,
    weight_clipping: bool = False,
) -> tuple[StepFn, str]:
    """Stage 1 (§4.3): R1/R2 learned with Cayley SGD under the stage-1 plan's fake quant, and
    with `learn_scales` the selective scales too (Quant.npu; without: SpinQuant's rotations
    only). An unrotated model learns no rotations; an equalized one learns its pairs' scales
    (MobileQuant, OmniQuant's LET); `weight_clipping` (with `learn_scales`) learns the linear
    weights' scales as clip factors of their current rows (OmniQuant's LWC). Batches are drawn
    from the calibration ids with `key`. The trained scales are kept over the next
    calibration's encodings."""
    if weight_clipping and not learn_scales:
        raise QnpuError("stage1: weight clipping is learned with the scales (learn_scales)")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        t = m.transforms
        if t.r1 is None and not t.equalization and not learn_scales:
            raise QnpuError(
                "stage1 has nothing to learn: no rotations (hadamard_rotations), no equivalent "
                "scales (equalize) and no scales"
            )
        s1_plan = stage1_plan(
            m.require_plan(), selective=selective, learn=learn_scales, learn_down_in=learn_down_in
        )
        params = place_params(ctx.mesh, m.unrounded_params())  # stage 1 drops GPTQ's codes
        s1_state = calibrate_state(
            params, m.cfg, s1_plan, data.windows, prefix=m.prefix, mesh=ctx.mesh
        )
        clip = clip_logits(params, s1_state, s1_plan) if weight_clipping else None
        with tempfile.TemporaryDirectory() as tmp:
            workdir = RunDir(ctx.workdir).stage1_dir if ctx.workdir is not None else Path(tmp)
            base = t.apply(m.base, m.cfg, rotate=False)
            start = init_train_state(
                t.r1, t.r2, s1_state, s1_plan, config, equalization=t.equalization, clip=clip
            )
            problem = Stage1Problem(
                cfg=m.cfg,
                plan=s1_plan,
                config=config,
                base_params=base,
                frozen_state=s1_state,
                calib_ids=data.ids,
                seq_len=data.seq_len,
                key=key,
                prefix=m.prefix,
            )
            trained = run_stage1(
                start, problem, run_dir=workdir, progress=ctx.progress, mesh=ctx.mesh
            )
        learned = trained["params"]
        scales = learned_scales(learned["scales"], config.scale_param) if learn_scales else None
        if "clip" in learned and scales is not None:
            final = transformed_params(base, m.cfg, learned)
            clipped = clipped_weight_scales(final, learned["clip"], s1_state)
            weights = learned_scales(clipped, "linear")["layers"]
            scales = {**scales, "layers": {**scales["layers"], **weights}}
        equalization = t.equalization
        if "equalization" in learned:
            equalization = {k: jnp.exp(v) for k, v in learned["equalization"].items()}
        new = m.replace(
            transforms=t.replace(
                r1=learned.get("r1"), r2=learned.get("r2"), equalization=equalization
            ),
            state=None,
            weight_codes=None,
            trained=scales,
        )
        info: dict[str, Any] = {}
        if "clip" in learned:
            info["clip_factor_mean"] = {
                f"{name}.{side}": float(jnp.mean(jax.nn.sigmoid(v)))
                for name, sides in learned["clip"].items()
                for side, v in sides.items()
            }
        if "best" in trained:  # checkpoint selection
            info["selected_step"] = int(trained["best"]["step"])
            info["held_out_ce"] = float(trained["best"]["loss"])
        return new, info or None

    what = "the model's rotations and equivalent scales" + (", scales" if learn_scales else "")
    what += ", weight clip factors" if weight_clipping else ""
    return fn, f"stage 1: {config.steps} steps ({what})"


@step_factory(only_if_set=("paths",))
def calibrate(paths: Sequence[str] | None = None) -> tuple[StepFn, str]:
    """Stage 2: static encodings of every tensor of the plan from the current model over the
    calibration windows; stage 1's trained scales are kept over them.

    With `paths`, only those plan entries are calibrated again (e.g. after a rule changed
    them): the other encodings stay, those of tensors the plan no longer quantizes go, and
    GPTQ's weight codes stay unless a recalibrated path is a rounded weight (an error: run
    gptq again)."""
    chosen = None if paths is None else tuple(paths)
    if chosen is not None and not chosen:
        raise QnpuError("calibrate: `paths` is empty (None calibrates every tensor)")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        plan = m.require_plan()
        if chosen is None:
            state = calibrate_state(  # GPTQ's codes go: their grid is recalibrated
                place_params(ctx.mesh, m.unrounded_params()),
                m.cfg,
                plan,
                data.windows,
                prefix=m.prefix,
                mesh=ctx.mesh,
            )
            if m.trained is not None:
                state = merge_scales(state, m.trained)
            return m.replace(state=state, weight_codes=None), None
        planned = {p for p, _ in plan.entries}
        unknown = [p for p in chosen if p not in planned]
        if unknown:
            raise QnpuError(f"calibrate: {unknown} are not tensors of the plan")
        rounded = [p for p in chosen if p.removeprefix("layers/") in (m.weight_codes or {})]
        if rounded:
            raise QnpuError(f"calibrate: {rounded} carry GPTQ codes; run gptq again instead")
        sub = plan.with_entries(e for e in plan.entries if e[0] in chosen)
        fresh = by_path(
            calibrate_state(
                place_params(ctx.mesh, m.params()),
                m.cfg,
                sub,
                data.windows,
                prefix=m.prefix,
                mesh=ctx.mesh,
                prefix_params=_placed_prefix_params(m, ctx),
            )
        )
        for p, fields in by_path(m.trained or {}).items():  # stage 1's scales stay
            if p in fresh:
                fresh[p] = fresh[p].replace(**fields)
        kept = {p: e for p, e in by_path(m.require_state()).items() if p in planned}
        return m.replace(state=from_paths({**kept, **fresh})), None

    what = "every tensor of the plan" if chosen is None else ", ".join(chosen)
    return fn, f"stage 2: static calibration of {what}"


def _placed_prefix_params(m: QuantizedModel, ctx: Context) -> Params | None:
    """`m.prefix_params()` on the context's mesh (None: the prefix runs on `m.params()`)."""
    unrounded = m.prefix_params()
    return None if unrounded is None else place_params(ctx.mesh, unrounded)


def _channel_input(plan: QuantPlan, tensor: str, what: str) -> TensorQuant:
    """The plan entry of a channel-wise linear input an outlier step may change."""
    tq = plan.get(f"layers/{tensor}")
    if tensor not in CHANNEL_INPUTS or tq is None:
        raise QnpuError(
            f"{what}: {tensor!r} is not a quantized linear input of the plan written channel "
            f"by channel ({', '.join(CHANNEL_INPUTS)})"
        )
    if tq.shadow_channels is not None or tq.muxq_channels is not None:
        raise QnpuError(f"{what}: layers/{tensor} has outlier channels already")
    return tq


@step_factory()
def shadow_outliers(
    tensor: str = UNROTATED_INPUT, clip: float = 99.99, keep: float = 0.15
) -> tuple[StepFn, str]:
    """mllm-NPU's shadow outlier execution on the linear input `tensor` (`pipeline.outlier_paths`):
    in the ceil(keep·L) most important layers, its scale is re-set to clip |x| at the
    `clip`-th percentile of the calibration values and the channels that overflow that range
    become shadow channels (codes not clamped: the device adds their overflow back on a
    shadow path). The other layers keep their encodings. Run it after calibration (stage 2),
    which would re-set those scales."""
    if not 0.0 < clip <= 100.0:
        raise QnpuError(f"shadow outliers: clip must be a percentile in (0, 100], got {clip}")
    if not 0.0 < keep <= 1.0:
        raise QnpuError(f"shadow outliers: keep must be in (0, 1], got {keep}")
    path = f"layers/{tensor}"

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        plan, state = m.require_plan(), m.require_state()
        tq = _channel_input(plan, tensor, "shadow outliers")
        params = place_params(ctx.mesh, m.params())
        prefix_params = _placed_prefix_params(m, ctx)
        n = m.cfg.num_layers
        single = QuantPlan(((path, dataclasses.replace(tq, init="percentile")),), n)
        stats = collect_activation_stats(
            params,
            m.cfg,
            single,
            data.windows,
            prefix=m.prefix,
            mesh=ctx.mesh,
            prefix_params=prefix_params,
        )["layers"][tensor]
        clipped = [
            scale_from_stats(
                jax.tree.map(lambda a, i=i: a[i], stats), "percentile", tq.spec(i), percentile=clip
            )
            for i in range(n)
        ]
        clip_scale = np.stack([np.asarray(s, np.float32).reshape(()) for s, _ in clipped])
        clip_zero = np.stack([np.asarray(z, np.float32).reshape(()) for _, z in clipped])
        absmax = channel_absmax(
            params, m.cfg, data.windows, (tensor,), prefix=m.prefix, prefix_params=prefix_params
        )[tensor]
        choice = choose_shadows(absmax, clip_scale, clip_zero, tq, keep)
        old = get_entry(state, path)
        kept = np.isin(np.arange(n), choice.kept_layers)
        scale = np.where(kept, clip_scale, np.asarray(old.scale, np.float32).reshape(n))
        zero = np.where(kept, clip_zero, np.asarray(old.zero_point, np.float32).reshape(n))
        shadowed = dataclasses.replace(tq, shadow_channels=choice.channels)
        new_plan = plan.with_entries((p, shadowed if p == path else t) for p, t in plan.entries)
        width = layer_widths(m.cfg.dims)[tensor]
        entry = state_entry(shadowed, scale, zero, layers=n, width=width)
        info = {"tensor": tensor, "clip": clip, "keep": keep, **shadow_summary(choice)}
        return m.replace(plan=new_plan, state=with_entry(state, path, entry)), info

    return fn, f"shadow outliers of {path} (clip at P{clip:g}, {keep:.0%} of layers)"


@step_factory()
def muxq(tensor: str = UNROTATED_INPUT, exp: int = 2, threshold: float = 6.0) -> tuple[StepFn, str]:
    """MUXQ on the linear input `tensor` (`pipeline.outlier_paths`): its channels whose largest
    |x| over the calibration exceeds `threshold` are shifted right by `exp` bits into the
    Body tensor, whose per-tensor scale is re-set to Body's range (Max-Min, symmetric) in the
    layers at 8 bits or fewer that have such channels; the device adds (2^exp − 1)·Aux·W.
    Run it after calibration (stage 2), which would re-set those scales."""
    if isinstance(exp, bool) or not isinstance(exp, int) or not 1 <= exp <= MUXQ_MAX_EXP:
        raise QnpuError(f"MUXQ: exp must be an integer in 1..{MUXQ_MAX_EXP}, got {exp!r}")
    if not threshold > 0:
        raise QnpuError(f"MUXQ: the outlier threshold must be positive, got {threshold}")
    path = f"layers/{tensor}"

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        plan, state = m.require_plan(), m.require_state()
        tq = _channel_input(plan, tensor, "MUXQ")
        if not tq.symmetric:
            raise QnpuError(f"MUXQ: {path} must be symmetric (Body's range from |x|)")
        params = place_params(ctx.mesh, m.params())
        n = m.cfg.num_layers
        absmax = channel_absmax(
            params,
            m.cfg,
            data.windows,
            (tensor,),
            prefix=m.prefix,
            prefix_params=_placed_prefix_params(m, ctx),
        )[tensor]
        choice = choose_muxq(absmax, exp, threshold, tq)
        old = np.asarray(get_entry(state, path).scale, np.float32).reshape(n)
        qmax = np.array([tq.qrange(tq.bits_for_layer(i))[1] for i in range(n)], np.float64)
        body_scale = np.asarray(choice.body_absmax, np.float64) / qmax
        has = np.array([bool(c) for c in choice.channels])
        base = np.where(has, np.maximum(body_scale, 1e-12), old).astype(np.float32)
        shifted = dataclasses.replace(tq, muxq_channels=choice.channels, muxq_exp=exp)
        width = layer_widths(m.cfg.dims)[tensor]
        scale = base[:, None] * shifted.muxq_multipliers(width).astype(np.float32)
        entry = get_entry(state, path).replace(scale=jnp.asarray(scale))
        new_plan = plan.with_entries((p, shifted if p == path else t) for p, t in plan.entries)
        info = {
            "tensor": tensor,
            "exp": exp,
            "threshold": threshold,
            "channels_per_layer": [len(c) for c in choice.channels],
        }
        return m.replace(plan=new_plan, state=with_entry(state, path, entry)), info

    return fn, f"MUXQ of {path} (channels above {threshold:g} shifted by {exp} bits)"


@step_factory()
def split_residual(div: float = 8.0) -> tuple[StepFn, str]:
    """The residual split of every residual add's output (`pipeline.outlier_paths`): per
    layer, the channels whose largest |x| over the calibration exceeds 1/`div` of the
    layer's largest hold x >> exp (one exp per tensor, the smallest that brings them under
    the other channels' range), and the per-tensor scale is re-set to the Body's range
    (Max-Min, symmetric, times the tensor's headroom). Run it after calibration (stage 2),
    which would re-set those scales."""
    if not div > 1:
        raise QnpuError(f"residual split: div must be above 1, got {div}")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        plan, state = m.require_plan(), m.require_state()
        names = tuple(op.out_name for op in plan.graph.ops(OpKind.ADD))
        for name in names:
            tq = plan.get(f"layers/{name}")
            if tq is None or not tq.symmetric:
                raise QnpuError(f"residual split: layers/{name} must be quantized, symmetric")
            if tq.muxq_channels is not None or tq.shadow_channels is not None:
                raise QnpuError(f"residual split: layers/{name} has outlier channels already")
        absmax = channel_absmax(
            place_params(ctx.mesh, m.params()),
            m.cfg,
            data.windows,
            names,
            prefix=m.prefix,
            prefix_params=_placed_prefix_params(m, ctx),
        )
        n, widths, info = m.cfg.num_layers, layer_widths(m.cfg.dims), {}
        for name in names:
            path, tq = f"layers/{name}", plan.get(f"layers/{name}")
            assert tq is not None
            choice = choose_residual_split(absmax[name], div)
            qmax = np.array([tq.qrange(tq.bits_for_layer(i))[1] for i in range(n)], np.float64)
            body = np.asarray(choice.body_absmax, np.float64) * tq.headroom / qmax
            split = dataclasses.replace(tq, muxq_channels=choice.channels, muxq_exp=choice.exp)
            multipliers = split.muxq_multipliers(widths[name]).astype(np.float32)
            scale = np.maximum(body, 1e-12).astype(np.float32)[:, None] * multipliers
            entry = get_entry(state, path).replace(scale=jnp.asarray(scale))
            state = with_entry(state, path, entry)
            plan = plan.with_entries((p, split if p == path else t) for p, t in plan.entries)
            info[name] = {
                "exp": choice.exp,
                "channels_per_layer": [len(c) for c in choice.channels],
            }
        return m.replace(plan=plan, state=state), {"div": div, **info}

    return fn, f"residual split (channels above 1/{div:g} of each layer's largest |x|)"


@step_factory(only_if_set=("windows", "key", "passes"))
def gptq(
    damp: float = 0.01,
    act_order: bool = False,
    windows: int | None = None,
    key: jax.Array | None = None,
    passes: int = 1,
) -> tuple[StepFn, str]:
    """GPTQ's integer codes of every quantized linear weight on the calibrated grid (the
    scales stay), from the fake-quant model's Hessians over the calibration; `act_order`
    rounds each weight's columns by decreasing H_ii. `windows`: the Hessians over that many
    windows (`Calibration.first_windows`, the ones beyond the calibration's drawn with `key`).
    `passes`: each after the first takes the Hessians with the last pass's codes in place."""
    if not damp > 0:
        raise QnpuError(f"gptq: damp must be positive, got {damp}")
    if passes < 1:
        raise QnpuError(f"gptq: passes must be at least 1, got {passes}")
    if windows is not None and (windows < 1 or key is None):
        raise QnpuError(f"gptq: windows must be positive and come with a key, got {windows}")

    def fn(m: QuantizedModel, data: Calibration, ctx: Context) -> tuple[QuantizedModel, Any]:
        if m.weight_codes:
            raise QnpuError("gptq: the weights are rounded already")
        chosen = data.windows
        if windows is not None and key is not None:  # both or neither (checked above)
            chosen = data.first_windows(windows, key)
        codes = gptq_round_weights(
            m.params(),
            m.require_state(),
            m.require_plan(),
            m.cfg,
            chosen,
            damp=damp,
            act_order=act_order,
            passes=passes,
            prefix=m.prefix,
        )
        return m.replace(weight_codes=codes), None

    how = [*(["act-order"] if act_order else []), *([f"{windows} windows"] if windows else [])]
    how += [f"{passes} passes"] if passes > 1 else []
    return fn, "GPTQ rounding of the linear weights" + (f" ({', '.join(how)})" if how else "")
