"""Answers to activation outliers side by side, each with the cost model's figures.

Rows, for each bit-width of `--bits` (W8A8, W4A8, W4A4): Quant.npu in setting (b) (down_proj
inputs 8-bit, `--mixed-fraction` of them promoted to 16 bits), run as the compare grid runs
it (`qnpu quantize`, reused when RUNS/quantnpu-w?a?kv?-ours[-prefix-bos] holds it); then each
post-training mechanism applied to that run's model, without a new stage 1:

    shadow-pP-kK   mllm-NPU's shadow outliers on the down_proj input (`steps.shadow_outliers`):
                   clip at the P-th percentile in the K share of layers where outliers
                   matter most, overflowing channels on a shadow path (`--shadow-clip`,
                   `--shadow-keep`, every pair)
    muxq-eE-tT     MUXQ on the down_proj input (`steps.muxq`): channels whose calibration |x|
                   exceeds T shifted right by E bits into the Body tensor, (2^E − 1)·Aux·W
                   added back (`--muxq-exp`, `--muxq-threshold`, every pair)
    down-out-F     16-bit down_proj outputs in the share F of layers eq. (4)'s scan of the
                   run's model ranks first (`--down-out`; the config's
                   `down_out_mixed_precision`), then stage 2 again
    M-down-out-F   each mechanism M above on top of it (the combination)

A row is its config options over the run's config (`post_recipe`: validated as a config, the
steps `recipes.after_stage1` takes from them), so `qnpu quantize` with those options gives the
same model from the same stage 1.

`--recipes` adds rows that are runs of their own (stage 1 included), at each bit-width:

    mobilequant    MobileQuant's recipe (no rotations; equivalent scaling of every linear
                   pair, learnable weight clipping, asymmetric activation ranges and weights,
                   learned end to end), setting (b) as for Quant.npu
    quantnpu-mq    Quant.npu with MobileQuant's pieces on top: equalization (α 0.5) in the
                   rotated basis, learnable weight clipping, asymmetric weights
    quantnpu-eq, quantnpu-lwc, quantnpu-asymw, quantnpu-asyma
                   each of MobileQuant's pieces alone on Quant.npu: equalization (α 0.5),
                   learnable weight clipping, asymmetric weights, asymmetric activation
                   ranges learned for every activation (`selective: false`)

and the post-training mechanisms then apply to those runs too (a mechanism a run's plan
refuses, e.g. MUXQ on an asymmetric down_proj input, is a row marked "refused" with why).

Every row: perplexity on the `wiki` eval split and WikiText-2 (the grid's protocol: the first
`--eval-windows` windows at seq_len 512; FP32 measured once), and `qnpu_jax.cost`'s counts
and modelled latency of its plan (a 512-token prompt in chunks of 64, then 128 tokens; both
readings of the 16-bit cost). A mechanism's rows are cached in RUNS/post/. Writes `--json`
(default reports/outliers.json), a markdown table and a perplexity-against-latency plot
beside it.

Zero-shot (`--tasks`, `--limit`, `--task-seed`, as in `qnpu study compare_methods`): the FP32
model and the rows `--tasks-rows` selects (per bit-width Quant.npu's run and the row lowest on
wiki, every row, or the rows of a comma list of keys) are scored as `qnpu eval --tasks` scores
them, on the same seeded items; a run's results go to RUN/evals/tasks-<N>-<seed>.json, a
post-training row's (its model rebuilt: the run loaded, the step applied again) to
RUNS/post/<key>/evals/, read back when there, written after every task.

    qnpu study outliers --prefix bos --eval-windows 32 --bits W4A8,W8A8,W4A4
    qnpu study outliers --bits W4A8 --shadow-keep 1.0 --limit 500 \\
        --tasks piqa,winogrande,hellaswag,arc_easy,arc_challenge,lambada
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from qnpu_jax import cost
from qnpu_jax.argtypes import comma_choices
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_bytes_atomic, write_json_atomic
from qnpu_jax.memory_plan import model_architecture
from qnpu_jax.models.load import load_model
from qnpu_jax.pipeline import Calibration, QuantizedModel
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.methods import MOBILEQUANT
from qnpu_jax.pipeline.recipes import after_stage1, chain, outlier_steps
from qnpu_jax.pipeline.run import calibration_data, evaluation_sets
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.quant.plan import QuantPlan
from qnpu_jax.report.plots import _figure, _png
from qnpu_jax.report.table import TASK_LABELS, average, pct, ppl_text, significance
from qnpu_jax.scoring import scored_quantized
from qnpu_jax.studies import compare_methods as cm
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.compare_methods import (
    BITS,
    _task_state,
    add_protocol_args,
    add_run_args,
    add_task_args,
)
from qnpu_jax.studies.harness import add_model_arg, w_a_bits, write_study_json

PROMPT, CHUNK, GENERATED = 512, 64, 128
LATENCY_READING = "quantnpu-table3"  # the plot's x axis: the reading Table 12 supports
MOBILEQUANT_PIECES = MOBILEQUANT.defaults  # its options, written out in its runs' configs
# --recipes: (method, run-dir setting, label, config options over the grid's)
RECIPE_ROWS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    MOBILEQUANT.name: (MOBILEQUANT.name, "ours", MOBILEQUANT.label, MOBILEQUANT_PIECES),
    "quantnpu-mq": (
        "quantnpu",
        "mq",
        "Quant.npu + equalization α 0.5 + LWC + asymmetric weights",
        {"equalize": 0.5, "weight_clipping": True, "asymmetric_weights": True},
    ),
    "quantnpu-eq": ("quantnpu", "eq", "Quant.npu + equalization α 0.5", {"equalize": 0.5}),
    "quantnpu-lwc": ("quantnpu", "lwc", "Quant.npu + LWC", {"weight_clipping": True}),
    "quantnpu-asymw": (
        "quantnpu",
        "asymw",
        "Quant.npu + asymmetric weights",
        {"asymmetric_weights": True},
    ),
    "quantnpu-asyma": (
        "quantnpu",
        "asyma",
        "Quant.npu + asymmetric activation ranges, all learned",
        {"asymmetric_activations": True, "selective": False},
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:

    parser = study_parser(__name__, __doc__, json=True)
    add_model_arg(parser)
    parser.add_argument(
        "--bits",
        type=comma_choices(BITS),
        default="W4A8",
        help=f"bit-widths of the rows: comma list of {', '.join(BITS)}",
    )
    parser.add_argument(
        "--shadow-clip", type=float, nargs="+", default=[99.99], help="clip percentiles"
    )
    parser.add_argument(
        "--shadow-keep", type=float, nargs="+", default=[0.15], help="shares of layers kept"
    )
    parser.add_argument("--muxq-exp", type=int, nargs="*", default=[2], help="MUXQ shifts")
    parser.add_argument(
        "--muxq-threshold", type=float, nargs="+", default=[6.0], help="MUXQ's outlier |x|"
    )
    parser.add_argument(
        "--down-out",
        type=float,
        nargs="*",
        default=[],
        help="shares of layers with 16-bit down_proj outputs, alone and with each mechanism",
    )
    parser.add_argument(
        "--recipes",
        nargs="*",
        choices=sorted(RECIPE_ROWS),
        default=[],
        help="rows that are runs of their own (stage 1 included)",
    )
    add_protocol_args(parser, eval_windows=32, prefix="bos")
    add_task_args(parser)
    parser.add_argument(
        "--tasks-rows",
        type=_rows_choice,
        default="best",
        help="rows scored on --tasks: per bit-width Quant.npu's and the lowest wiki perplexity "
        "(best), every row with a perplexity (all), or a comma list of row keys",
    )
    add_run_args(parser, runs_dir="runs/outliers")
    return parser.parse_args(argv)


def plan_cost(plan: Any, cfg: Any, devices: dict[str, Any]) -> dict[str, Any]:
    """A row's cost-model figures: counts of both phases, modelled seconds per reading."""

    out: dict[str, Any] = {}
    for phase in (cost.prefill(PROMPT, CHUNK), cost.decode(PROMPT, GENERATED)):
        costs = cost.plan_costs(plan, cfg, phase)
        sums = cost.totals(costs)
        out[phase.name] = {
            "macs": sums["macs"],
            "cpu_macs": sums["cpu_macs"],
            "syncs": sums["syncs"],
            "bytes": sums["weight_bytes"] + sums["act_bytes"] + sums["kv_bytes"],
            "latency_s": {
                k: cost.latency(costs, d, cost.num_linears(cfg, plan.graph))["total_s"]
                for k, d in devices.items()
            },
        }
    return out


def _variants(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """(key suffix, label, config options) of every post-training row: each mechanism, each
    down_proj output promotion, and each mechanism on top of each promotion."""
    mechanisms = [
        (
            f"shadow-p{clip:g}-k{keep:g}",
            f"+ shadow outliers (P{clip:g}, {keep:.0%} of layers)",
            {"shadow_outliers": clip, "shadow_keep": keep},
        )
        for clip in args.shadow_clip
        for keep in args.shadow_keep
    ] + [
        (
            f"muxq-e{exp}-t{threshold:g}",
            f"+ MUXQ (exp {exp}, channels with |x| > {threshold:g})",
            {"muxq_exp": exp, "muxq_threshold": threshold},
        )
        for exp in args.muxq_exp
        for threshold in args.muxq_threshold
    ]
    promotions = [
        (
            f"down-out-{share:g}",
            f"+ 16-bit down_proj outputs ({share:.0%} of layers)",
            {"down_out_mixed_precision": share},
        )
        for share in args.down_out
    ]
    both = [
        (f"{m[0]}-{p[0]}", f"{m[1]} {p[1]}", {**m[2], **p[2]})
        for p in promotions
        for m in mechanisms
    ]
    return mechanisms + promotions + both


def post_recipe(config: QuantizeConfig, options: dict[str, Any]) -> Any:
    """The steps a post-training row applies to the finished run of `config`: `options` over
    the run's config (a `QnpuError` when the config refuses them), then what they change
    after stage 1 (`recipes.after_stage1`): the outlier step alone on the calibrated model,
    or, when they promote down_proj outputs (a plan change), stage 2 again before it."""

    new = config.replace(**options)
    if new.promotions.down_out != config.promotions.down_out:
        return chain(*after_stage1(new))
    return chain(*outlier_steps(new))


def _post_rows(
    run_dir: Path, config: Any, args: argparse.Namespace, loaded: Any, floats: dict[str, float]
) -> list[dict[str, Any]]:
    """The post-training rows on the finished run in `run_dir` (cached in RUNS/post/)."""

    specs = cm.eval_specs(args)
    cache = Path(args.runs_dir) / "post"
    model = data = windows = None
    rows = []
    for suffix, label, options in _variants(args):
        key = f"{run_dir.name}-{suffix}"
        path = cache / f"{key}.json"
        if path.is_file():
            row = json.loads(path.read_text())
            if row.get("options") == options:  # else written by an older study: run again
                rows.append({**row, "base_dir": str(run_dir), "status": "reused"})
                continue
        refused = {"key": key, "base": run_dir.name, "label": label, "status": "refused"}
        try:
            recipe = post_recipe(config, options)
        except QnpuError as e:  # e.g. a promotion on a run without selective optimization
            rows.append({**refused, "why": str(e)})
            continue
        if model is None:
            model = QuantizedModel.load(run_dir, loaded)
            data = Calibration(*calibration_data(config, loaded.tokenizer))
            limit = loaded.config.max_position_embeddings - len(model.prefix)
            windows = evaluation_sets(config, loaded.tokenizer, limit)
        assert data is not None and windows is not None
        t0 = time.perf_counter()
        try:
            changed = recipe(model, data)
        except QnpuError as e:  # e.g. MUXQ on an asymmetric down_proj input
            rows.append({**refused, "why": str(e)})
            continue
        ppl = {n: changed.perplexity(windows[s])["ppl"] for n, s in specs.items()}
        applied = changed.steps[len(model.steps) :]
        row = {
            "key": key,
            "base": run_dir.name,
            "base_dir": str(run_dir),
            "label": label,
            "options": options,
            "steps": [r.name for r in applied],
            "info": {r.name: r.info for r in applied if r.info is not None},
            "plan": changed.require_plan().to_dict(),
            "ppl": ppl,
            "ratio": {n: ppl[n] / floats[n] for n in ppl},
            "seconds": time.perf_counter() - t0,
        }
        write_json_atomic(path, row)
        rows.append({**row, "status": "ran"})
        print(f"{label} on {run_dir.name}: {ppl}", flush=True)
    return rows


def _rows_choice(text: str) -> str | tuple[str, ...]:
    """`--tasks-rows`: "best", "all", or a non-empty comma list of row keys."""
    if text in ("best", "all"):
        return text
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    if not keys:
        raise argparse.ArgumentTypeError(f"best, all or a comma list of row keys; got {text!r}")
    return keys


def tasks_rows(rows: list[dict[str, Any]], which: str | tuple[str, ...]) -> list[dict[str, Any]]:
    """The rows `--tasks-rows` selects among those with a perplexity, in table order: every
    one ("all"), per bit-width the Quant.npu run and the row lowest on wiki ("best"), or those
    whose keys are listed (a `QnpuError` naming a key that no such row has)."""
    done = [r for r in rows if "ppl" in r]
    if which == "all":
        return done
    if not isinstance(which, str):
        have = [r["key"] for r in done]
        missing = [k for k in which if k not in have]
        if missing:
            raise QnpuError(
                f"--tasks-rows: no row with a perplexity has the key {', '.join(missing)}; "
                f"those with one: {', '.join(have) or 'none'}"
            )
        return [r for r in done if r["key"] in which]
    keep: set[str] = set()
    for bits in dict.fromkeys(r["bits"] for r in done):
        group = [r for r in done if r["bits"] == bits]
        keep.add(group[0]["key"])  # the Quant.npu run comes first
        keep.add(min(group, key=lambda r: r["ppl"]["wiki"])["key"])
    return [r for r in done if r["key"] in keep]


def _post_scored(row: dict[str, Any], config: Any, loaded: Any) -> Any:
    """The post-training row's model rebuilt (its run, then its steps) as a `Scored`."""

    model = QuantizedModel.load(Path(row["base_dir"]), loaded)
    data = Calibration(*calibration_data(config, loaded.tokenizer))
    recipe = post_recipe(config, row["options"])
    changed = recipe(model, data)
    report = {
        "model": None,
        "run": None,
        "base_run": row["base_dir"],
        "post_steps": [{"name": step.name, "args": dict(step.args)} for step in recipe],
        "post_options": row["options"],
        "prefix": config.prefix,
    }
    return scored_quantized(changed, loaded.tokenizer, label=row["label"], report=report)


def _task_cells(scores: Any) -> dict[str, Any]:
    """A row's zero-shot part of the JSON: status, file (as the compare grid's), per task
    score ± se and n."""

    out = _task_state(scores)
    out["tasks"] = {
        t: {"metric": r.metric, "score": r.score.value, "stderr": r.score.stderr, "n": r.n}
        for t, r in scores.results.items()
    }
    return out


def _tasks_table(scored: list[tuple[str, Any]], names: list[str]) -> list[str]:
    """Markdown: one line per scored row (label, TaskScores), the first the float model's;
    ▼/▲ where a score (or LAMBADA's perplexity) differs from float's by more than two
    standard errors of the difference."""

    lambada = "lambada" in names
    head = [TASK_LABELS[t] for t in names] + ["Avg"] + (["LAMBADA ppl"] if lambada else [])
    lines = ["| Row | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    ref = scored[0][1].results if scored else {}
    ref_avg = average(ref, names)

    def mark(m: Any, against: Any, is_ref: bool) -> str:
        return "" if is_ref or against is None else " " + significance(m, against)

    def ppl(m: Any) -> str:
        return ppl_text(m.value) + (f" ±{ppl_text(m.stderr)}" if m.stderr is not None else "")

    for i, (label, scores) in enumerate(scored):
        res = scores.results
        cells = [
            pct(res[t].score) + mark(res[t].score, ref[t].score if t in ref else None, i == 0)
            if t in res
            else ""
            for t in names
        ]
        avg = average(res, names)
        cells.append("" if avg is None else pct(avg) + mark(avg, ref_avg, i == 0))
        if lambada:
            lp = res["lambada"].perplexity if "lambada" in res else None
            ref_lp = ref["lambada"].perplexity if "lambada" in ref else None
            cells.append("" if lp is None else ppl(lp) + mark(lp, ref_lp, i == 0))
        lines.append(f"| {_cell_text(label)} | " + " | ".join(c.rstrip() for c in cells) + " |")
    return lines


def _cell_text(text: str) -> str:
    """`text` inside a markdown table cell (its pipes escaped: "|x| > 6")."""
    return text.replace("|", "\\|")


def _table(rows: list[dict[str, Any]], floats: dict[str, float]) -> list[str]:
    r = LATENCY_READING
    lines = [
        "| Row | PPL wiki | PPL WikiText-2 | × float (wiki / WT2) | prefill ms "
        f"({r} / mobilequant-table6) | decode ms | NPU GMACs (with a 16-bit operand) | "
        "CPU MACs (M) | syncs | Pareto front |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| FP32 | {floats['wiki']:.2f} | {floats['wikitext2']:.2f} | 1.000 / 1.000 |||||||",
    ]
    front = set(pareto_front(rows))
    for row in rows:
        if "ppl" not in row:
            why = f": {row['why']}" if "why" in row else ""
            lines.append(
                f"| {_cell_text(row['label'])} | {row['status']}{_cell_text(why)} |||||||||"
            )
            continue
        c = row["cost"]
        pre, dec = c["prefill"], c["decode"]
        wide = sum(n for p, n in pre["macs"].items() if "16" in p) / 1e9
        total = sum(pre["macs"].values()) / 1e9
        lines.append(
            f"| {_cell_text(row['label'])} | {row['ppl']['wiki']:.2f} | "
            f"{row['ppl']['wikitext2']:.2f} | "
            f"{row['ratio']['wiki']:.3f} / {row['ratio']['wikitext2']:.3f} | "
            f"{pre['latency_s'][r] * 1e3:.1f} / "
            f"{pre['latency_s']['mobilequant-table6'] * 1e3:.1f} | "
            f"{dec['latency_s'][r] * 1e3:.1f} | {total:.2f} ({wide:.2f}) | "
            f"{pre['cpu_macs'] / 1e6:.1f} | "
            f"{pre['syncs']} | {'yes' if row['key'] in front else ''} |"
        )
    return lines


def _prefill_s(row: dict[str, Any]) -> float:
    return float(row["cost"]["prefill"]["latency_s"][LATENCY_READING])


def pareto_front(rows: list[dict[str, Any]]) -> list[str]:
    """Keys of the rows no other row dominates on (modelled prefill latency, wiki
    perplexity): none is at most as slow and at most as high with one of the two lower; by
    latency."""
    done = [r for r in rows if "ppl" in r and "cost" in r]

    def dominated(r: dict[str, Any]) -> bool:
        x, y = _prefill_s(r), r["ppl"]["wiki"]
        return any(
            _prefill_s(o) <= x
            and o["ppl"]["wiki"] <= y
            and (_prefill_s(o), o["ppl"]["wiki"]) != (x, y)
            for o in done
        )

    return [r["key"] for r in sorted(done, key=_prefill_s) if not dominated(r)]


def pareto_plot(rows: list[dict[str, Any]], floats: dict[str, float]) -> bytes:
    """Perplexity (wiki) against modelled prefill latency, one point per row, the Pareto
    front joined."""

    fig = _figure(7.0, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    done = [r for r in rows if "ppl" in r and "cost" in r]
    xs = [_prefill_s(r) * 1e3 for r in done]
    ys = [r["ppl"]["wiki"] for r in done]
    ax.scatter(xs, ys)
    for x, y, r in zip(xs, ys, done, strict=True):
        ax.annotate(r["key"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    by_key = {r["key"]: r for r in done}
    front = [by_key[k] for k in pareto_front(rows)]
    ax.plot(
        [_prefill_s(r) * 1e3 for r in front],
        [r["ppl"]["wiki"] for r in front],
        color="C1",
        drawstyle="steps-post",
        label="Pareto front",
    )
    ax.axhline(floats["wiki"], color="grey", linestyle=":", label="FP32")
    ax.set_xlabel(f"modelled prefill latency, ms ({LATENCY_READING} reading; a model)")
    ax.set_ylabel("perplexity, wiki eval")
    ax.legend()
    return _png(fig)


def main(argv: list[str] | None = None) -> int:

    args = parse_args(argv)
    command = "qnpu study outliers " + " ".join(argv or sys.argv[1:])
    problem = cm.check_tasks(args)  # missing task data fails now, not after the runs
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    specs = cm.eval_specs(args)
    t0 = time.perf_counter()
    loaded = load_model(args.model)
    float_report = cm.float_cell(args, specs, command, loaded)
    floats = {n: float_report["perplexity"][n]["ppl"] for n in specs}
    devices = cost.devices(model_architecture(cost.ANCHOR_MODEL))
    base = cm.base_config(args)
    rows: list[dict[str, Any]] = []
    configs: dict[str, Any] = {}  # row key -> the config of its run (a post row: its base's)

    def posts(run_dir: Path, config: Any, label: str, bits: str) -> list[dict[str, Any]]:
        """The mechanisms' rows on the run in `run_dir`, each with its plan's cost."""
        out = []
        for post in _post_rows(run_dir, config, args, loaded, floats):
            if "plan" in post:  # a refused mechanism has none
                post["cost"] = plan_cost(QuantPlan.from_dict(post["plan"]), loaded.config, devices)
            post["label"] = f"{label} {post['label']}"
            post["bits"] = bits
            configs[post["key"]] = config
            out.append({k: v for k, v in post.items() if k != "plan"})
        return out

    for bits in args.bits:
        w, a = w_a_bits(bits)
        promote = {"down_in_bits": 8, "mixed_precision": args.mixed_fraction}
        config = base.replace(w_bits=w, a_bits=a, **promote)
        run_dir = cm._run_dir(args, "quantnpu", w, a, args.kv_bits, "ours")
        promoted = f"{args.mixed_fraction:.0%} of down_proj inputs at 16 bits"
        label = f"Quant.npu {bits}, setting (b), {promoted}"
        cell = cm._cell("quantnpu", "ours", config, run_dir, label)
        status, payload = cm.run_cell(cell, args, command, cm.float_reference(float_report, specs))
        entry = cm.grid_entry(cell, status, payload, specs)
        entry.update(key=run_dir.name, bits=bits)
        configs[run_dir.name] = config
        rows.append(entry)
        print(f"{entry['label']}: {status} {entry.get('ppl', '')}", flush=True)
        if status not in cm.FINISHED:
            continue
        entry["cost"] = plan_cost(RunDir(run_dir).read_plan(), loaded.config, devices)
        rows += posts(run_dir, config, entry["label"], bits)
        for name in args.recipes:
            method, setting, what, options = RECIPE_ROWS[name]
            own = config.replace(method=method, **options)
            own_dir = cm._run_dir(args, method, w, a, args.kv_bits, setting)
            own_cell = cm._cell(method, setting, own, own_dir, f"{what} {bits}, {promoted}")
            status, payload = cm.run_cell(
                own_cell, args, command, cm.float_reference(float_report, specs)
            )
            row = cm.grid_entry(own_cell, status, payload, specs)
            row.update(key=own_dir.name, bits=bits)
            configs[own_dir.name] = own
            print(f"{row['label']}: {status} {row.get('ppl', '')}", flush=True)
            rows.append(row)
            if status not in cm.FINISHED:
                continue
            row["cost"] = plan_cost(RunDir(own_dir).read_plan(), loaded.config, devices)
            rows += posts(own_dir, own, row["label"], bits)  # on this run too

    out = Path(args.json)
    names = cm.task_order(args.tasks)
    scored: dict[str, Any] = {}  # row key (FLOAT_KEY for float) -> TaskScores

    def flush() -> None:
        doc = {
            "float": floats,
            "rows": rows,
            "cost_note": "latencies are qnpu_jax.cost's model (docs/cost.md), not measurements",
            "pareto_front": {
                "axes": ["prefill latency_s " + LATENCY_READING, "ppl wiki"],
                "keys": pareto_front(rows),
            },
            "devices": {k: dataclasses.asdict(v) for k, v in devices.items()},
        }
        md = [f"Command: `{command}`", "", *_table(rows, floats), ""]
        if names:
            doc["tasks"] = {
                "names": names,
                "limit": args.limit,
                "seed": args.task_seed,
                "rows": args.tasks_rows,
                "float": _task_cells(scored[cm.FLOAT_KEY]) if cm.FLOAT_KEY in scored else None,
            }
            shown = [("FP32", scored[cm.FLOAT_KEY])] if cm.FLOAT_KEY in scored else []
            shown += [(r["label"], scored[r["key"]]) for r in rows if r["key"] in scored]
            md += [
                f"Zero-shot, {args.limit or 'all'} items per task (seed {args.task_seed}); "
                "▼/▲: more than two standard errors of the difference from FP32:",
                "",
                *_tasks_table(shown, names),
                "",
            ]
        write_study_json(out, doc, command=command, started=t0)
        write_bytes_atomic(out.with_suffix(".md"), "\n".join(md).encode())
        write_bytes_atomic(out.with_suffix(".png"), pareto_plot(rows, floats))

    flush()
    if names:
        selected = tasks_rows(rows, args.tasks_rows)  # an unknown key fails before any scoring
        scored[cm.FLOAT_KEY] = cm.score_tasks(
            cm.float_dir(args), args, command, compute=True, model=args.model
        )
        cm._print_tasks("FP32", scored[cm.FLOAT_KEY])
        for row in selected:
            key = row["key"]
            if "options" in row:  # a post-training row: no run directory of its own

                def build(row: dict[str, Any] = row) -> Any:
                    return _post_scored(row, configs[row["key"]], loaded)

                where = Path(args.runs_dir) / "post" / key
                scores = cm.score_tasks(where, args, command, compute=True, scored=build)
            else:
                scores = cm.score_tasks(Path(row["run_dir"]), args, command, compute=True)
            scored[key] = scores
            row.update(_task_cells(scores))
            cm._print_tasks(row["label"], scores)
            flush()
    print(f"-> {out}")
    failed = [r for r in rows if r.get("tasks_error")]
    float_failed = cm.FLOAT_KEY in scored and scored[cm.FLOAT_KEY].error
    ok = all(r["status"] in (*cm.FINISHED, "refused") for r in rows)
    return 0 if ok and not failed and not float_failed else 1
