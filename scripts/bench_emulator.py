"""Prefill throughput of the integer engines against the float JAX forward, in one run.

Times prefill of the same tokens on the float JAX forward of the artifact's model, the JAX
integer forward and the numpy NPU emulator, in that order (median of --repeats after one
warm-up call, which also holds the JAX compilations, reported apart), and greedy decode on
both integer engines. The emulator goes last: run before the JAX engine in the same process,
it halved that engine's decode speed (cause not found; standalone runs agree with this order).
One more emulator prefill counts the seconds spent inside its float32 BLAS matmuls
(`emulator_matmuls`): the emulator's prefill can be no faster than that part alone.
Writes a JSON report.

    python scripts/bench_emulator.py --artifact artifacts/smollm2-135m-quantnpu-w4a8-device \
        --seq-len 512 --repeats 5 --json reports/bench_emulator.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import qnpu_jax.runtime.emulator as emulator_engine
from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.export.int_model import artifact_tokenizer, load_int_model
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models.llama import forward
from qnpu_jax.models.load import load_model
from qnpu_jax.runtime.engines import open_engine


def _timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"first_call_s": first, "median_s": statistics.median(times), "repeats": repeats}


@contextmanager
def _matmul_clock(seconds: list[float]) -> Iterator[None]:
    """Time every matmul the emulator hands to BLAS (its einsum hook), appending to `seconds`."""
    inner = emulator_engine._einsum

    def timed(subscripts: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = inner(subscripts, a, b)
        seconds.append(time.perf_counter() - t0)
        return out

    emulator_engine._einsum = timed
    try:
        yield
    finally:
        emulator_engine._einsum = inner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m", help="the float model it came from")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--decode-tokens", type=int, default=16)
    parser.add_argument("--json", type=Path, default=Path("reports/bench_emulator.json"))
    args = parser.parse_args()
    int_model = load_int_model(args.artifact)
    tokenizer = artifact_tokenizer(int_model)
    ids = tokenize_documents(load_documents("wiki", "eval"), tokenizer)
    tokens = eval_windows(ids, args.seq_len, 1)[:1]
    report: dict[str, Any] = {
        "artifact": str(args.artifact),
        "seq_len": args.seq_len,
        "batch": 1,
        "prefill": {},
        "decode": {},
    }
    model = load_model(args.model)
    fwd = jax.jit(lambda p, t: forward(p, t, cfg=model.config))
    tok = jnp.asarray(tokens)
    r = _timed(lambda: fwd(model.params, tok).block_until_ready(), args.repeats)
    r["tokens_per_s"] = args.seq_len / r["median_s"]
    report["prefill"]["float_jax"] = r
    print(f"float JAX: prefill {r['tokens_per_s']:.1f} tok/s")
    for name in ("jax", "emulator"):  # numpy last (see the docstring)
        engine = open_engine(name, int_model)

        def prefill(engine: Any = engine) -> Any:
            return engine.prefill(tokens)[0]

        r = _timed(prefill, args.repeats)
        r["tokens_per_s"] = args.seq_len / r["median_s"]
        report["prefill"][name] = r
        if name == "emulator":
            seconds: list[float] = []
            t0 = time.perf_counter()
            with _matmul_clock(seconds):
                prefill()
            total = time.perf_counter() - t0
            report["prefill"]["emulator_matmuls"] = {
                "prefill_s": total,
                "matmul_s": sum(seconds),
                "matmul_calls": len(seconds),
                "tokens_per_s_matmuls_alone": args.seq_len / sum(seconds),
            }
            print(f"emulator: {sum(seconds):.2f} of {total:.2f} s in {len(seconds)} matmuls")
        prompt = [int(t) for t in tokens[0, :32]]
        engine.generate(prompt, 2)  # warm-up: compiles prefill and the decode step
        t0 = time.perf_counter()
        engine.generate(prompt, 1)
        prefill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = engine.generate(prompt, args.decode_tokens + 1)
        steps_s = time.perf_counter() - t0 - prefill_s  # the same prefill, then N decode steps
        report["decode"][name] = {
            "steps": len(out) - 1,
            "seconds": steps_s,
            "tokens_per_s": (len(out) - 1) / steps_s,
        }
        print(
            f"{name}: prefill {r['tokens_per_s']:.1f} tok/s, "
            f"decode {(len(out) - 1) / steps_s:.2f} tok/s"
        )
    report["environment"] = environment_info()
    report["command"] = script_command(__file__)
    write_json_atomic(args.json, report)
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
