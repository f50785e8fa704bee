"""`RunDir` (issue 39, item 2): one value owns the file names and readers of a run directory.
Its paths and its readers' refusals here; its readers on a finished run in
test_run_integrity.py (`rtn_run`) and test_pipeline_run.py (a run with stage 1)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest

from qnpu_jax import QnpuError
from qnpu_jax.ir.graph import UNROTATED_INPUT, UNROTATED_OUTPUT
from qnpu_jax.pipeline.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
# The run directory's file names that only run_dir.py may spell.
RUN_DIR_NAMES = (
    RunDir.CONFIG,
    RunDir.MODEL,
    RunDir.PLAN,
    RunDir.REPORT,
    RunDir.STAGE1_METRICS,
    RunDir.MANIFEST,
)
# The integer artifact's own manifest (an export directory, not a run directory): its format
# names its file, which happens to share the run manifest's name.
ALLOWED = {("qnpu_jax/export/artifact.py", RunDir.MANIFEST)}


def test_run_dir_paths(tmp_path: Path) -> None:
    run = RunDir(str(tmp_path))  # a str is taken as a path
    assert run.path == tmp_path
    assert run.lock_path == tmp_path / ".qnpu.lock"
    assert run.config_path == tmp_path / "config.yaml"
    assert run.model_json_path == tmp_path / "model.json"
    assert run.plan_path == tmp_path / "plan.json"
    assert run.learned_path == tmp_path / "learned"
    assert run.resume == RunDir(tmp_path / "resume")
    assert run.resume.model_json_path == tmp_path / "resume" / "model.json"
    assert run.stage1_dir == tmp_path / "stage1"
    assert run.stage1_metrics_path == tmp_path / "stage1" / "metrics.jsonl"
    assert run.report_path == tmp_path / "report.json"
    assert run.evals_dir == tmp_path / "evals"
    assert run.manifest_path == tmp_path / "manifest.json"
    assert run.sensitivity_path() == tmp_path / "sensitivity.json"
    assert run.sensitivity_path(UNROTATED_INPUT) == tmp_path / "sensitivity.json"
    other = f"sensitivity_{UNROTATED_OUTPUT}.json"
    assert run.sensitivity_path(UNROTATED_OUTPUT) == tmp_path / other
    with pytest.raises(AttributeError):
        run.path = tmp_path / "other"  # type: ignore[misc]  # frozen


def _refusal(read: Callable[[], object]) -> str:
    with pytest.raises(QnpuError) as e:
        read()
    return str(e.value)


def test_readers_of_an_empty_directory_name_the_missing_file(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    assert not (run.is_sealed or run.has_config or run.has_model_json or run.has_report)
    assert run.read_stage1_metrics() is None and run.read_sensitivity() is None
    missing = f"{tmp_path} is not a finished run:"
    assert _refusal(run.require_config) == f"{missing} config.yaml is missing"
    assert _refusal(run.read_report) == f"{missing} report.json is missing"
    assert _refusal(run.read_plan) == f"{missing} plan.json is missing"
    message = f"{tmp_path} holds no saved model (model.json is missing)"
    assert _refusal(run.read_model_json) == message


def test_readers_refuse_unreadable_files(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.report_path.write_text("[1, 2]")
    assert _refusal(run.read_report) == f"{run.report_path}: not a run report"
    run.report_path.write_text("{")
    assert _refusal(run.read_report).startswith(f"{run.report_path}: not a readable report (")
    run.plan_path.write_text("{")
    assert _refusal(run.read_plan).startswith(f"{run.plan_path}: ")
    run.model_json_path.write_text('{"format": "other"}')
    message = f"{run.model_json_path}: not a qnpu-quantized-model file"
    assert _refusal(run.read_model_json) == message
    run.stage1_dir.mkdir()
    run.stage1_metrics_path.write_text('{"step": 1}\n\n{"step": 2}\n')
    rows = run.read_stage1_metrics()
    assert rows is not None and list(rows) == [(1, {"step": 1}), (3, {"step": 2})]


# ------------------------------------------------------- nothing else spells the names


def _spellings(source: str, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, name) of every string constant of `source` that contains one of `names`,
    docstrings excluded (they may explain the layout)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found += [(node.lineno, name) for name in names if name in node.value]
    return sorted(found)


def test_the_scan_finds_literals_and_skips_docstrings() -> None:
    source = (
        '"""The run: report.json."""\n'
        "def f(run):\n"
        '    """Reads plan.json."""\n'
        '    return run / "report.json", f"{run}/stage1/metrics.jsonl"\n'
    )
    assert _spellings(source, RUN_DIR_NAMES) == [(4, "metrics.jsonl"), (4, "report.json")]


def test_no_module_but_run_dir_spells_the_run_directory_file_names() -> None:
    modules = sorted((ROOT / "qnpu_jax").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    offenders = []
    for path in modules:
        rel = path.relative_to(ROOT).as_posix()
        if rel == "qnpu_jax/pipeline/run_dir.py":
            continue
        for line, name in _spellings(path.read_text(encoding="utf-8"), RUN_DIR_NAMES):
            if (rel, name) not in ALLOWED:
                offenders.append(f"{rel}:{line}: {name!r}")
    assert not offenders, "spell these through RunDir (qnpu_jax/pipeline/run_dir.py):\n" + (
        "\n".join(offenders)
    )
