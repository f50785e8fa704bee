"""Run an ONNX export (`qnpu export --format onnx`) with onnxruntime on the CPU.

`OnnxModel(directory, qdq=...)` reads the export's files once and verifies those bytes
(manifest digest and every file's hash), then builds the onnxruntime sessions from the same
bytes, never reopening a file by path (a re-export landing in between cannot mix in), at graph
optimization level BASIC (level ALL fuses
QuantizeLinear/DequantizeLinear pairs into integer kernels whose int8 products saturate on
CPUs without VNNI, so their results are not the reference) and feeds them as a device would:
the sink prefix's K/V as the caches' initial contents, the tokens in chunks of C (the last one
padded), or one token at a time through the decode graph.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError, some_of
from qnpu_jax.export.onnx_export import (
    DATA_FILES,
    EMBED_FILES,
    ENCODINGS_FILE,
    FORMAT,
    GRAPH_FILES,
    PREFIX_FILE,
    graph_tensor_names,
)

LEVELS = ("basic", "extended", "all")


class OnnxModel:
    """An ONNX export opened in onnxruntime: logits and next-token NLL of token sequences."""

    def __init__(
        self,
        directory: Path | str,
        *,
        qdq: bool = False,
        level: str = "basic",
        sessions: dict[str, Any] | None = None,
    ) -> None:
        """`qdq`: the QDQ graphs, fed the fake-quant embedding rows and prefix K/V (else the
        float graphs and float inputs). `sessions` ({"prefill": ..., "decode": ...}, either
        optional) replaces the onnxruntime sessions by others with the same inputs and
        outputs in the same order, e.g. AIMET QuantSim's over model.onnx (with `qdq=True`:
        its quantizers take the fake-quant inputs)."""
        from qnpu_jax.export.artifact import read_artifact

        if level not in LEVELS:
            raise QnpuError(f"unknown graph optimization level {level!r}; known: {LEVELS}")
        self.path = Path(directory)
        art = read_artifact(self.path)
        info = art.manifest.get("onnx")
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise QnpuError(
                f"{self.path} is not an ONNX export (`qnpu export --format onnx`): its manifest "
                "has no 'onnx' section"
            )
        self.info = info
        self.qdq = qdq
        self.chunk = int(info["chunk"])
        self.max_context = int(info["max_context"])
        self.prefix = tuple(int(t) for t in info["prefix_tokens"])
        self.manifest = art.manifest
        self.files = {k: v for k, v in art.files.items() if k == "tokenizer.json"}
        graph_file = GRAPH_FILES[("float", "prefill")]
        if ENCODINGS_FILE in art.files:  # absent when the plan has no AIMET form
            check_encodings(self.path, art.files[ENCODINGS_FILE], _file(art, graph_file))
        kv = _npy(art.files[PREFIX_FILE])
        self.prefix_kv = kv[1 if qdq else 0]  # [2 (K, V), L, Hkv, P, hd]
        if qdq:  # the fake-quant rows: codes · per-row scale
            codes = _npy(art.files[EMBED_FILES["codes"]]).astype(np.float32)
            self.table = codes * _npy(art.files[EMBED_FILES["scale"]])[:, None]
        else:
            self.table = _npy(art.files[EMBED_FILES["float"]])
        self.input_name = str(info["input"])
        kind = "qdq" if qdq else "float"
        data_file = DATA_FILES[kind]
        data = _file(art, data_file)
        self.sessions = sessions or {
            role: _session(_file(art, GRAPH_FILES[(kind, role)]), data_file, data, level)
            for role in ("prefill", "decode")
        }
        self.num_layers = int(info["num_layers"])

    def new_cache(self) -> list[np.ndarray]:
        """The caches with the sink prefix's K/V at positions 0..P-1: [K0, V0, K1, V1, ...]."""
        _, n, hkv, p, hd = self.prefix_kv.shape
        caches = []
        for i in range(n):
            for j in range(2):
                c = np.zeros((1, hkv, self.max_context, hd), np.float32)
                c[0, :, :p] = self.prefix_kv[j, i]
                caches.append(c)
        return caches

    def _step(
        self, role: str, tokens: np.ndarray, start: int, caches: list[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        size = tokens.shape[0]
        if start + size > self.max_context:
            raise QnpuError(
                f"positions {start}..{start + size - 1} exceed the export's context of "
                f"{self.max_context} (max_context)"
            )
        feeds: dict[str, Any] = {
            self.input_name: self.table[tokens].reshape(1, size, -1).astype(np.float32),
            "position_ids": np.arange(start, start + size, dtype=np.int64).reshape(1, size),
        }
        for i in range(self.num_layers):
            feeds[f"past_key.{i}"] = caches[2 * i]
            feeds[f"past_value.{i}"] = caches[2 * i + 1]
        if role not in self.sessions:
            raise QnpuError(f"no {role} session: pass one, or score with the other graph")
        out = self.sessions[role].run(None, feeds)
        return out[0][0], list(out[1:])

    def logits(
        self, tokens: Sequence[int] | np.ndarray, *, prefill: int | None = None
    ) -> np.ndarray:
        """Logits [T, V] of `tokens` after the sink prefix: the first `prefill` tokens (default
        all) through the prefill graph in chunks (the last padded), the rest one at a time
        through the decode graph."""
        ids = np.asarray(tokens, np.int64).reshape(-1)
        t = ids.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= self.table.shape[0]):
            raise QnpuError(f"token ids must be in [0, {self.table.shape[0]}), the vocabulary")
        prefill = t if prefill is None else prefill
        p, c = len(self.prefix), self.chunk
        if max(p + t, p + prefill + (-prefill % c)) > self.max_context:
            raise QnpuError(
                f"{t} tokens after a {p}-token prefix (last chunk padded to {c}) exceed the "
                f"export's context of {self.max_context}"
            )
        caches = self.new_cache()
        rows = []
        for s in range(0, prefill, c):
            chunk = ids[s : min(s + c, prefill)]
            padded = np.concatenate([chunk, np.zeros(c - chunk.shape[0], np.int64)])
            logits, caches = self._step("prefill", padded, p + s, caches)
            rows.append(logits[: chunk.shape[0]])
        for s in range(prefill, t):
            logits, caches = self._step("decode", ids[s : s + 1], p + s, caches)
            rows.append(logits)
        return np.concatenate(rows).astype(np.float32)

    def token_nll_argmax(self, windows: Any) -> tuple[np.ndarray, np.ndarray]:
        """Next-token NLL [N, T-1] (float64) of token windows [N, T] and the greedy prediction
        at each of those positions."""
        nll, top = [], []
        for w in np.asarray(windows):
            logits = self.logits(w).astype(np.float64)[:-1]
            peak = logits.max(axis=-1, keepdims=True)
            logz = np.log(np.exp(logits - peak).sum(axis=-1)) + peak[:, 0]
            nll.append(logz - logits[np.arange(len(w) - 1), w[1:]])
            top.append(logits.argmax(axis=-1))
        return np.stack(nll), np.stack(top)

    def token_nll(self, windows: Any) -> np.ndarray:
        """Next-token NLL [N, T-1] of token windows [N, T] (float64)."""
        return self.token_nll_argmax(windows)[0]

    def tokenizer(self) -> Any:
        """The tokenizer the export stores."""
        from qnpu_jax.export.int_model import stored_tokenizer

        return stored_tokenizer(self.files, self.manifest.get("tokenizer", {}), self.path)


def _file(art: Any, name: str) -> bytes:
    if name not in art.files:
        raise QnpuError(f"{art.path}: the manifest does not list {name}, which the export needs")
    return bytes(art.files[name])


def _session(graph: bytes, data_file: str, data: bytes, level: str) -> Any:
    """An onnxruntime CPU session over a graph's verified bytes, its external data (in
    `data_file`) supplied from the verified `data`: nothing is read from disk."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[level]
    if hasattr(options, "add_external_initializers_from_files_in_memory"):
        options.add_external_initializers_from_files_in_memory([data_file], [data], [len(data)])
    else:  # an onnxruntime without it: the initializers put inline (graphs under 2 GiB)
        graph = _inlined(graph, data_file, data)
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


def _inlined(graph: bytes, data_file: str, data: bytes) -> bytes:
    """`graph` with every initializer stored in `data_file` copied in from `data`."""
    import onnx

    model = onnx.load_from_string(graph)
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in t.external_data}
        if info.get("location") != data_file:
            raise QnpuError(f"initializer {t.name} is stored in {info.get('location')!r}")
        offset = int(info.get("offset", 0))
        t.raw_data = data[offset : offset + int(info["length"])]
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
    return bytes(model.SerializeToString())


def check_encodings(directory: Path, data: bytes, graph: bytes | None = None) -> None:
    """The export's AIMET encodings name only tensors of its float prefill graph (`graph`: its
    verified bytes; None: read from `directory`), each in its section (activations: node
    outputs; parameters: initializers); QnpuError otherwise."""
    import json

    import onnx

    graph_path = directory / GRAPH_FILES[("float", "prefill")]
    model = (
        onnx.load(str(graph_path), load_external_data=False)
        if graph is None
        else onnx.load_from_string(graph)
    )
    acts, inits = graph_tensor_names(model)
    try:
        enc = json.loads(data)
        sections = {"activation_encodings": acts, "param_encodings": inits}
        missing: list[str] = []
        for key, known in sections.items():
            entries = enc[key]
            names = [e["name"] for e in entries] if isinstance(entries, list) else list(entries)
            missing += [n for n in names if n not in known]
    except (ValueError, KeyError, TypeError) as e:
        raise QnpuError(f"{directory / ENCODINGS_FILE}: not AIMET encodings ({e})") from e
    if missing:
        raise QnpuError(
            f"{directory / ENCODINGS_FILE} names tensors that {graph_path.name} lacks "
            f"({some_of(missing)}): "
            "encodings of another graph"
        )


def encoding_bits(enc: Mapping[str, Any]) -> dict[str, int]:
    """name -> bit-width of every entry of an AIMET encodings object (1.0.0 lists of named
    entries, or 0.6.1 name -> [entry]); an LPBQ entry's is its codes' (`compressed_bw`), which
    AIMET's quantizer holds, not the decompressed `bw`."""
    bits: dict[str, int] = {}
    for section in ("activation_encodings", "param_encodings"):
        entries = enc[section]
        if isinstance(entries, list):
            bits |= {e["name"]: int(e.get("compressed_bw", e["bw"])) for e in entries}
        else:
            bits |= {name: int(e[0]["bitwidth"]) for name, e in entries.items()}
    return bits


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


@dataclasses.dataclass(frozen=True)
class SimSession:
    """An AIMET QuantSim's onnxruntime session together with the sim that owns it: the sim's
    quantize ops read quantizer state held by the Python sim object, so running the session
    after the sim is collected crashes the process."""

    sim: Any

    def run(self, output_names: Any, feeds: dict[str, Any]) -> list[Any]:
        return list(self.sim.session.run(output_names, feeds))


def aimet_quantsim(
    directory: Path | str, role: str = "prefill"
) -> tuple[SimSession, dict[str, Any]]:
    """AIMET's QuantSim (aimet-onnx) over one float graph of an export with `model.encodings`
    loaded by AIMET's own loader: (a session running the sim, what was loaded).

    `strict=False`: AIMET's default config puts a quantizer at every op output and input
    (int8 parameters, int16 activations here); the file overwrites those it names
    (`allow_overwrite`) and every other quantizer is disabled (`disable_missing_quantizers`),
    so exactly the plan's tensors are quantized. Raises QnpuError when an entry does not end
    up on an enabled quantizer of its own with the file's bit-width.
    """
    import json
    import logging

    import onnx

    try:
        from aimet_onnx.quantsim import QuantizationSimModel, load_encodings_to_sim
    except ImportError as e:
        raise QnpuError(
            "AIMET's QuantSim needs aimet-onnx (docs/deploy.md: pip install --no-deps "
            "aimet-onnx==2.42.0 and its listed dependencies)"
        ) from e
    path = Path(directory)
    kind = GRAPH_FILES[("float", role)]
    model = onnx.load(str(path / kind))
    sim = QuantizationSimModel(model, param_type="int8", activation_type="int16")
    enc_path = path / ENCODINGS_FILE
    if not enc_path.is_file():
        from qnpu_jax.export.artifact import read_artifact

        why = read_artifact(path).manifest.get("onnx", {}).get("encodings", {}).get("why")
        raise QnpuError(f"{path} has no AIMET encodings for QuantSim to load: {why}")
    # AIMET logs every default quantizer the file overrides or disables (INFO, one line each)
    aimet_log = logging.getLogger("Quant")
    level = aimet_log.level
    aimet_log.setLevel(logging.WARNING)
    try:
        mismatched = load_encodings_to_sim(sim, str(enc_path), strict=False)
    finally:
        aimet_log.setLevel(level)
    wanted = encoding_bits(json.loads(enc_path.read_text()))
    quantizers = sim.qc_quantize_op_dict
    enabled = {n for n, q in quantizers.items() if q.enabled}
    wrong = sorted(
        n for n, bw in wanted.items() if n not in enabled or quantizers[n].bitwidth != bw
    )
    extra = sorted(enabled - set(wanted))
    if wrong or extra:
        raise QnpuError(
            f"AIMET QuantSim on {kind}: entries not on an enabled quantizer of their bit-width "
            f"{wrong[:3]}, quantizers the file does not name {extra[:3]}"
        )
    return SimSession(sim), {
        "graph": kind,
        "quantizers": len(enabled),
        "defaults_overwritten": len(mismatched),
    }
