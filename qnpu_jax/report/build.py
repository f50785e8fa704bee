"""`qnpu report`: the table, the plots and their Markdown/HTML/JSON, built whole in memory
(every input read and checked first) and then written file by file atomically, so a bad
input leaves nothing behind and a reader never sees half a file."""

from __future__ import annotations

import base64
import dataclasses
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from qnpu_jax.files import write_bytes_atomic
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.report.plots import (
    plot_stage1_losses,
    plot_sweep,
    read_stage1_metrics,
    read_sweep,
)
from qnpu_jax.report.table import (
    Row,
    Table,
    build_rows,
    build_table,
    data_label,
    html_table,
    legend,
    markdown_table,
    protocol_text,
    row_label,
    rows_json,
)

STAGE1_PNG = "stage1_loss.png"
SWEEP_PNG = "mixed_precision_sweep.png"
PLOTS = (STAGE1_PNG, SWEEP_PNG)  # the pictures this command owns in reports/NAME/


@dataclasses.dataclass(frozen=True)
class Report:
    """Everything `qnpu report` writes, as bytes, keyed by the path relative to --out's
    parent: NAME.md, NAME.html, NAME.json and NAME/<plot>.png."""

    name: str
    files: tuple[tuple[str, bytes], ...]
    table: Table
    skipped_stage1: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Section:
    """A report section with text in both renderings, an optional results table
    (`qnpu_jax.report.table.Table`), a plain table and a picture."""

    title: str
    paragraphs: tuple[str, ...] = ()
    items: tuple[str, ...] = ()
    image: str | None = None  # file name under NAME/
    table: tuple[tuple[str, ...], ...] = ()  # header row first
    results: Table | None = None  # rendered before the paragraphs


def row_sources(row: Row) -> str:
    """Where a row's numbers come from, as one line."""
    parts = []
    for key, p in row.ppl.items():
        parts.append(f"PPL {data_label(key)} from {p.source} ({protocol_text(p.protocol())})")
    by_source: dict[str, list[str]] = {}
    for t in row.tasks.values():
        limit = "all items" if t.limit is None else f"limit {t.limit}"
        by_source.setdefault(f"{t.source} ({limit}, prefix {t.prefix})", []).append(t.task)
    parts += [f"{', '.join(tasks)} from {src}" for src, tasks in by_source.items()]
    return f"{row_label(row)}: " + ("; ".join(parts) if parts else "no numbers")


def build_report(
    runs: Sequence[Path],
    evals: Sequence[Path] = (),
    sweep: Path | None = None,
    *,
    name: str,
    command: str,
) -> Report:
    """Read every input, build the table and the plots; raises QnpuError on a bad input."""
    rows, notes = build_rows(runs, evals)
    table = build_table(rows, notes)
    images: dict[str, bytes] = {}
    curves: dict[str, list[dict[str, float]]] = {}
    skipped: list[str] = []
    for run in runs:
        metrics = read_stage1_metrics(Path(run))
        if metrics:
            curves[Path(run).name] = metrics
        else:
            skipped.append(str(run))
    if curves:
        images[STAGE1_PNG] = plot_stage1_losses(curves)
    sweep_doc = read_sweep(sweep) if sweep is not None else None
    if sweep_doc is not None:
        images[SWEEP_PNG] = plot_sweep(sweep_doc)

    sections = [
        Section(
            "Results (in the shape of the paper's Table 1)",
            paragraphs=tuple(legend(table)),
            results=table,
        ),
        *table_sections(table),
    ]
    stage1_text = []
    if skipped:
        listed = ", ".join(f"`{s}`" for s in skipped)
        no_metrics = f"{RunDir.STAGE1}/{RunDir.STAGE1_METRICS}"
        stage1_text.append(f"Runs without stage 1 (no {no_metrics}), skipped: {listed}")
    if not curves:
        stage1_text.insert(0, "No run has stage-1 metrics: no plot.")
    sections.append(
        Section(
            "Stage-1 loss (paper Figure 1b)",
            paragraphs=tuple(stage1_text),
            image=STAGE1_PNG if curves else None,
        )
    )
    if sweep_doc is not None:
        header = ("16-bit share", "promoted layers", "PPL", "× float")
        body = tuple(
            (
                f"{100 * r['fraction']:g}%",
                ", ".join(map(str, r.get("promoted_layers", []))) or "–",
                f"{r['ppl']:.3f}",
                f"{r['ratio_to_float']:.3f}" if "ratio_to_float" in r else "–",
            )
            for r in sorted(sweep_doc["rows"], key=lambda r: r["fraction"])
        )
        sections.append(
            Section(
                "Perplexity vs share of 16-bit down_proj inputs (paper Figure 4)",
                paragraphs=(
                    f"From `{sweep}` (run `{sweep_doc.get('run', '?')}`, "
                    f"{sweep_doc.get('method', '?')} {sweep_doc.get('bits', '')}; float PPL "
                    f"{sweep_doc.get('float_ppl', float('nan')):.3f}).",
                ),
                image=SWEEP_PNG,
                table=(header, *body),
            )
        )
    sections.append(
        Section(
            "Activation distributions (paper Figures 5–6)",
            paragraphs=(
                "They need the model: `qnpu study plot_activations --run runs/NAME "
                "--layer L --windows N --out reports/NAME_acts`.",
            ),
        )
    )
    doc: dict[str, Any] = {
        "name": name,
        "command": command,
        "columns": [header for _, header in table.columns],
        "reference": table.reference,
        "rows": rows_json(table),
        "flags": list(table.flags),
        "notes": list(table.notes),
        "plots": [f"{name}/{p}" for p in images],
        "stage1_skipped": skipped,
        "sweep": str(sweep) if sweep is not None else None,
    }
    files = assemble(name, f"qnpu report: {name}", command, sections, images, doc)
    return Report(name, files, table, tuple(skipped))


def table_sections(table: Table) -> list[Section]:
    """The sections that go with a results table: its rows' sources, flags and notes."""
    out = [Section("Where each row's numbers come from", items=tuple(map(row_sources, table.rows)))]
    if table.flags:
        out.append(
            Section(
                "Flags: cells measured under other settings (not compared silently)",
                items=table.flags,
            )
        )
    if table.notes:
        out.append(Section("Notes", items=table.notes))
    return out


def assemble(
    name: str,
    title: str,
    command: str,
    sections: Sequence[Section],
    images: dict[str, bytes],
    doc: dict[str, Any],
) -> tuple[tuple[str, bytes], ...]:
    """The files of a report, keyed by the path relative to --out's parent: NAME/<plot>.png,
    NAME.json (`doc`), NAME.md and NAME.html (`sections` rendered both ways)."""
    return (
        *((f"{name}/{p}", data) for p, data in images.items()),
        (f"{name}.json", (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()),
        (f"{name}.md", _markdown(title, command, sections, name).encode()),
        (f"{name}.html", _html(title, command, sections, images).encode()),
    )


def _markdown(title: str, command: str, sections: Sequence[Section], name: str) -> str:
    lines = [f"# {title}", "", f"Made with `{command}`.", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.results is not None:
            lines += [markdown_table(s.results), ""]
        for p in s.paragraphs:
            lines += [p, ""]
        if s.items:
            lines += [f"- {item}" for item in s.items] + [""]
        if s.image:
            lines += [f"![{s.title}]({name}/{s.image})", ""]
        if s.table:
            head, *body = s.table
            lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            lines += ["| " + " | ".join(r) + " |" for r in body] + [""]
    return "\n".join(lines)


_CSS = (
    "body{font-family:sans-serif;margin:2em;max-width:110em}"
    "table{border-collapse:collapse;font-size:90%}"
    "th,td{border:1px solid #bbb;padding:3px 6px;text-align:left}"
    "th{background:#eee}td.higher{background:#e3f4e3}td.lower{background:#f8e0e0}"
    "img{max-width:100%}"
)


def _html(title: str, command: str, sections: Sequence[Section], images: dict[str, bytes]) -> str:
    """One self-contained page: no scripts, pictures inlined as data: URIs."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p>Made with <code>{e(command)}</code>.</p>",
    ]
    for s in sections:
        parts.append(f"<h2>{e(s.title)}</h2>")
        if s.results is not None:
            parts.append(html_table(s.results))
        parts += [f"<p>{e(p)}</p>" for p in s.paragraphs]
        if s.items:
            parts.append("<ul>" + "".join(f"<li>{e(i)}</li>" for i in s.items) + "</ul>")
        if s.image:
            data = base64.b64encode(images[s.image]).decode()
            parts.append(f'<img alt="{e(s.title)}" src="data:image/png;base64,{data}">')
        if s.table:
            head, *body = s.table
            parts.append(
                "<table><tr>"
                + "".join(f"<th>{e(h)}</th>" for h in head)
                + "</tr>"
                + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body)
                + "</table>"
            )
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_report(out: Path, report: Report) -> list[Path]:
    """Write every file of `report` next to `out` (reports/NAME → reports/NAME.md, ...), each
    atomically; plots of an earlier report that this one does not make are removed."""

    base = Path(out).parent
    written = [write_bytes_atomic(base / rel, data) for rel, data in report.files]
    made = {Path(rel).name for rel, _ in report.files}
    for stale in PLOTS:
        if stale not in made:
            (Path(out) / stale).unlink(missing_ok=True)
    return written
