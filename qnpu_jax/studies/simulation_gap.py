"""The simulation gap: fake-quant perplexity of `qnpu quantize` runs vs their integer artifact.

For each run: export it (unless the artifact exists), then score the same `wiki` eval windows
with the run's fake-quant model (JAX) and with the artifact on the numpy NPU emulator (and,
with --jax-engine, on the JAX integer forward). Writes one JSON report: per engine the gap
ppl_int / ppl_fq - 1, with a paired standard error over windows (the same windows go through
both models, so the window-to-window spread of the difference measures how much of the gap
is rounding noise amplified through the layers rather than a systematic difference).

    qnpu study simulation_gap --runs runs/smollm2-135m-quantnpu-w8a8 \
        runs/smollm2-135m-quantnpu-w4a8 --seq-len 512 --windows 32 \
        --json reports/simulation_gap.json
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import study_command
from qnpu_jax.eval import perplexity
from qnpu_jax.export.exporter import export_run
from qnpu_jax.export.int_model import load_int_model, open_engine
from qnpu_jax.pipeline.run import load_run
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import write_study_json


def _ppl(nll_fn: Any, windows: np.ndarray) -> dict[str, Any]:
    r = perplexity(nll_fn, windows, progress=False)
    return {
        "ppl": r.ppl,
        "nll_mean": r.nll_sum / r.predicted_tokens,
        "seconds": r.seconds,
        "window_nll": list(r.window_nll),
    }


def paired_gap(fake: list[float], integer: list[float]) -> dict[str, Any]:
    """The perplexity gap with a paired standard error over windows (equal-length windows:
    log ppl is the mean of the window NLLs), and how many windows each side wins."""
    d = np.asarray(integer) - np.asarray(fake)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
    return {
        "gap": math.expm1(mean),
        "gap_2se_interval": [math.expm1(mean - 2 * se), math.expm1(mean + 2 * se)],
        "nll_diff_mean": mean,
        "nll_diff_se": se,
        "windows_integer_lower": int((d < 0).sum()),
        "windows_integer_higher": int((d > 0).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__)
    parser.add_argument("--runs", nargs="+", type=Path, required=True)
    parser.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--jax-engine", action="store_true", help="also the JAX integer engine")
    parser.add_argument("--json", type=Path, default=Path("reports/simulation_gap.json"))
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "data": "wiki (eval split)",
        "seq_len": args.seq_len,
        "windows": args.windows,
        "runs": {},
    }
    command = study_command("simulation_gap", argv)
    for run in args.runs:
        loaded_run = load_run(run)
        config, model = loaded_run.config, loaded_run.loaded
        art = args.artifacts / run.resolve().name
        export_s = None  # None: an existing artifact was reused
        if not (art / "manifest.json").exists():
            t0 = time.perf_counter()
            export_run(run, art)
            export_s = time.perf_counter() - t0
        ids = tokenize_documents(load_documents("wiki", "eval"), model.tokenizer)
        windows = eval_windows(ids, args.seq_len, args.windows)
        fake = _ppl(loaded_run.model.nll_fn(), windows)
        int_model = load_int_model(art)
        engines = ["emulator", "jax"] if args.jax_engine else ["emulator"]
        entry: dict[str, Any] = {
            "method": config.method,
            "bits": config.bits_name,
            "artifact": str(art),
            "export_seconds": export_s,
            "fake_quant": fake,
        }
        for name in engines:
            result = _ppl(open_engine(name, int_model).token_nll, windows)
            result |= paired_gap(fake["window_nll"], result["window_nll"])
            entry[name] = result
            lo, hi = result["gap_2se_interval"]
            print(
                f"{run.name}: fake-quant {fake['ppl']:.4f}, {name} {result['ppl']:.4f} "
                f"({100 * result['gap']:+.3f}%, ±2 SE [{100 * lo:+.3f}%, {100 * hi:+.3f}%])"
            )
        report["runs"][run.name] = entry
        write_study_json(args.json, report, command=command)
    worst = max(abs(e["emulator"]["gap"]) for e in report["runs"].values())
    print(f"largest |gap| {100 * worst:.3f}% -> {args.json}")
    return 0 if math.isfinite(worst) else 1
