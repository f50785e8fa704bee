"""`QuantizedModel`: a quantized model as one pytree value.

It holds the float base params as loaded, every model-equivalent transform applied to them
(`Transforms`: fused norms, MLP smoothing, R1/R2, equivalent scaling), the quantization plan,
the quantizer state (the encodings, in the forward's layer view), GPTQ's weight codes when a
rounding step chose them, the sink prefix and the record of the steps that made it. Steps
(`pipeline.steps`) map a QuantizedModel to a new one; recipes (`pipeline.recipes`) chain steps.

`save(dir)` writes
    model.json   format, base model spec and config, the base weights' identity (location and
                 sha256 of each weights file), sink prefix, static transform facts, the step
                 records; written last (its presence marks a complete save)
    plan.json    the plan
    learned/     orbax: the quantizer state, R1/R2, the smoothing and equivalent scales,
                 GPTQ's codes
and `QuantizedModel.load(dir)` restores the value without running any step: the base model is
loaded from its spec, refused unless its weights files have the recorded sha256 (a model.json
saved before weights were recorded has none, and any base of the same config loads), and the
stored transforms are applied to it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import zlib
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import struct
from jax.sharding import Mesh

from qnpu_jax.errors import QnpuError, first_line
from qnpu_jax.eval import perplexity
from qnpu_jax.files import write_json_atomic
from qnpu_jax.ir.graph import Graph
from qnpu_jax.mesh import data_size, host_tree, is_primary, place_params, sync
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params, graph_of, rotated_graph
from qnpu_jax.models.load import WeightsIdentity, load_model
from qnpu_jax.models.taps import FakeQuantTaps, QuantState, sink_prefix, tapped_token_nll
from qnpu_jax.pipeline.run_dir import MODEL_FORMAT, MODEL_VERSION, RunDir
from qnpu_jax.pipeline.weight_rounding import weights_from_codes
from qnpu_jax.quant.plan import QuantPlan
from qnpu_jax.quant.state import state_from_tree
from qnpu_jax.transforms import (
    add_rotation_linears,
    apply_rotations,
    equalize,
    fuse_norms,
    smooth_mlp,
)

ORTHOGONALITY_TOL = 1e-3  # max |R·Rᵀ − I| of a learned float32 rotation (Cayley keeps ~1e-6)


class Transforms(struct.PyTreeNode):
    """The model-equivalent rewrites of the base params, applied in this order: norm fusion,
    up→down smoothing (scales [L, I]), R1/R2 rotations, equivalent channel scaling of the
    linear pairs in the rotated basis ({input name: s [L, C]}, `transforms.equalize`). None:
    not applied."""

    mlp_smoothing: jax.Array | None = None
    r1: jax.Array | None = None
    r2: jax.Array | None = None
    equalization: dict[str, jax.Array] | None = None
    fused_norms: bool = struct.field(pytree_node=False, default=False)
    mlp_smoothing_alpha: float | None = struct.field(pytree_node=False, default=None)

    @property
    def rotated(self) -> bool:
        return self.r1 is not None

    def graph(self, cfg: ModelConfig) -> Graph:
        """The graph of the params `apply` gives: `cfg`'s, or with R1 on a model whose
        post-norms join the residual (Gemma 3), its variant with a rotation linear after each
        pre-norm."""
        if self.fused_norms and self.r1 is not None:
            return rotated_graph(cfg)
        return graph_of(cfg)

    def apply(self, base: Params, cfg: ModelConfig, *, rotate: bool = True) -> Params:
        """`base` rewritten by every transform (`rotate` False: all but R1/R2 and the
        equalization, the base that stage 1 rotates and scales on the fly). With R1 on a model
        whose post-norms join the residual, each pre-norm gets a rotation linear (`graph`)."""
        if self.fused_norms and self.r1 is not None:
            base = add_rotation_linears(base, cfg)
        params = fuse_norms(base, cfg) if self.fused_norms else base
        if self.mlp_smoothing is not None:
            params = smooth_mlp(params, self.mlp_smoothing)
        if rotate and self.r1 is not None:
            params = apply_rotations(params, cfg, self.r1, self.r2)
        if rotate and self.equalization:
            params = equalize(params, cfg, self.equalization)
        return params


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One applied step: its name, its recorded arguments and what it reported (JSON text,
    so the record is hashable and compares by value)."""

    name: str
    args_json: str = "{}"
    info_json: str = "null"

    @classmethod
    def of(cls, name: str, args: Mapping[str, Any], info: Any = None) -> StepRecord:
        return cls(name, json.dumps(dict(args), sort_keys=True), json.dumps(info, sort_keys=True))

    @property
    def args(self) -> dict[str, Any]:
        return dict(json.loads(self.args_json))

    @property
    def info(self) -> Any:
        return json.loads(self.info_json)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "args": self.args, "info": self.info}


class QuantizedModel(struct.PyTreeNode):
    """A model under quantization (see the module docstring). Pure: every step returns a new
    value; `replace` changes fields."""

    base: Params
    transforms: Transforms
    state: QuantState | None = None
    weight_codes: dict[str, jax.Array] | None = None
    # stage 1's trained scales ({"layers": {name: {"scale", ...}}, "outer": ...}): a
    # calibration keeps them over the encodings it computes
    trained: dict[str, Any] | None = None
    cfg: ModelConfig = struct.field(pytree_node=False, kw_only=True)
    source: str = struct.field(pytree_node=False, kw_only=True)  # the base model's spec
    # the base weights' files and digests (None: a base made in memory, or an older save)
    base_weights: WeightsIdentity | None = struct.field(
        pytree_node=False, default=None, kw_only=True
    )
    prefix: tuple[int, ...] = struct.field(pytree_node=False, default=(), kw_only=True)
    plan: QuantPlan | None = struct.field(pytree_node=False, default=None, kw_only=True)
    steps: tuple[StepRecord, ...] = struct.field(pytree_node=False, default=(), kw_only=True)
    # `base_fingerprint` of the base params and model config as loaded (None: unknown): `save`
    # stores neither (`load` rebuilds them from `source`), so it refuses a model whose differ
    base_fingerprint: str | None = struct.field(pytree_node=False, default=None, kw_only=True)

    @classmethod
    def from_float(cls, loaded: Any, *, prefix: str | tuple[int, ...] = ()) -> QuantizedModel:
        """The float `loaded` model (a `LoadedModel`) before any step. `prefix`: the sink
        prefix, token ids or a name ("bos", "none") that `sink_prefix` resolves."""

        ids = sink_prefix(prefix, loaded.tokenizer) if isinstance(prefix, str) else prefix
        return cls(
            loaded.params,
            Transforms(),
            cfg=loaded.config,
            source=loaded.source,
            base_weights=getattr(loaded, "weights", None),
            prefix=tuple(int(i) for i in ids),
            base_fingerprint=base_fingerprint(loaded.params, loaded.config),
        )

    def params(self) -> Params:
        """The effective float params: transforms applied, GPTQ's codes in place."""
        params = self.transforms.apply(self.base, self.cfg)
        if self.weight_codes:
            params = weights_from_codes(params, self.require_state(), self.weight_codes)
        return params

    def unrounded_params(self) -> Params:
        """The transformed float params before GPTQ's rounding (`params()` without codes)."""
        return self.transforms.apply(self.base, self.cfg)

    def prefix_params(self) -> Params | None:
        """The float params the offline sink prefix runs on where they differ from
        `params()` (GPTQ's codes in place): the transformed weights before rounding. None:
        `params()` serve (the prefix's taps leave weights in float). Every forward of a model
        with codes takes them (`prefix_params=`), or its prefix K/V are the rounded model's."""
        if not self.weight_codes:
            return None
        return self.unrounded_params()

    def with_transforms(self, transforms: Transforms) -> QuantizedModel:
        """The model under new `transforms`: GPTQ's codes, made for the old weights, go."""
        return self.replace(transforms=transforms, weight_codes=None)

    def require_plan(self) -> QuantPlan:
        if self.plan is None:
            raise QnpuError("the model has no quantization plan yet: add a plan step first")
        return self.plan

    def require_state(self) -> QuantState:
        if self.state is None:
            raise QnpuError("the model has no encodings yet: add a calibrate step first")
        return self.state

    def record(self, name: str, args: Mapping[str, Any], info: Any = None) -> QuantizedModel:
        return self.replace(steps=(*self.steps, StepRecord.of(name, args, info)))

    def step_info(self, name: str, **args: Any) -> Any:
        """The info of the last step `name` whose args include `args` (None: no such step)."""
        for rec in reversed(self.steps):
            if rec.name == name and all(rec.args.get(k) == v for k, v in args.items()):
                return rec.info
        return None

    def nll_fn(self, mesh: Mesh | None = None) -> Any:
        """tokens [B, T] -> next-token NLL [B, T-1] of the static fake-quant model (the float
        model while there is no state), with the params placed on `mesh` (if any). The sink
        prefix runs on `prefix_params()` where those differ."""
        plan = self.require_plan() if self.state is not None else None
        return static_nll_fn(
            self.params(),
            self.state,
            plan,
            self.cfg,
            self.prefix,
            mesh=mesh,
            prefix_params=self.prefix_params(),
        )

    def perplexity(self, windows: np.ndarray, *, progress: bool = False) -> dict[str, Any]:
        """{"ppl", "windows", "tokens"} of the fake-quant model over token `windows` [N, T]."""
        return nll_perplexity(self.nll_fn(), windows, progress=progress)

    def check_base_unchanged(self) -> None:
        """Refuse a model whose base params or model config differ from those it was made
        from (`from_float`, `load`): `save` stores neither, `load` would rebuild them from
        `source`, so a step's change to them would be lost. Such a change belongs in a
        transform, an encoding or the weight codes (docs/pipeline.md, "Custom steps")."""
        if self.base_fingerprint is None:
            return
        now = base_fingerprint(self.base, self.cfg)
        if now is not None and now != self.base_fingerprint:
            after = [r.name for r in self.steps]
            raise QnpuError(
                "the model's base params or model config are not those it was made from "
                f"({self.source}): a step changed `base` or `cfg` (steps: "
                f"{', '.join(after) or 'none'}), which `save` does not store, so loading would "
                "lose the change. Change the model through its transforms, encodings (state) or "
                "weight codes instead (docs/pipeline.md, 'Custom steps')"
            )

    def save(self, directory: Path) -> Path:
        """Write the model to `directory` (see the module docstring); model.json goes last.
        In a multi-host job every process calls it and the primary one writes."""

        self.check_base_unchanged()  # before anything is written
        directory = Path(directory)
        saved = RunDir(directory)
        primary = is_primary()
        if primary:
            directory.mkdir(parents=True, exist_ok=True)
            saved.model_json_path.unlink(missing_ok=True)
            write_json_atomic(saved.plan_path, self.require_plan().to_dict())
        t = self.transforms
        save_learned(
            directory,
            t.r1,
            t.r2,
            self.state,
            self.weight_codes,
            t.mlp_smoothing,
            t.mlp_smoothing_alpha,
            t.equalization,
            self.trained,
        )
        if primary:
            write_json_atomic(
                saved.model_json_path,
                {
                    "format": MODEL_FORMAT,
                    "version": MODEL_VERSION,
                    "source": self.source,
                    **self._weights_json(),
                    "config": _config_json(self.cfg),
                    "prefix": list(self.prefix),
                    "fused_norms": t.fused_norms,
                    "rotated": t.rotated,
                    "mlp_smoothing_alpha": t.mlp_smoothing_alpha,
                    "equalized": sorted(t.equalization or {}),
                    "steps": [rec.to_dict() for rec in self.steps],
                },
            )
        sync("qnpu: model saved")
        return directory

    def _weights_json(self) -> dict[str, Any]:
        return {} if self.base_weights is None else {"weights": self.base_weights.to_json()}

    @classmethod
    def load(cls, directory: Path, base: Any = None) -> QuantizedModel:
        """The model `save` wrote to `directory`; `base` (a `LoadedModel`) is its float model,
        loaded from the stored spec when None. No step runs."""
        directory = Path(directory)
        meta = RunDir(directory).read_model_json()
        if base is None:
            base = load_model(meta["source"])
        if _config_json(base.config) != meta["config"]:
            raise QnpuError(
                f"{directory}: the base model {meta['source']!r} is not the one this model was "
                "made on (its config differs)"
            )
        check_base_weights(directory, meta, base)
        steps = tuple(
            StepRecord.of(s["name"], s.get("args", {}), s.get("info")) for s in meta["steps"]
        )
        return assemble(
            directory,
            base,
            fused_norms=bool(meta["fused_norms"]),
            rotated=bool(meta["rotated"]),
            smoothing_alpha=meta["mlp_smoothing_alpha"],
            equalized=tuple(meta.get("equalized", ())),
            prefix=tuple(int(i) for i in meta["prefix"]),
            steps=steps,
        )


def check_base_weights(directory: Path, meta: Mapping[str, Any], base: Any) -> None:
    """Refuse a `base` whose weights files differ from those model.json records (a model.json
    without them, saved before they were recorded, accepts any base)."""
    if "weights" not in meta:
        return
    where = str(RunDir(directory).model_json_path)
    recorded = WeightsIdentity.from_json(meta["weights"], where)
    actual = getattr(base, "weights", None)
    if actual is None:
        raise QnpuError(
            f"{where} records its base weights {recorded.describe()}, but the base model given "
            "was not loaded from files (load it with load_model), so it cannot be checked"
        )
    if not actual.same_weights(recorded):
        raise QnpuError(
            f"{directory} was made from the base weights {recorded.describe()}, not from "
            f"{actual.describe()}: other weights; point the model at the original files"
        )


def _config_json(cfg: ModelConfig) -> Any:
    # the Gemma fields at their defaults are left out: runs saved before them still match
    return cfg.to_json()


def base_fingerprint(params: Params, cfg: ModelConfig) -> str | None:
    """A fingerprint of base params and their model config: every leaf's path, dtype, shape
    and CRC-32 of its bytes (fast: a change a step makes is caught; a forged one could pass),
    and the config. None where the params are not all on this host (a multi-host array)."""
    parts = [json.dumps(_config_json(cfg), sort_keys=True)]
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not getattr(leaf, "is_fully_addressable", True):
            return None
        a = np.ascontiguousarray(np.asarray(leaf))
        crc = zlib.crc32(a.view(np.uint8).reshape(-1).data) if a.size else 0
        parts.append(f"{jax.tree_util.keystr(path)} {a.dtype} {a.shape} {crc:08x}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def static_nll_fn(
    params: Params,
    state: QuantState | None,
    plan: QuantPlan | None,
    cfg: ModelConfig,
    prefix: tuple[int, ...],
    *,
    mesh: Mesh | None = None,
    prefix_params: Params | None = None,
) -> Any:
    """tokens [B, T] -> next-token NLL [B, T-1] of the static fake-quant model of `plan` and
    `state` (`plan` None: the float model), with the params placed on `mesh` (if any). The
    sink prefix runs on `prefix_params` where not None (a model with GPTQ's codes)."""
    return partial(
        tapped_token_nll,
        place_params(mesh, params),
        state,
        cfg=cfg,
        taps=None if plan is None else FakeQuantTaps(plan),
        prefix=prefix,
        prefix_params=None if prefix_params is None else place_params(mesh, prefix_params),
    )


def nll_perplexity(
    nll: Any, windows: np.ndarray, *, progress: bool = False, mesh: Any = None
) -> dict[str, Any]:
    """{"ppl", "windows", "tokens"} of `nll` over `windows`, on `mesh` as many windows at a time
    as its data axis has devices (one without a mesh)."""

    result = perplexity(nll, windows, batch_size=data_size(mesh), progress=progress, mesh=mesh)
    return {"ppl": result.ppl, "windows": result.windows, "tokens": result.predicted_tokens}


def save_learned(
    directory: Path,
    r1: Any,
    r2: Any,
    state: QuantState | None,
    weight_codes: Mapping[str, Any] | None = None,
    smoothing: Any = None,
    smoothing_alpha: float | None = None,
    equalization: Mapping[str, Any] | None = None,
    trained: Mapping[str, Any] | None = None,
) -> None:
    """Write rotations (None: unrotated), the quantizer state (None: not calibrated yet),
    GPTQ's weight codes (None: round-to-nearest), the up→down smoothing scales (None: no
    smoothing), the pairs' equivalent scales (None: none) and stage 1's trained scales (None:
    none; a later calibration keeps them) to directory/learned, through a
    temporary sibling and a rename; as host arrays, so a run made on a mesh loads on any
    device count. Every process of a multi-host
    job calls it (the arrays are gathered); the primary one writes."""

    tree: dict[str, Any] = {} if state is None else {"state": state}
    if r1 is not None:
        tree |= {"r1": r1, "r2": r2}
    if weight_codes:
        tree["weight_codes"] = dict(weight_codes)
    if smoothing is not None:
        tree["mlp_smoothing"] = smoothing
        tree["mlp_smoothing_alpha"] = np.asarray(smoothing_alpha, np.float32)
    if equalization:
        tree["equalization"] = dict(equalization)
    if trained:
        tree["trained"] = dict(trained)
    host = host_tree(tree)
    if is_primary():
        target = RunDir(directory).learned_path.resolve()
        tmp = target.with_name(f"{RunDir.LEARNED}.tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        alone = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
        with ocp.StandardCheckpointer(multiprocessing_options=alone) as ckpt:
            ckpt.save(tmp, host)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    sync("qnpu: learned saved")


def restore_learned(directory: Path) -> dict[str, Any]:
    """The orbax tree in directory/learned, with orbax's failures as a QnpuError naming it."""

    path = RunDir(directory).learned_path.resolve()
    if not path.exists():
        raise QnpuError(f"{Path(directory)} is not a finished run: {RunDir.LEARNED} is missing")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            learned = ckpt.restore(path)
    except Exception as e:  # orbax/tensorstore raise many types; all mean "unreadable"
        raise QnpuError(f"{path}: cannot restore the learned checkpoint ({first_line(e)})") from e
    if not isinstance(learned, dict):
        raise QnpuError(f"{path}: the learned checkpoint is not a tree of named arrays")
    return learned


def check_orthogonal(name: str, r: np.ndarray, where: str) -> None:
    """Refuse a rotation (or a stack of them) that is not orthogonal: folding it into the
    weights would silently change the model."""
    r = np.asarray(r, np.float64)
    if r.ndim < 2 or r.shape[-1] != r.shape[-2]:
        raise QnpuError(f"{where}: rotation {name} has shape {r.shape}, not square")
    if not np.isfinite(r).all():
        raise QnpuError(f"{where}: rotation {name} holds NaN or infinity")
    err = float(np.abs(r @ np.swapaxes(r, -1, -2) - np.eye(r.shape[-1])).max())
    if err > ORTHOGONALITY_TOL:
        raise QnpuError(
            f"{where}: rotation {name} is not orthogonal (max |R·Rᵀ − I| = {err:.3g} > "
            f"{ORTHOGONALITY_TOL}): corrupt or edited"
        )


def assemble(
    directory: Path,
    base: Any,
    *,
    fused_norms: bool,
    rotated: bool,
    smoothing_alpha: float | None,
    prefix: tuple[int, ...],
    steps: tuple[StepRecord, ...],
    equalized: tuple[str, ...] = (),
) -> QuantizedModel:
    """The QuantizedModel stored in directory/plan.json and directory/learned, over the float
    `base` (a LoadedModel), after checking the stored pieces agree with the stated facts
    (`rotated`: whether R1/R2 belong; `smoothing_alpha`: whether smoothing scales do)."""
    directory = Path(directory)
    plan = RunDir(directory).read_plan()
    learned = restore_learned(directory)
    where = str(RunDir(directory).learned_path)
    if rotated != ("r1" in learned and "r2" in learned):
        raise QnpuError(
            f"{where} does not match its description: the model "
            f"{'needs' if rotated else 'has no'} rotations R1/R2"
        )
    if (smoothing_alpha is not None) != ("mlp_smoothing" in learned):
        raise QnpuError(
            f"{where} does not match its description: smooth_mlp is {smoothing_alpha!r} but "
            f"the smoothing scales are {'present' if 'mlp_smoothing' in learned else 'missing'}"
        )
    stored_alpha = float(learned.get("mlp_smoothing_alpha", smoothing_alpha or 0.0))
    if smoothing_alpha is not None and abs(stored_alpha - smoothing_alpha) > 1e-6:
        raise QnpuError(
            f"{where} does not match its description: smooth_mlp is {smoothing_alpha!r} but "
            f"the scales were made with {stored_alpha:.6g}"
        )
    stored = learned.get("equalization") or {}
    if set(stored) != set(equalized):
        raise QnpuError(
            f"{where} does not match its description: equalized pairs {sorted(equalized)}, "
            f"stored scales for {sorted(stored)}"
        )
    equalization = {k: jnp.asarray(v) for k, v in stored.items()} or None
    if equalization:
        try:  # corrupt or edited factors would silently change the model
            equalize(base.params, base.config, equalization)
        except QnpuError as e:
            raise QnpuError(f"{where}: {e}") from e
    r1 = r2 = None
    if rotated:
        for name in ("r1", "r2"):
            check_orthogonal(name, learned[name], where)
        r1, r2 = jnp.asarray(learned["r1"]), jnp.asarray(learned["r2"])
    smoothing = learned.get("mlp_smoothing")
    transforms = Transforms(
        mlp_smoothing=None if smoothing is None else jnp.asarray(smoothing),
        r1=r1,
        r2=r2,
        fused_norms=fused_norms,
        mlp_smoothing_alpha=smoothing_alpha,
        equalization=equalization,
    )
    codes = learned.get("weight_codes")
    state = learned.get("state")
    trained = learned.get("trained")  # runs saved before it was stored: None
    return QuantizedModel(
        base.params,
        transforms,
        state=None if state is None else state_from_tree(jax.tree.map(jnp.asarray, state), where),
        weight_codes=None if not codes else {k: jnp.asarray(v) for k, v in codes.items()},
        trained=None if trained is None else jax.tree.map(jnp.asarray, trained),
        cfg=base.config,
        source=base.source,
        base_weights=getattr(base, "weights", None),
        prefix=prefix,
        plan=plan,
        steps=steps,
        base_fingerprint=base_fingerprint(base.params, base.config),
    )
