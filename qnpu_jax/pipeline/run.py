"""`qnpu quantize`: a method's recipe end to end, into a run directory.

run_dir/
  .qnpu.lock         held (`flock`) by the one `qnpu quantize` that writes the run, holding its
                     pid; a second writer is refused by name. Removed at the end, never sealed
  config.yaml        the QuantizeConfig (a resumed run must match it)
  model.json, plan.json, learned/
                     the QuantizedModel (`pipeline.quantized_model`): the steps that made
                     it, the base weights' location and sha256 (a run loads only on those
                     weights; runs made before they were recorded load on any base of the
                     same config), the
                     final plan, and in orbax the rotations R1/R2, the quantizer state, the MLP
                     smoothing scales and GPTQ's weight codes where the recipe made them
  sensitivity.json   eq. (4) per layer and the promoted layers of the down_proj inputs;
                     sensitivity_TENSOR.json for any other promoted tensor
  resume/            the model saved before stage 1, with stage1/: what --resume continues
  stage1/            orbax checkpoints of stage 1; metrics.jsonl per step
  report.json        float and quantized perplexity, wall time of every step
  manifest.json      written last: sha256 and size of every file, sealed with one digest
                     (`run_manifest`); a run without it is unfinished, and every reader
                     verifies it before use. `--resume` of a run that has it does nothing: the
                     run is complete

`run_dir.RunDir` names these files and reads them; nothing else spells their names.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from jax.sharding import Mesh

from qnpu_jax.data import (
    eval_windows,
    load_documents,
    tokenize_documents,
)
from qnpu_jax.environment import environment_info
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import (
    exclusive_lock,
    make_output_dir,
    remove_empty_dirs,
    write_bytes_atomic,
    write_json_atomic,
)
from qnpu_jax.ir.graph import UNROTATED_INPUT, UNROTATED_OUTPUT
from qnpu_jax.mesh import check_batch, is_primary, make_mesh, sync
from qnpu_jax.mesh import describe as describe_mesh
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params
from qnpu_jax.models.load import load_model, open_model
from qnpu_jax.models.taps import QuantState, sink_prefix
from qnpu_jax.pipeline.config import QuantizeConfig, differing_keys, read_run_config
from qnpu_jax.pipeline.methods import method_spec
from qnpu_jax.pipeline.quantized_model import (
    QuantizedModel,
    StepRecord,
    assemble,
    nll_perplexity,
    static_nll_fn,
)
from qnpu_jax.pipeline.recipes import Recipe, config_keys, for_config
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.run_manifest import seal_run, unseal_run, verify_run
from qnpu_jax.pipeline.steps import Calibration, Context
from qnpu_jax.quant.plan import QuantPlan


def _token_ids(spec: str, split: str | None, tokenizer: Any) -> np.ndarray:
    return tokenize_documents(load_documents(spec, split), tokenizer)


def calibration_data(config: QuantizeConfig, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the calibration text, the run's calibration windows [N, T])."""
    data = Calibration.from_text(
        config.data.calib,
        tokenizer,
        seq_len=config.data.seq_len,
        windows=config.data.windows,
        key=config_keys(config)[0],
    )
    return data.ids, data.windows


def eval_set_windows(
    config: QuantizeConfig, tokenizer: Any, spec: str, cap: int | None
) -> np.ndarray:
    """The first `cap` windows of the eval set `spec` (as `eval_data` names it: `wiki` reads
    its eval split, any other set its whole text) at the run's seq_len."""
    try:
        ids = _token_ids(spec, _eval_split(spec), tokenizer)
        return eval_windows(ids, config.data.seq_len, cap)
    except (QnpuError, OSError) as e:
        raise QnpuError(f"eval_data {spec!r}: {e}") from e


def wiki_eval_windows(config: QuantizeConfig, tokenizer: Any, cap: int | None) -> np.ndarray:
    """The first `cap` windows of the `wiki` eval split at the run's seq_len: the evaluation
    protocol of the scripts that re-evaluate a run."""
    return eval_set_windows(config, tokenizer, "wiki", cap)


def evaluate(
    params: Params,
    state: QuantState | None,
    plan: QuantPlan | None,
    cfg: ModelConfig,
    windows: np.ndarray,
    prefix: tuple[int, ...],
    mesh: Mesh | None = None,
    prefix_params: Params | None = None,
) -> dict[str, Any]:
    """Perplexity of the float (state None) or static fake-quant model over `windows`, on
    `mesh` with the params sharded and the windows split along its data axis.
    `prefix_params`: what the sink prefix runs on where not `params`
    (`QuantizedModel.prefix_params`: a model with GPTQ's codes)."""
    nll = static_nll_fn(params, state, plan, cfg, prefix, mesh=mesh, prefix_params=prefix_params)
    return nll_perplexity(nll, windows, mesh=mesh)


def _eval_split(spec: str) -> str | None:
    return "eval" if spec == "wiki" else None


# Keys that change only how a finished model is evaluated, or where it runs (a checkpoint
# resumes on another mesh): --resume may change them.
EVAL_ONLY_KEYS = ("eval_data", "eval_windows", "mesh")


def without_eval(config: QuantizeConfig) -> QuantizeConfig:
    """`config` with the keys that do not change a run's model (EVAL_ONLY_KEYS) at their
    defaults: what two configs must share to make the same run."""
    defaults = QuantizeConfig().flat()
    return config.replace(**{k: defaults[k] for k in EVAL_ONLY_KEYS})


@contextmanager
def claimed(run_dir: Path) -> Iterator[None]:
    """Hold `run_dir`'s lock (`RunDir.lock_path`) for the block, creating the directory: a
    second `qnpu quantize` on it is refused by name. Directories made here and left empty are
    removed again."""
    made = make_output_dir(run_dir, "--out")
    try:
        with exclusive_lock(RunDir(run_dir).lock_path, f"run directory {run_dir}"):
            yield
    finally:
        remove_empty_dirs(made)


def _check_run_dir(run_dir: Path, config: QuantizeConfig, resume: bool) -> None:
    run = RunDir(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise QnpuError(f"--out {run_dir} exists and is not a directory")
    if resume:
        if not run.has_config:
            raise QnpuError(f"--resume: {run_dir} holds no run (no {RunDir.CONFIG})")
        saved, asked = without_eval(read_run_config(run)), without_eval(config)
        if saved != asked:
            raise QnpuError(
                f"--resume: the config differs from the one in {run.config_path} (only "
                f"{', '.join(EVAL_ONLY_KEYS)} may change on resume; the run's -> this one's): "
                + "; ".join(differing_keys(saved, asked))
            )
    elif run_dir.exists() and any(p.name != RunDir.LOCK for p in run_dir.iterdir()):
        raise QnpuError(f"{run_dir} is not empty; pass --resume to continue that run")


def _complete_report(run_dir: Path, config: QuantizeConfig) -> dict[str, Any]:
    """The report of the finished run that `--resume` names: nothing is left to run. Its
    evaluation can no longer change this way (only its mesh may differ)."""
    verify_run(run_dir)
    run = RunDir(run_dir)
    saved = read_run_config(run)
    on_this_mesh = dataclasses.replace(saved, mesh=config.mesh)
    if on_this_mesh != config:
        raise QnpuError(
            f"--resume: {run_dir} is a finished run, and its evaluation settings differ from "
            "this config's (the run's -> this one's: "
            + "; ".join(differing_keys(on_this_mesh, config))
            + "); evaluate the run with `qnpu eval --run` instead"
        )
    return run.read_report()


def evaluation_sets(
    config: QuantizeConfig, tokenizer: Any, max_length: int
) -> dict[str, np.ndarray]:
    """{spec: windows} of every eval_data set, read before anything expensive runs, so a wrong
    path or a text shorter than one window fails in the first seconds, not after stage 1."""
    if config.data.seq_len > max_length:
        raise QnpuError(
            f"seq_len {config.data.seq_len} exceeds the model's context ({max_length} positions "
            "after the sink prefix)"
        )
    sets = {}
    for spec in config.eval.data:
        sets[spec] = eval_set_windows(config, tokenizer, spec, config.eval.windows)
    return sets


def quantize(
    config: QuantizeConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
    float_reference: Mapping[str, Mapping[str, Any]] | None = None,
    announce: Callable[[str], None] | None = None,
    recipe: Recipe | None = None,
) -> dict[str, Any]:
    """Run `recipe` (default: the recipe of `config`, `recipes.for_config`) into `run_dir`;
    returns the report (also report.json). `config` gives the model, data and evaluation.

    `float_reference` ({eval spec: {"ppl", "windows", "tokens"}}) is the float model measured
    on the same evaluation windows (e.g. a comparison's FP32 row): it replaces the float
    evaluation of those specs, and must cover the same windows and tokens as the run's.
    `announce` is told when each phase starts (the CLI prints it).

    The writing process holds the run directory's lock throughout (`claimed`); `resume` of a
    finished run returns its report without running anything."""
    run_dir = Path(run_dir)
    go = partial(
        _quantize,
        config,
        run_dir,
        recipe,
        float_reference,
        resume=resume,
        progress=progress,
        command=command,
        announce=announce,
    )
    if not is_primary():  # in a multi-host job process 0 holds the run directory
        return go()
    with claimed(run_dir):
        return go()


def _quantize(
    config: QuantizeConfig,
    run_dir: Path,
    recipe: Recipe | None,
    float_reference: Mapping[str, Mapping[str, Any]] | None,
    *,
    resume: bool,
    progress: bool,
    command: str | None,
    announce: Callable[[str], None] | None,
) -> dict[str, Any]:
    """`quantize`'s steps, with the run directory claimed: check it, read the inputs, start
    the run directory, run the recipe, evaluate, write the report and seal the run."""
    _check_run_dir(run_dir, config, resume)
    say = announce or (lambda message: None)
    if resume and RunDir(run_dir).is_sealed:
        report = _complete_report(run_dir, config)
        say(f"{run_dir} is a finished run (its {RunDir.MANIFEST} is sealed): nothing to resume")
        return report
    recipe = for_config(config) if recipe is None else recipe
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    inputs = _read_inputs(config, recipe, say)
    _start_run_dir(run_dir, config)
    model, first = _first_model(run_dir, recipe, inputs, resume, say)
    seconds["load"] = time.perf_counter() - t0
    model = _run_steps(
        run_dir,
        recipe,
        model,
        first,
        inputs,
        resume=resume,
        progress=progress,
        say=say,
        seconds=seconds,
    )
    t0 = time.perf_counter()
    results = _evaluate_run(config, model, inputs, float_reference, say)
    seconds["eval"] = time.perf_counter() - t0
    report = _run_report(
        config,
        recipe,
        model,
        results,
        seconds=seconds,
        resume=resume,
        run_dir=run_dir,
        mesh=inputs.mesh,
        command=command,
    )
    if is_primary():
        write_json_atomic(RunDir(run_dir).report_path, report)
        seal_run(run_dir)
    sync("qnpu: run sealed")
    return report


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What a run reads before any step: the mesh, the float model (a `LoadedModel`), the sink
    prefix, the evaluation windows ({spec: windows}) and the calibration data."""

    mesh: Mesh
    loaded: Any
    prefix: tuple[int, ...]
    eval_sets: dict[str, np.ndarray]
    data: Calibration


def _read_inputs(config: QuantizeConfig, recipe: Recipe, say: Callable[[str], None]) -> _Inputs:
    """The run's inputs, read before anything expensive runs: a batch the mesh cannot split,
    a wrong path or a text shorter than one window fails in the first seconds."""
    say(f"loading {config.model}; then the calibration and evaluation text")
    mesh = make_mesh(config.mesh)
    if any(s.name == "stage1" for s in recipe):  # before anything expensive runs
        check_batch(mesh, config.stage1.batch_size, "stage1.batch_size")
    source = open_model(config.model)  # the metadata only: a recipe it cannot take fails now
    if source.config is not None:
        recipe.check_graph(source.config)
    loaded = load_model(source)
    cfg = loaded.config
    recipe.check_graph(cfg)
    prefix = sink_prefix(config.prefix, loaded.tokenizer)
    eval_sets = evaluation_sets(config, loaded.tokenizer, cfg.max_position_embeddings - len(prefix))
    try:
        calib_ids, calib = calibration_data(config, loaded.tokenizer)
    except (QnpuError, OSError) as e:
        raise QnpuError(f"calib_data {config.data.calib!r}: {e}") from e
    return _Inputs(mesh, loaded, prefix, eval_sets, Calibration(calib_ids, calib))


def _start_run_dir(run_dir: Path, config: QuantizeConfig) -> None:
    """Mark the run unfinished and write its config; in a multi-host job process 0 writes the
    run directory and every process waits for it."""
    primary = is_primary()
    sync("qnpu: run directory checked")
    if primary:
        run_dir.mkdir(parents=True, exist_ok=True)
        unseal_run(run_dir)  # a resumed run is unfinished until its manifest is written again
        write_bytes_atomic(
            RunDir(run_dir).config_path,
            yaml.safe_dump(config.to_dict(), sort_keys=False).encode(),
        )
    sync("qnpu: run directory started")


def _first_model(
    run_dir: Path, recipe: Recipe, inputs: _Inputs, resume: bool, say: Callable[[str], None]
) -> tuple[QuantizedModel, int]:
    """(model, index of the first step to run): the float model from step 0, or with `resume`
    the model saved before the first resumable step (`_resumed`)."""
    model = QuantizedModel.from_float(inputs.loaded, prefix=inputs.prefix)
    first = 0
    if resume:
        model, first = _resumed(RunDir(run_dir).resume.path, recipe, model, inputs.loaded)
        if first:
            say(f"resuming before step {first + 1} of {len(recipe)} ({recipe.steps[first].name})")
    return model, first


def _run_steps(
    run_dir: Path,
    recipe: Recipe,
    model: QuantizedModel,
    first: int,
    inputs: _Inputs,
    *,
    resume: bool,
    progress: bool,
    say: Callable[[str], None],
    seconds: dict[str, float],
) -> QuantizedModel:
    """Run the recipe's steps from `first` (each one's wall time into `seconds`) and save the
    final model to the run. Before each resumable step the model is saved to resume/ (not
    again before the step a resume starts at); each promote step's scan is written."""
    run = RunDir(run_dir)
    primary = is_primary()
    context = Context(workdir=run_dir, progress=progress, mesh=inputs.mesh)
    for i, step in enumerate(recipe.steps[first:], first):
        if step.resumable and not (resume and i == first):
            model.save(run.resume.path)
        t0 = time.perf_counter()
        say(step.describe)
        model = step(model, inputs.data, context)
        seconds[step.label] = time.perf_counter() - t0
        if step.name == "promote" and primary:
            write_json_atomic(run.sensitivity_path(step.args["tensor"]), model.steps[-1].info)
    model.save(run_dir)
    return model


def _evaluate_run(
    config: QuantizeConfig,
    model: QuantizedModel,
    inputs: _Inputs,
    float_reference: Mapping[str, Mapping[str, Any]] | None,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """{spec: float and quantized perplexity} on every evaluation set; the float side comes
    from `float_reference` where it has the spec (it must cover the same windows and tokens)."""
    mesh, loaded, prefix = inputs.mesh, inputs.loaded, inputs.prefix
    nll = model.nll_fn(mesh)
    results: dict[str, Any] = {}
    for spec, windows in inputs.eval_sets.items():
        say(
            f"evaluation on {spec}: {len(windows)} windows of {config.data.seq_len}, quantized "
            "and float"
        )
        quant_r = nll_perplexity(nll, windows, mesh=mesh)
        reference = (float_reference or {}).get(spec)
        if reference is None:
            float_r = evaluate(loaded.params, None, None, loaded.config, windows, prefix, mesh)
        elif (reference.get("windows"), reference.get("tokens")) != (
            quant_r["windows"],
            quant_r["tokens"],
        ):
            raise QnpuError(
                f"the float reference for {spec} covers {reference.get('windows')} windows / "
                f"{reference.get('tokens')} tokens, the run {quant_r['windows']} / "
                f"{quant_r['tokens']}: not the same evaluation"
            )
        else:
            float_r = dict(reference)
        results[spec] = {
            "float_ppl": float_r["ppl"],
            "quantized_ppl": quant_r["ppl"],
            "ratio": quant_r["ppl"] / float_r["ppl"],
            "windows": quant_r["windows"],
            "tokens": quant_r["tokens"],
            "float_from_reference": reference is not None,
        }
        if not math.isfinite(quant_r["ppl"]):
            raise QnpuError(f"quantized perplexity on {spec} is not finite")
    return results


def _run_report(
    config: QuantizeConfig,
    recipe: Recipe,
    model: QuantizedModel,
    results: dict[str, Any],
    *,
    seconds: dict[str, float],
    resume: bool,
    run_dir: Path,
    mesh: Mesh,
    command: str | None,
) -> dict[str, Any]:
    """The run's report (report.json): the config's summary, the evaluation `results`, the
    wall times, and where and how the run was made."""
    trained = any(s.name == "stage1" for s in recipe)
    return {
        **config.summary(),
        "eval_windows_cap": config.eval.windows,
        "calibration": {"data": config.data.calib, "windows": config.data.windows},
        "stage1_steps": config.stage1.steps if trained else 0,
        "sensitivity": model.step_info("promote", tensor=UNROTATED_INPUT),
        "down_out_sensitivity": model.step_info("promote", tensor=UNROTATED_OUTPUT),
        "perplexity": results,
        "seconds": seconds,
        "resumed": resume,
        "stage1_step_seconds": _stage1_step_seconds(run_dir),
        "mesh": describe_mesh(mesh),
        "environment": environment_info(),
        "command": command,
    }


def _resumed(
    snapshot: Path, recipe: Recipe, model: QuantizedModel, loaded: Any
) -> tuple[QuantizedModel, int]:
    """(model, index of the next step) to resume `recipe` from: the model saved in `snapshot`
    when there is one (its steps must be the recipe's first ones), else the start."""
    if not RunDir(snapshot).has_model_json:
        return model, 0
    saved = QuantizedModel.load(snapshot, base=loaded)
    done = len(saved.steps)
    expected = [StepRecord.of(s.name, s.args).args_json for s in recipe.steps[:done]]
    if [r.args_json for r in saved.steps] != expected or done >= len(recipe):
        raise QnpuError(
            f"--resume: {snapshot} was made by other steps than this config's recipe; "
            "start the run again in a new directory"
        )
    return saved, done


def _stage1_step_seconds(run_dir: Path) -> float | None:
    """Stage 1's step time summed over every recorded step, earlier attempts of a resumed run
    included (`seconds` covers this invocation only); None without a stage 1."""
    rows = RunDir(run_dir).read_stage1_metrics()
    if rows is None:
        return None
    return float(sum(float(row.get("seconds", 0.0)) for _, row in rows))


@dataclasses.dataclass(frozen=True)
class Run:
    """A finished run: its config, its QuantizedModel and the float model it was made from
    (a `LoadedModel`: params, config, tokenizer)."""

    config: QuantizeConfig
    model: QuantizedModel
    loaded: Any

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer


def load_run(run_dir: Path) -> Run:
    """The finished run in `run_dir`, after its manifest and every file's hash are verified;
    no step runs. A run made before QuantizedModel (no model.json) is rebuilt from its
    config.yaml the way that version's quantize built it."""

    run_dir = Path(run_dir)
    verify_run(run_dir)
    run = RunDir(run_dir)
    config = read_run_config(run)
    loaded = load_model(config.model)
    if run.has_model_json:
        model = QuantizedModel.load(run_dir, base=loaded)
        model_alpha = model.transforms.mlp_smoothing_alpha
        if (model_alpha is None) != (config.smooth_mlp is None) or (
            model_alpha is not None and abs(model_alpha - float(config.smooth_mlp or 0)) > 1e-6
        ):
            raise QnpuError(
                f"{run.model_json_path} does not match {RunDir.CONFIG}: smooth_mlp is "
                f"{config.smooth_mlp!r} but "
                + (
                    "the smoothing scales are present"
                    if config.smooth_mlp is None
                    else "the smoothing scales are missing"
                    if model_alpha is None
                    else f"the scales were made with {model_alpha}"
                )
            )
    else:
        rotated = method_spec(config.method).rotates  # every method of that version but rtn
        model = assemble(
            run_dir,
            loaded,
            fused_norms=rotated,
            rotated=rotated,
            smoothing_alpha=config.smooth_mlp,
            prefix=sink_prefix(config.prefix, loaded.tokenizer),
            steps=(StepRecord.of("legacy_run", {"method": config.method}),),
        )
    if model.state is None:
        raise QnpuError(f"{run.learned_path}: the learned checkpoint holds no quantizer state")
    return Run(config, model, loaded)
