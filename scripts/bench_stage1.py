"""Stage-1 step speed and memory -> JSON report.

Times the jitted Quant.npu stage-1 train step (W4A8, static fake quantization, remat per
layer) on the real model: seconds per step, tokens/s, achieved FLOP/s (XLA's cost analysis of
the compiled step) against this machine's matmul peak measured in the same run, and peak
memory (device allocator where it reports one, else the process's max RSS). Runs unchanged
on CPU, GPU and TPU.

    python scripts/bench_stage1.py --batch-size 2 --seq-len 512 --steps 3 \
        --json reports/bench_stage1.json

`--simulation` picks what the fake-quant forward computes between quantizers (`fake`: float32;
`device`, the default: the integer softmax and Q14 RoPE tables).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import load_documents, sample_windows, tokenize_documents
from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.export.graph import SIMULATIONS
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models import load_model
from qnpu_jax.models.llama import MATMUL_DTYPES
from qnpu_jax.pipeline import calibrate
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.recipes import build_plan
from qnpu_jax.pipeline.recipes import config_stage1_plan as stage1_plan
from qnpu_jax.pipeline.stage1 import Stage1Config, init_train_state, make_train_step
from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations


def matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best float32 FLOP/s of an n×n×n matmul on the default device."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_memory_bytes() -> tuple[int, str]:
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device allocator peak_bytes_in_use"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process max RSS"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no-remat", action="store_true")
    parser.add_argument("--simulation", choices=SIMULATIONS, default="device")
    parser.add_argument("--compute-dtype", choices=MATMUL_DTYPES, default="float32")
    parser.add_argument("--json", default="reports/bench_stage1.json")
    args = parser.parse_args()

    model = load_model(args.model)
    cfg = model.config
    config = QuantizeConfig(
        model=args.model, w_bits=4, a_bits=8, seq_len=args.seq_len, simulation=args.simulation
    )
    s1 = Stage1Config(
        steps=max(args.steps, 1), batch_size=args.batch_size, grad_accum=args.grad_accum,
        remat=not args.no_remat, compute_dtype=args.compute_dtype,
    )  # fmt: skip
    plan = stage1_plan(build_plan(config, cfg.num_layers, None), config)
    ids = tokenize_documents(load_documents("wiki", "calib"), model.tokenizer)
    base = fuse_norms(model.params, cfg)
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(0))
    calib = sample_windows(ids, args.seq_len, 2, jax.random.key(1))
    state = calibrate(apply_rotations(base, cfg, r1, r2), cfg, plan, calib)
    train_state = init_train_state(r1, r2, state, plan, s1)
    step = make_train_step(cfg, plan, s1)
    shape = (args.grad_accum, args.batch_size, args.seq_len)
    batch = jnp.asarray(
        sample_windows(ids, args.seq_len, int(np.prod(shape[:2])), jax.random.key(2))
    )
    batch = batch.reshape(shape)

    t0 = time.perf_counter()
    compiled = step.lower(train_state, batch, base, state).compile()
    compile_s = time.perf_counter() - t0
    cost: Any = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    flops = float(cost.get("flops", float("nan"))) if cost else float("nan")
    train_state, metrics = compiled(train_state, batch, base, state)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_state, metrics = compiled(train_state, batch, base, state)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    tokens = int(np.prod(shape))
    peak = matmul_peak()
    memory, memory_source = peak_memory_bytes()
    report = {
        "model": args.model,
        "step": "Quant.npu stage 1, W4A8 static fake quant, learnable input/weight scales, "
        "R1/R2 Cayley SGD",
        "batch": {
            "grad_accum": args.grad_accum,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
        },
        "remat": not args.no_remat,
        "simulation": args.simulation,
        "compute_dtype": args.compute_dtype,
        "compile_seconds": compile_s,
        "step_seconds_median": seconds,
        "step_seconds": times,
        "tokens_per_step": tokens,
        "tokens_per_second": tokens / seconds,
        "flops_per_step_xla": flops,
        "achieved_flops_per_second": flops / seconds,
        "matmul_peak_flops_per_second": peak,
        "share_of_matmul_peak": flops / seconds / peak,
        "peak_memory_bytes": memory,
        "peak_memory_source": memory_source,
        "final_loss": float(metrics["loss"]),
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    print(
        f"{seconds:.2f} s/step, {tokens / seconds:.0f} tokens/s, "
        f"{flops / seconds / 1e9:.1f} GFLOP/s of {peak / 1e9:.1f} peak, "
        f"memory {memory / 2**30:.2f} GiB ({memory_source})"
    )
    write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
