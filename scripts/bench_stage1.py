"""Stage-1 step speed and memory -> JSON report.

Times the jitted Quant.npu stage-1 train step (W4A8, static fake quantization, remat per
layer) on the real model: seconds per step, tokens/s, the step's matmul FLOP/s (counted from
the shapes, `step_matmul_flops`; XLA's cost analysis is reported beside it but counts the scan
over layers once) against this machine's matmul peak measured in the same run, and peak
memory (device allocator where it reports one, else the process's max RSS). Runs unchanged
on CPU, GPU and TPU.

    python scripts/bench_stage1.py --batch-size 2 --seq-len 512 --steps 3 \
        --json reports/bench_stage1.json

`--simulation` picks what the fake-quant forward computes between quantizers (`fake`: float32;
`device`, the default: the integer softmax and Q14 RoPE tables).
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import load_documents, sample_windows, tokenize_documents
from qnpu_jax.environment import environment_info, matmul_peak, script_command
from qnpu_jax.files import write_json_atomic
from qnpu_jax.ir.graph import SIMULATIONS, rotation_linears
from qnpu_jax.models.llama import MATMUL_DTYPES
from qnpu_jax.models.load import load_model
from qnpu_jax.pipeline import calibrate
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.quantized_model import Transforms
from qnpu_jax.pipeline.recipes import build_plan
from qnpu_jax.pipeline.recipes import config_stage1_plan as stage1_plan
from qnpu_jax.pipeline.stage1 import Stage1Config, init_train_state, make_train_step
from qnpu_jax.transforms import apply_rotations, randomized_hadamard_rotations


def step_matmul_flops(
    cfg: Any, tokens: int, seq_len: int, remat: bool, online_linears: int = 0
) -> float:
    """Matmul FLOPs of one stage-1 step counted from the shapes (XLA's cost analysis counts
    the scan over layers once, so it misses 29 of SmolLM2's 30 layers): forward through the
    layers' linears, attention (QK and PV over the full T×T, as computed) and lm_head; the
    backward twice the layers' and attention's (dx and dW) and once lm_head's (dx: the table
    is float); remat's second forward of the layers; R1 rotating every linear weight forward
    and its gradient backward (R2 and the elementwise work left out). `online_linears`:
    the hidden × hidden linears per layer that hold R1 online (Gemma 3's two; R1 then rotates
    fewer weights than counted, so its term is an upper bound there)."""
    d, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    linear_params = cfg.num_layers * (2 * d * q + 2 * d * kv + 3 * d * inter)
    linear_params += cfg.num_layers * online_linears * d * d
    layers = 2 * tokens * linear_params
    attention = cfg.num_layers * 2 * 2 * tokens * cfg.num_heads * seq_len * hd
    head = 2 * tokens * d * cfg.vocab_size
    rotation = 2 * 2 * d * linear_params
    return float(
        (layers + attention + head) + 2 * (layers + attention) + head
        + (layers + attention if remat else 0) + rotation
    )  # fmt: skip


# what the profile sorts each XLA:CPU thunk into, by its op_name and output shape
# (events of XLA's worker threads that are bookkeeping, not a thunk's work)
PROFILE_SKIP = ("ThunkExecutor::", "SlinkyThreadPool::", "ThreadpoolListener::", "end: ")
PROFILE_THREADS = ("tf_XLAEigen", "tf_XLAPjRtCpuClient")


def _thunk_kind(op: str, shape: str, attention_elements: int, vocab_size: int) -> str:
    """`attention_elements`: B·heads·T·T, the size of the scores and probabilities."""
    dims = [int(x) for x in re.findall(r"\d+", shape.split("[")[-1].split("]")[0])]
    if "ji,ljk" in op or "jvp()" in op:
        return "R1 rotating the weights"
    if "dot_general" in op.split("/")[-1]:
        if "bkgts" in op or "btkgd" in op:
            return "attention matmul"
        return "lm_head matmul" if vocab_size in dims else "linear matmul"
    if "bkgts" in op or "btkgd" in op or math.prod(dims) == attention_elements:
        return "attention elementwise"
    return "other elementwise"


def profile_step(
    compiled: Any, args: tuple[Any, ...], attention_elements: int, vocab_size: int
) -> dict[str, Any]:
    """One step under `jax.profiler`: the seconds of each kind of thunk (`_thunk_kind`; each
    thunk's duration on the thread that ran it, so concurrent thunks both count, while the
    partitions a thunk hands to the other worker are inside its own duration), their share,
    the part in the remat recomputation, and the process's CPU seconds over the step (how
    many cores it kept busy; spinning workers count too)."""
    meta = {}
    for line in compiled.as_text().splitlines():
        m = re.match(r'\s*(?:ROOT )?%([\w.\-]+) = (\S+) .*?op_name="([^"]*)"', line)
        if m:
            meta[m.group(1)] = (m.group(2), m.group(3))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            jax.block_until_ready(compiled(*args))
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_SELF)
        data = jax.profiler.ProfileData.from_file(str(next(Path(tmp).rglob("*.xplane.pb"))))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    kinds: collections.Counter[str] = collections.Counter()
    remat: collections.Counter[str] = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith(PROFILE_THREADS):
                continue
            for ev in line.events:
                if ev.name.startswith(PROFILE_SKIP):
                    continue
                shape, op = meta.get(ev.name, ("", ev.name))
                kind = _thunk_kind(op, shape, attention_elements, vocab_size)
                kinds[kind] += ev.duration_ns
                if "rematted_computation" in op:
                    remat[kind] += ev.duration_ns
    total = sum(kinds.values())
    if not total:
        raise RuntimeError("the profile holds no XLA:CPU thunk events")
    return {
        "step_seconds": wall,
        "process_cpu_seconds": cpu,
        "thunk_seconds": total / 1e9,
        "by_kind": {
            k: {
                "thunk_seconds": v / 1e9,
                "share": v / total,
                "remat_thunk_seconds": remat[k] / 1e9,
            }
            for k, v in kinds.most_common()
        },
    }


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
    parser.add_argument(
        "--profile", action="store_true", help="add one profiled step's breakdown to the report"
    )
    args = parser.parse_args()

    model = load_model(args.model)
    cfg = model.config
    config = QuantizeConfig.of(
        model=args.model, w_bits=4, a_bits=8, seq_len=args.seq_len, simulation=args.simulation
    )
    s1 = Stage1Config(
        steps=max(args.steps, 1), batch_size=args.batch_size, grad_accum=args.grad_accum,
        remat=not args.no_remat, compute_dtype=args.compute_dtype,
    )  # fmt: skip
    r1, r2 = randomized_hadamard_rotations(cfg, jax.random.key(0))
    # what stage 1 starts from, as the pipeline's stage 1 builds it: the base it rotates on the
    # fly and the graph it trains (Gemma 3's has a rotation linear after each pre-norm)
    start = Transforms(r1=r1, r2=r2, fused_norms=True)
    plan = stage1_plan(build_plan(config, cfg.num_layers, graph=start.graph(cfg)), config)
    ids = tokenize_documents(load_documents("wiki", "calib"), model.tokenizer)
    base = start.apply(model.params, cfg, rotate=False)
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
    attention_elements = args.batch_size * cfg.num_heads * args.seq_len**2
    profile = (
        profile_step(
            compiled, (train_state, batch, base, state), attention_elements, cfg.vocab_size
        )
        if args.profile
        else None
    )
    tokens = int(np.prod(shape))
    online = len(rotation_linears(plan.graph))
    matmul_flops = step_matmul_flops(cfg, tokens, args.seq_len, not args.no_remat, online)
    peak = matmul_peak()
    memory, memory_source = peak_memory_bytes()
    report = {
        "model": args.model,
        "graph": plan.to_dict().get("graph", "llama"),
        "rotation_linears_per_layer": online,
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
        "matmul_flops_per_step": matmul_flops,
        "achieved_matmul_flops_per_second": matmul_flops / seconds,
        "matmul_peak_flops_per_second": peak,
        "share_of_matmul_peak": matmul_flops / seconds / peak,
        "matmul_floor_seconds_at_peak": matmul_flops / peak,
        "flops_per_step_xla": flops,
        "flops_xla_note": "XLA's cost analysis counts the scan over layers once",
        "peak_memory_bytes": memory,
        "peak_memory_source": memory_source,
        "final_loss": float(metrics["loss"]),
        **({"profile": profile} if profile else {}),
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    print(
        f"{seconds:.2f} s/step, {tokens / seconds:.0f} tokens/s, "
        f"{matmul_flops / seconds / 1e9:.1f} matmul GFLOP/s of {peak / 1e9:.1f} peak, "
        f"memory {memory / 2**30:.2f} GiB ({memory_source})"
    )
    write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
