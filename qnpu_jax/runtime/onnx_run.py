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
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError, some_of
from qnpu_jax.export.artifact import read_artifact
from qnpu_jax.export.int_model import stored_tokenizer
from qnpu_jax.export.onnx_export import (
    DATA_FILES,
    EMBED_FILES,
    ENCODINGS_FILE,
    FLOAT_WEIGHTS,
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
        if level not in LEVELS:
            raise QnpuError(f"unknown graph optimization level {level!r}; known: {LEVELS}")
        self.path = Path(directory)
        art = _read_export(self.path)
        info = art.manifest.get("onnx")
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise QnpuError(
                f"{self.path} is not an ONNX export (`qnpu export --format onnx`): its manifest "
                "has no 'onnx' section"
            )
        self.info = info
        self.qdq = qdq
        # exports before the key had it "transformed" or no GPTQ codes to tell apart
        self.float_weights = str(info.get("float_weights", "transformed"))
        if self.float_weights not in FLOAT_WEIGHTS:
            raise QnpuError(
                f"{self.path}: unknown float_weights {self.float_weights!r} in the manifest; "
                f"known: {', '.join(FLOAT_WEIGHTS)}"
            )
        self.chunk = int(info["chunk"])
        self.max_context = int(info["max_context"])
        self.prefix = tuple(int(t) for t in info["prefix_tokens"])
        self.manifest = art.manifest
        self.files = {k: v for k, v in art.files.items() if k == "tokenizer.json"}
        graph_file = GRAPH_FILES[("float", "prefill")]
        if ENCODINGS_FILE in art.files:
            check_encodings(self.path, art.files[ENCODINGS_FILE], _file(art, graph_file))
            qdq_graph = _file(art, GRAPH_FILES[("qdq", "prefill")])
            check_encodings_match_qdq(art.files[ENCODINGS_FILE], qdq_graph)
        kv = _npy(art.files[PREFIX_FILE])
        self.prefix_kv = kv[1 if qdq else 0]  # [2 (K, V), L, Hkv, P, hd]
        self.input_name = str(info["input"])
        if qdq:  # the fake-quant rows: codes · per-row scale
            codes = _npy(art.files[EMBED_FILES["codes"]]).astype(np.float32)
            self.table = codes * _npy(art.files[EMBED_FILES["scale"]])[:, None]
            if ENCODINGS_FILE in art.files:
                self.table = _on_input_grid(self.table, art.files[ENCODINGS_FILE], self.input_name)
        else:
            self.table = _npy(art.files[EMBED_FILES["float"]])
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

        return stored_tokenizer(self.files, self.manifest.get("tokenizer", {}), self.path)


def _on_input_grid(rows: np.ndarray, encodings: bytes, name: str) -> np.ndarray:
    """The embedding rows on the grid of graph input `name`, rounded half to even as the QDQ
    graph's QuantizeLinear and the fake-quant model round: the host quantizes the graph's
    input, as a device's host does (it feeds codes). Both the QDQ graph and a QuantSim then
    see values on the grid, whatever their rule for halves (AIMET rounds them up)."""

    entries = encoding_entries(json.loads(encodings), "activation_encodings")
    if name not in entries:
        return rows
    bits, scales, offsets = entries[name]
    s, o = np.float32(scales[0]), np.float32((offsets or [0])[0])
    codes = np.clip(np.rint(rows / s) - o, 0, (1 << bits) - 1)
    return ((codes + o) * s).astype(np.float32)


def _read_export(path: Path) -> Any:
    """The verified export at `path`. When its encodings file fails verification (edited by
    hand), the refusal also names the entry that disagrees with the QDQ graph, if one does."""

    try:
        return read_artifact(path)
    except QnpuError as e:
        if ENCODINGS_FILE not in str(e):
            raise
        try:  # unverified bytes, read only to say which entry changed
            check_encodings_match_qdq(
                (path / ENCODINGS_FILE).read_bytes(),
                _inlined_from_disk(path / GRAPH_FILES[("qdq", "prefill")]),
            )
        except QnpuError as entry:
            raise QnpuError(f"{e}; {entry}") from e
        except Exception:  # the file is beyond naming an entry: the verification's refusal
            raise e from None
        raise


def _inlined_from_disk(graph_path: Path) -> bytes:
    import onnx

    return bytes(onnx.load(str(graph_path), load_external_data=False).SerializeToString())


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


def encoding_entries(
    enc: Mapping[str, Any], section: str
) -> dict[str, tuple[int, list[float], Any]]:
    """name -> (bit-width, scales, offsets) of one section of an AIMET encodings object."""
    entries = enc[section]
    if isinstance(entries, list):  # 1.0.0
        return {
            e["name"]: (int(e.get("compressed_bw", e["bw"])), list(e["scale"]), e.get("offset"))
            for e in entries
        }
    return {  # 0.6.1: one entry per channel
        name: (int(e[0]["bitwidth"]), [c["scale"] for c in e], [c["offset"] for c in e])
        for name, e in entries.items()
    }


def check_encodings_match_qdq(data: bytes, qdq_graph: bytes) -> None:
    """The export's AIMET encodings say what its QDQ graph executes: each activation entry
    has the bit-width, scale and offset of the tensor's QuantizeLinear, each weight entry the
    bit-width and scales of its DequantizeLinear, each cache output (present_*) its cache
    input's entry. QnpuError naming the first entry that differs (an edited file)."""

    import onnx
    from onnx import helper, numpy_helper

    try:
        enc = json.loads(data)
        acts = encoding_entries(enc, "activation_encodings")
        params = encoding_entries(enc, "param_encodings")
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise QnpuError(f"{ENCODINGS_FILE}: not AIMET encodings ({e})") from e
    graph = onnx.load_from_string(qdq_graph).graph
    inits = {t.name: t for t in graph.initializer}

    def grid(node: Any) -> tuple[int, np.ndarray, np.ndarray]:
        zp = inits[node.input[2]]
        bits = int(np.dtype(helper.tensor_dtype_to_np_dtype(zp.data_type)).itemsize * 8)
        if zp.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
            bits = 4
        scale = numpy_helper.to_array(inits[node.input[1]]).reshape(-1)
        return bits, scale, numpy_helper.to_array(zp).reshape(-1).astype(np.int64)

    def refuse(name: str, what: str) -> QnpuError:
        return QnpuError(
            f"{ENCODINGS_FILE}: entry {name} {what}: the encodings were edited or belong to "
            "another export (re-export, or fix the entry)"
        )

    quantize = {n.input[0]: n for n in graph.node if n.op_type == "QuantizeLinear"}
    for name, (bits, scales, offsets) in acts.items():
        node = quantize.get(name)
        if node is None:
            continue  # a cache output: checked against its input below
        want_bits, want_scale, zp = grid(node)
        if bits != want_bits:
            raise refuse(name, f"says {bits} bits, the QDQ graph quantizes it at {want_bits}")
        if not np.allclose(np.asarray(scales, np.float32), want_scale, rtol=1e-6, atol=0):
            raise refuse(name, f"has scale {scales[0]!r}, the QDQ graph {float(want_scale[0])!r}")
        if offsets is not None and [int(o) for o in offsets] != [-int(z) for z in zp]:
            raise refuse(name, f"has offset {offsets[0]}, the QDQ graph {-int(zp[0])}")
    for name, entry in acts.items():
        if name.startswith("present_"):
            past = "past_" + name.removeprefix("present_")
            if acts.get(past) != entry:
                raise refuse(name, f"differs from {past}'s, the cache it writes")
    for name, (bits, scales, _) in params.items():
        codes = inits.get(f"{name}_quantized")
        if codes is None:
            continue
        want_bits = 4 if codes.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) else 8
        if codes.data_type in (onnx.TensorProto.INT16, onnx.TensorProto.UINT16):
            want_bits = 16
        if bits != want_bits:
            raise refuse(name, f"says {bits} bits, the QDQ graph's codes are {want_bits}-bit")
        stored = inits.get(f"{name}_scale")
        ours = None  # (large scales are in model_qdq.data: not checked here)
        if stored is not None and stored.data_location != onnx.TensorProto.EXTERNAL:
            ours = numpy_helper.to_array(stored)
        if (
            ours is not None
            and ours.ndim == 1
            and ours.size == len(scales)
            and not np.allclose(np.asarray(scales, np.float32), ours, rtol=1e-6, atol=0)
        ):
            raise refuse(name, "has other scales than the QDQ graph's")


def encoding_bits(enc: Mapping[str, Any]) -> dict[str, int]:
    """name -> bit-width of every entry of an AIMET encodings object (1.0.0 lists of named
    entries, or 0.6.1 name -> [entry]); an LPBQ entry's is its codes' (`compressed_bw`), which
    AIMET's quantizer holds, not the decompressed `bw`."""
    sections = ("activation_encodings", "param_encodings")
    return {n: e[0] for sec in sections for n, e in encoding_entries(enc, sec).items()}


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
