"""The results table of `qnpu report`, in the shape of the paper's Table 1.

Rows come from finished run directories (`report.json`, `config.yaml`, `plan.json`) and from
`qnpu eval --json` files: a float model (`--model`: its "model" key), a run (`--run`: matched
to a run directory by its resolved path) or an integer artifact (`--artifact`: matched by the
name of its source run, which is all the artifact records). Everything here is a pure function
of the loaded JSON except the `load_*` readers, which name the file in every error.

Significance (the issue's rule): a difference smaller than two standard errors is not called
a difference. A cell is marked ▲/▼ only where |x − x_float| > 2·sqrt(se² + se_float²); cells
measured under other settings than their column's reference (n, item subset, sink prefix,
seq_len, windows) carry † and are listed, never silently compared.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import LINEAR_INPUTS, UNROTATED_INPUT
from qnpu_jax.pipeline.config import QuantizeConfig, read_run_config
from qnpu_jax.pipeline.methods import METHOD_LABELS, METHOD_OFF, METHODS
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.run_manifest import verify_run
from qnpu_jax.quant.plan import WEIGHTS

# lm-evaluation-harness headline metric per task, in the paper's Table 1 column order.
HEADLINE: dict[str, str] = {
    "piqa": "acc_norm",
    "winogrande": "acc",
    "hellaswag": "acc_norm",
    "arc_easy": "acc_norm",
    "arc_challenge": "acc_norm",
    "lambada": "acc",
}
TASK_LABELS = {
    "piqa": "PIQA",
    "winogrande": "Winogrande",
    "hellaswag": "HellaSwag",
    "arc_easy": "ARC-E",
    "arc_challenge": "ARC-C",
    "lambada": "LAMBADA",
}
HIGHER, LOWER, FLAG = "▲", "▼", "†"
LAMBADA_PPL = "lambada_ppl"
RATIO = "ratio"  # column key prefix of "× float": ratio:<data key>
AVERAGE = "avg"
NONE_TEXT = "–"


@dataclasses.dataclass(frozen=True)
class Measure:
    """A value with its standard error (None: not known, e.g. fewer than 2 items)."""

    value: float
    stderr: float | None


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """One zero-shot task of one row: the headline metric and how it was measured."""

    task: str
    metric: str
    score: Measure
    n: int
    indices: tuple[int, ...] | None
    perplexity: Measure | None  # LAMBADA's own perplexity; None for the other tasks
    prefix: str | None
    limit: int | None
    source: str

    def protocol(self) -> dict[str, Any]:
        return {"n": self.n, "items": self.indices, "prefix": self.prefix}


@dataclasses.dataclass(frozen=True)
class PplResult:
    """Perplexity of one row on one data set and the windows it was measured on."""

    data: str
    ppl: float
    seq_len: int | None
    windows: int | None
    prefix: str | None
    source: str

    def protocol(self) -> dict[str, Any]:
        return {"seq_len": self.seq_len, "windows": self.windows, "prefix": self.prefix}


@dataclasses.dataclass(frozen=True)
class Row:
    """One table row: a float model, a run (fake-quant) or an integer artifact of a run."""

    kind: str  # "float" | "run" | "artifact" | "post" (a run with steps applied in memory)
    method: str
    source: str
    bits: str
    granularity: str
    down_in: str
    ppl: Mapping[str, PplResult]
    tasks: Mapping[str, TaskResult]
    stage1_steps: int | None = None
    run_dir: str | None = None  # resolved, for runs and artifacts


@dataclasses.dataclass(frozen=True)
class Cell:
    text: str
    mark: str = ""  # HIGHER, LOWER or ""
    flag: str = ""  # why this cell is not comparable to its reference ("" if it is)

    def render(self) -> str:
        return self.text + (f" {self.mark}" if self.mark else "") + (FLAG if self.flag else "")


@dataclasses.dataclass(frozen=True)
class Table:
    """What `qnpu report` renders: headers, cells per row, flags and notes."""

    columns: tuple[tuple[str, str], ...]  # (key, header)
    rows: tuple[Row, ...]
    cells: tuple[Mapping[str, Cell], ...]
    averages: tuple[Measure | None, ...]
    reference: str | None  # the float row's label, if any
    flags: tuple[str, ...]
    notes: tuple[str, ...]


# ------------------------------------------------------------------------------ reading


def read_json(path: Path, what: str) -> Any:
    """The JSON content of `path`; a missing or malformed file is a QnpuError naming it."""
    path = Path(path)
    if not path.is_file():
        raise QnpuError(f"{what} not found: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QnpuError(f"{path}: malformed JSON ({e})") from e


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QnpuError(f"{where}: expected a number, got {value!r}")
    return float(value)


def _optional_number(value: Any, where: str) -> float | None:
    return None if value is None else _number(value, where)


def _optional_int(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise QnpuError(f"{where}: expected an integer, got {value!r}")
    return value


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise QnpuError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def data_key(spec: str, split: str | None = None) -> str:
    """The column a perplexity goes to: the data spec, file paths resolved, and the wiki split
    when it is not the evaluation split (the one `qnpu quantize` reports)."""
    if spec.startswith("wikitext:"):
        spec = "wikitext:" + str(Path(spec.removeprefix("wikitext:")).resolve())
    if spec == "wiki" and split not in (None, "eval"):
        return f"wiki ({split})"
    return spec


def data_label(key: str) -> str:
    """A short column header for a data key (file paths by their name)."""
    if key.startswith("wikitext:"):
        return "wikitext:" + Path(key.removeprefix("wikitext:")).name
    return key


def granularity_name(tq: Any) -> str:
    """per-tensor, per-channel, per-block B, or LPBQ B (k-bit block scales)."""
    if tq.block is not None:
        if tq.block_scale_bits is not None:
            return f"LPBQ {tq.block} ({tq.block_scale_bits}-bit block scales)"
        return f"per-block {tq.block}"
    return "per-channel" if tq.axis is not None else "per-tensor"


def _granularity(plan: Any) -> str:
    """The granularity of the plan's linear weights and inputs, e.g. W per-channel / A
    per-tensor static."""

    def axes_text(entries: list[Any]) -> str:
        kinds = {granularity_name(tq) for tq in entries}
        return "/".join(sorted(kinds)) if kinds else "float"

    weights = [plan.get(f"layers/{n}") for n in WEIGHTS]
    inputs = [plan.get(f"layers/{n}") for n in LINEAR_INPUTS]
    # Every activation encoding of a plan is static (that is the method); dynamic is a
    # stage-1-only baseline mode, never stored.
    w = axes_text([tq for tq in weights if tq is not None])
    a = axes_text([tq for tq in inputs if tq is not None])
    return f"W {w} / A {a}{' static' if a != 'float' else ''}"


def _down_in_text(plan: Any) -> str:
    tq = plan.get(f"layers/{UNROTATED_INPUT}")
    if tq is None:
        return "float"
    if tq.layer_bits is None or len(set(tq.layer_bits)) == 1:
        return str(tq.layer_bits[0] if tq.layer_bits else tq.bits)
    low = min(tq.layer_bits)
    high = [i for i, b in enumerate(tq.layer_bits) if b != low]
    bits = sorted({tq.layer_bits[i] for i in high})
    layers = "layer" if len(high) == 1 else "layers"
    return f"{low}; {'/'.join(map(str, bits))} in {layers} {', '.join(map(str, high))}"


def run_label(method: str, config: QuantizeConfig) -> str:
    """The method's label plus the options beyond the paper that the run used."""
    label = METHOD_LABELS.get(method, method)
    spec = METHODS.get(method)  # None: a method this version does not know
    own = spec.defaults if spec is not None else METHOD_OFF  # the method's own options
    if config.smooth_mlp is not None:
        label += f" + smoothing α={config.smooth_mlp:g}"
    if config.mobilequant.equalize is not None and own["equalize"] is None:
        label += f" + equalization α={config.mobilequant.equalize:g}"
    if config.mobilequant.weight_clipping and not own["weight_clipping"]:
        label += " + LWC"
    if config.stage1.objective != "end_to_end":
        label += f" ({config.stage1.objective}-wise)"
    if config.weights.rounding != "rtn":
        label += f" + {config.weights.rounding.upper()}"
    if config.outliers.shadow_clip is not None:
        label += f" + shadow outliers (P{config.outliers.shadow_clip:g})"
    if config.outliers.muxq_exp is not None:
        label += f" + MUXQ (exp {config.outliers.muxq_exp})"
    if config.outliers.residual_split is not None:
        label += f" + residual split (1/{config.outliers.residual_split:g})"
    return label


def load_run_row(run_dir: Path) -> Row:
    """The row of a finished `qnpu quantize` run: report.json, config.yaml and plan.json."""

    run_dir = Path(run_dir)
    verify_run(run_dir)
    run = RunDir(run_dir)
    report_path, report = run.report_path, run.read_report()
    config = read_run_config(run)
    plan = run.read_plan()
    method = report.get("method")
    bits = report.get("bits")
    if not isinstance(method, str) or not isinstance(bits, str):
        raise QnpuError(f"{report_path}: 'method' and 'bits' must be strings")
    perplexity = _mapping(report.get("perplexity", {}), f"{report_path}: 'perplexity'")
    seq_len = _optional_int(report.get("seq_len", config.data.seq_len), f"{report_path}: seq_len")
    prefix = report.get("prefix", config.prefix)
    ppl = {}
    for spec, entry in perplexity.items():
        where = f"{report_path}: perplexity[{spec!r}]"
        entry = _mapping(entry, where)
        key = data_key(spec)
        ppl[key] = PplResult(
            data=key,
            ppl=_number(entry.get("quantized_ppl"), f"{where}.quantized_ppl"),
            seq_len=seq_len,
            windows=_optional_int(entry.get("windows"), f"{where}.windows"),
            prefix=prefix,
            source=str(report_path),
        )
    return Row(
        kind="run",
        method=run_label(method, config),
        source=str(run_dir),
        bits=bits,
        granularity=_granularity(plan),
        down_in=_down_in_text(plan),
        ppl=ppl,
        tasks={},
        stage1_steps=_optional_int(report.get("stage1_steps"), f"{report_path}: stage1_steps"),
        run_dir=str(run_dir.resolve()),
    )


def recorded_float_ppl(run_dir: Path) -> dict[str, PplResult]:
    """The float perplexities a run measured on the same windows as its quantized ones."""
    run = RunDir(Path(run_dir))
    path, report = run.report_path, run.read_report()
    out = {}
    for spec, entry in _mapping(report.get("perplexity", {}), str(path)).items():
        if isinstance(entry, dict) and entry.get("float_ppl") is not None:
            key = data_key(spec)
            out[key] = PplResult(
                data=key,
                ppl=_number(entry["float_ppl"], f"{path}: perplexity[{spec!r}].float_ppl"),
                seq_len=_optional_int(report.get("seq_len"), f"{path}: seq_len"),
                windows=_optional_int(entry.get("windows"), f"{path}: perplexity[{spec!r}]"),
                prefix=report.get("prefix"),
                source=f"float PPL recorded in {path}",
            )
    return out


@dataclasses.dataclass(frozen=True)
class EvalFile:
    """One `qnpu eval --json` file, parsed: what it evaluated and its results."""

    path: str
    kind: str  # "float" | "run" | "artifact" | "post" (a run with steps applied in memory)
    target: str  # model spec, run path or artifact path
    engine: str | None  # artifacts: "integer, emulator", "integer, jax", "onnxruntime, QDQ"
    source_run: str | None  # artifacts: the name of the run it was exported from
    ppl: PplResult | None
    tasks: Mapping[str, TaskResult]


def _measure(metrics: Mapping[str, Any], key: str, where: str) -> Measure:
    if key not in metrics:
        raise QnpuError(f"{where}: metric {key!r} is missing")
    return Measure(
        _number(metrics[key], f"{where}.{key}"),
        _optional_number(metrics.get(f"{key}_stderr"), f"{where}.{key}_stderr"),
    )


def load_eval(path: Path) -> EvalFile:
    """Parse a `qnpu eval --json` report (float model, run or artifact)."""
    doc = _mapping(read_json(path, "eval JSON"), str(path))
    where = str(path)
    if doc.get("artifact"):
        kind, target = "artifact", str(doc["artifact"])
    elif doc.get("onnx"):  # an ONNX export of a run: a deployed form, like an artifact
        kind, target = "artifact", str(doc["onnx"])
    elif doc.get("run"):
        kind, target = "run", str(doc["run"])
    elif doc.get("base_run"):  # a run with post-training steps applied in memory
        steps = doc.get("post_steps")
        if not isinstance(steps, list):
            raise QnpuError(f"{where}: post_steps: expected a JSON list")
        names = [_mapping(s, f"{where}: post_steps").get("name") for s in steps]
        kind, target = "post", " + ".join([str(doc["base_run"]), *map(str, names)])
    elif doc.get("model"):
        kind, target = "float", str(doc["model"])
    else:
        raise QnpuError(f"{path}: not a `qnpu eval` report (no 'model', 'run' or 'artifact')")
    prefix = doc.get("prefix")
    limit = _optional_int(doc.get("limit"), f"{where}: limit")
    tasks: dict[str, TaskResult] = {}
    for name, entry in _mapping(doc.get("tasks", {}), f"{where}: tasks").items():
        if name not in HEADLINE:
            raise QnpuError(f"{path}: unknown task {name!r}; known: {', '.join(HEADLINE)}")
        w = f"{where}: tasks.{name}"
        entry = _mapping(entry, w)
        metrics = _mapping(entry.get("metrics"), f"{w}.metrics")
        n = _optional_int(entry.get("n"), f"{w}.n")
        if n is None:
            raise QnpuError(f"{w}: 'n' is missing")
        indices = entry.get("indices")
        tasks[name] = TaskResult(
            task=name,
            metric=HEADLINE[name],
            score=_measure(metrics, HEADLINE[name], f"{w}.metrics"),
            n=n,
            indices=tuple(indices) if isinstance(indices, list) else None,
            perplexity=_measure(metrics, "perplexity", f"{w}.metrics")
            if name == "lambada"
            else None,
            prefix=prefix,
            limit=limit,
            source=where,
        )
    ppl = None
    if doc.get("ppl") is not None:
        if not isinstance(doc.get("data"), str):
            raise QnpuError(f"{path}: 'ppl' without its 'data'")
        key = data_key(doc["data"], doc.get("split"))
        ppl = PplResult(
            data=key,
            ppl=_number(doc["ppl"], f"{where}: ppl"),
            seq_len=_optional_int(doc.get("seq_len"), f"{where}: seq_len"),
            windows=_optional_int(doc.get("windows"), f"{where}: windows"),
            prefix=prefix,
            source=where,
        )
    if ppl is None and not tasks:
        raise QnpuError(f"{path}: holds neither a perplexity nor zero-shot tasks")
    engine = source_run = None
    if kind == "artifact":
        source = doc.get("source")
        if not isinstance(source, dict) or not isinstance(source.get("run"), str):
            raise QnpuError(f"{path}: an artifact eval without its source run ('source.run')")
        source_run = source["run"]
        text = str(doc.get("path", ""))  # "integer (emulator)", "onnxruntime (QDQ)"
        head = "onnxruntime" if doc.get("onnx") else "integer"
        inner = text[text.find("(") + 1 : text.rfind(")")] if "(" in text else ""
        engine = f"{head}, {inner}" if inner else head
    return EvalFile(str(path), kind, target, engine, source_run, ppl, tasks)


# ------------------------------------------------------------------------------ rows


def _merge(row: Row, ev: EvalFile, notes: list[str]) -> Row:
    """`row` with the tasks and perplexity of `ev` added; a task twice is an error."""
    tasks = dict(row.tasks)
    for name, result in ev.tasks.items():
        if name in tasks:
            raise QnpuError(
                f"task {name} of {row.source} is in both {tasks[name].source} and {ev.path}: "
                "pass one of them"
            )
        tasks[name] = result
    ppl = dict(row.ppl)
    if ev.ppl is not None:
        old = ppl.get(ev.ppl.data)
        if old is None:
            ppl[ev.ppl.data] = ev.ppl
        else:  # a run's report.json is measured on the windows of its own float PPL: keep it
            notes.append(
                f"{ev.path}: PPL {ev.ppl.ppl:.3f} on {data_label(ev.ppl.data)} "
                f"({protocol_text(ev.ppl.protocol())}) not shown; the table shows "
                f"{old.ppl:.3f} from {old.source} ({protocol_text(old.protocol())})"
            )
    return dataclasses.replace(row, tasks=tasks, ppl=ppl)


def build_rows(run_dirs: Sequence[Path], eval_paths: Sequence[Path]) -> tuple[list[Row], list[str]]:
    """(rows: the float row first, then each run followed by its artifacts; notes)."""
    notes: list[str] = []
    runs = [load_run_row(Path(r)) for r in run_dirs]
    by_path: dict[str, int] = {}
    for i, row in enumerate(runs):
        assert row.run_dir is not None
        if row.run_dir in by_path:
            raise QnpuError(f"run {row.source} is given twice in --runs")
        by_path[row.run_dir] = i
    evals = [load_eval(Path(p)) for p in eval_paths]
    seen: set[str] = set()
    for ev in evals:
        resolved = str(Path(ev.path).resolve())
        if resolved in seen:
            raise QnpuError(f"eval JSON {ev.path} is given twice in --evals")
        seen.add(resolved)

    float_models = sorted({ev.target for ev in evals if ev.kind == "float"})
    if len(float_models) > 1:
        raise QnpuError(
            f"the eval JSONs evaluate {len(float_models)} float models "
            f"({', '.join(float_models)}); a report compares against one float row"
        )
    float_row: Row | None = None
    if float_models:
        float_row = Row("float", "FP32", float_models[0], NONE_TEXT, NONE_TEXT, NONE_TEXT, {}, {})
        for ev in evals:
            if ev.kind == "float":
                float_row = _merge(float_row, ev, notes)
    recorded: dict[str, PplResult] = {}
    for r in run_dirs:
        for key, result in recorded_float_ppl(Path(r)).items():
            recorded.setdefault(key, result)
    if recorded:
        if float_row is None:
            source = "float PPL recorded by the runs"
            float_row = Row("float", "FP32", source, NONE_TEXT, NONE_TEXT, NONE_TEXT, {}, {})
        missing = {k: v for k, v in recorded.items() if k not in float_row.ppl}
        for k, v in recorded.items():
            shown = float_row.ppl.get(k)
            if shown is not None and _protocol_diff(v.protocol(), shown.protocol()):
                # The comparable float number exists; say so rather than hide it.
                notes.append(
                    f"{v.source}: {v.ppl:.3f} on {data_label(k)} ({protocol_text(v.protocol())}),"
                    f" on the run's own windows; the float row shows {shown.ppl:.3f} from "
                    f"{shown.source} ({protocol_text(shown.protocol())})"
                )
        float_row = dataclasses.replace(float_row, ppl={**float_row.ppl, **missing})

    artifacts: dict[int, list[Row]] = {}
    for ev in evals:
        if ev.kind == "post":
            raise QnpuError(
                f"{ev.path}: scores {ev.target}, a run with post-training steps applied in "
                "memory (qnpu study outliers), which has no run directory to be a row of"
            )
        if ev.kind == "run":
            resolved = str(Path(ev.target).resolve())
            if resolved not in by_path:
                raise QnpuError(f"{ev.path}: its run {ev.target} ({resolved}) is not among --runs")
            i = by_path[resolved]
            runs[i] = _merge(runs[i], ev, notes)
        elif ev.kind == "artifact":
            names = [
                i for i, row in enumerate(runs) if Path(str(row.run_dir)).name == ev.source_run
            ]
            if len(names) != 1:
                what = "no run in --runs has" if not names else "several runs in --runs have"
                raise QnpuError(
                    f"{ev.path}: artifact {ev.target} was exported from run "
                    f"{ev.source_run!r}, and {what} that name"
                )
            run = runs[names[0]]
            rows = artifacts.setdefault(names[0], [])
            method = f"{run.method} ({ev.engine})"
            existing = [
                k for k, a in enumerate(rows) if (a.source, a.method) == (ev.target, method)
            ]
            if existing:  # one row per artifact and engine, whatever the number of evals
                rows[existing[0]] = _merge(rows[existing[0]], ev, notes)
            else:
                base = dataclasses.replace(
                    run, kind="artifact", method=method, source=ev.target, ppl={}, tasks={}
                )
                rows.append(_merge(base, ev, notes))
    out: list[Row] = [float_row] if float_row is not None else []
    for i, run in enumerate(runs):
        out += [run, *artifacts.get(i, [])]
    return out, notes


# ------------------------------------------------------------------------------ comparison


def significance(x: Measure, ref: Measure) -> str:
    """HIGHER/LOWER when |x − ref| > 2·sqrt(se_x² + se_ref²), else "" (within noise)."""
    if x.stderr is None or ref.stderr is None:
        return ""
    bound = 2.0 * math.sqrt(x.stderr**2 + ref.stderr**2)
    diff = x.value - ref.value
    if diff > bound:
        return HIGHER
    if diff < -bound:
        return LOWER
    return ""


def _protocol_diff(a: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    """What differs between two measurement settings (unknown values are not compared)."""
    out = []
    for key, value in a.items():
        other = ref.get(key)
        if value is None or other is None or value == other:
            continue
        if key == "items" and a.get("n") != ref.get("n"):
            continue  # other n already says it
        out.append("another item subset" if key == "items" else f"{key} {value} vs {other}")
    return out


def protocol_text(p: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in p.items() if v is not None and k != "items")


def average(tasks: Mapping[str, TaskResult], names: Sequence[str]) -> Measure | None:
    """Mean headline score over `names` (None unless the row has all of them); its standard
    error treats the tasks as independent samples: sqrt(Σ se²) / k."""
    if not names or any(n not in tasks for n in names):
        return None
    scores = [tasks[n].score for n in names]
    value = sum(s.value for s in scores) / len(scores)
    ses = [s.stderr for s in scores if s.stderr is not None]
    stderr = (
        math.sqrt(sum(se * se for se in ses)) / len(scores) if len(ses) == len(scores) else None
    )
    return Measure(value, stderr)


def pct(m: Measure) -> str:
    """A score in percent with its standard error, e.g. "61.3 ±2.2"."""
    se = f" ±{100 * m.stderr:.1f}" if m.stderr is not None else ""
    return f"{100 * m.value:.1f}{se}"


def ppl_text(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x:.2f}" if x < 1e5 else f"{x:.3g}"


def _n_text(row: Row) -> str:
    if not row.tasks:
        return NONE_TEXT
    ns = {t.n for t in row.tasks.values()}
    limits = {t.limit for t in row.tasks.values()}
    head = "all: " if limits == {None} else ""
    if len(ns) == 1 and (limits != {None} or len(row.tasks) == 1):
        return f"{head}{next(iter(ns))}"
    order = [t for t in HEADLINE if t in row.tasks]
    return head + ", ".join(f"{TASK_LABELS[t]} {row.tasks[t].n}" for t in order)


def row_label(row: Row) -> str:
    return f"{row.method} ({row.source})"


def build_table(rows: Sequence[Row], notes: Sequence[str] = (), *, ratios: bool = False) -> Table:
    """Columns, rendered cells, significance marks and flags of `rows`; with `ratios`, a
    "× float" column after each perplexity the float row has (its cells carry the flag of
    the perplexity they divide)."""
    ppl_keys = list(dict.fromkeys(k for row in rows for k in row.ppl))
    task_names = [t for t in HEADLINE if any(t in row.tasks for row in rows)]
    ref = next((r for r in rows if r.kind == "float"), None)
    ratio_keys = [k for k in ppl_keys if ratios and ref is not None and k in ref.ppl]
    columns: list[tuple[str, str]] = [
        ("method", "Method"),
        ("source", "Source"),
        ("bits", "W-A-KV"),
        ("granularity", "Granularity"),
        ("down_in", "down_proj in"),
        ("n", "n / task"),
        *((f"ppl:{k}", f"PPL {data_label(k)} ↓") for k in ppl_keys),
        *((f"{RATIO}:{k}", f"× float {data_label(k)}") for k in ratio_keys),
        *((f"task:{t}", TASK_LABELS[t]) for t in task_names),
    ]
    if "lambada" in task_names:
        columns.append((LAMBADA_PPL, "LAMBADA ppl ↓"))
    if task_names:
        columns.append((AVERAGE, "Avg ↑"))
    flags: list[str] = []

    def reference(get: Any) -> tuple[Row, Any] | None:
        """The column's reference measurement: the float row's, else the first row's."""
        for r in ([ref] if ref is not None else []) + list(rows):
            value = get(r)
            if value is not None:
                return r, value
        return None

    def flag_for(row: Row, header: str, proto: Mapping[str, Any], get: Any) -> str:
        found = reference(get)
        if found is None or found[0] is row:
            return ""
        diff = _protocol_diff(proto, found[1].protocol())
        if not diff:
            return ""
        text = f"{row_label(row)}, {header}: {'; '.join(diff)} (reference: {row_label(found[0])})"
        flags.append(text)
        return text

    averages = [average(row.tasks, task_names) for row in rows]
    ref_avg = averages[rows.index(ref)] if ref is not None else None
    all_cells: list[dict[str, Cell]] = []
    for row, avg in zip(rows, averages, strict=True):
        cells: dict[str, Cell] = {
            "method": Cell(row.method),
            "source": Cell(row.source),
            "bits": Cell(row.bits),
            "granularity": Cell(row.granularity),
            "down_in": Cell(row.down_in),
            "n": Cell(_n_text(row)),
        }
        header = dict(columns)
        for k in ppl_keys:
            p = row.ppl.get(k)
            key = f"ppl:{k}"
            if p is None:
                cells[key] = Cell(NONE_TEXT)
                continue
            flag = flag_for(row, header[key], p.protocol(), lambda r, k=k: r.ppl.get(k))
            cells[key] = Cell(ppl_text(p.ppl), flag=flag)
        for k in ratio_keys:
            p, base = row.ppl.get(k), ref.ppl[k] if ref is not None else None
            ratio = None if p is None or base is None else p.ppl / base.ppl
            flagged = cells[f"ppl:{k}"].flag
            text = NONE_TEXT if ratio is None else f"{ratio:.3f}"
            cells[f"{RATIO}:{k}"] = Cell(text, flag=flagged)
        ref_tasks = ref.tasks if ref is not None else {}
        any_flag = False
        for t in task_names:
            key = f"task:{t}"
            result = row.tasks.get(t)
            if result is None:
                cells[key] = Cell(NONE_TEXT)
                continue
            flag = flag_for(row, header[key], result.protocol(), lambda r, t=t: r.tasks.get(t))
            any_flag |= bool(flag)
            mark = ""
            if row is not ref and t in ref_tasks:
                mark = significance(result.score, ref_tasks[t].score)
            cells[key] = Cell(pct(result.score), mark, flag)
            if t == "lambada" and result.perplexity is not None:
                pm = ""
                ref_l = ref_tasks.get("lambada")
                if row is not ref and ref_l is not None and ref_l.perplexity is not None:
                    pm = significance(result.perplexity, ref_l.perplexity)
                se = result.perplexity.stderr
                text = ppl_text(result.perplexity.value) + (
                    f" ±{ppl_text(se)}" if se is not None else ""
                )
                cells[LAMBADA_PPL] = Cell(text, pm, flag)
        if "lambada" in task_names and LAMBADA_PPL not in cells:
            cells[LAMBADA_PPL] = Cell(NONE_TEXT)
        if task_names:
            if avg is None:
                cells[AVERAGE] = Cell(NONE_TEXT)
            else:
                mark = significance(avg, ref_avg) if row is not ref and ref_avg else ""
                # The average inherits the flags of its tasks: a mixed subset is not comparable.
                cells[AVERAGE] = Cell(pct(avg), mark, "see the task flags" if any_flag else "")
        all_cells.append(cells)
    out_notes = list(notes)
    if ref is None and any(r.tasks for r in rows):
        out_notes.append(
            "no float row (an eval JSON of `qnpu eval --model`): no significance marks"
        )
    return Table(
        columns=tuple(columns),
        rows=tuple(rows),
        cells=tuple(all_cells),
        averages=tuple(averages),
        reference=row_label(ref) if ref is not None else None,
        flags=tuple(flags),
        notes=tuple(out_notes),
    )


# ------------------------------------------------------------------------------ rendering


def legend(table: Table) -> list[str]:
    """The sentences every rendering carries under the table."""
    lines = [
        "Accuracies: the lm-evaluation-harness headline metric in percent ± its standard error "
        "(acc_norm for PIQA, HellaSwag, ARC-E and ARC-C; acc for Winogrande and LAMBADA). "
        "Avg is their mean (standard error sqrt(Σ se²)/k); LAMBADA ppl is the task's own "
        "perplexity (± bootstrap standard error), not in the average. n / task is the number "
        'of items per task (`--limit`; "all" = the whole task).',
    ]
    if table.reference is not None:
        lines.append(
            f"{HIGHER} / {LOWER}: significantly higher / lower than the float row "
            f"{table.reference}, i.e. |x − x_float| > 2·sqrt(se² + se_float²). Unmarked "
            "differences are within noise: a difference smaller than two standard errors is "
            "not called a difference. PPL cells have no standard error and are not marked."
        )
    lines.append(
        f"{FLAG}: measured under other settings than the column's reference (float row, else "
        "the first row with that column): n, item subset, sink prefix, seq_len or windows "
        "differ; listed under Flags."
    )
    return lines


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(table: Table) -> str:
    headers = [h for _, h in table.columns]
    lines = [
        "| " + " | ".join(_md_escape(h) for h in headers) + " |",
        "|" + "---|" * len(headers),
    ]
    for cells in table.cells:
        texts = [_md_escape(cells[k].render()) for k, _ in table.columns]
        lines.append("| " + " | ".join(texts) + " |")
    return "\n".join(lines)


def html_table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h in table.columns)
    body = []
    for cells in table.cells:
        tds = []
        for key, _ in table.columns:
            cell = cells[key]
            cls = {HIGHER: "higher", LOWER: "lower"}.get(cell.mark, "")
            attrs = (f' class="{cls}"' if cls else "") + (
                f' title="{html.escape(cell.flag)}"' if cell.flag else ""
            )
            tds.append(f"<td{attrs}>{html.escape(cell.render())}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    rows = "\n".join(body)
    return f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}\n</tbody>\n</table>"


def rows_json(table: Table) -> list[dict[str, Any]]:
    """The rendered rows with their numbers: what `qnpu report` writes to NAME.json."""
    out = []
    ref = next((r for r in table.rows if r.kind == "float"), None)
    ratio_keys = [k.split(":", 1)[1] for k, _ in table.columns if k.startswith(f"{RATIO}:")]
    for row, cells, avg in zip(table.rows, table.cells, table.averages, strict=True):
        out.append(
            {
                "kind": row.kind,
                "method": row.method,
                "source": row.source,
                "bits": row.bits,
                "granularity": row.granularity,
                "down_in": row.down_in,
                "stage1_steps": row.stage1_steps,
                "ppl": {k: dataclasses.asdict(v) for k, v in row.ppl.items()},
                "ratio": {
                    k: row.ppl[k].ppl / ref.ppl[k].ppl
                    for k in ratio_keys
                    if ref is not None and k in row.ppl
                },
                "tasks": {
                    name: {
                        "metric": t.metric,
                        "value": t.score.value,
                        "stderr": t.score.stderr,
                        "n": t.n,
                        "limit": t.limit,
                        "prefix": t.prefix,
                        "perplexity": dataclasses.asdict(t.perplexity) if t.perplexity else None,
                        "mark": cells[f"task:{name}"].mark,
                        "flag": cells[f"task:{name}"].flag,
                        "source": t.source,
                    }
                    for name, t in row.tasks.items()
                },
                "average": dataclasses.asdict(avg) if avg is not None else None,
                "cells": {header: cells[key].render() for key, header in table.columns},
            }
        )
    return out
