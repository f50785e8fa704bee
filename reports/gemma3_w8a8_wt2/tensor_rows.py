"""The run with chosen tensors back in float, beside `qnpu study error_budget`'s rows: the
tensors its groups leave out (q_rope, the 16-bit activations, the embedding and lm_head).

    QNPU_DATA_DIR=../shared/data python3 reports/gemma3_w8a8_wt2/tensor_rows.py \
        RUN DATA WINDOWS OUT [--each16 | --residual]

`--each16`: each calibrated 16-bit activation alone instead; `--residual`: the residual stream
and the post-norm outputs, together.
"""

from __future__ import annotations

import json
import sys

from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.quant.plan import is_weight
from qnpu_jax.studies.error_budget import float_row_ppl
from qnpu_jax.studies.harness import open_run


def main(
    run_dir: str, data: str, n: int, out: str, each16: bool = False, residual: bool = False
) -> None:
    run = open_run(run_dir)
    plan, state, cfg, prefix = run.plan, run.state, run.cfg, run.prefix
    windows = run.eval_windows(n, data)
    acts16 = {
        p for p, tq in plan.entries if not is_weight(p) and tq.bits == 16 and tq.init != "fixed"
    }
    rows_spec = {
        "q_rope": {"layers/q_rope"},
        "16-bit activations (calibrated)": acts16,
        "embed_tokens": {"embed_tokens"},
        "lm_head": {"lm_head"},
        "embed_tokens and lm_head": {"embed_tokens", "lm_head"},
        "up_out and q_rope": {"layers/up_out", "layers/q_rope"},
    }
    if residual:  # the residual stream and the post-norm outputs that join it
        rows_spec = {
            "resid_attn and resid_mlp": {"layers/resid_attn", "layers/resid_mlp"},
            "attn_post and mlp_post": {"layers/attn_post", "layers/mlp_post"},
            "the four": {
                "layers/resid_attn",
                "layers/resid_mlp",
                "layers/attn_post",
                "layers/mlp_post",
            },
        }
    if each16:  # each calibrated 16-bit activation alone
        rows_spec = {p: {p} for p in sorted(acts16)}
    result = {"run": run_dir, "data": data, "windows": n}
    result["float_ppl"] = run.float_ppl(windows)
    result["run_ppl"] = evaluate(
        run.params, state, plan, cfg, windows, prefix, prefix_params=run.prefix_params
    )["ppl"]
    print(f"float {result['float_ppl']:.3f}, run {result['run_ppl']:.3f}", flush=True)
    rows = []
    for label, paths in rows_spec.items():
        ppl = float_row_ppl(run, lambda p, s=paths: p in s, windows)
        rows.append({"label": label, "float": sorted(paths), "ppl": ppl})
        print(f"{label} float: {ppl:.3f}", flush=True)
    result["rows"] = rows
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    flags = sys.argv[5:]
    main(
        sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4],
        "--each16" in flags, "--residual" in flags,
    )  # fmt: skip
