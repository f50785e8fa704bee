"""Stage 2 of a finished run again under other plan rules, without a new stage 1 -> JSON.

`--config` (default: the run's own config) must equal the run's config except for `rules` and
`down_out_mixed_precision`, which `--down-out-mixed-precision P` also sets; the change must
leave the tensors stage 1 learned (the linears' inputs and weights) as they were. A changed
`down_out_mixed_precision` runs its scan on the run's final model, as `qnpu quantize` does. A
run with GPTQ codes keeps them (a full run would re-choose them under the new plan; the JSON
says so). The tensors whose entry changes are recalibrated on the run's rotated model and
calibration windows, everything else keeps the run's encodings, and both plans are evaluated on
the same `wiki` eval windows. Because stage 1 never sees the other tensors, the result equals
what `qnpu quantize --config CONFIG` gives (same seed, same stage 1), at the cost of one
calibration and two evaluations.

    qnpu study restage2 --run runs/smollm2-135m-quantnpu-w4a8 \
        --config smollm2-135m-quantnpu-w4a8-clip --json reports/restage2_clip.json
    qnpu study restage2 --run runs/compare/quantnpu-w8a8kv8-ours-prefix-bos \
        --down-out-mixed-precision 0.1 --json reports/restage2_w8a8_ours_down_out.json
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

from qnpu_jax.export.graph import UNROTATED_INPUT, UNROTATED_OUTPUT
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import say, write_study_json


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
    args = parser.parse_args(argv)
    from qnpu_jax.environment import study_command

    command = study_command("restage2", argv)

    from qnpu_jax.errors import QnpuError
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.pipeline.model import nll_perplexity
    from qnpu_jax.pipeline.recipes import build_plan
    from qnpu_jax.pipeline.run import calibration_data, load_run, wiki_eval_windows
    from qnpu_jax.pipeline.steps import STAGE1_TENSORS, Calibration, calibrate, promote

    try:
        say(f"reading and verifying the run {args.run}")
        run = load_run(args.run)
        config, plan, model = run.config, run.model.require_plan(), run.loaded
        data = Calibration(*calibration_data(config, model.tokenizer))
        new_config = load_config(args.config) if args.config is not None else config
        if args.down_out_mixed_precision is not None:
            new_config = dataclasses.replace(
                new_config, down_out_mixed_precision=args.down_out_mixed_precision
            )
        source = str(args.config) if args.config is not None else "the run's config"
        same = dataclasses.replace(
            new_config,
            rules=config.rules,
            down_out_mixed_precision=config.down_out_mixed_precision,
        )
        if same != config:
            raise QnpuError(
                f"{source} differs from the run's config in more than `rules` and "
                "`down_out_mixed_precision`"
            )
        layer_bits = {}  # the run's per-layer promotions (sensitivity scans) stay
        for name in (UNROTATED_INPUT, UNROTATED_OUTPUT):
            entry = plan.get(f"layers/{name}")
            layer_bits[name] = entry.layer_bits if entry is not None else None
        promotion = None
        if new_config.down_out_mixed_precision != config.down_out_mixed_precision:
            layer_bits[UNROTATED_OUTPUT] = None
            if new_config.down_out_mixed_precision > 0:
                fraction = new_config.down_out_mixed_precision
                promotion = promote(UNROTATED_OUTPUT, fraction)(run.model, data).steps[-1].info
                layer_bits[UNROTATED_OUTPUT] = tuple(promotion["layer_bits"])
        new_plan = build_plan(
            new_config, plan.num_layers, layer_bits[UNROTATED_INPUT], layer_bits[UNROTATED_OUTPUT]
        )
        changed = changed_entries(plan, new_plan)
        learned = [p for p in changed if p.removeprefix("layers/") in STAGE1_TENSORS]
        if learned:
            raise QnpuError(f"the rules change stage-1 tensors {learned}: run qnpu quantize")
        if not changed:
            raise QnpuError("the new rules change no tensor of the plan")
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    restaged = calibrate(changed)(run.model.replace(plan=new_plan), data)
    windows = wiki_eval_windows(config, model.tokenizer, args.eval_windows)
    run_ppl = nll_perplexity(run.model.nll_fn(), windows)["ppl"]
    new_ppl = nll_perplexity(restaged.nll_fn(), windows)["ppl"]
    print(f"run {run_ppl:.3f} -> {new_ppl:.3f} ({', '.join(changed)})", flush=True)
    write_study_json(
        args.json,
        {
            "run": str(args.run),
            "config": str(args.config) if args.config is not None else None,
            "down_out_mixed_precision": new_config.down_out_mixed_precision,
            **config.summary(),
            "eval": {"data": "wiki (eval split)", "windows": len(windows)},
            "recalibrated": changed,
            "down_out_promotion": promotion,
            # GPTQ's Hessians depend on the plan: a full run would re-choose the codes
            "gptq_codes_kept": config.weight_rounding == "gptq",
            "run_ppl": run_ppl,
            "new_ppl": new_ppl,
        },
        command=command,
    )
    return 0
