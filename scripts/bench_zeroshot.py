"""Zero-shot scoring speed, the head on the continuations alone against every position -> JSON.

`qnpu eval --tasks` scores each request's continuation tokens only, so its scorers run
lm_head on those positions (`LmScorer.span_nll_argmax_fn`). This times the same requests
through both paths of the float model (each twice: the first pass compiles), checks that
they give the same log-likelihoods and greedy matches, and reports the seconds and their
ratio beside this machine's matmul peak, measured in the same run.

    QNPU_DATA_DIR=../shared/data python scripts/bench_zeroshot.py --model gemma3-270m \
        --tasks hellaswag,lambada --limit 16 --json reports/bench_zeroshot_gemma3.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from qnpu_jax.environment import environment_info, matmul_peak, script_command
from qnpu_jax.eval import LmScorer, load_task
from qnpu_jax.eval.zeroshot import encode_requests, score_token_requests, select_indices
from qnpu_jax.files import write_json_atomic
from qnpu_jax.scoring import scored_model


def _timed(scorer: LmScorer, requests: list[Any], greedy: bool, batch: int) -> dict[str, Any]:
    seconds, scores = [], []
    for _ in range(2):  # the first pass compiles
        start = time.perf_counter()
        scores = score_token_requests(scorer, requests, greedy=greedy, batch_size=batch,
                                      progress=False)  # fmt: skip
        seconds.append(time.perf_counter() - start)
    return {"first_pass_s": seconds[0], "second_pass_s": seconds[1], "scores": scores}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--tasks", default="hellaswag,lambada")
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    peak = matmul_peak()
    scored = scored_model(model=args.model)
    assert scored.span_nll_argmax_fn is not None
    full = LmScorer(scored.nll_fn, scored.nll_argmax_fn, scored.max_length)
    span = LmScorer(scored.nll_fn, None, scored.max_length, scored.span_nll_argmax_fn)
    rows = {}
    for task in args.tasks.split(","):
        docs = load_task(task)
        picked = [docs[i] for i in select_indices(len(docs), args.limit, 0)]
        requests = encode_requests(scored.tokenizer, [r for d in picked for r in d.requests])
        greedy = task == "lambada"
        a = _timed(full, requests, greedy, args.batch_size)
        b = _timed(span, requests, greedy, args.batch_size)
        sa, sb = a.pop("scores"), b.pop("scores")
        lp_a, lp_b = (np.asarray([s.logprob for s in x]) for x in (sa, sb))
        rows[task] = {
            "requests": len(requests),
            "continuation_tokens": int(sum(len(c) for _, c in requests)),
            "sequence_tokens": int(sum(len(x) + len(c) for x, c in requests)),
            "every_position": a,
            "continuations_alone": b,
            "speedup_second_pass": a["second_pass_s"] / b["second_pass_s"],
            "max_abs_logprob_difference": float(np.max(np.abs(lp_a - lp_b))),
            "max_rel_logprob_difference": float(np.max(np.abs(lp_a - lp_b) / np.abs(lp_a))),
            "greedy_matches_equal": [s.greedy for s in sa] == [s.greedy for s in sb],
        }
        print(f"{task}: {len(requests)} requests, every position {a['second_pass_s']:.1f} s, "
              f"continuations alone {b['second_pass_s']:.1f} s "
              f"({rows[task]['speedup_second_pass']:.2f}x), max |d logprob| "
              f"{rows[task]['max_abs_logprob_difference']:.2e}")  # fmt: skip
    write_json_atomic(
        args.json,
        {
            "model": args.model,
            "limit": args.limit,
            "batch_size": args.batch_size,
            "tasks": rows,
            "matmul_peak_gflops": peak / 1e9,
            "environment": environment_info(),
            "command": script_command(__file__),
        },
    )


if __name__ == "__main__":
    main()
