"""AIMET's QuantSim against the export's QDQ graph, quantizer by quantizer, on the same inputs.

    qnpu study aimet_gap --onnx exports/smollm2-135m-quantnpu-w4a8 --windows 2 --seq-len 512 \
        --json reports/aimet_gap.json

AIMET's QuantizationSimModel over `model.onnx` with `model.encodings` loaded (`aimet_quantsim`)
and onnxruntime over `model_qdq.onnx` run every prefill chunk on the same feeds: the
fake-quant embedding rows, and the QDQ graph's caches (so each chunk starts from the same
state; within a chunk each runs on from its own tensors). Per quantized tensor, AIMET's
quantizer output against the QDQ graph's DequantizeLinear output, in codes of the tensor's
scale: the share of codes that differ, the mean signed difference AIMET − QDQ, the largest;
weights once, activations over every chunk. The first tensor in graph order whose codes
differ is where the two part. Each scores the windows on its own too (NLL, paired per window).

AIMET's extra outputs are added to its sim's graph (`QuantizationSimModel._rebuild_session`,
aimet-onnx 2.42's way of rebuilding after an edit).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.export.artifact import read_artifact
from qnpu_jax.export.onnx_export import DATA_FILES, GRAPH_FILES
from qnpu_jax.runtime.onnx_run import OnnxModel, _session, aimet_quantsim, encoding_entries
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import add_eval_args, say, write_study_json
from qnpu_jax.studies.simulation_gap import paired_gap


class _Stats:
    """Running code differences of one tensor."""

    def __init__(self) -> None:
        self.differ = 0
        self.count = 0
        self.signed = 0.0
        self.max_abs = 0.0
        self.same_input = 0  # codes whose value before quantizing is equal on both sides
        self.same_input_differ = 0
        self.explained = 0  # of those, the codes `aimet_rounding` gives exactly

    def add(self, diff: np.ndarray) -> None:
        d = np.asarray(diff, np.float64).reshape(-1)
        self.differ += int(np.count_nonzero(np.abs(d) > 0.5))
        self.count += d.size
        self.signed += float(np.rint(d).sum())
        self.max_abs = max(self.max_abs, float(np.abs(d).max(initial=0.0)))

    def explain(self, same: np.ndarray, differ: np.ndarray, predicted_ok: np.ndarray) -> None:
        self.same_input += int(same.sum())
        self.same_input_differ += int((same & differ).sum())
        self.explained += int((same & differ & predicted_ok).sum())

    def row(self) -> dict[str, Any]:
        row = {
            "differ_share": self.differ / max(self.count, 1),
            "mean_signed_codes": self.signed / max(self.count, 1),
            "max_abs_codes": self.max_abs,
            "codes": self.count,
        }
        if self.same_input:
            row |= {
                "same_input_differ_share": self.same_input_differ / self.same_input,
                "same_input_differ_explained": self.explained / max(self.same_input_differ, 1),
            }
        return row


def aimet_rounding(x: np.ndarray, scale: float, offset: int, bits: int) -> np.ndarray:
    """The codes (signed domain: u + offset) AIMET's QuantSim gives x (aimet-onnx 2.42 on the
    CPU, as measured here): x/s in float32, minus its offset (−2^(bits-1) on a signed grid)
    in float32, rounded half up, clamped to [0, 2^bits − 1]. At 16 bits the float32 value of
    the unsigned code keeps 8 fractional bits, so codes within 2^-9 of a half round to
    either side."""
    u = (x.astype(np.float32) / np.float32(scale)).astype(np.float32) - np.float32(offset)
    codes = np.floor(u.astype(np.float32) + np.float32(0.5))
    return np.clip(codes, 0, (1 << bits) - 1) + offset


def _scales(enc: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """name -> scale (per tensor [1], per channel [C]) of every entry."""
    sections = ("activation_encodings", "param_encodings")
    return {
        n: np.asarray(e[1], np.float64)
        for sec in sections
        for n, e in encoding_entries(enc, sec).items()
    }


class _PairedSession:
    """The QDQ graph's prefill session, which also runs AIMET's sim on each call's feeds and
    records both sides' quantized tensors; returns the QDQ graph's outputs."""

    def __init__(
        self,
        qdq: Any,
        sim: Any,
        names: list[str],
        n_out: int,
        scales: Any,
        pre: Mapping[str, tuple[int, int]],
    ) -> None:
        """`pre`: the activations whose value before quantizing both sides also output (after
        the quantized ones, in this order), with their (offset, bits)."""
        self.qdq, self.sim, self.names, self.n_out, self.scales = qdq, sim, names, n_out, scales
        self.pre = dict(pre)
        self.stats: dict[str, _Stats] = {n: _Stats() for n in names}
        self.first: list[str] = []  # per call: the first tensor whose codes differ

    def run(self, output_names: Any, feeds: dict[str, Any]) -> list[Any]:
        ours = self.qdq.run(None, feeds)
        theirs = self.sim.session.run(None, feeds)
        first = None
        for k, name in enumerate(self.names):
            a, q = theirs[self.n_out + k], ours[self.n_out + k]
            scale = self.scales[name]
            if a.shape != q.shape:  # a weight stored [in, out] in both: same layout
                continue
            diff = (a.astype(np.float64) - q.astype(np.float64)) / (
                scale if scale.size == 1 else scale.reshape([1] * (a.ndim - 1) + [-1])
            )
            self.stats[name].add(diff)
            if first is None and np.any(np.abs(diff) > 0.5):
                first = name
        base = self.n_out + len(self.names)
        for k, (name, (offset, bits)) in enumerate(self.pre.items()):
            x_q, x_a = ours[base + k], theirs[base + k]
            scale = float(self.scales[name][0])
            a_codes = np.rint(theirs[self.n_out + self.names.index(name)] / scale)
            q_codes = np.rint(ours[self.n_out + self.names.index(name)] / scale)
            predicted = aimet_rounding(x_q, scale, offset, bits)
            self.stats[name].explain(x_q == x_a, a_codes != q_codes, predicted == a_codes)
        self.first.append(first or "")
        return list(ours[: self.n_out])


def _qdq_session(
    out_dir: Path, names: list[str], pre: list[str]
) -> tuple[Any, list[str], list[str]]:
    """onnxruntime over model_qdq.onnx with each of `names`' dequantized value as an extra
    output (activations `{name}_dequantized`, weights the DequantizeLinear named `name`), and
    the names it found, in graph order."""
    import onnx


    art = read_artifact(out_dir)
    model = onnx.load_from_string(art.files[GRAPH_FILES[("qdq", "prefill")]])
    position = {o: k for k, n in enumerate(model.graph.node) for o in n.output}
    found = {}
    for name in names:
        tap = f"{name}_dequantized" if f"{name}_dequantized" in position else name
        if tap in position:
            found[name] = tap
    kept = sorted(found, key=lambda n: position[found[n]])  # graph order
    for name in kept:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(found[name]))
    pre_kept = [n for n in pre if n in kept and n in position]  # made by a node: tappable
    for name in pre_kept:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    data = art.files[DATA_FILES["qdq"]]
    return _session(model.SerializeToString(), DATA_FILES["qdq"], data, "basic"), kept, pre_kept


def aimet_gap(export: Path, windows: np.ndarray, tensor_windows: int) -> dict[str, Any]:
    """The study on token `windows` [N, T]: per-tensor code differences over the first
    `tensor_windows` windows, each side's NLL over all of them (module docstring)."""
    import onnx


    sim, loaded = aimet_quantsim(export)
    enc = json.loads((export / "model.encodings").read_text())
    scales = _scales(enc)
    params = {e["name"] for e in enc["param_encodings"]}
    graph = sim.sim.model.model.graph
    n_out = len(graph.output)
    produced = {o for node in graph.node for o in node.output}
    taps = {}
    for n, q in sim.sim.qc_quantize_op_dict.items():
        tap = f"{n}_updated" if f"{n}_updated" in produced else f"{n}_qdq"
        if q.enabled and n in scales and tap in produced:
            taps[n] = tap
    grids = {
        e["name"]: (int(e["offset"][0]), int(e["bw"]))
        for e in enc["activation_encodings"]
        if e.get("enc_type") == "PER_TENSOR"
    }
    pre_wanted = [n for n in taps if n in grids and n in produced]
    qdq, kept, pre = _qdq_session(export, list(taps), pre_wanted)
    for n in kept:
        graph.output.append(onnx.helper.make_empty_tensor_value_info(taps[n]))
    for n in pre:
        graph.output.append(onnx.helper.make_empty_tensor_value_info(n))
    sim.sim._rebuild_session()
    paired = _PairedSession(qdq, sim.sim, kept, n_out, scales, {n: grids[n] for n in pre})
    say(f"{len(kept)} quantizers compared on {tensor_windows} windows of {windows.shape[1]}")
    OnnxModel(export, qdq=True, sessions={"prefill": paired}).token_nll(windows[:tensor_windows])
    say(f"each on its own, {len(windows)} windows: the QDQ graph, then AIMET's QuantSim")
    nll_qdq = OnnxModel(export, qdq=True).token_nll(windows)
    nll_aimet = OnnxModel(export, qdq=True, sessions={"prefill": sim}).token_nll(windows)
    rows = {n: {"order": k, **paired.stats[n].row()} for k, n in enumerate(kept)}
    weights = [n for n in kept if n in params]
    first = next((n for n in kept if n not in weights and rows[n]["differ_share"] > 0), None)
    return {
        "export": str(export),
        "aimet_loaded": loaded,
        "windows": len(windows),
        "tensor_windows": tensor_windows,
        "seq_len": int(windows.shape[1]),
        "weights_differing": [n for n in weights if rows[n]["differ_share"] > 0],
        "first_differing_activation": first,
        "first_differing_per_chunk": paired.first,
        "tensors": rows,
        # AIMET over the QDQ graph, with its paired interval over the windows
        "aimet_vs_qdq": paired_gap(
            [float(v) for v in nll_qdq.mean(axis=1)], [float(v) for v in nll_aimet.mean(axis=1)]
        ),
        "ppl": {"qdq": float(np.exp(nll_qdq.mean())), "aimet": float(np.exp(nll_aimet.mean()))},
    }


def main(argv: list[str] | None = None) -> int:

    parser = study_parser(__name__, __doc__, json=True)
    parser.add_argument("--onnx", type=Path, required=True, help="an ONNX export directory")
    add_eval_args(parser, windows=2)
    parser.add_argument(
        "--tensor-windows", type=int, default=2, help="of those, compared tensor by tensor"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    say(f"AIMET QuantSim over {args.onnx}/model.onnx with its encodings")
    tokenizer = OnnxModel(args.onnx, qdq=True).tokenizer()
    ids = tokenize_documents(load_documents("wiki", "eval"), tokenizer)
    windows = np.asarray(eval_windows(ids, args.seq_len, args.windows))
    report = aimet_gap(args.onnx, windows, min(args.tensor_windows, len(windows)))
    write_study_json(
        args.json, report, command="qnpu study aimet_gap " + " ".join(argv or []), started=started
    )
    rows = report["tensors"]
    worst = sorted(rows, key=lambda n: -rows[n]["differ_share"])[:3]
    say(
        f"weights differing: {len(report['weights_differing'])}; first differing activation: "
        f"{report['first_differing_activation']}; most differing: {worst}"
    )
    gap = report["aimet_vs_qdq"]
    lo, hi = gap["gap_2se_interval"]
    print(
        f"perplexity QDQ {report['ppl']['qdq']:.3f}, AIMET {report['ppl']['aimet']:.3f}: "
        f"{gap['gap']:+.2%} (paired 2-se interval {lo:+.2%} .. {hi:+.2%})"
    )
    print(f"-> {args.json}")
    return 0
