"""Count the package's import structure: cycles, imports against the layer order, imports
inside functions, long functions and lines per layer.

    python scripts/import_census.py [--root DIR] [--json FILE]

The layer order is read from pyproject.toml's import-linter contract when it has one
(`[[tool.importlinter.contracts]]` of type `layers`); otherwise every top-level subpackage
is its own unordered layer and only cycles are counted. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

# optional heavy packages that may be imported inside the function that needs them
OPTIONAL = ("onnx", "onnxruntime", "aimet_onnx", "aimet_common", "matplotlib", "datasets", "torch")
LONG_FUNCTION = 80


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(root: Path, package: str) -> dict:
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        modules[module_name(root, path)] = path
    edges: dict[str, set[str]] = defaultdict(set)  # module-level (import time) edges
    late: dict[str, set[str]] = defaultdict(set)  # edges of imports inside functions
    inner = []  # imports inside functions
    long_functions = []
    lines: dict[str, int] = {}
    for name, path in modules.items():
        source = path.read_text()
        lines[name] = len(source.splitlines())
        tree = ast.parse(source)
        is_package = path.name == "__init__.py"
        parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > LONG_FUNCTION:
                    long_functions.append((f"{name}.{node.name}", length))
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            targets = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [resolve(name, is_package, node)]
            )
            if isinstance(node, ast.ImportFrom):  # `from pkg import module`
                base = targets[0]
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            in_function, guarded = False, False
            p = parents.get(node)
            while p is not None:
                if isinstance(p, ast.FunctionDef | ast.AsyncFunctionDef):
                    in_function = True
                if isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test):
                    guarded = True
                p = parents.get(p)
            if in_function:
                inner.append((name, targets[0], node.lineno))
            for target in targets:
                if target.split(".")[0] != package or guarded:
                    continue
                (late if in_function else edges)[name].add(target)
    return {
        "modules": modules,
        "edges": edges,
        "late": late,
        "inner": inner,
        "long": long_functions,
        "lines": lines,
    }


def cycles(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def layers_of(root: Path) -> tuple[list[list[str]], str] | None:
    pyproject = root / "pyproject.toml"
    if not pyproject.exists():
        return None
    data = tomllib.loads(pyproject.read_text())
    for contract in data.get("tool", {}).get("importlinter", {}).get("contracts", []):
        if contract.get("type") == "layers":
            container = contract.get("containers", [""])[0]
            return [
                [x.strip() for x in layer.replace("|", ":").split(":")]
                for layer in contract["layers"]
            ], container
    return None


def layer_index(module: str, layers: list[list[str]], container: str) -> int | None:
    rel = module[len(container) + 1 :] if module.startswith(container + ".") else None
    if rel is None:
        return None
    for i, group in enumerate(layers):
        for item in group:
            if rel == item or rel.startswith(item + "."):
                return len(layers) - i  # import-linter lists the top layer first
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--package", default="qnpu_jax")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    found = scan(args.root, args.package)
    nodes = list(found["modules"])
    every = {m: found["edges"].get(m, set()) | found["late"].get(m, set()) for m in nodes}
    cyc = cycles(nodes, every)  # counting the imports inside functions too
    upward = []
    layer_lines: dict[str, int] = defaultdict(int)
    spec = layers_of(args.root)
    if spec:
        layers, container = spec
        for src, targets in every.items():
            for target in targets:
                a, b = layer_index(src, layers, container), layer_index(target, layers, container)
                if a is not None and b is not None and b > a:
                    upward.append((src, target))
        for name, n in found["lines"].items():
            i = layer_index(name, layers, container)
            layer_lines[" | ".join(layers[len(layers) - i]) if i else "(package root)"] += n
    else:
        for name, n in found["lines"].items():
            parts = name.split(".")
            layer_lines[parts[1] if len(parts) > 2 else "(top-level modules)"] += n
    inner = found["inner"]
    optional = [i for i in inner if i[1].split(".")[0] in OPTIONAL]
    report = {
        "modules": len(nodes),
        "lines": sum(found["lines"].values()),
        "cycles": cyc,
        "upward_imports": sorted(upward),
        "in_function_imports": len(inner),
        "in_function_imports_optional": len(optional),
        "in_function_imports_other": sorted(
            f"{m}:{line} {t}" for m, t, line in inner if t.split(".")[0] not in OPTIONAL
        ),
        "functions_over_80_lines": sorted(found["long"], key=lambda x: -x[1]),
        "lines_per_layer": dict(layer_lines),
    }
    print(f"modules {report['modules']}, lines {report['lines']}")
    print(f"cycles (imports inside functions included) {len(cyc)}: {cyc}")
    print(
        f"upward imports {len(upward)}"
        + (": " + ", ".join(f"{a} -> {b}" for a, b in upward) if upward else "")
    )
    print(
        f"in-function imports {len(inner)} ({len(optional)} of optional packages: "
        f"{', '.join(OPTIONAL)})"
    )
    print(f"functions over {LONG_FUNCTION} lines: {len(found['long'])}")
    print("lines per layer:")
    for k, v in report["lines_per_layer"].items():
        print(f"  {k}: {v}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
