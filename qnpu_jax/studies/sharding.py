"""One `qnpu quantize` config on several device meshes: learned parameters and perplexity -> JSON.

Each mesh runs in its own process (the device count is fixed when JAX starts) with
`--xla_force_host_platform_device_count=N` on the CPU, so an 8-device mesh runs on any
machine; on an accelerator pass `--platform-devices 0` and the real devices are used. The
first mesh is the reference: every other run's R1, R2 and learned quantizer state are
compared with it leaf by leaf (max absolute difference, and relative to the leaf's max), and
the perplexities are listed. Meshes differ only in how XLA splits and orders float
reductions, so the differences are rounding, which stage 1 amplifies.

    qnpu study sharding --config quick --meshes 1x1 8x1 2x4 1x8 --floor \
        --set stage1.batch_size=8 --json reports/sharding.json
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from qnpu_jax.mesh import host_platform_flags
from qnpu_jax.pipeline.calibrate import calibrate
from qnpu_jax.pipeline.quantized_model import QuantizedModel, restore_learned
from qnpu_jax.pipeline.recipes import config_stage1_plan, run_keys
from qnpu_jax.pipeline.run import calibration_data, load_run
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.stage1 import init_train_state, make_train_step, step_batch
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import write_study_json


def flat_leaves(tree: Any) -> dict[str, np.ndarray]:
    """{"state/layers/q_proj/scale": array, ...} of a restored learned tree (pure)."""

    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        out[key] = np.asarray(leaf, np.float64)
    return out


def leaf_differences(reference: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> dict:
    """Max |a - b| over all leaves and over each group (r1, r2, state), and the worst leaf's
    difference relative to its own largest value (pure)."""
    if set(reference) != set(other):
        raise ValueError(f"learned trees differ in leaves: {set(reference) ^ set(other)}")
    groups: dict[str, float] = {}
    worst_rel, worst_leaf = 0.0, ""
    for key, a in reference.items():
        b = other[key]
        if a.shape != b.shape:
            raise ValueError(f"{key}: shape {a.shape} vs {b.shape}")
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        group = key.split("/")[0]
        groups[group] = max(groups.get(group, 0.0), diff)
        rel = diff / max(float(np.max(np.abs(a))), 1e-30) if a.size else 0.0
        if rel > worst_rel:
            worst_rel, worst_leaf = rel, key
    return {
        "max_abs": max(groups.values(), default=0.0),
        "max_abs_by_group": groups,
        "max_relative": worst_rel,
        "max_relative_leaf": worst_leaf,
    }


def run_on_mesh(
    config: str, mesh: str, out: Path, overrides: list[str], devices: int
) -> dict[str, Any]:
    """`qnpu quantize --config CONFIG --mesh MESH` in a fresh process (with `devices` CPU
    platform devices; 0: the machine's own); its report."""

    env = dict(os.environ)
    if devices:
        env["XLA_FLAGS"] = host_platform_flags(devices, env.get("XLA_FLAGS", ""))
    command = [sys.executable, "-m", "qnpu_jax.cli", "quantize", "--config", config]
    command += ["--mesh", mesh, "--out", str(out), "--no-progress"]
    for item in overrides:
        command += ["--set", item]
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"mesh {mesh}: qnpu quantize failed:\n{done.stderr[-3000:]}")
    report = RunDir(out).read_report()
    report["wall_seconds"] = time.perf_counter() - t0
    return report


def first_step_sensitivity(run_dir: Path, eps: float, seed: int = 0) -> dict[str, Any]:
    """Stage 1's first step on one device from the run's model before stage 1 (resume/),
    once as it is and once with R1 + eps·N(0, 1): how far float noise of that size moves the
    cross-entropy and the gradient norm (the fake-quant loss is piecewise constant, so its
    rounding decisions turn tiny differences into finite ones)."""


    run = load_run(run_dir)
    model = QuantizedModel.load(RunDir(run_dir).resume.path, base=run.loaded)
    cfg, t, config = model.cfg, model.transforms, run.config.stage1
    if t.r1 is None or t.r2 is None:
        raise SystemExit(f"{run_dir}: the run learns no rotations (no stage 1 to measure)")
    ids, windows = calibration_data(run.config, run.tokenizer)
    plan = config_stage1_plan(model.require_plan(), run.config)
    state = calibrate(model.unrounded_params(), cfg, plan, windows, prefix=model.prefix)
    base = t.apply(model.base, cfg, rotate=False)
    batch = step_batch(ids, 0, config, run.config.data.seq_len, run_keys(run.config.seed)[2])
    step = make_train_step(cfg, plan, config, model.prefix)
    out = {}
    for label, noise in (("as_is", 0.0), ("perturbed", eps)):
        r1 = t.r1 + noise * jax.random.normal(jax.random.key(seed), t.r1.shape)
        start = init_train_state(r1, t.r2, state, plan, config)
        _, metrics = step(start, batch, base, state)
        out[label] = {"ce": float(metrics["ce"]), "grad_norm": float(metrics["grad_norm"])}
    return {
        "eps": eps,
        **out,
        "ce_relative": out["perturbed"]["ce"] / out["as_is"]["ce"] - 1,
        "grad_norm_relative": out["perturbed"]["grad_norm"] / out["as_is"]["grad_norm"] - 1,
    }


def main(argv: list[str]) -> int:
    parser = study_parser(__name__, __doc__, json=True)
    parser.add_argument("--config", default="quick", help="a shipped config name or YAML file")
    parser.add_argument(
        "--meshes",
        nargs="+",
        default=["1x1", "8x1", "2x4", "1x8"],
        help="device meshes DATAxFSDP, one `qnpu quantize --mesh` run each; the first is the "
        "reference",
    )
    parser.add_argument(
        "--platform-devices",
        type=int,
        default=8,
        help="CPU devices per process (XLA host platform); 0: the real devices",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key in every run (as `qnpu quantize --set`), repeatable",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("runs/sharding"),
        help="one run directory per mesh under it, deleted first if it exists",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also rerun the first mesh in a process of one CPU device (XLA's own threading, "
        "not one thread per platform device): the same program with another float reduction "
        "order, the size of difference that is not the mesh's; and stage 1's first step with R1 "
        "moved by 1e-7 noise",
    )
    args = parser.parse_args(argv)


    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    reference: dict[str, np.ndarray] | None = None
    jobs = [(m, m, args.platform_devices) for m in args.meshes]
    if args.floor:
        jobs.append((f"{args.meshes[0]} in a 1-device process", args.meshes[0], 0))
    for label, mesh, devices in jobs:
        out = args.out_dir / label.replace(" ", "_")
        if out.exists():
            shutil.rmtree(out)
        report = run_on_mesh(args.config, mesh, out, args.overrides, devices)
        leaves = flat_leaves(restore_learned(out))
        row: dict[str, Any] = {
            "mesh": label,
            "report_mesh": report.get("mesh"),
            "perplexity": {k: v["quantized_ppl"] for k, v in report["perplexity"].items()},
            "float_perplexity": {k: v["float_ppl"] for k, v in report["perplexity"].items()},
            "promoted_layers": (report.get("sensitivity") or {}).get("promoted_layers"),
            "stage1_step_seconds": report.get("stage1_step_seconds"),
            "wall_seconds": report["wall_seconds"],
        }
        if reference is None:
            reference = leaves
        else:
            row["vs_first"] = leaf_differences(reference, leaves)
        rows.append(row)
        print(f"mesh {label}: {row['perplexity']}", file=sys.stderr)
    floor = None
    if args.floor:
        floor = first_step_sensitivity(args.out_dir / args.meshes[0], 1e-7)
    first = rows[0]["perplexity"]
    for row in rows[1:]:
        row["perplexity_relative_to_first"] = {
            k: row["perplexity"][k] / first[k] - 1 for k in first
        }
    write_study_json(
        args.json,
        {
            "config": args.config,
            "overrides": args.overrides,
            "platform_devices": args.platform_devices,
            "rows": rows,
            "first_step_sensitivity": floor,
        },
        command="qnpu study sharding " + " ".join(argv),
        started=started,
    )
    return 0
