"""A run's integer artifact on both engines and against its fake-quant model -> JSON.

Exports the run (`qnpu export`, a context of `--seq-len` after the sink prefix, one prefill
chunk), then prefills `--windows` evaluation windows of `--seq-len` tokens (the run's own
evaluation text) on the numpy emulator and on the JAX integer engine: whether their logits and
K/V codes are equal bit for bit, and each window's mean next-token NLL on the emulator against
the fake-quant model's. On Gemma 3 a window longer than its sliding window (512) makes the
sliding layers drop keys (issue 54).

    QNPU_DATA_DIR=../shared/data python scripts/artifact_agreement.py --run runs/gemma3-w8a8 \
        --out artifacts/gemma3-w8a8 --seq-len 600 --windows 1 --json reports/agreement.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.export.exporter import export_run
from qnpu_jax.export.int_model import load_int_model
from qnpu_jax.files import write_json_atomic
from qnpu_jax.pipeline.run import evaluation_sets, load_run
from qnpu_jax.runtime.engines import open_engine


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished `qnpu quantize` run")
    ap.add_argument("--out", type=Path, required=True, help="where to export the artifact")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        run = load_run(args.run)
        start = time.perf_counter()
        context = args.seq_len + len(run.model.prefix)
        export_run(args.run, args.out, max_context=context, prefill_chunk=args.seq_len)
        export_s = time.perf_counter() - start
        art = load_int_model(args.out)
        config = run.config.replace(seq_len=args.seq_len, eval_windows=args.windows)
        windows = np.asarray(evaluation_sets(config, run.tokenizer, args.seq_len)["wiki"])
    except QnpuError as e:
        print(f"artifact_agreement: error: {e}", file=sys.stderr)
        return 2
    emulator, jax_engine = open_engine("emulator", art), open_engine("jax", art)
    rows = []
    for i, window in enumerate(windows[: args.windows]):
        ids = window[None]
        logits_e, cache_e = emulator.prefill(ids)
        logits_j, cache_j = jax_engine.prefill(ids)
        pairs = ((logits_e, logits_j), (cache_e.k, cache_j.k), (cache_e.v, cache_j.v))
        same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs)
        row = {
            "window": i,
            "bit_exact": same,
            "nll_integer": float(np.mean(emulator.token_nll(ids))),
            "nll_fake_quant": float(np.log(run.model.perplexity(ids)["ppl"])),
        }
        rows.append(row)
        print(row, flush=True)
    report = {
        "run": str(args.run),
        "architecture": run.model.cfg.architecture,
        "seq_len": args.seq_len,
        "export_s": round(export_s, 1),
        "rows": rows,
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    write_json_atomic(args.json, report)
    return 0 if all(r["bit_exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
