"""Stage 2 of a finished run again under other plan rules, without a new stage 1 -> JSON.

`--config` (default: the run's own config) must equal the run's config except for
`RESTAGED_KEYS`: `rules`, `down_out_mixed_precision` (which `--down-out-mixed-precision P` also
sets), GPTQ's keys and `residual_split`; the change must leave the tensors stage 1 learned
(the linears' inputs and weights) as they were. A changed `down_out_mixed_precision` runs its
scan on the run's final model (its weights before GPTQ's rounding), as `qnpu quantize` does.
The tensors whose entry changes are recalibrated on the run's rotated model and calibration
windows, everything else keeps the run's encodings; a `residual_split` then splits the
residual stream's encodings; with `weight_rounding: gptq` GPTQ then re-chooses the
codes under the new plan (`rtn`: the run's codes go), and both models are evaluated on the same
eval windows. Because stage 1 never sees the other tensors, the result is what `qnpu quantize
--config CONFIG` gives (same seed, same stage 1; equal on the test model) up to float rounding:
the partial calibration compiles another forward (encodings within 1e-6), and GPTQ's codes can
carry that to a few tenths of a percent of perplexity (SmolLM2 W4A8 seed 0: 18.212 here, 18.262
from `qnpu quantize`). It costs one calibration, GPTQ where it rounds, and two evaluations per
`--eval-data` set (default `wiki`; `wikitext2` reads QNPU_DATA_DIR as `qnpu quantize` does).

    qnpu study restage2 --run runs/smollm2-135m-quantnpu-w4a8 \
        --config smollm2-135m-quantnpu-w4a8-clip --json reports/restage2_clip.json
    qnpu study restage2 --run runs/compare/quantnpu-w8a8kv8-ours-prefix-bos \
        --down-out-mixed-precision 0.1 --json reports/restage2_w8a8_ours_down_out.json
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from qnpu_jax.environment import study_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import MLP_INPUT, UNROTATED_INPUT, UNROTATED_OUTPUT
from qnpu_jax.pipeline.config import differing_keys, load_config
from qnpu_jax.pipeline.quantized_model import nll_perplexity
from qnpu_jax.pipeline.recipes import build_plan, gptq_step
from qnpu_jax.pipeline.run import (
    EVAL_ONLY_KEYS,
    calibration_data,
    evaluation_sets,
    load_run,
    without_eval,
)
from qnpu_jax.pipeline.steps import (
    STAGE1_TENSORS,
    Calibration,
    calibrate,
    promote,
    split_residual,
)
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import say, write_study_json

# the config keys a restage may change: the plan's rules, the scan after stage 1, GPTQ's
RESTAGED_KEYS = (
    "rules",
    "down_out_mixed_precision",
    "weight_rounding",
    "gptq_damp",
    "gptq_act_order",
    "gptq_windows",
    "gptq_passes",
    "residual_split",
)


def changed_entries(old: Any, new: Any) -> list[str]:
    """Paths whose TensorQuant differs between two plans (added, removed or changed)."""
    a, b = dict(old.entries), dict(new.entries)
    return sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, run=True, eval_windows=32, json=True)
    parser.add_argument("--config", type=Path, default=None, help="default: the run's config")
    parser.add_argument(
        "--down-out-mixed-precision",
        type=float,
        default=None,
        metavar="P",
        help="set down_out_mixed_precision (over --config, or the run's config)",
    )
    parser.add_argument(
        "--eval-data",
        default="wiki",
        help="comma-separated eval sets, as the config's eval_data (default: wiki)",
    )
    args = parser.parse_args(argv)

    command = study_command("restage2", argv)

    try:
        say(f"reading and verifying the run {args.run}")
        run = load_run(args.run)
        config, plan, model = run.config, run.model.require_plan(), run.loaded
        data = Calibration(*calibration_data(config, model.tokenizer))
        specs = tuple(s.strip() for s in args.eval_data.split(",") if s.strip())
        if not specs:
            raise QnpuError("--eval-data names no eval set")
        evaluated = config.replace(eval_data=specs, eval_windows=args.eval_windows)
        room = model.config.max_position_embeddings - len(run.model.prefix)
        sets = evaluation_sets(evaluated, model.tokenizer, room)  # a wrong path fails first
        new_config = load_config(args.config) if args.config is not None else config
        if args.down_out_mixed_precision is not None:
            new_config = new_config.replace(down_out_mixed_precision=args.down_out_mixed_precision)
        source = str(args.config) if args.config is not None else "the run's config"
        same = new_config.replace(**{key: config.value(key) for key in RESTAGED_KEYS})
        ran, asked = without_eval(config), without_eval(same)
        if asked != ran:
            raise QnpuError(
                f"{source} differs from the run's config in more than "
                f"{', '.join(f'`{key}`' for key in RESTAGED_KEYS)} and the keys "
                f"that change no run ({', '.join(EVAL_ONLY_KEYS)}; the run's -> this one's): "
                + "; ".join(differing_keys(ran, asked))
            )
        layer_bits = {}  # the run's per-layer promotions (sensitivity scans) stay
        for name in (UNROTATED_INPUT, UNROTATED_OUTPUT, MLP_INPUT):
            entry = plan.get(f"layers/{name}")
            if entry is not None and entry.layer_bits is not None:
                layer_bits[name] = entry.layer_bits
        promotion = None
        fraction = new_config.promotions.down_out
        if fraction != config.promotions.down_out:
            layer_bits.pop(UNROTATED_OUTPUT, None)
            if fraction > 0:
                promotion = promote(UNROTATED_OUTPUT, fraction)(run.model, data).steps[-1].info
                layer_bits[UNROTATED_OUTPUT] = tuple(promotion["layer_bits"])
        graph = run.model.transforms.graph(run.model.cfg)  # Gemma 3's rotation graph, say
        new_plan = build_plan(new_config, plan.num_layers, layer_bits, graph=graph)
        changed = changed_entries(plan, new_plan)
        learned = [p for p in changed if p.removeprefix("layers/") in STAGE1_TENSORS]
        if learned:
            raise QnpuError(f"the rules change stage-1 tensors {learned}: run qnpu quantize")
        rounds = new_config.weights.rounding == "gptq"
        div = new_config.outliers.residual_split
        if (
            not changed
            and new_config.weights == config.weights
            and div == config.outliers.residual_split
        ):
            raise QnpuError(
                "the new config changes no tensor of the plan, not the rounding and not the "
                "residual split"
            )
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the run before its GPTQ step: codes are re-chosen under the new plan, or go (rtn)
    restaged = run.model.replace(plan=new_plan, weight_codes=None)
    if changed:
        restaged = calibrate(changed)(restaged, data)
    if div is not None:  # on the run's stage-2 encodings of the residual, as quantize does
        restaged = split_residual(div)(restaged, data)
    if rounds:
        restaged = gptq_step(new_config)(restaged, data)
    split = [] if div is None else [f"residual split 1/{div:g}"]
    what = ", ".join([*changed, *split, f"rounding {new_config.weights.rounding}"])
    results = {}
    for spec, windows in sets.items():
        run_ppl = nll_perplexity(run.model.nll_fn(), windows)["ppl"]
        new_ppl = nll_perplexity(restaged.nll_fn(), windows)["ppl"]
        results[spec] = {"windows": len(windows), "run_ppl": run_ppl, "new_ppl": new_ppl}
        print(f"{spec}: run {run_ppl:.3f} -> {new_ppl:.3f} ({what})", flush=True)
    first = results[specs[0]]
    write_study_json(
        args.json,
        {
            "run": str(args.run),
            "config": str(args.config) if args.config is not None else None,
            "down_out_mixed_precision": new_config.promotions.down_out,
            **config.summary(),
            "eval": {"data": specs, "windows": first["windows"]},
            "recalibrated": changed,
            "down_out_promotion": promotion,
            "weight_rounding": new_config.weights.rounding,
            "gptq_redone": rounds,
            "run_ppl": first["run_ppl"],  # of the first eval set
            "new_ppl": first["new_ppl"],
            "perplexity": results,
        },
        command=command,
    )
    return 0
