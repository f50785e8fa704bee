"""Studies: the measurements behind docs/results.md, each a module with `main(argv)` that
writes a JSON report recording its command (`qnpu study NAME ARGS`) and environment. Run as
`qnpu study NAME [ARGS]`; `qnpu study` lists them with the first line of their docstring.

Modules are imported only when run: listing them reads their docstrings from source.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
from collections.abc import Sequence
from pathlib import Path

from qnpu_jax.argtypes import HelpFormatter
from qnpu_jax.errors import QnpuError

STUDIES = (
    "ablate_16bit",
    "aimet_gap",
    "compare_methods",
    "error_budget",
    "gptq_study",
    "init_study",
    "kernel_accuracy",
    "mixed_precision_sweep",
    "op_gap",
    "outliers",
    "plot_activations",
    "quant_baselines",
    "restage2",
    "scale_drift",
    "sharding",
    "simulation_gap",
    "smooth_study",
    "table_cost",
    "weight_granularity",
)


def _module(name: str) -> str:
    if name not in STUDIES:
        raise QnpuError(f"unknown study {name!r}; known: {', '.join(STUDIES)}")
    return f"{__name__}.{name}"


def describe(name: str) -> str:
    """The first line of study `name`'s docstring, read without importing it."""
    spec = importlib.util.find_spec(_module(name))
    if spec is None or spec.origin is None:
        raise QnpuError(f"study {name!r} is not installed")
    with open(spec.origin, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    return doc.splitlines()[0] if doc else ""


def run_study(name: str, argv: Sequence[str]) -> int:
    """Run study `name` with its command-line arguments `argv`; its exit status."""
    module = importlib.import_module(_module(name))
    return int(module.main(list(argv)))


def study_parser(
    module: str,
    doc: str | None,
    *,
    run: bool = False,
    eval_windows: int | None = None,
    json: bool = False,
    md: bool = False,
) -> argparse.ArgumentParser:
    """The argument parser of a study module (`__name__`, `__doc__`): `qnpu study NAME`, with
    the options studies share: `--run RUN` (a finished run directory, required),
    `--eval-windows N` (default `eval_windows`), `--json` (default reports/NAME.json) and `--md`
    (default reports/NAME.md)."""
    name = module.rsplit(".", 1)[-1]
    parser = argparse.ArgumentParser(
        prog=f"qnpu study {name}",
        description=(doc or "").split("\n")[0],
        formatter_class=HelpFormatter,
    )
    if run:
        parser.add_argument("--run", type=Path, required=True, help="a finished run directory")
    if eval_windows is not None:
        parser.add_argument(
            "--eval-windows", type=int, default=eval_windows, help="wiki eval windows"
        )
    if json:
        parser.add_argument("--json", default=f"reports/{name}.json", help="the JSON report")
    if md:
        parser.add_argument("--md", default=f"reports/{name}.md", help="the markdown report")
    return parser
