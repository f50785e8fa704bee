"""A picture of one decoder layer of an ONNX export, drawn from the file (Netron-style boxes).

    python -m qnpu_jax.report.onnx_layer EXPORT_DIR --layer 1 --out docs/images/layer.png

The layer's nodes are those of the float prefill graph (`model.onnx`) that its output depends
on, back to the previous layer's output and the graph-wide tables (RoPE, mask, cache write
index). Each node is a box at its depth in the graph; an edge that carries a tensor of
`model.encodings` is labelled with its bit-width (`u8`, `u16`, ...); nodes on the CPU side
(`onnx_export.node_side`, the shadow path) are drawn red, the rest (the NPU) blue.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.onnx_export import CPU_SIDE, ENCODINGS_FILE, GRAPH_FILES, node_side
from qnpu_jax.files import write_bytes_atomic

# graph-wide values a layer reads but does not own
SHARED = ("attention.mask", "rope.cos", "rope.sin", "cache.write_index", "position_ids")


def layer_nodes(graph: Any, layer: int) -> list[Any]:
    """The nodes of decoder layer `layer`, in graph order: those its output depends on, back
    to the previous layer's output (the embedding rows for layer 0) and SHARED values."""
    producer = {o: n for n in graph.node for o in n.output}
    stop = set(SHARED) | {t.name for t in graph.initializer} | {i.name for i in graph.input}
    previous = f"model.layers.{layer - 1}.output"
    stop.add(previous)
    out = f"model.layers.{layer}.output"
    if out not in producer:
        raise QnpuError(f"the graph has no tensor {out} (layers: 0..N-1)")
    keep: dict[int, Any] = {}
    todo = [out]
    while todo:
        name = todo.pop()
        node = producer.get(name)
        if name in stop or node is None or id(node) in keep:
            continue
        keep[id(node)] = node
        todo.extend(node.input)
    return [n for n in graph.node if id(n) in keep]


def _depths(nodes: list[Any]) -> dict[int, int]:
    """Longest path from the layer's inputs to each node (nodes in topological order)."""
    made = {o: n for n in nodes for o in n.output}
    depth: dict[int, int] = {}
    for n in nodes:
        depth[id(n)] = 1 + max((depth[id(made[i])] for i in n.input if i in made), default=-1)
    return depth


def draw_layer(
    directory: Path, layer: int, out: Path, encodings: Mapping[str, Any] | None = None
) -> dict[str, int]:
    """Draw layer `layer` of the export at `directory` to PNG `out`; returns the node count
    per side."""
    import matplotlib

    matplotlib.use("Agg")

    import matplotlib.pyplot as plt
    import onnx

    graph_path = Path(directory) / GRAPH_FILES[("float", "prefill")]
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    if encodings is None and (Path(directory) / ENCODINGS_FILE).is_file():
        encodings = json.loads((Path(directory) / ENCODINGS_FILE).read_text())
    bits: dict[str, int] = {}
    for e in (encodings or {}).get("activation_encodings", []):
        bits[e["name"]] = int(e["bw"])
    nodes = layer_nodes(graph, layer)
    depth = _depths(nodes)
    rows: dict[int, list[Any]] = {}
    for n in nodes:
        rows.setdefault(depth[id(n)], []).append(n)
    where: dict[int, tuple[float, float]] = {}
    for d, row in rows.items():
        for k, n in enumerate(row):
            where[id(n)] = ((k - (len(row) - 1) / 2) * 1.6, -d)
    made = {o: n for n in nodes for o in n.output}
    width = max(len(r) for r in rows.values())
    fig, ax = plt.subplots(figsize=(max(6.0, 1.7 * width), 0.55 * len(rows) + 1))
    for n in nodes:
        x1, y1 = where[id(n)]
        for i in n.input:
            if i not in made:
                continue
            x0, y0 = where[id(made[i])]
            ax.annotate(
                "",
                (x1, y1 + 0.18),
                (x0, y0 - 0.18),
                arrowprops={"arrowstyle": "->", "lw": 0.6, "color": "0.45"},
            )
            if i in bits:
                ax.text((x0 + x1) / 2, (y0 + y1) / 2, f"u{bits[i]}", fontsize=5, color="darkgreen")
    sides = {"npu": 0, "cpu": 0}
    for n in nodes:
        x, y = where[id(n)]
        side = node_side(n)
        sides[side] += 1
        color = "#f4c7c3" if side == CPU_SIDE else "#cfe2f3"
        label = n.op_type
        if n.output[0].startswith("model."):
            label += "\n" + n.output[0].removeprefix(f"model.layers.{layer}.")[:28]
        ax.text(
            x,
            y,
            label,
            ha="center",
            va="center",
            fontsize=5,
            bbox={"boxstyle": "round,pad=0.25", "fc": color, "ec": "0.3", "lw": 0.5},
        )
    ax.set_xlim(-0.9 * width - 1, 0.9 * width + 1)
    ax.set_ylim(-len(rows) - 0.5, 0.8)
    ax.axis("off")
    ax.set_title(
        f"{graph_path.name}, layer {layer}: blue NPU, red CPU (shadow path); uN: the tensor's "
        "encoding",
        fontsize=7,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=160, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(Path(out), buf.getvalue())
    return sides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export", type=Path, help="an ONNX export (qnpu export --format onnx)")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        sides = draw_layer(args.export, args.layer, args.out)
    except QnpuError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: {sides['npu']} NPU nodes, {sides['cpu']} CPU nodes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
