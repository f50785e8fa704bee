"""`qnpu quantize`: a method recipe end to end, into a run directory.

run_dir/
  config.yaml        the QuantizeConfig (a resumed run must match it)
  plan.json          the final quantization plan (mixed precision included)
  sensitivity.json   eq. (4) per layer and the promoted layers (when mixed precision runs)
  sensitivity_down_out.json  the same for the down_proj outputs (down_out_mixed_precision)
  mlp_smoothing.npy  with smooth_mlp: the up→down smoothing scales (made before stage 1)
  stage1/            orbax checkpoints of stage 1; metrics.jsonl per step
  learned/           orbax: rotations R1/R2, the full quantizer state after stage 2, with
                     smooth_mlp the up→down smoothing scales and, with weight_rounding gptq,
                     the linear weights' integer codes
  report.json        float and quantized perplexity, wall time of every stage
  manifest.json      written last: sha256 and size of every file, sealed with one digest
                     (`run_manifest`); a run without it is unfinished, and every reader
                     verifies it before use
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import shutil
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import (
    eval_windows,
    load_documents,
    sample_windows,
    tokenize_documents,
)
from qnpu_jax.environment import environment_info
from qnpu_jax.errors import QnpuError, first_line
from qnpu_jax.files import write_bytes_atomic, write_json_atomic
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params
from qnpu_jax.models.quantized import FakeQuantTaps, QuantState, sink_prefix, tapped_token_nll
from qnpu_jax.pipeline.calibrate import calibrate, channel_absmax
from qnpu_jax.pipeline.config import QuantizeConfig, load_config
from qnpu_jax.pipeline.mixed_precision import mixed_layer_bits, tensor_sensitivity
from qnpu_jax.pipeline.run_manifest import seal_run, unseal_run, verify_run
from qnpu_jax.pipeline.stage1 import (
    init_train_state,
    learned_scales,
    merge_scales,
    run_stage1,
)
from qnpu_jax.pipeline.weight_rounding import gptq_round_weights, weights_from_codes
from qnpu_jax.quant.plan import WEIGHTS, QuantPlan, QuantRule, default_plan
from qnpu_jax.transforms import (
    apply_rotations,
    fuse_norms,
    randomized_hadamard_rotations,
    smooth_mlp,
    smoothing_scales,
)

ROTATED_INPUTS = ("attn_in", "attn_out", "mlp_in")  # R1 (q/k/v, gate/up) and R2 (o_proj)
STAGE1_TENSORS = (*WEIGHTS, *ROTATED_INPUTS, "down_in")  # the linears' inputs and weights
LINEAR_OUTPUTS = ("q_out", "k_out", "v_out", "o_out", "gate_out", "up_out", "down_out")
KV_TENSORS = ("k_rope", "v_out")
TRAINED_METHODS = ("quantnpu", "spinquant")  # the methods with a stage 1
SMOOTHING_FILE = "mlp_smoothing.npy"  # written before stage 1, reused by --resume


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


def build_plan(
    config: QuantizeConfig,
    num_layers: int,
    down_in_bits: tuple[int, ...] | None,
    down_out_bits: tuple[int, ...] | None = None,
) -> QuantPlan:
    """The deployment plan of a method: DESIGN §3's table, init rules, mixed precision (per-layer
    bits of the down_proj inputs and outputs), rules."""
    rules: list[QuantRule] = []
    if config.scope == "linears":  # Table 2: the linears' weights, inputs and outputs only
        keep = "|".join((*STAGE1_TENSORS, *LINEAR_OUTPUTS))
        rules.append(QuantRule(pattern=f"(?!layers/({keep})$).*", quantize=False))
    if config.method == "quantnpu" and config.init_scheme == "aware":
        rules += init_rules(config.w_bits, config.a_bits)
    if down_in_bits is not None:
        rules.append(QuantRule(pattern="layers/down_in", layer_bits=down_in_bits))
    if down_out_bits is not None:
        rules.append(QuantRule(pattern="layers/down_out", layer_bits=down_out_bits))
    rules += config.rules
    return default_plan(
        num_layers,
        w_bits=config.w_bits,
        a_bits=config.a_bits,
        kv_bits=config.kv_bits,
        down_in_bits=config.down_in_bits,
        rules=rules,
    )


def stage1_plan(plan: QuantPlan, config: QuantizeConfig) -> QuantPlan:
    """Selective optimization: only the linears' input activations and weights are quantized
    (and learnable, for quantnpu) in stage 1; everything else, lm_head included, stays float.
    Without `selective`, the linear outputs and the K/V cache are learned in stage 1 too."""
    names = STAGE1_TENSORS if config.selective else (*STAGE1_TENSORS, *LINEAR_OUTPUTS, *KV_TENSORS)
    keep = {f"layers/{n}" for n in names}
    learn = config.method == "quantnpu"
    entries = []
    for path, tq in plan.entries:
        if path not in keep:
            continue
        learnable = learn and (path != "layers/down_in" or config.learn_down_in)
        entries.append((path, dataclasses.replace(tq, learnable=learnable)))
    return QuantPlan(tuple(entries), plan.num_layers)


def _token_ids(spec: str, split: str | None, tokenizer: Any) -> np.ndarray:
    return tokenize_documents(load_documents(spec, split), tokenizer)


def run_keys(seed: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(calibration windows, start rotations, stage-1 data) keys of a run with `seed`."""
    calib_key, rotation_key, data_key = jax.random.split(jax.random.key(seed), 3)
    return calib_key, rotation_key, data_key


def calibration_data(config: QuantizeConfig, tokenizer: Any) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the calibration text, the run's calibration windows [N, T])."""
    split = "calib" if config.calib_data == "wiki" else None
    ids = _token_ids(config.calib_data, split, tokenizer)
    windows = sample_windows(ids, config.seq_len, config.calib_windows, run_keys(config.seed)[0])
    return ids, windows


def wiki_eval_windows(config: QuantizeConfig, tokenizer: Any, cap: int | None) -> np.ndarray:
    """The first `cap` windows of the `wiki` eval split at the run's seq_len: the evaluation
    protocol of the scripts that re-evaluate a run."""
    ids = tokenize_documents(load_documents("wiki", "eval"), tokenizer)
    return eval_windows(ids, config.seq_len, cap)


def _ppl(nll_fn: Any, windows: np.ndarray) -> dict[str, Any]:
    from qnpu_jax.eval import perplexity

    result = perplexity(nll_fn, windows, batch_size=1, progress=False)
    return {"ppl": result.ppl, "windows": result.windows, "tokens": result.predicted_tokens}


def evaluate(
    params: Params,
    state: QuantState | None,
    plan: QuantPlan | None,
    cfg: ModelConfig,
    windows: np.ndarray,
    prefix: tuple[int, ...],
) -> dict[str, Any]:
    """Perplexity of the float (state None) or static fake-quant model over `windows`."""
    taps = FakeQuantTaps(plan) if plan is not None else None
    nll = partial(tapped_token_nll, params, state, cfg=cfg, taps=taps, prefix=prefix)
    return _ppl(nll, windows)


def _eval_split(spec: str) -> str | None:
    return "eval" if spec == "wiki" else None


# Keys that change only how a finished model is evaluated: --resume may change them.
EVAL_ONLY_KEYS = ("eval_data", "eval_windows")


def _without_eval(config: QuantizeConfig) -> QuantizeConfig:
    defaults = QuantizeConfig()
    return dataclasses.replace(config, **{k: getattr(defaults, k) for k in EVAL_ONLY_KEYS})


def _check_run_dir(run_dir: Path, config: QuantizeConfig, resume: bool) -> None:
    saved = run_dir / "config.yaml"
    if run_dir.exists() and not run_dir.is_dir():
        raise QnpuError(f"--out {run_dir} exists and is not a directory")
    if resume:
        if not saved.is_file():
            raise QnpuError(f"--resume: {run_dir} holds no run (no config.yaml)")
        if _without_eval(load_config(saved)) != _without_eval(config):
            raise QnpuError(
                f"--resume: the config differs from the one in {saved} (only "
                f"{', '.join(EVAL_ONLY_KEYS)} may change on resume)"
            )
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise QnpuError(f"{run_dir} is not empty; pass --resume to continue that run")


def evaluation_sets(
    config: QuantizeConfig, tokenizer: Any, max_length: int
) -> dict[str, np.ndarray]:
    """{spec: windows} of every eval_data set, read before anything expensive runs, so a wrong
    path or a text shorter than one window fails in the first seconds, not after stage 1."""
    if config.seq_len > max_length:
        raise QnpuError(
            f"seq_len {config.seq_len} exceeds the model's context ({max_length} positions "
            "after the sink prefix)"
        )
    sets = {}
    for spec in config.eval_data:
        try:
            ids = _token_ids(spec, _eval_split(spec), tokenizer)
            sets[spec] = eval_windows(ids, config.seq_len, config.eval_windows)
        except (QnpuError, OSError) as e:
            raise QnpuError(f"eval_data {spec!r}: {e}") from e
    return sets


def save_learned(
    run_dir: Path,
    r1: Any,
    r2: Any,
    state: QuantState,
    weight_codes: dict[str, np.ndarray] | None = None,
    smoothing: Any = None,
    smoothing_alpha: float | None = None,
) -> None:
    """Write rotations (None: unrotated method), the quantizer state, GPTQ's weight codes
    (None: round-to-nearest, nothing to store) and the up→down smoothing scales (None: no
    smoothing) to run_dir/learned."""
    import orbax.checkpoint as ocp

    target = (run_dir / "learned").resolve()
    tmp = target.with_name("learned.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    with ocp.StandardCheckpointer() as ckpt:
        tree: dict[str, Any] = {"state": state}
        if r1 is not None:
            tree |= {"r1": r1, "r2": r2}
        if weight_codes:
            tree["weight_codes"] = weight_codes
        if smoothing is not None:
            tree["mlp_smoothing"] = smoothing
            tree["mlp_smoothing_alpha"] = np.asarray(smoothing_alpha, np.float32)
        ckpt.save(tmp, tree)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def _load_npy(path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise QnpuError(f"{path}: not a readable .npy array: {e}") from e


def mlp_smoothing(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    alpha: float,
    *,
    prefix: tuple[int, ...] = (),
) -> jax.Array:
    """Smoothing scales [L, I] for `params` as they will be quantized (after R1/R2, which the
    smoothing commutes with): down_proj input ranges over the calibration `windows`."""
    absmax = channel_absmax(params, cfg, windows, ("down_in",), prefix=prefix)["down_in"]
    return smoothing_scales(absmax, params["layers"]["down_proj"], alpha)


def layer_promotion(
    params: Params,
    cfg: ModelConfig,
    windows: np.ndarray,
    name: str,
    fraction: float,
    prefix: tuple[int, ...],
) -> dict[str, Any]:
    """Eq. (4)'s scan on the per-layer tensor `name` of `params` and the per-layer bits that
    promoting the top `fraction` gives (sensitivity.json / sensitivity_down_out.json)."""
    scan = tensor_sensitivity(params, cfg, windows, name, prefix=prefix)
    bits = mixed_layer_bits(scan.ratios, fraction)
    return {
        "ratios": list(scan.ratios),
        "bits_measured": scan.bits,
        "fraction": fraction,
        "promoted_layers": [i for i, b in enumerate(bits) if b == 16],
        "layer_bits": list(bits),
    }


def quantize(
    config: QuantizeConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    command: str | None = None,
    float_reference: Mapping[str, Mapping[str, Any]] | None = None,
    announce: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the method of `config` into `run_dir`; returns the report (also report.json).

    `float_reference` ({eval spec: {"ppl", "windows", "tokens"}}) is the float model measured
    on the same evaluation windows (e.g. a comparison's FP32 row): it replaces the float
    evaluation of those specs, and must cover the same windows and tokens as the run's.
    `announce` is told when each phase starts (the CLI prints it)."""
    import yaml

    from qnpu_jax.models import load_model

    run_dir = Path(run_dir)
    _check_run_dir(run_dir, config, resume)
    seconds: dict[str, float] = {}
    say = announce or (lambda message: None)
    t0 = time.perf_counter()
    say(f"loading {config.model}; then the calibration and evaluation text")
    model = load_model(config.model)
    cfg = model.config
    prefix = sink_prefix(config.prefix, model.tokenizer)
    eval_sets = evaluation_sets(config, model.tokenizer, cfg.max_position_embeddings - len(prefix))
    try:
        calib_ids, calib = calibration_data(config, model.tokenizer)
    except (QnpuError, OSError) as e:
        raise QnpuError(f"calib_data {config.calib_data!r}: {e}") from e
    _, rotation_key, data_key = run_keys(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    unseal_run(run_dir)  # a resumed run is unfinished until its manifest is written again
    write_bytes_atomic(
        run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False).encode()
    )
    seconds["load"] = time.perf_counter() - t0

    rotated = config.method != "rtn"
    base = fuse_norms(model.params, cfg) if rotated else model.params
    r1 = r2 = None
    if rotated:
        r1, r2 = randomized_hadamard_rotations(cfg, rotation_key)
    start_params = apply_rotations(base, cfg, r1, r2) if rotated else base
    smoothing = None
    if config.smooth_mlp is not None:
        t0 = time.perf_counter()
        say(f"MLP smoothing (alpha {config.smooth_mlp})")
        saved = run_dir / SMOOTHING_FILE
        if resume and saved.is_file():  # stage 1 continues on exactly the base it started on
            smoothing = jnp.asarray(_load_npy(saved))
        else:
            smoothing = mlp_smoothing(start_params, cfg, calib, config.smooth_mlp, prefix=prefix)
            buf = io.BytesIO()
            np.save(buf, np.asarray(smoothing))
            write_bytes_atomic(saved, buf.getvalue())
        base = smooth_mlp(base, smoothing)
        start_params = apply_rotations(base, cfg, r1, r2) if rotated else base
        seconds["smooth_mlp"] = time.perf_counter() - t0

    down_in_bits = None
    sensitivity = None
    if config.mixed_precision > 0 and config.down_in_bits == 8:
        t0 = time.perf_counter()
        say(f"sensitivity scan (eq. 4) of the down_proj inputs, {cfg.num_layers} layers")
        sensitivity = layer_promotion(
            start_params, cfg, calib, "down_in", config.mixed_precision, prefix
        )
        down_in_bits = tuple(sensitivity["layer_bits"])
        write_json_atomic(run_dir / "sensitivity.json", sensitivity)
        seconds["mixed_precision"] = time.perf_counter() - t0
    plan = build_plan(config, cfg.num_layers, down_in_bits)
    write_json_atomic(run_dir / "plan.json", plan.to_dict())

    learned = None
    if config.method in TRAINED_METHODS:
        assert r1 is not None and r2 is not None
        t0 = time.perf_counter()
        say(f"stage 1: {config.stage1.steps} steps ({config.method})")
        s1_plan = stage1_plan(plan, config)
        s1_config = config.stage1
        if config.method == "spinquant":
            s1_config = dataclasses.replace(s1_config, activation_mode="dynamic", lr_scale=0.0)
        s1_state = calibrate(start_params, cfg, s1_plan, calib, prefix=prefix)
        train_state = run_stage1(
            init_train_state(r1, r2, s1_state, s1_plan, s1_config),
            cfg=cfg,
            plan=s1_plan,
            config=s1_config,
            base_params=base,
            frozen_state=s1_state,
            calib_ids=calib_ids,
            seq_len=config.seq_len,
            key=data_key,
            run_dir=run_dir / "stage1",
            prefix=prefix,
            progress=progress,
        )
        r1, r2 = train_state["params"]["r1"], train_state["params"]["r2"]
        if config.method == "quantnpu":
            learned = learned_scales(train_state["params"]["scales"], s1_config.scale_param)
        seconds["stage1"] = time.perf_counter() - t0

    final_params = apply_rotations(base, cfg, r1, r2) if rotated else base
    down_out_sensitivity = None
    if config.down_out_mixed_precision > 0:  # a stage-2 tensor: scanned on the final model
        t0 = time.perf_counter()
        say("sensitivity scan (eq. 4) of the down_proj outputs")
        down_out_sensitivity = layer_promotion(
            final_params, cfg, calib, "down_out", config.down_out_mixed_precision, prefix
        )
        plan = build_plan(config, cfg.num_layers, down_in_bits, down_out_sensitivity["layer_bits"])
        write_json_atomic(run_dir / "sensitivity_down_out.json", down_out_sensitivity)
        write_json_atomic(run_dir / "plan.json", plan.to_dict())
        seconds["down_out_mixed_precision"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    say("stage 2: static calibration of every tensor of the plan")
    state = calibrate(final_params, cfg, plan, calib, prefix=prefix)
    if learned is not None:
        state = merge_scales(state, learned)
    seconds["stage2"] = time.perf_counter() - t0
    weight_codes = None
    if config.weight_rounding == "gptq":
        t0 = time.perf_counter()
        say("GPTQ rounding of the linear weights")
        weight_codes = gptq_round_weights(
            final_params, state, plan, cfg, calib, damp=config.gptq_damp, prefix=prefix
        )
        final_params = weights_from_codes(final_params, state, weight_codes)
        seconds["gptq"] = time.perf_counter() - t0
    save_learned(run_dir, r1, r2, state, weight_codes, smoothing, config.smooth_mlp)

    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    for spec, windows in eval_sets.items():
        say(
            f"evaluation on {spec}: {len(windows)} windows of {config.seq_len}, quantized and float"
        )
        quant_r = evaluate(final_params, state, plan, cfg, windows, prefix)
        reference = (float_reference or {}).get(spec)
        if reference is None:
            float_r = evaluate(model.params, None, None, cfg, windows, prefix)
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
    seconds["eval"] = time.perf_counter() - t0
    report = {
        **config.summary(),
        "eval_windows_cap": config.eval_windows,
        "calibration": {"data": config.calib_data, "windows": config.calib_windows},
        "stage1_steps": config.stage1.steps if config.method in TRAINED_METHODS else 0,
        "sensitivity": sensitivity,
        "down_out_sensitivity": down_out_sensitivity,
        "perplexity": results,
        "seconds": seconds,
        "resumed": resume,
        "stage1_step_seconds": _stage1_step_seconds(run_dir),
        "environment": environment_info(),
        "command": command,
    }
    write_json_atomic(run_dir / "report.json", report)
    seal_run(run_dir)
    return report


def _stage1_step_seconds(run_dir: Path) -> float | None:
    """Stage 1's step time summed over every recorded step, earlier attempts of a resumed run
    included (`seconds` covers this invocation only); None without a stage 1."""
    from qnpu_jax.files import iter_jsonl

    path = run_dir / "stage1" / "metrics.jsonl"
    if not path.is_file():
        return None
    return float(sum(float(row.get("seconds", 0.0)) for _, row in iter_jsonl(path)))


ORTHOGONALITY_TOL = 1e-3  # max |R·Rᵀ − I| of a learned float32 rotation (Cayley keeps ~1e-6)


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


def restore_learned(run_dir: Path) -> dict[str, Any]:
    """The orbax tree in run_dir/learned, with orbax's failures as a QnpuError naming it."""
    import orbax.checkpoint as ocp

    path = (run_dir / "learned").resolve()
    try:
        with ocp.StandardCheckpointer() as ckpt:
            learned = ckpt.restore(path)
    except Exception as e:  # orbax/tensorstore raise many types; all mean "unreadable"
        raise QnpuError(f"{path}: cannot restore the learned checkpoint ({first_line(e)})") from e
    if not isinstance(learned, dict) or "state" not in learned:
        raise QnpuError(f"{path}: the learned checkpoint holds no quantizer state")
    return learned


def load_run(run_dir: Path) -> tuple[QuantizeConfig, QuantPlan, Params, QuantState, Any]:
    """(config, plan, rotated params, quantizer state, model) of a finished run, after its
    manifest, every file's hash and the rotations' orthogonality are verified."""
    from qnpu_jax.models import load_model

    run_dir = Path(run_dir)
    verify_run(run_dir)
    for name in ("config.yaml", "plan.json", "learned"):
        if not (run_dir / name).exists():
            raise QnpuError(f"{run_dir} is not a finished run: {name} is missing")
    config = load_config(run_dir / "config.yaml")
    try:
        plan = QuantPlan.from_dict(json.loads((run_dir / "plan.json").read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise QnpuError(f"{run_dir / 'plan.json'}: {e}") from e
    model = load_model(config.model)
    cfg = model.config
    learned = restore_learned(run_dir)
    rotated = config.method != "rtn"
    if rotated != ("r1" in learned and "r2" in learned):
        raise QnpuError(
            f"{run_dir / 'learned'} does not match config.yaml: method {config.method} "
            f"{'needs' if rotated else 'has no'} rotations R1/R2"
        )
    params = fuse_norms(model.params, cfg) if rotated else model.params
    if (config.smooth_mlp is not None) != ("mlp_smoothing" in learned):
        raise QnpuError(
            f"{run_dir / 'learned'} does not match config.yaml: smooth_mlp is "
            f"{config.smooth_mlp!r} but the smoothing scales are "
            f"{'present' if 'mlp_smoothing' in learned else 'missing'}"
        )
    alpha = float(learned.get("mlp_smoothing_alpha", config.smooth_mlp or 0.0))  # older runs: none
    if config.smooth_mlp is not None and abs(alpha - config.smooth_mlp) > 1e-6:
        raise QnpuError(
            f"{run_dir / 'learned'} does not match config.yaml: smooth_mlp is "
            f"{config.smooth_mlp!r} but the scales were made with {alpha:.6g}"
        )
    if "mlp_smoothing" in learned:
        params = smooth_mlp(params, jnp.asarray(learned["mlp_smoothing"]))
    if rotated:
        for name in ("r1", "r2"):
            check_orthogonal(name, learned[name], str(run_dir / "learned"))
        params = apply_rotations(
            params, cfg, jnp.asarray(learned["r1"]), jnp.asarray(learned["r2"])
        )
    state = jax.tree.map(jnp.asarray, learned["state"])
    if "weight_codes" in learned:
        params = weights_from_codes(params, state, learned["weight_codes"])
    return config, plan, params, state, model
