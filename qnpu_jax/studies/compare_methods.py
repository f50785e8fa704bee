"""Method comparison in the shape of the paper's Table 1, and the Table 2 ablation -> reports.

The grid is configs × recipes: every cell is a `QuantizeConfig` and the recipe it runs
(`qnpu_jax.pipeline.recipes.for_config`), one `qnpu_jax.pipeline.run.quantize` run into
`RUNS/<method>-<bits>-<setting>/`
(`--prefix bos` appends `-prefix-bos`), with one calibration set (the `wiki` calib split, the
same seed, hence the same windows and the same randomized-Hadamard start for every method) and
one evaluation protocol (the `wiki` eval split and WikiText-2 test, seq_len 512, the first
`--eval-windows` non-overlapping windows of each). A cell whose run directory already holds a
report.json (with the same config) is read back instead of re-run, and a killed run resumes
from its stage-1 checkpoint, so the script can be killed and restarted. With an FP32 row
(`float` among the methods, or one from an earlier invocation) the cells take their float
perplexity from it instead of evaluating the float model again on the same windows
(`quantize(float_reference=...)` checks windows and tokens match); that halves a
training-free cell's evaluation.

The report (`--out reports/compare` -> compare.md, compare.html, compare.json) is built by
`qnpu_jax.report` from the finished cells' run directories and zero-shot files, exactly as
`qnpu report --runs ... --evals ...` builds its table, with the Table 2 ablation, the
paper-target checks and the state of every cell as further sections. It covers every
finished cell of the grid, also those of earlier invocations with other `--methods`.

Zero-shot columns (`--tasks`, default none): every selected cell and the FP32 row (the float
model with the runs' sink prefix) are scored on the tasks exactly as `qnpu eval --run RUN
--tasks ... --limit N --seed S` scores them (the same code, `qnpu_jax.cli.zero_shot_report`),
on the same seeded subset of N items per task. The results go to
`RUN/evals/tasks-<N|all>-<S>.json` (`RUNS/float[-prefix-bos]/evals/...` for the float row), in
the layout of `qnpu eval --json`, written after every task; a task already there is read back,
not recomputed, and cells that are finished but not selected are only read back. The tables
show the harness headline metric per task in percent ± standard error and the average,
marked ▲/▼ only where a difference to the FP32 row exceeds two standard errors
(`qnpu_jax.report.table`).

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
    qnpu study compare_methods --report-only        # the report from finished runs only
    qnpu study compare_methods --limit 500 \\
        --tasks piqa,winogrande,hellaswag,arc_easy,arc_challenge,lambada   # + zero-shot columns
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qnpu_jax.argtypes import comma_choices, positive_int
from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.data.locations import wikitext2_spec
from qnpu_jax.environment import study_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.eval import TASKS
from qnpu_jax.eval.zeroshot import task_source
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import sink_prefix
from qnpu_jax.pipeline.config import Method, QuantizeConfig, read_run_config
from qnpu_jax.pipeline.config_doc import CONFIG_KEYS, STAGE1_KEYS
from qnpu_jax.pipeline.methods import STAGE1_METHODS
from qnpu_jax.pipeline.recipes import describe, for_config
from qnpu_jax.pipeline.run import evaluate, quantize
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.stage1 import Stage1Config
from qnpu_jax.report import Report, Section, assemble, table_sections, write_report
from qnpu_jax.report.table import (
    HEADLINE,
    METHOD_LABELS,
    TASK_LABELS,
    TaskResult,
    build_rows,
    build_table,
    legend,
    load_eval,
    load_run_row,
    pct,
    read_json,
    rows_json,
)
from qnpu_jax.scoring import finish_eval_report, scored_model, zero_shot_report
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import (
    add_model_arg,
    add_prefix_arg,
    add_seed_arg,
    add_window_args,
    provenance,
    w_a_bits,
    write_study_json,
)

if TYPE_CHECKING:
    from qnpu_jax.scoring import Scored

# the methods of the grid (Table 1's), and its rows: the float reference, then them
GRID_METHODS: tuple[Method, ...] = ("rtn", "quarot", "spinquant", "quantnpu")
ROWS = ("float", *GRID_METHODS)
BASELINES: tuple[Method, ...] = ("rtn", "quarot", "spinquant")
BITS = ("W8A8", "W4A8", "W4A4")
SETTINGS = ("table1", "ours")
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
FINISHED = ("ran", "reused")


def bits_name(w: int, a: int) -> str:
    return f"W{w}A{a}"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run of the grid: a config and the recipe it runs."""

    method: str
    setting: str  # table1 | ours | ablation-<key>
    config: QuantizeConfig
    recipe: Any  # qnpu_jax.pipeline.recipes.Recipe
    run_dir: Path
    label: str = ""  # ablation row label

    @property
    def bits(self) -> str:
        return bits_name(self.config.bits.w, self.config.bits.a)

    @property
    def ablation(self) -> bool:
        return self.setting.startswith("ablation-")


def eval_specs(args: argparse.Namespace) -> dict[str, str]:
    """Display name -> data spec of the two evaluation sets (WikiText-2: --wikitext, else the
    `wikitext2` spec's file under $QNPU_DATA_DIR)."""

    if args.wikitext is None:
        return {"wiki": "wiki", "wikitext2": wikitext2_spec()}
    path = Path(args.wikitext).expanduser().resolve()  # a relative path: from the cwd
    return {"wiki": "wiki", "wikitext2": f"wikitext:{path}"}


def base_config(args: argparse.Namespace) -> QuantizeConfig:

    stage1 = Stage1Config(
        steps=args.steps,
        batch_size=args.stage1_batch_size,
        grad_accum=args.grad_accum,
        lr_rotation=args.lr_rotation,
        lr_scale=args.lr_scale,
        local_loss_fraction=args.local_loss_fraction,
        checkpoint_every=args.checkpoint_every,
    )
    return QuantizeConfig.of(
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
    return RunDir(Path(args.runs_dir) / f"float{_suffix(args)}").report_path


def _cell(method: str, setting: str, config: Any, run_dir: Path, label: str = "") -> Cell:

    return Cell(method, setting, config, for_config(config), run_dir, label)


def grid(args: argparse.Namespace) -> tuple[list[Cell], list[Cell]]:
    """(Table 1 cells of both settings, ablation cells): configs × recipes, the whole grid,
    selected or not."""

    base = base_config(args)
    kv = args.kv_bits
    table: list[Cell] = []
    for setting in SETTINGS:
        for bits in BITS:
            w, a = w_a_bits(bits)
            for method in GRID_METHODS:
                over: dict[str, Any]
                if setting == "table1":
                    over = {"down_in_bits": 16, "mixed_precision": 0.0}
                elif method == "quantnpu":
                    over = {"down_in_bits": 8, "mixed_precision": args.mixed_fraction}
                else:
                    over = {"down_in_bits": 8, "mixed_precision": 0.0}
                config = base.replace(method=method, w_bits=w, a_bits=a, **over)
                if method not in STAGE1_METHODS:  # stage 1 flags do not change these runs
                    config = dataclasses.replace(config, stage1=Stage1Config())
                run_dir = _run_dir(args, method, w, a, kv, setting)
                table.append(_cell(method, setting, config, run_dir))
    w, a = args.ablation_bits
    ablation: list[Cell] = []
    for key, label, over in ABLATION:
        config = base.replace(
            method="quantnpu", w_bits=w, a_bits=a, down_in_bits=8, scope="linears", **over
        )
        setting = f"ablation-{key}"
        run_dir = _run_dir(args, "quantnpu", w, a, kv, setting)
        ablation.append(_cell("quantnpu", setting, config, run_dir, label))
    return table, ablation


def selected(cell: Cell, args: argparse.Namespace) -> bool:
    if cell.ablation:
        return not args.skip_ablation and cell.setting.removeprefix("ablation-") in args.variants
    if args.only_ablation:
        return False
    return cell.method in args.methods and cell.bits in args.bits and cell.setting in args.settings


def finished_report(cell: Cell) -> dict[str, Any] | None:
    """The report of a finished run with this cell's config, else None."""

    run = RunDir(cell.run_dir)
    if not run.has_report or not run.has_config:
        return None
    try:
        if read_run_config(run) != cell.config:
            return None
        return run.read_report()
    except QnpuError:
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

    run = RunDir(cell.run_dir)
    try:
        if run.has_config and read_run_config(run) != cell.config:
            return "error", (
                f"{cell.run_dir} holds a run with a different config (other --steps, windows, "
                "seq_len, ...): delete it or pass another --runs-dir"
            )
        report = finished_report(cell)
        if report is not None:
            return "reused", report
        resume = run.has_config  # a killed run: stage 1 continues from its checkpoint
        report = quantize(
            cell.config,
            cell.run_dir,
            resume=resume,
            progress=args.progress,
            command=command,
            float_reference=reference,
            recipe=cell.recipe,
        )
        return "ran", report
    except QnpuError as e:
        return "error", str(e)


def grid_entry(cell: Cell, status: str, payload: Any, specs: Mapping[str, str]) -> dict[str, Any]:
    """The state of one cell: what the report's "grid" lists and the target checks read
    (perplexities and ratios keyed by evaluation name)."""

    entry: dict[str, Any] = {
        "run_dir": str(cell.run_dir),
        "method": cell.method,
        "bits": cell.bits,
        "setting": cell.setting,
        "label": cell.label or METHOD_LABELS[cell.method],
        "recipe": describe(cell.recipe),
        "status": status,
    }
    if status == "error":
        entry["error"] = payload
    if status not in FINISHED:
        return entry
    perplexity = payload["perplexity"]
    measured = {n: perplexity[s] for n, s in specs.items() if s in perplexity}
    entry["ppl"] = {n: m["quantized_ppl"] for n, m in measured.items()}
    entry["ratio"] = {n: m["ratio"] for n, m in measured.items()}
    entry["command"] = payload.get("command")  # the invocation that ran it (maybe an earlier one)
    return entry


def float_cell(
    args: argparse.Namespace, specs: dict[str, str], command: str, model: Any = None
) -> dict[str, Any]:
    """Float perplexity on the same windows (cached in RUNS/float[-prefix-bos]/report.json)."""

    protocol = {
        "model": args.model,
        "seq_len": args.seq_len,
        "eval_windows": args.eval_windows,
        "eval_data": list(specs.values()),
        "prefix": args.prefix,
    }
    path = float_path(args)
    if path.is_file():
        cached = RunDir(path.parent).read_report()
        if cached.get("protocol") == protocol:
            return {**cached, "status": "reused"}
        raise QnpuError(f"{path} was measured under another protocol: delete it")
    if model is None:

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
    doc = {"protocol": protocol, "perplexity": results}
    report = write_study_json(path, doc, command=command, started=t0)
    return {**report, "status": "ran"}


def task_order(tasks: Sequence[str]) -> list[str]:
    """The selected zero-shot tasks in the paper's Table 1 column order."""
    return [t for t in HEADLINE if t in tasks]


def evals_path(row_dir: Path, limit: int | None, seed: int) -> Path:
    """Where a row's zero-shot results live: ROW/evals/tasks-<limit|all>-<seed>.json."""
    return RunDir(row_dir).evals_dir / f"tasks-{'all' if limit is None else limit}-{seed}.json"


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
    scored: Callable[[], Scored] | None = None,
) -> TaskScores:
    """The `args.tasks` results of the run in `row_dir` (or of the float `model`, or of what
    `scored` builds, each cached in `row_dir`), as `qnpu eval --run/--model ... --tasks
    --limit --seed --prefix` computes them.

    Tasks already in the evals JSON are read back; the missing ones are scored if `compute`,
    and the JSON is rewritten after every task, so a killed invocation loses one task at most.
    """

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
            if scored is not None:
                source = scored()
            else:
                run = None if model is not None else row_dir
                source = scored_model(model=model, run=run, prefix=args.prefix)
            for name in missing:
                part = zero_shot_report(
                    source,
                    [name],
                    limit=args.limit,
                    seed=args.task_seed,
                    batch_size=args.task_batch_size,
                    progress=args.progress,
                    data_dir=args.task_data,
                )
                tasks = {**(doc or {}).get("tasks", {}), **part["tasks"]}
                doc = {**(doc or {}), **source.report, **part, "tasks": tasks}
                finish_eval_report(doc, command=command, started=started, path=path)
            status = "ran"
        if doc is None:
            return TaskScores(status, {}, path)
        results = load_eval(path).tasks
        return TaskScores(status, {t: results[t] for t in names if t in results}, path)
    except QnpuError as e:
        return TaskScores("error", {}, path, str(e))


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


def _tasks_protocol(args: argparse.Namespace, scores: Mapping[str, TaskScores]) -> list[str]:
    """The protocol line of the zero-shot columns (empty without --tasks)."""
    names = task_order(args.tasks)
    if not names:
        return []
    subset = (
        f"a seeded subset of {args.limit} items per task (seed {args.task_seed})"
        if args.limit is not None
        else "all items of each task"
    )
    n: dict[str, int] = {}  # min(limit, task size): the same for every row
    for s in scores.values():
        for t, r in s.results.items():
            n.setdefault(t, r.n)
    n_text = ", ".join(f"{TASK_LABELS[t]} {n[t]}" for t in names if t in n) or "none scored yet"
    return [
        f"zero-shot: {', '.join(TASK_LABELS[t] for t in names)}, formatted and scored as "
        f"lm-evaluation-harness does (`qnpu eval --tasks`) on {subset}, the same items for "
        f"every row (n per task: {n_text}); sink prefix {args.prefix} for every row, the FP32 "
        "row scores the float model with it. Results per row in RUN/evals/"
        f"{evals_path(Path(), args.limit, args.task_seed).name} (the layout of `qnpu eval "
        "--json`)."
    ]


def _protocol(args: argparse.Namespace, float_report: Mapping[str, Any] | None) -> list[str]:
    s1 = base_config(args).stage1
    specs = eval_specs(args)
    float_source = (
        f"the float model evaluated once on these windows ({float_path(args)}), the runs' "
        "float reference"
        if float_report is not None
        else "the float perplexity each run measured on the same windows"
    )
    return [
        f"evaluation: {', '.join(EVAL_LABELS[n] for n in EVAL_NAMES)} ({specs['wikitext2']}); "
        f"seq_len {args.seq_len}, the first {args.eval_windows} non-overlapping windows of each; "
        "perplexity = exp(mean next-token NLL).",
        f"calibration: `wiki` calib split, {args.calib_windows} random windows of "
        f"{args.seq_len} tokens (seed {args.seed}), the same for every method.",
        f"stage 1 (SpinQuant, Quant.npu): {s1.steps} steps, batch {s1.batch_size} x "
        f"{s1.grad_accum} accumulation, lr rotation {s1.lr_rotation}, lr scale {s1.lr_scale}, "
        f"local loss for the first {100 * s1.local_loss_fraction:g}% of steps.",
        f"sink prefix: {args.prefix}; KV cache {args.kv_bits} bits; the other tensors as in "
        "`default_plan` (qnpu_jax/quant/plan.py).",
        f"FP32 row: {float_source}. × float: a row's perplexity over the FP32 row's.",
    ]


def _earlier_commands(entries: Sequence[Mapping[str, Any]], command: str) -> list[str]:
    """The other invocations whose finished cells this report reads back."""
    seen = {e.get("command") for e in entries if e["status"] == "reused"}
    return sorted(c for c in seen if c and c != command)


def _grid_items(
    entries: Sequence[Mapping[str, Any]], scores: Mapping[str, TaskScores]
) -> list[str]:
    """One line per cell that has no row (not run, error) and per zero-shot error."""
    items = []
    for e in entries:
        if e["status"] == "error":
            items.append(f"`{e['run_dir']}`: error: {e['error']}")
        elif e["status"] not in FINISHED:
            items.append(f"`{e['run_dir']}`: {e['status']}")
    for key, s in scores.items():
        if s.error:
            items.append(f"`{key}` (zero-shot): error: {s.error}")
    return items


def compare_report(
    args: argparse.Namespace,
    cells: Sequence[Cell],
    entries: Mapping[Path, dict[str, Any]],
    scores: Mapping[str, TaskScores],
    float_report: Mapping[str, Any] | None,
    command: str,
    started: float,
) -> Any:
    """The comparison as a `qnpu_jax.report.Report`: the finished cells' run directories and
    zero-shot files through `qnpu_jax.report.table` (the main table and the ablation's), the
    target checks and the grid's state as further sections."""

    def evals(key: str) -> list[Path]:
        s = scores.get(key)
        return [s.path] if s is not None and s.results else []

    def table_of(part: Sequence[Cell]) -> Any:
        done = [c for c in part if entries[c.run_dir]["status"] in FINISHED]
        files = evals(FLOAT_KEY) + [p for c in done for p in evals(str(c.run_dir))]
        rows, notes = build_rows([c.run_dir for c in done], files)
        labels = {str(c.run_dir.resolve()): c.label for c in done if c.label}
        rows = [
            dataclasses.replace(r, method=labels[r.run_dir]) if r.run_dir in labels else r
            for r in rows
        ]
        return build_table(rows, notes, ratios=True)

    ordered = sorted(  # setting, then bits, then method: the paper's row order
        (c for c in cells if not c.ablation),
        key=lambda c: (SETTINGS.index(c.setting), BITS.index(c.bits), ROWS.index(c.method)),
    )
    ablation_cells = [c for c in cells if c.ablation]
    main, ablation = table_of(ordered), table_of(ablation_cells)
    grid_rows = [entries[c.run_dir] for c in cells]
    targets = target_checks([entries[c.run_dir] for c in ordered])
    earlier = _earlier_commands(grid_rows, command)
    settings = " ".join(f"{k}: {SETTING_TITLES[k]}." for k in SETTINGS)
    sections = [
        Section(
            "Protocol (one for every row)",
            items=(*_protocol(args, float_report), *_tasks_protocol(args, scores)),
            paragraphs=(
                "Cells read back from earlier invocations were run by: "
                + "; ".join(f"`{c}`" for c in earlier),
            )
            if earlier
            else (),
        ),
        Section(
            f"Methods on {args.model} (paper Table 1 shape)",
            paragraphs=(
                f"Rows by setting (the run directory's suffix -table1 / -ours), bits and "
                f"method. {settings}",
                *legend(main),
            ),
            results=main,
        ),
        *table_sections(main),
        Section("Target checks", items=tuple(c["line"] for c in targets)),
    ]
    abl_bits = bits_name(*args.ablation_bits)
    if ablation.rows:
        sections.append(
            Section(
                f'Ablation (paper Table 2): Quant.npu {abl_bits} KV{args.kv_bits}, scope "linears"',
                paragraphs=(
                    "Only the linears' weights, inputs and outputs quantized, other operators "
                    "float; down_proj inputs at 8 bits. Each row adds one step to the one "
                    "above: static joint (Max-Min, joint stage 1), + initialization (§4.2), "
                    "+ selective optimization (§4.3), + mixed 10% / 100% (§4.4); the last row "
                    "is mixed 10% with the down_proj input scale kept at its initialization "
                    "(App. E).",
                ),
                results=ablation,
            )
        )
        sections += table_sections(ablation)[1:]  # its rows' sources are the run dirs
    items = _grid_items(grid_rows, scores)
    if items:
        sections.append(Section("Cells without a row", items=tuple(items)))
    doc: dict[str, Any] = {
        "name": Path(args.out).name,
        "model": args.model,
        "protocol": {
            "lines": [*_protocol(args, float_report), *_tasks_protocol(args, scores)],
            "eval_data": eval_specs(args),
            "seq_len": args.seq_len,
            "eval_windows": args.eval_windows,
            "calib_windows": args.calib_windows,
            "seed": args.seed,
            "prefix": args.prefix,
            "kv_bits": args.kv_bits,
            "stage1": dataclasses.asdict(base_config(args).stage1),
            "tasks": task_order(args.tasks),
            "task_limit": args.limit,
            "task_seed": args.task_seed,
            "runs_dir": str(args.runs_dir),
        },
        "float": dict(float_report) if float_report is not None else None,
        "columns": [header for _, header in main.columns],
        "reference": main.reference,
        "rows": rows_json(main),
        "flags": list(main.flags),
        "notes": list(main.notes),
        "ablation": {
            "bits": abl_bits,
            "columns": [header for _, header in ablation.columns],
            "rows": rows_json(ablation),
            "flags": list(ablation.flags),
            "notes": list(ablation.notes),
        },
        "targets": targets,
        "grid": [
            {**e, **_task_state(scores.get(e["run_dir"]))} if args.tasks else e for e in grid_rows
        ],
        "earlier_commands": earlier,
        **provenance(command, started),
    }
    name = Path(args.out).name
    title = f"Method comparison on {args.model} (paper Table 1 shape) and Table 2 ablation"
    files = assemble(name, title, command, sections, {}, doc)
    return Report(name, files, main, ())


def _task_state(scores: TaskScores | None) -> dict[str, Any]:
    if scores is None:
        return {"tasks_status": "not run"}
    out: dict[str, Any] = {"tasks_status": scores.status, "evals": str(scores.path)}
    if scores.error:
        out["tasks_error"] = scores.error
    return out


def add_protocol_args(parser: argparse.ArgumentParser, *, eval_windows: int, prefix: str) -> None:
    """The grid's protocol options (bits, data, sink prefix, seed) and stage 1's, shared by the
    studies that add rows to it."""

    s1 = Stage1Config()
    parser.add_argument("--kv-bits", type=int, default=8, help=CONFIG_KEYS["kv_bits"])
    parser.add_argument("--mixed-fraction", type=float, default=0.1, help="setting (b)")
    add_window_args(parser)
    parser.add_argument(
        "--eval-windows", type=int, default=eval_windows, help="cap per evaluation set"
    )
    parser.add_argument(
        "--wikitext",
        default=None,
        help="WikiText-2 raw test file (default: $QNPU_DATA_DIR/wikitext-2-raw/wiki.test.raw, "
        "the `wikitext2` data spec)",
    )
    add_prefix_arg(parser, prefix)
    add_seed_arg(parser)

    def stage1(key: str) -> str:
        return f"stage 1 (runs that train): {STAGE1_KEYS[key]}"

    parser.add_argument("--steps", type=int, default=s1.steps, help=stage1("steps"))
    parser.add_argument(
        "--stage1-batch-size", type=int, default=s1.batch_size, help=stage1("batch_size")
    )
    parser.add_argument("--grad-accum", type=int, default=s1.grad_accum, help=stage1("grad_accum"))
    parser.add_argument(
        "--lr-rotation", type=float, default=s1.lr_rotation, help=stage1("lr_rotation")
    )
    parser.add_argument("--lr-scale", type=float, default=s1.lr_scale, help=stage1("lr_scale"))
    parser.add_argument(
        "--local-loss-fraction",
        type=float,
        default=s1.local_loss_fraction,
        help=stage1("local_loss_fraction"),
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=s1.checkpoint_every,
        help="stage 1 (runs that train): steps between checkpoints (a killed run resumes from "
        "its last)",
    )


def add_run_args(parser: argparse.ArgumentParser, *, runs_dir: str) -> None:
    """Where the grid's runs go and whether they show progress, shared by the studies that add
    rows to it."""
    parser.add_argument(
        "--runs-dir",
        default=runs_dir,
        help="one run directory per row under it: a finished one is read back, a killed one "
        "resumes",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bars"
    )


def add_task_args(parser: argparse.ArgumentParser) -> None:
    """The zero-shot options (`score_tasks` reads them), shared by the studies with such
    columns."""
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
    parser.add_argument(
        "--task-data",
        metavar="DIR|hf",
        default=None,
        help="zero-shot task data, as `qnpu eval --task-data` (default: $QNPU_DATA_DIR)",
    )
    parser.add_argument(
        "--task-batch-size",
        type=positive_int,
        default=8,
        help="zero-shot: sequences scored per batch",
    )


def check_tasks(args: argparse.Namespace) -> str | None:
    """Why the selected tasks cannot be scored (missing data), checked before any long run;
    None when they can."""

    if not args.tasks:
        return None
    try:
        task_source(args.tasks, args.task_data)
    except QnpuError as e:
        return str(e)
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser(__name__, __doc__)
    add_model_arg(parser)
    parser.add_argument(
        "--methods",
        type=comma_choices(ROWS),
        default=",".join(ROWS),
        help=f"Table 1 rows to run: comma list of {', '.join(ROWS)} (float: the FP32 row)",
    )
    parser.add_argument(
        "--bits",
        type=comma_choices(BITS),
        default=",".join(BITS),
        help=f"Table 1 bit-widths to run: comma list of {', '.join(BITS)}",
    )
    parser.add_argument(
        "--settings",
        type=comma_choices(SETTINGS),
        default=",".join(SETTINGS),
        help="Table 1 settings to run: comma list of table1 (all down_proj inputs at 16 bits), "
        "ours (at 8 bits; Quant.npu promotes --mixed-fraction of them to 16)",
    )
    parser.add_argument(
        "--only-ablation", action="store_true", help="run only the Table 2 ablation rows"
    )
    parser.add_argument(
        "--skip-ablation", action="store_true", help="run none of the ablation rows"
    )
    parser.add_argument(
        "--ablation-bits", type=w_a_bits, default="W4A4", help="the ablation's bits, as W4A4"
    )
    parser.add_argument(
        "--variants",
        type=comma_choices(ABLATION_KEYS),
        default=ABLATION_KEYS,
        help="ablation rows to run: " + ",".join(ABLATION_KEYS),
    )
    add_protocol_args(parser, eval_windows=64, prefix="none")
    add_task_args(parser)
    add_run_args(parser, runs_dir="runs/compare")
    parser.add_argument(
        "--out", default="reports/compare", help="the report: OUT.md, OUT.html and OUT.json"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing; tables from finished runs"
    )
    args = parser.parse_args(argv)
    if args.only_ablation and args.skip_ablation:
        parser.error("--only-ablation and --skip-ablation exclude each other")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    command = study_command("compare_methods", argv)

    start = time.perf_counter()
    try:
        specs = eval_specs(args)
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wikitext = Path(specs["wikitext2"].removeprefix("wikitext:"))
    if specs["wikitext2"].startswith("wikitext:") and not wikitext.is_file():
        print(
            f"error: WikiText-2 test file not found: {wikitext} (see --wikitext)", file=sys.stderr
        )
        return 2
    problem = check_tasks(args)  # missing task data fails now, not after a quantize run
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    table_cells, ablation_cells = grid(args)
    cells = table_cells + ablation_cells
    results: dict[Path, dict[str, Any]] = {}
    task_scores: dict[str, TaskScores] = {}
    for cell in cells:  # finished runs of earlier invocations count too
        report = finished_report(cell)
        status = "reused" if report is not None else "not run"
        results[cell.run_dir] = checked_entry(cell, status, report, specs)
        if args.tasks and report is not None:
            task_scores[str(cell.run_dir)] = score_tasks(cell.run_dir, args, command, compute=False)

    float_report = None
    run_float = "float" in args.methods and not args.only_ablation and not args.report_only
    if run_float or float_path(args).is_file():
        try:
            float_report = float_cell(args, specs, command)
        except QnpuError as e:
            if run_float:
                print(f"error: float: {e}", file=sys.stderr)
                return 2
            print(f"float: {e}; the FP32 row comes from the runs", file=sys.stderr)

    def flush() -> None:
        report = compare_report(
            args, cells, results, task_scores, float_report, command, started=start
        )
        write_report(Path(args.out), report)

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
            row = checked_entry(cell, status, payload, specs)
            results[cell.run_dir] = row
            if row["status"] == "error":
                print(f"  error: {row['error']}", flush=True)
            else:
                ppl = ", ".join(
                    f"{n} {row['ppl'][n]:.3f} ({row['ratio'][n]:.3f}x)" for n in row["ppl"]
                )
                print(f"  {status}: {ppl}", flush=True)
            flush()
            if args.tasks and row["status"] != "error":
                scores = score_tasks(cell.run_dir, args, command, compute=True)
                task_scores[str(cell.run_dir)] = scores
                _print_tasks("  zero-shot", scores)
                flush()
    out = Path(args.out)
    report = json.loads((out.parent / f"{out.name}.json").read_text())
    for check in report["targets"]:
        print(check["line"])
    failed = [e for e in report["grid"] if e["status"] == "error" or e.get("tasks_error")]
    float_scores = task_scores.get(FLOAT_KEY)
    return 1 if failed or (float_scores is not None and float_scores.error) else 0


def checked_entry(
    cell: Cell, status: str, payload: Any, specs: Mapping[str, str]
) -> dict[str, Any]:
    """`grid_entry`, with a finished run that `qnpu report` cannot read (a broken manifest,
    plan or report) turned into an error that names it."""

    if status in FINISHED:
        try:
            load_run_row(cell.run_dir)
        except QnpuError as e:
            return grid_entry(cell, "error", str(e), specs)
    return grid_entry(cell, status, payload, specs)


def _print_tasks(head: str, scores: TaskScores) -> None:
    if scores.error:
        print(f"{head}: zero-shot error: {scores.error}", flush=True)
        return
    shown = ", ".join(f"{TASK_LABELS[t]} {pct(r.score)}" for t, r in scores.results.items())
    print(f"{head} {scores.status}: {shown or 'no task scored'}", flush=True)
