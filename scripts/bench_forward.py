"""Throughput of the jitted float forward (tokens/s) at fixed batch x seq shapes -> JSON report.

    python scripts/bench_forward.py --model smollm2-135m --shapes 1x512 4x512 \
        --json reports/bench_forward.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models.llama import forward
from qnpu_jax.models.load import load_model


def _shape(text: str) -> tuple[int, int]:
    try:
        b, t = (int(x) for x in text.lower().split("x"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"shape must look like 4x512, got {text!r}") from e
    return b, t


def bench(model, batch: int, seq: int, repeats: int, key: jax.Array) -> dict:
    tokens = jax.random.randint(key, (batch, seq), 0, model.config.vocab_size, jnp.int32)
    start = time.perf_counter()
    forward(model.params, tokens, cfg=model.config).block_until_ready()
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forward(model.params, tokens, cfg=model.config).block_until_ready()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "batch": batch,
        "seq_len": seq,
        "repeats": repeats,
        "first_call_seconds": compile_s,
        "median_seconds": median,
        "min_seconds": min(times),
        "tokens_per_second": batch * seq / median,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[(1, 512), (4, 512)])
    parser.add_argument("--repeats", type=int, default=5, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="reports/bench_forward.json")
    args = parser.parse_args()
    try:
        model = load_model(args.model)
    except QnpuError as e:
        print(f"bench_forward: error: {e}", file=sys.stderr)
        return 2
    keys = jax.random.split(jax.random.key(args.seed), len(args.shapes))
    results = []
    for (b, t), key in zip(args.shapes, keys, strict=True):
        row = bench(model, b, t, args.repeats, key)
        print(
            f"{b}x{t}: {row['tokens_per_second']:.0f} tokens/s "
            f"(median {row['median_seconds']:.3f} s, first call {row['first_call_seconds']:.1f} s)"
        )
        results.append(row)
    report = {
        "model": args.model,
        "path": "float",
        "results": results,
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
