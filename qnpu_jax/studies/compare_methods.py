"""Method comparison in the shape of the paper's Table 1, and the Table 2 ablation -> reports.

Every cell is one `qnpu_jax.pipeline.run.quantize` run into `RUNS/<method>-<bits>-<setting>/`
(`--prefix bos` appends `-prefix-bos`), with one calibration set (the `wiki` calib split, the
same seed, hence the same windows and the same randomized-Hadamard start for every method) and
one evaluation protocol (the `wiki` eval split and WikiText-2 test, seq_len 512, the first
`--eval-windows` non-overlapping windows of each). A cell whose run directory already holds a
report.json (with the same config) is read back instead of re-run, and a killed run resumes
from its stage-1 checkpoint, so the script can be killed and restarted. With an FP32 row
(`float` among the methods, or one from an earlier invocation) the cells take their float
perplexity from it instead of evaluating the float model again on the same windows
(`quantize(float_reference=...)` checks windows and tokens match); that halves a
training-free cell's evaluation. The reports cover
every finished cell of the grid, also those of earlier invocations with other `--methods`.

Zero-shot columns (`--tasks`, default none): every selected cell and the FP32 row (the float
model with the runs' sink prefix) are scored on the tasks exactly as `qnpu eval --run RUN
--tasks ... --limit N --seed S` scores them (the same code, `qnpu_jax.cli.zero_shot_report`),
on the same seeded subset of N items per task. The results go to
`RUN/evals/tasks-<N|all>-<S>.json` (`RUNS/float[-prefix-bos]/evals/...` for the float row), in
the layout of `qnpu eval --json`, written after every task; a task already there is read back,
not recomputed, and cells that are finished but not selected are only read back. The tables
show the harness headline metric per task (acc_norm: PIQA, HellaSwag, ARC-E/C; acc:
WinoGrande, LAMBADA) in percent ± standard error and the average, marked ▲/▼ only where a
difference to the FP32 row exceeds two standard errors (`qnpu_jax.report.table`).

Settings (paper §5.1 and Table 1; Table 2 / §5.4):
  table1    every method with all down_proj inputs at 16 bits (down_in_bits=16, no mixed
            precision): the paper's Table 1 configuration.
  ours      down_proj inputs at 8 bits; Quant.npu promotes the most sensitive 10% of layers
            to 16 bits (eq. 4), the baselines keep all of them at 8 bits.
  ablation  Table 2 at W4A4 KV8 (`--ablation-bits`), scope "linears" (only the linears'
            weights, inputs and outputs quantized, other operators float), all Quant.npu:
            static joint (Max-Min, no selective optimization) -> + initialization ->
            + selective optimization -> + mixed 10% -> + mixed 100%; beside that chain,
            mixed 10% with the down_proj input scale not learned in stage 1 (Appendix E's
            argument against learning unrotated scales; the issue asks for both).

    qnpu study compare_methods                      # everything (hours on a CPU)
    qnpu study compare_methods --methods float,rtn,quarot --skip-ablation
    qnpu study compare_methods --only-ablation --steps 60
    qnpu study compare_methods --report-only        # tables from finished runs only
    qnpu study compare_methods --limit 500 \\
        --tasks piqa,winogrande,hellaswag,arc_easy,arc_challenge,lambada   # + zero-shot columns
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qnpu_jax.argtypes import comma_choices, positive_int
from qnpu_jax.eval import TASKS
from qnpu_jax.report.table import (
    HEADLINE,
    TASK_LABELS,
    Measure,
    TaskResult,
    average,
    pct,
    significance,
)
from qnpu_jax.studies import study_parser

METHODS = ("float", "rtn", "quarot", "spinquant", "quantnpu")
QUANT_METHODS = METHODS[1:]
BASELINES = ("rtn", "quarot", "spinquant")
STAGE1_METHODS = ("spinquant", "quantnpu")
BITS = ("W8A8", "W4A8", "W4A4")
SETTINGS = ("table1", "ours")
METHOD_LABELS = {
    "float": "FP32",
    "rtn": "RTN (ExecuTorch-like)",
    "quarot": "QuaRot",
    "spinquant": "SpinQuant",
    "quantnpu": "Quant.npu",
}
SETTING_TITLES = {
    "table1": "Setting (a), the paper's Table 1: all down_proj inputs at 16 bits",
    "ours": "Setting (b), Quant.npu as deployed: down_proj inputs at 8 bits, "
    "Quant.npu promotes the most sensitive 10% to 16 bits",
}
# (key, label, overrides of the Quant.npu config); all at scope "linears", down_in 8 bits.
ABLATION = (
    (
        "static-joint",
        "static joint",
        {"init_scheme": "max_min", "selective": False, "mixed_precision": 0.0},
    ),
    (
        "init",
        "+ initialization",
        {"init_scheme": "aware", "selective": False, "mixed_precision": 0.0},
    ),
    (
        "selective",
        "+ selective optimization",
        {"init_scheme": "aware", "selective": True, "mixed_precision": 0.0},
    ),
    ("mixed10", "+ mixed 10%", {"init_scheme": "aware", "selective": True, "mixed_precision": 0.1}),
    (
        "mixed100",
        "+ mixed 100%",
        {"init_scheme": "aware", "selective": True, "mixed_precision": 1.0},
    ),
    # beside the chain, not a step of it: the down_proj flag, both ways reported
    (
        "mixed10-frozen-down-in",
        "mixed 10%, down_proj input not learned (App. E)",
        {
            "init_scheme": "aware",
            "selective": True,
            "mixed_precision": 0.1,
            "learn_down_in": False,
        },
    ),
)
ABLATION_KEYS = tuple(key for key, _, _ in ABLATION)
# Quant.npu's ratio to float per bit setting; at W4A8 it must also beat every baseline.
TARGETS = {"W8A8": 1.02, "W4A8": 1.15, "W4A4": 1.5}
EVAL_NAMES = ("wiki", "wikitext2")
EVAL_LABELS = {"wiki": "wiki (eval split)", "wikitext2": "WikiText-2 test"}
FLOAT_KEY = "float"  # the FP32 row's key among the zero-shot scores (cells: their run_dir)


def parse_bits(text: str) -> tuple[int, int]:
    """'W4A8' -> (4, 8)."""
    t = text.strip().upper()
    if not t.startswith("W") or "A" not in t:
        raise argparse.ArgumentTypeError(f"bit setting must look like W4A8, got {text!r}")
    w, a = t[1:].split("A", 1)
    try:
        return int(w), int(a)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bit setting must look like W4A8, got {text!r}") from e


def bits_name(w: int, a: int) -> str:
    return f"W{w}A{a}"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One quantize run of the grid."""

    method: str
    w_bits: int
    a_bits: int
    kv_bits: int
    setting: str  # table1 | ours | ablation-<key>
    config: Any  # QuantizeConfig
    run_dir: Path
    label: str = ""  # ablation row label

    @property
    def bits(self) -> str:
        return bits_name(self.w_bits, self.a_bits)


def eval_specs(args: argparse.Namespace) -> dict[str, str]:
    """Display name -> data spec of the two evaluation sets."""
    path = Path(args.wikitext).expanduser().resolve()  # a relative path: from the cwd
    return {"wiki": "wiki", "wikitext2": f"wikitext:{path}"}


def base_config(args: argparse.Namespace) -> Any:
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.stage1 import Stage1Config

    stage1 = Stage1Config(
        steps=args.steps,
        batch_size=args.stage1_batch_size,
        grad_accum=args.grad_accum,
        lr_rotation=args.lr_rotation,
        lr_scale=args.lr_scale,
        local_loss_fraction=args.local_loss_fraction,
        checkpoint_every=args.checkpoint_every,
    )
    return QuantizeConfig(
        model=args.model,
        method="quantnpu",
        kv_bits=args.kv_bits,
        prefix=args.prefix,
        seed=args.seed,
        calib_data="wiki",
        seq_len=args.seq_len,
        calib_windows=args.calib_windows,
        eval_data=tuple(eval_specs(args).values()),
        eval_windows=args.eval_windows,
        stage1=stage1,
    )


def _suffix(args: argparse.Namespace) -> str:
    return "" if args.prefix == "none" else f"-prefix-{args.prefix}"


def _run_dir(args: argparse.Namespace, method: str, w: int, a: int, kv: int, setting: str) -> Path:
    return Path(args.runs_dir) / f"{method}-w{w}a{a}kv{kv}-{setting}{_suffix(args)}"


def float_path(args: argparse.Namespace) -> Path:
    return Path(args.runs_dir) / f"float{_suffix(args)}" / "report.json"


def grid(args: argparse.Namespace) -> tuple[list[Cell], list[Cell]]:
    """(Table 1 cells of both settings, ablation cells): the whole grid, selected or not."""
    from qnpu_jax.pipeline.stage1 import Stage1Config

    base = base_config(args)
    kv = args.kv_bits
    table: list[Cell] = []
    for setting in SETTINGS:
        for bits in BITS:
            w, a = parse_bits(bits)
            for method in QUANT_METHODS:
                over: dict[str, Any]
                if setting == "table1":
                    over = {"down_in_bits": 16, "mixed_precision": 0.0}
                elif method == "quantnpu":
                    over = {"down_in_bits": 8, "mixed_precision": args.mixed_fraction}
                else:
                    over = {"down_in_bits": 8, "mixed_precision": 0.0}
                config = dataclasses.replace(base, method=method, w_bits=w, a_bits=a, **over)
                if method not in STAGE1_METHODS:  # stage 1 flags do not change these runs
                    config = dataclasses.replace(config, stage1=Stage1Config())
                run_dir = _run_dir(args, method, w, a, kv, setting)
                table.append(Cell(method, w, a, kv, setting, config, run_dir))
    w, a = args.ablation_bits
    ablation: list[Cell] = []
    for key, label, over in ABLATION:
        config = dataclasses.replace(
            base, method="quantnpu", w_bits=w, a_bits=a, down_in_bits=8, scope="linears", **over
        )
        setting = f"ablation-{key}"
        run_dir = _run_dir(args, "quantnpu", w, a, kv, setting)
        ablation.append(Cell("quantnpu", w, a, kv, setting, config, run_dir, label))
    return table, ablation


def selected(cell: Cell, args: argparse.Namespace) -> bool:
    if cell.setting.startswith("ablation-"):
        return not args.skip_ablation and cell.setting.removeprefix("ablation-") in args.variants
    if args.only_ablation:
        return False
    return cell.method in args.methods and cell.bits in args.bits and cell.setting in args.settings


def finished_report(cell: Cell) -> dict[str, Any] | None:
    """The report of a finished run with this cell's config, else None."""
    from qnpu_jax.errors import QnpuError
    from qnpu_jax.pipeline.config import load_config

    report = cell.run_dir / "report.json"
    saved = cell.run_dir / "config.yaml"
    if not report.is_file() or not saved.is_file():
        return None
    try:
        if load_config(saved) != cell.config:
            return None
        return json.loads(report.read_text())
    except (QnpuError, json.JSONDecodeError):
        return None


def float_reference(
    float_report: Mapping[str, Any] | None, specs: Mapping[str, str]
) -> dict[str, Any] | None:
    """The FP32 row as `quantize`'s float reference ({spec: ppl/windows/tokens}): the cells
    then skip their own float evaluation of the same windows (quantize checks they match)."""
    if float_report is None:
        return None
    measured = float_report.get("perplexity", {})
    return {spec: measured[name] for name, spec in specs.items() if name in measured}


def run_cell(
    cell: Cell,
    args: argparse.Namespace,
    command: str,
    reference: Mapping[str, Any] | None = None,
) -> tuple[str, Any]:
    """("reused" | "ran", report) or ("error", message)."""
    from qnpu_jax.errors import QnpuError
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.pipeline.run import quantize

    saved = cell.run_dir / "config.yaml"
    try:
        if saved.is_file() and load_config(saved) != cell.config:
            return "error", (
                f"{cell.run_dir} holds a run with a different config (other --steps, windows, "
                "seq_len, ...): delete it or pass another --runs-dir"
            )
        report = finished_report(cell)
        if report is not None:
            return "reused", report
        resume = saved.is_file()  # a killed run: stage 1 continues from its checkpoint
        report = quantize(
            cell.config,
            cell.run_dir,
            resume=resume,
            progress=args.progress,
            command=command,
            float_reference=reference,
        )
        return "ran", report
    except QnpuError as e:
        return "error", str(e)


def row_of(cell: Cell, status: str, payload: Any, specs: dict[str, str]) -> dict[str, Any]:
    row: dict[str, Any] = {
        "method": cell.method,
        "bits": cell.bits,
        "w_bits": cell.w_bits,
        "a_bits": cell.a_bits,
        "kv_bits": cell.kv_bits,
        "setting": cell.setting,
        "label": cell.label or METHOD_LABELS[cell.method],
        "granularity": "per-channel",
        "down_in": down_in_text(cell.config),
        "run_dir": str(cell.run_dir),
        "config": config_summary(cell.config),
        "status": status,
    }
    if status == "error":
        row["error"] = payload
    if status not in ("ran", "reused"):
        return row
    report = payload
    perplexity = report["perplexity"]
    row["ppl"] = {n: perplexity[s]["quantized_ppl"] for n, s in specs.items() if s in perplexity}
    row["float_ppl"] = {n: perplexity[s]["float_ppl"] for n, s in specs.items() if s in perplexity}
    row["ratio"] = {n: perplexity[s]["ratio"] for n, s in specs.items() if s in perplexity}
    row["windows"] = {n: perplexity[s]["windows"] for n, s in specs.items() if s in perplexity}
    row["tokens"] = {n: perplexity[s]["tokens"] for n, s in specs.items() if s in perplexity}
    row["stage1_steps"] = report.get("stage1_steps")
    sens = report.get("sensitivity")
    row["promoted_layers"] = sens["promoted_layers"] if sens else None
    row["seconds"] = report.get("seconds")
    row["command"] = report.get("command")  # the invocation that ran it (maybe an earlier one)
    return row


def config_summary(c: Any) -> dict[str, Any]:
    return {
        "down_in_bits": c.down_in_bits,
        "mixed_precision": c.mixed_precision,
        "init_scheme": c.init_scheme,
        "selective": c.selective,
        "learn_down_in": c.learn_down_in,
        "scope": c.scope,
        "stage1_steps": c.stage1.steps if c.method in STAGE1_METHODS else 0,
    }


def down_in_text(config: Any) -> str:
    if config.down_in_bits == 16:
        return "16"
    if config.mixed_precision > 0:
        return f"8/16 ({100 * config.mixed_precision:g}%)"
    return "8"


def float_cell(args: argparse.Namespace, specs: dict[str, str], model: Any) -> dict[str, Any]:
    """Float perplexity on the same windows (cached in RUNS/float[-prefix-bos]/report.json)."""
    from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
    from qnpu_jax.environment import environment_info
    from qnpu_jax.errors import QnpuError
    from qnpu_jax.files import write_json_atomic
    from qnpu_jax.models.quantized import sink_prefix
    from qnpu_jax.pipeline.run import evaluate

    protocol = {
        "model": args.model,
        "seq_len": args.seq_len,
        "eval_windows": args.eval_windows,
        "eval_data": list(specs.values()),
        "prefix": args.prefix,
    }
    path = float_path(args)
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached.get("protocol") == protocol:
            return {**cached, "status": "reused"}
        raise QnpuError(f"{path} was measured under another protocol: delete it")
    if model is None:
        from qnpu_jax.models import load_model

        model = load_model(args.model)
    prefix = sink_prefix(args.prefix, model.tokenizer)
    t0 = time.perf_counter()
    results = {}
    for name, spec in specs.items():
        docs = load_documents(spec, "eval" if spec == "wiki" else None)
        windows = eval_windows(
            tokenize_documents(docs, model.tokenizer), args.seq_len, args.eval_windows
        )
        r = evaluate(model.params, None, None, model.config, windows, prefix)
        results[name] = {"ppl": r["ppl"], "windows": r["windows"], "tokens": r["tokens"]}
        print(f"float / {name}: {r['ppl']:.3f}", flush=True)
    report = {
        "protocol": protocol,
        "perplexity": results,
        "seconds": time.perf_counter() - t0,
        "environment": environment_info(),
    }
    write_json_atomic(path, report)
    return {**report, "status": "ran"}


def task_order(tasks: Sequence[str]) -> list[str]:
    """The selected zero-shot tasks in the paper's Table 1 column order."""
    return [t for t in HEADLINE if t in tasks]


def evals_path(row_dir: Path, limit: int | None, seed: int) -> Path:
    """Where a row's zero-shot results live: ROW/evals/tasks-<limit|all>-<seed>.json."""
    return row_dir / "evals" / f"tasks-{'all' if limit is None else limit}-{seed}.json"


def float_dir(args: argparse.Namespace) -> Path:
    return float_path(args).parent


@dataclasses.dataclass(frozen=True)
class TaskScores:
    """The zero-shot results of one row, as far as they exist."""

    status: str  # "ran" (some scored now) | "reused" (all read back) | "not run" | "error"
    results: Mapping[str, TaskResult]
    path: Path
    error: str = ""


def score_tasks(
    row_dir: Path,
    args: argparse.Namespace,
    command: str,
    *,
    compute: bool,
    model: str | None = None,
) -> TaskScores:
    """The `args.tasks` results of the run in `row_dir` (or of the float `model`, cached in
    `row_dir`), as `qnpu eval --run/--model ... --tasks --limit --seed --prefix` computes them.

    Tasks already in the evals JSON are read back; the missing ones are scored if `compute`,
    and the JSON is rewritten after every task, so a killed invocation loses one task at most.
    """
    from qnpu_jax.cli import finish_eval_report, scored_model, zero_shot_report
    from qnpu_jax.errors import QnpuError
    from qnpu_jax.report.table import load_eval, read_json

    path = evals_path(row_dir, args.limit, args.task_seed)
    names = task_order(args.tasks)
    try:
        doc: dict[str, Any] | None = None
        if path.is_file():
            doc = read_json(path, "eval JSON")
            if not isinstance(doc, dict) or not isinstance(doc.get("tasks", {}), dict):
                raise QnpuError(f"{path}: not a `qnpu eval --json` report: delete it")
            # the name already says limit and seed; a mismatch means the file was edited or
            # the directory holds another model's results, which must not be mixed in
            want = {"prefix": args.prefix, "limit": args.limit, "seed": args.task_seed}
            if model is not None:
                want["model"] = model
            other = {k: doc.get(k) for k, v in want.items() if doc.get(k) != v}
            if other:
                raise QnpuError(
                    f"{path} was measured with {other}, not {want}: delete it to score again"
                )
        missing = [t for t in names if t not in (doc or {}).get("tasks", {})]
        status = "reused"
        if missing and not compute:
            status = "not run"
        elif missing:
            started = time.perf_counter() - float((doc or {}).get("seconds_total") or 0.0)
            run = None if model is not None else row_dir
            scored = scored_model(model=model, run=run, prefix=args.prefix)
            for name in missing:
                part = zero_shot_report(
                    scored,
                    [name],
                    limit=args.limit,
                    seed=args.task_seed,
                    batch_size=args.task_batch_size,
                    progress=args.progress,
                )
                tasks = {**(doc or {}).get("tasks", {}), **part["tasks"]}
                doc = {**(doc or {}), **scored.report, **part, "tasks": tasks}
                finish_eval_report(doc, command=command, started=started, path=path)
            status = "ran"
        if doc is None:
            return TaskScores(status, {}, path)
        results = load_eval(path).tasks
        return TaskScores(status, {t: results[t] for t in names if t in results}, path)
    except QnpuError as e:
        return TaskScores("error", {}, path, str(e))


def task_fields(
    results: Mapping[str, TaskResult], names: Sequence[str], ref: Mapping[str, TaskResult] | None
) -> dict[str, Any]:
    """The JSON of a row's zero-shot results: per task the headline metric, its value,
    standard error, n and mark against the float results `ref`; the average over `names`."""

    def mark(x: Measure, r: Measure | None) -> str:
        return significance(x, r) if r is not None else ""

    tasks: dict[str, Any] = {}
    for name in names:
        r = results.get(name)
        if r is None:
            continue
        ref_score = ref[name].score if ref is not None and name in ref else None
        tasks[name] = {
            "metric": r.metric,
            "value": r.score.value,
            "stderr": r.score.stderr,
            "n": r.n,
            "mark": mark(r.score, ref_score),
        }
        if r.perplexity is not None:  # LAMBADA's own perplexity: not in the table
            tasks[name]["perplexity"] = dataclasses.asdict(r.perplexity)
    avg = average(results, names)
    ref_avg = average(ref, names) if ref is not None else None
    avg_json = None
    if avg is not None:
        avg_json = {**dataclasses.asdict(avg), "mark": mark(avg, ref_avg)}
    return {"tasks": tasks, "tasks_average": avg_json}


def with_tasks(
    entry: dict[str, Any],
    scores: TaskScores | None,
    names: Sequence[str],
    ref: Mapping[str, TaskResult] | None,
) -> dict[str, Any]:
    """A row (or the float summary) with its zero-shot fields added."""
    if not names:
        return entry
    if scores is None:
        return {**entry, "tasks_status": "not run", "tasks": {}, "tasks_average": None}
    out = {
        **entry,
        "tasks_status": scores.status,
        "evals": str(scores.path),
        **task_fields(scores.results, names, ref),
    }
    if scores.error:
        out["tasks_error"] = scores.error
    return out


def target_checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The stated targets, per setting, bit setting and evaluation set, from the numbers:
    Quant.npu's PPL ratio to float <= TARGETS[bits]; at W4A8 also a PPL below every baseline
    of the same setting (status "incomplete" while a baseline has not run)."""
    done = {
        (r["setting"], r["bits"], r["method"]): r for r in rows if r["status"] in ("ran", "reused")
    }
    checks = []
    for setting in SETTINGS:
        for bits, limit in TARGETS.items():
            ours = done.get((setting, bits, "quantnpu"))
            vs_baselines = bits == "W4A8"
            goal = f"<= {limit}x float" + (" and below every baseline" if vs_baselines else "")
            for name in EVAL_NAMES:
                head = f"[{setting}] Quant.npu {bits} KV8 on {name}"
                check: dict[str, Any] = {
                    "setting": setting,
                    "bits": bits,
                    "eval": name,
                    "limit": limit,
                    "needs_below_baselines": vs_baselines,
                    "ratio": None,
                }
                if ours is None or name not in ours.get("ratio", {}):
                    check.update(status="not run", line=f"{head}: {goal} — not run")
                    checks.append(check)
                    continue
                ratio = ours["ratio"][name]
                check["ratio"] = ratio
                text = f"{ratio:.4f}x float (limit {limit}x)"
                status = "met" if ratio <= limit else "not met"
                if vs_baselines:
                    baselines = {
                        m: done[(setting, bits, m)]["ppl"][name]
                        for m in BASELINES
                        if name in done.get((setting, bits, m), {}).get("ppl", {})
                    }
                    missing = [m for m in BASELINES if m not in baselines]
                    below = all(ours["ppl"][name] < p for p in baselines.values())
                    check.update(baselines=baselines, missing_baselines=missing)
                    check["below_baselines"] = below
                    shown = ", ".join(f"{m} {p:.3f}" for m, p in baselines.items()) or "none run"
                    text += (
                        f"; PPL {ours['ppl'][name]:.3f} vs baselines {shown}: "
                        + ("below all" if below else "NOT below all")
                        + (f" (not run: {', '.join(missing)})" if missing else "")
                    )
                    if not below:
                        status = "not met"
                    elif missing and status == "met":
                        status = "incomplete"
                check.update(status=status, line=f"{head}: {text} — {status}")
                checks.append(check)
    return checks


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "–"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.{digits}f}" if x < 1e5 else f"{x:.3g}"


def _cell_text(row: dict[str, Any], key: str, name: str, digits: int = 2) -> str:
    if row["status"] == "error":
        return "error"
    if row["status"] not in ("ran", "reused"):
        return "not run"
    return _fmt(row.get(key, {}).get(name), digits)


def _task_cells(row: dict[str, Any], names: Sequence[str]) -> str:
    """The zero-shot cells of a row (empty without tasks), each with its leading " | "."""
    if not names:
        return ""
    status = row.get("status", "ran")  # the float summary has no status
    if status in ("error", "not run"):
        texts = [status] * (len(names) + 1)
    elif row.get("tasks_status") == "error":
        texts = ["error"] * (len(names) + 1)
    else:
        missing = "not run" if row.get("tasks_status") in (None, "not run") else "–"
        entries = [row.get("tasks", {}).get(t) for t in names] + [row.get("tasks_average")]
        texts = [missing if e is None else _score_text(e) for e in entries]
    return "".join(f" {t} |" for t in texts)


def _score_text(entry: Mapping[str, Any]) -> str:
    text = pct(Measure(entry["value"], entry["stderr"]))
    return f"{text} {entry['mark']}" if entry.get("mark") else text


def _task_headers(names: Sequence[str]) -> tuple[str, str]:
    """(header cells, separator cells) of the zero-shot columns."""
    if not names:
        return "", ""
    heads = [f"{TASK_LABELS[t]} ↑" for t in names] + ["Avg ↑"]
    return "".join(f" {h} |" for h in heads), "---|" * len(heads)


def _tasks_protocol(report: dict[str, Any]) -> list[str]:
    """The protocol lines of the zero-shot columns."""
    p = report["protocol"]
    names = p.get("tasks") or []
    if not names:
        return []
    n = p.get("task_n") or {}
    n_text = ", ".join(f"{TASK_LABELS[t]} {n[t]}" for t in names if t in n) or "none scored yet"
    subset = (
        f"a seeded subset of {p['task_limit']} items per task (seed {p['task_seed']})"
        if p.get("task_limit") is not None
        else "all items of each task"
    )
    return [
        f"- zero-shot: {', '.join(TASK_LABELS[t] for t in names)}, formatted and scored as "
        f"lm-evaluation-harness does (`qnpu eval --tasks`, qnpu_jax/eval/zeroshot.py) on "
        f"{subset}, the same items for every row (n per task: {n_text}); sink prefix "
        f"{p['prefix']} for every row, the FP32 row scores the float model with it. Results "
        f"per row in RUN/evals/{evals_path(Path(), p['task_limit'], p['task_seed']).name} "
        "(the layout of `qnpu eval --json`).",
        "- zero-shot cells: the harness headline metric in percent ± its standard error "
        "(acc_norm for PIQA, HellaSwag, ARC-E and ARC-C; acc for WinoGrande and LAMBADA); Avg "
        "is their mean (standard error sqrt(Σ se²)/k). ▲ / ▼: significantly higher / lower "
        "than the FP32 row, |x − x_float| > 2·sqrt(se² + se_float²); a difference smaller than "
        "two standard errors is not called a difference, so unmarked cells are within noise.",
    ]


def render_markdown(report: dict[str, Any]) -> str:
    """The comparison report as markdown (tables in the shape of the paper's Tables 1 and 2)."""
    p = report["protocol"]
    fl = report["float"]
    names = p.get("tasks") or []
    task_head, task_sep = _task_headers(names)
    lines = [
        f"# Method comparison on {report['model']} (paper Table 1 shape) and Table 2 ablation",
        "",
        f"Command: `{report['command']}`",
        *_earlier_commands(report),
        "",
        "Protocol (one for every row):",
        f"- evaluation: {', '.join(EVAL_LABELS[n] for n in EVAL_NAMES)}; seq_len {p['seq_len']}, "
        f"the first {p['eval_windows']} non-overlapping windows of each "
        f"({_windows_text(report)}); perplexity = exp(mean next-token NLL).",
        f"- calibration: `wiki` calib split, {p['calib_windows']} random windows of "
        f"{p['seq_len']} tokens (seed {p['seed']}), the same for every method.",
        f"- stage 1 (SpinQuant, Quant.npu): {p['stage1']['steps']} steps, batch "
        f"{p['stage1']['batch_size']} x {p['stage1']['grad_accum']} accumulation, lr rotation "
        f"{p['stage1']['lr_rotation']}, lr scale {p['stage1']['lr_scale']}, local loss for the "
        f"first {100 * p['stage1']['local_loss_fraction']:g}% of steps.",
        f"- sink prefix: {p['prefix']}; KV cache {p['kv_bits']} bits; weights per-channel "
        "symmetric, activations per-tensor static; the other tensors as in `default_plan` "
        "(qnpu_jax/quant/plan.py).",
        f"- FP32 row: {fl.get('source', 'not run')}. The ratio of a row is its quantized PPL over "
        "the float PPL measured in the same run (same windows).",
        *_tasks_protocol(report),
        "",
    ]
    for setting in SETTINGS:
        rows = [r for r in report["rows"] if r["setting"] == setting]
        lines += [f"## {SETTING_TITLES[setting]}", ""]
        lines += [
            "| Method | W-A-KV | W. Gran. | down_proj in | PPL wiki ↓ | PPL WikiText-2 ↓ "
            "| × float (wiki) | × float (WikiText-2) |" + task_head,
            "|---|---|---|---|---|---|---|---|" + task_sep,
            _float_line(fl) + _task_cells(fl, names),
        ]
        for bits in BITS:
            for r in rows:
                if r["bits"] != bits:
                    continue
                label = r["label"]
                if r.get("promoted_layers"):
                    label += f" (16-bit layers {', '.join(map(str, r['promoted_layers']))})"
                lines.append(
                    f"| {label} | {_wakv(r)} | per-channel | {r['down_in']} "
                    f"| {_cell_text(r, 'ppl', 'wiki')} | {_cell_text(r, 'ppl', 'wikitext2')} "
                    f"| {_cell_text(r, 'ratio', 'wiki', 3)} "
                    f"| {_cell_text(r, 'ratio', 'wikitext2', 3)} |" + _task_cells(r, names)
                )
        lines.append("")
    abl = report["ablation"]
    if abl["rows"]:
        lines += [
            f"## Ablation (paper Table 2): Quant.npu {abl['bits']} KV{p['kv_bits']}, scope "
            '"linears" (the linears\' weights, inputs and outputs quantized; other operators '
            "float)",
            "",
            "| Variant | Init (§4.2) | Sel-Opt (§4.3) | Adaptive (§4.4) | down_proj in learned "
            "| PPL wiki ↓ | PPL WikiText-2 ↓ | × float (wiki) | × float (WikiText-2) |" + task_head,
            "|---|---|---|---|---|---|---|---|---|" + task_sep,
            _float_line(fl, empty=4) + _task_cells(fl, names),
        ]
        for r in abl["rows"]:
            c = r["config"]
            init = "aware" if c["init_scheme"] == "aware" else "Max-Min"
            sel = "✓" if c["selective"] else "joint"
            mixed = f"{100 * c['mixed_precision']:g}%" if c["mixed_precision"] else "–"
            learned = "✓" if c.get("learn_down_in", True) else "– (init kept)"
            lines.append(
                f"| {r['label']} | {init} | {sel} | {mixed} | {learned} "
                f"| {_cell_text(r, 'ppl', 'wiki')} | {_cell_text(r, 'ppl', 'wikitext2')} "
                f"| {_cell_text(r, 'ratio', 'wiki', 3)} "
                f"| {_cell_text(r, 'ratio', 'wikitext2', 3)} |" + _task_cells(r, names)
            )
        lines.append("")
    lines += ["## Target checks", ""]
    lines += [f"- {c['line']}" for c in report["targets"]]
    errors = [
        f"- `{r['run_dir']}`: {r['error']}"
        for r in [*report["rows"], *abl["rows"]]
        if r["status"] == "error"
    ]
    errors += [
        f"- `{r.get('evals', r.get('run_dir'))}` (zero-shot): {r['tasks_error']}"
        for r in [fl, *report["rows"], *abl["rows"]]
        if r.get("tasks_error")
    ]
    if errors:
        lines += ["", "## Errors", "", *errors]
    lines.append("")
    return "\n".join(lines)


def _earlier_commands(report: dict[str, Any]) -> list[str]:
    """The other invocations whose finished cells this report reads back."""
    rows = report["rows"] + report["ablation"]["rows"]
    seen = [r.get("command") for r in rows if r.get("status") == "reused"]
    earlier = sorted({c for c in seen if c and c != report["command"]})
    if not earlier:
        return []
    return ["", "Cells read back from earlier invocations were run by:"] + [
        f"- `{c}`" for c in earlier
    ]


def _wakv(row: dict[str, Any]) -> str:
    return f"{row['w_bits']}-{row['a_bits']}-{row['kv_bits']}"


def _float_line(fl: dict[str, Any], empty: int = 3) -> str:
    """The FP32 row: `empty` dashed columns between the label and the perplexities."""
    ppl = fl.get("ppl", {})
    return (
        f"| FP32 |{' – |' * empty} {_fmt(ppl.get('wiki'))} | {_fmt(ppl.get('wikitext2'))} "
        "| 1.000 | 1.000 |"
    )


def _windows_text(report: dict[str, Any]) -> str:
    windows: dict[str, Any] = {}
    for r in [*report["rows"], *report["ablation"]["rows"]]:
        for name, n in r.get("windows", {}).items():
            windows.setdefault(name, (n, r["tokens"][name]))
    fl = report["float"]
    for name, n in fl.get("windows", {}).items():
        windows.setdefault(name, (n, fl["tokens"][name]))
    if not windows:
        return "no run finished yet"
    return "; ".join(f"{n}: {w} windows, {t} predicted tokens" for n, (w, t) in windows.items())


def float_summary(
    float_report: dict[str, Any] | None, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The FP32 row: the float evaluation if run, else the float PPL recorded by the runs."""
    if float_report is not None:
        perplexity = float_report["perplexity"]
        out: dict[str, Any] = {
            "source": f"float model evaluated by this script ({float_report['status']})",
            "ppl": {n: v["ppl"] for n, v in perplexity.items()},
            "windows": {n: v["windows"] for n, v in perplexity.items()},
            "tokens": {n: v["tokens"] for n, v in perplexity.items()},
        }
    else:
        finished = [r for r in rows if r.get("float_ppl")]
        if not finished:
            return {"source": "not run"}
        out = {
            "source": f"float PPL recorded in run {finished[0]['run_dir']}",
            "ppl": dict(finished[0]["float_ppl"]),
        }
    # every run evaluates the float model on the same windows: they must agree
    diffs = [
        abs(r["float_ppl"][n] / out["ppl"][n] - 1)
        for r in rows
        if r.get("float_ppl")
        for n in r["float_ppl"]
        if n in out["ppl"]
    ]
    out["max_rel_diff_vs_runs"] = max(diffs) if diffs else None
    return out


def build_report(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    ablation_rows: list[dict[str, Any]],
    float_report: dict[str, Any] | None,
    command: str,
    seconds: float,
    tasks: Mapping[str, TaskScores] | None = None,
) -> dict[str, Any]:
    """The JSON report; `tasks`: the zero-shot scores per row (key: run_dir, or FLOAT_KEY)."""
    from qnpu_jax.environment import environment_info

    base = base_config(args)
    protocol = {
        "model": args.model,
        "seq_len": args.seq_len,
        "eval_windows": args.eval_windows,
        "eval_data": eval_specs(args),
        "calib_data": "wiki (calib split)",
        "calib_windows": args.calib_windows,
        "seed": args.seed,
        "prefix": args.prefix,
        "kv_bits": args.kv_bits,
        "stage1": dataclasses.asdict(base.stage1),
        "runs_dir": str(args.runs_dir),
    }
    names = task_order(args.tasks)
    scores = tasks or {}
    if names:
        task_n: dict[str, int] = {}  # min(limit, task size): the same for every row
        for s in scores.values():
            for t, r in s.results.items():
                task_n.setdefault(t, r.n)
        protocol |= {
            "tasks": names,
            "task_limit": args.limit,
            "task_seed": args.task_seed,
            "task_batch_size": args.task_batch_size,
            "task_n": task_n,
        }
    float_scores = scores.get(FLOAT_KEY)
    ref = float_scores.results if float_scores is not None else None
    rows = [with_tasks(r, scores.get(r["run_dir"]), names, ref) for r in rows]
    ablation_rows = [with_tasks(r, scores.get(r["run_dir"]), names, ref) for r in ablation_rows]
    all_rows = rows + ablation_rows
    report = {
        "model": args.model,
        "protocol": protocol,
        "float": with_tasks(float_summary(float_report, all_rows), float_scores, names, None),
        "rows": rows,
        "ablation": {"bits": bits_name(*args.ablation_bits), "rows": ablation_rows},
        "targets": target_checks(rows),
        "seconds": seconds,
        "environment": environment_info(),
        "command": command,
    }
    return report


def write_reports(report: dict[str, Any], args: argparse.Namespace) -> None:
    from qnpu_jax.files import write_bytes_atomic, write_json_atomic

    write_json_atomic(Path(args.json), report)
    write_bytes_atomic(Path(args.md), render_markdown(report).encode())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from qnpu_jax.pipeline.stage1 import Stage1Config

    s1 = Stage1Config()
    parser = study_parser(__name__, __doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--methods", type=comma_choices(METHODS), default=METHODS)
    parser.add_argument("--bits", type=comma_choices(BITS), default=BITS)
    parser.add_argument("--settings", type=comma_choices(SETTINGS), default=SETTINGS)
    parser.add_argument("--only-ablation", action="store_true")
    parser.add_argument("--skip-ablation", action="store_true")
    parser.add_argument("--ablation-bits", type=parse_bits, default=(4, 4), help="e.g. W4A4")
    parser.add_argument(
        "--variants",
        type=comma_choices(ABLATION_KEYS),
        default=ABLATION_KEYS,
        help="ablation rows to run: " + ",".join(ABLATION_KEYS),
    )
    parser.add_argument("--kv-bits", type=int, default=8)
    parser.add_argument("--mixed-fraction", type=float, default=0.1, help="setting (b)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--calib-windows", type=int, default=16)
    parser.add_argument("--eval-windows", type=int, default=64, help="cap per evaluation set")
    parser.add_argument(
        "--wikitext",
        default="../shared/data/wikitext-2-raw/wiki.test.raw",
        help="WikiText-2 test file (relative paths: to the repository root)",
    )
    parser.add_argument("--prefix", choices=("none", "bos"), default="none")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=s1.steps, help="stage 1 steps")
    parser.add_argument("--stage1-batch-size", type=int, default=s1.batch_size)
    parser.add_argument("--grad-accum", type=int, default=s1.grad_accum)
    parser.add_argument("--lr-rotation", type=float, default=s1.lr_rotation)
    parser.add_argument("--lr-scale", type=float, default=s1.lr_scale)
    parser.add_argument("--local-loss-fraction", type=float, default=s1.local_loss_fraction)
    parser.add_argument("--checkpoint-every", type=int, default=s1.checkpoint_every)
    parser.add_argument(
        "--tasks",
        type=comma_choices(TASKS),
        default=(),
        help="zero-shot columns: comma list of " + ", ".join(TASKS) + " (default: none)",
    )
    parser.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="zero-shot: a seeded subset of N items per task (default: all of them)",
    )
    parser.add_argument("--task-seed", type=int, default=0, help="zero-shot subset seed")
    parser.add_argument("--task-batch-size", type=positive_int, default=8)
    parser.add_argument("--runs-dir", default="runs/compare")
    parser.add_argument("--json", default="reports/compare.json")
    parser.add_argument("--md", default="reports/compare.md")
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing; tables from finished runs"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    args = parser.parse_args(argv)
    if args.only_ablation and args.skip_ablation:
        parser.error("--only-ablation and --skip-ablation exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from qnpu_jax.environment import study_command
    from qnpu_jax.errors import QnpuError

    command = study_command("compare_methods", argv)

    start = time.perf_counter()
    specs = eval_specs(args)
    wikitext = Path(specs["wikitext2"].removeprefix("wikitext:"))
    if not wikitext.is_file():
        print(
            f"error: WikiText-2 test file not found: {wikitext} (see --wikitext)", file=sys.stderr
        )
        return 2
    if args.tasks:
        from qnpu_jax.eval import load_task

        try:  # missing task data fails now, not after the first quantize run
            for name in args.tasks:
                load_task(name)
        except QnpuError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    table_cells, ablation_cells = grid(args)
    cells = table_cells + ablation_cells
    results: dict[Path, dict[str, Any]] = {}
    task_scores: dict[str, TaskScores] = {}
    for cell in cells:  # finished runs of earlier invocations count too
        report = finished_report(cell)
        status = "reused" if report is not None else "not run"
        results[cell.run_dir] = row_of(cell, status, report, specs)
        if args.tasks and report is not None:
            task_scores[str(cell.run_dir)] = score_tasks(cell.run_dir, args, command, compute=False)

    float_report = None
    run_float = "float" in args.methods and not args.only_ablation and not args.report_only
    if run_float or float_path(args).is_file():
        try:
            float_report = float_cell(args, specs, None)
        except QnpuError as e:
            if run_float:
                print(f"error: float: {e}", file=sys.stderr)
                return 2
            print(f"float: {e}; the FP32 row comes from the runs", file=sys.stderr)

    def flush() -> None:
        rows = [results[c.run_dir] for c in table_cells]
        abl = [results[c.run_dir] for c in ablation_cells]
        elapsed = time.perf_counter() - start
        report = build_report(args, rows, abl, float_report, command, elapsed, task_scores)
        write_reports(report, args)

    if args.tasks:
        scores = score_tasks(float_dir(args), args, command, compute=run_float, model=args.model)
        task_scores[FLOAT_KEY] = scores
        _print_tasks("float", scores)
    flush()
    if not args.report_only:
        todo = [c for c in cells if selected(c, args)]
        for i, cell in enumerate(todo, 1):
            print(f"[{i}/{len(todo)}] {cell.run_dir.name}", flush=True)
            status, payload = run_cell(cell, args, command, float_reference(float_report, specs))
            row = row_of(cell, status, payload, specs)
            results[cell.run_dir] = row
            if status == "error":
                print(f"  error: {payload}", flush=True)
            else:
                ppl = ", ".join(
                    f"{n} {row['ppl'][n]:.3f} ({row['ratio'][n]:.3f}x)" for n in row["ppl"]
                )
                print(f"  {status}: {ppl}", flush=True)
            flush()
            if args.tasks and status != "error":
                scores = score_tasks(cell.run_dir, args, command, compute=True)
                task_scores[str(cell.run_dir)] = scores
                _print_tasks("  zero-shot", scores)
                flush()
    report = json.loads(Path(args.json).read_text())
    for check in report["targets"]:
        print(check["line"])
    rows = [report["float"], *report["rows"], *report["ablation"]["rows"]]
    errors = [r for r in rows if r.get("status") == "error" or r.get("tasks_error")]
    return 1 if errors else 0


def _print_tasks(head: str, scores: TaskScores) -> None:
    if scores.error:
        print(f"{head}: zero-shot error: {scores.error}", flush=True)
        return
    shown = ", ".join(f"{TASK_LABELS[t]} {pct(r.score)}" for t, r in scores.results.items())
    print(f"{head} {scores.status}: {shown or 'no task scored'}", flush=True)
