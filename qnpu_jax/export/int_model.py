"""An artifact read back for execution: the validated integer model every engine runs.

`load_int_model` reads an artifact directory (hashes, dtypes, shapes), checks that its graph is
the one the engines implement (op list, activation tables, fixed-point constants) and returns an
`IntModel`. Numpy only: the emulator imports it and must never pull in JAX.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.artifact import Artifact, read_artifact
from qnpu_jax.ir.graph import (
    CHANNEL_INPUTS,
    FORMAT_GRAPH,
    FORMAT_GRAPH_CHANNELS,
    GRAPH,
    LAYER_INPUT,
    LOGITS_SCALE,
    MUXQ_MAX_EXP,
    MUXQ_TENSORS,
    NORM_FRACTION_BITS,
    NORM_UNIT_BITS,
    RESIDUAL_OUTPUTS,
    ROPE_FRACTION_BITS,
    SHADOW_RANGE,
    WEIGHT_CODE_RANGE,
    Graph,
    OpKind,
    artifact_graph,
    channel_mask,
    expected_tensors,
    layer_widths,
    model_widths,
    op_kind,
)
from qnpu_jax.models.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class IntModel:
    """A validated artifact: model config, graph description and integer tensors."""

    path: Path
    model: dict[str, Any]
    graph: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: dict[str, Any]
    files: dict[str, bytes]
    source: dict[str, Any] = dataclasses.field(default_factory=dict)
    _operands: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False
    )
    _derived: dict[str, Any] = dataclasses.field(  # per-channel tables, built once
        default_factory=dict, repr=False, compare=False
    )

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    def t(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def _channels(self, kind: str, name: str, layer: int) -> np.ndarray:
        lists = self.tensors.get(f"layers.{kind}.{name}.channels")
        return np.zeros(0, np.int64) if lists is None else lists[layer][lists[layer] >= 0]

    def _mask(self, kind: str, name: str) -> np.ndarray | None:
        """bool [L, C]: the `kind` ("shadow", "muxq") channels of `name`, None without any."""
        lists = self.tensors.get(f"layers.{kind}.{name}.channels")
        if lists is None:
            return None
        return channel_mask(lists, layer_widths(model_widths(self.model))[name])

    def shadow_channels(self, name: str, layer: int) -> np.ndarray:
        """The shadow channels of activation `name` in `layer` (empty: none)."""
        return self._channels("shadow", name, layer)

    def shadow_bounds(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """`shadow_bounds(self, name)`, computed once per model."""
        key = f"shadow:{name}"
        if key not in self._derived:
            self._derived[key] = shadow_bounds(self, name)
        return self._derived[key]  # type: ignore[no-any-return]

    def muxq_channels(self, name: str, layer: int) -> np.ndarray:
        """The MUXQ outlier channels of activation `name` in `layer` (empty: none)."""
        return self._channels("muxq", name, layer)

    def muxq_exp(self, name: str) -> int:
        """MUXQ's shift of activation `name` (0: none)."""
        return int(((self.graph.get("muxq") or {}).get(name) or {}).get("exp", 0))

    def muxq_shifts(self, name: str) -> np.ndarray | None:
        """[L, C] int64: `muxq_exp` on the MUXQ channels of `name`, 0 elsewhere (the extra
        right shift of the producer), or None without MUXQ channels."""
        key = f"muxq:{name}"
        if key not in self._derived:
            mask = self._mask("muxq", name)
            self._derived[key] = None if mask is None else mask * np.int64(self.muxq_exp(name))
        return self._derived[key]  # type: ignore[no-any-return]

    def stream_source(self, name: str) -> str:
        """The tensor whose codes a layer op reads as value `name`: the last layer op's output
        for the layer input (the layer before's; layer 0 reads the embedding)."""
        return str(self.graph["ops"]["layer"][-1]["out"]) if name == LAYER_INPUT else name

    def read_exp(self, name: str) -> int:
        """The residual split's exp of value `name` as its readers (adds, norms) see it: the
        MUXQ exp of a residual add's output (of the last one's, for the layer input), else 0."""
        source = self.stream_source(name)
        return self.muxq_exp(source) if source in RESIDUAL_OUTPUTS else 0

    def read_shifts(self, name: str) -> np.ndarray | None:
        """[L, C] int64: the left shift the adds and norms reading value `name` in each layer
        apply to its centered codes (`read_exp` on the residual split's channels; the layer
        input's in layer i are the last output's of layer i − 1, none in layer 0), or None
        where `name` has no split. Built once per model: every add and norm of every decode
        step reads it."""
        key = f"read:{name}"
        if key not in self._derived:
            source = self.stream_source(name)
            shifts = self.muxq_shifts(source) if source in RESIDUAL_OUTPUTS else None
            if shifts is not None and source != name:
                shifts = np.concatenate([np.zeros_like(shifts[:1]), shifts[:-1]])
            self._derived[key] = shifts
        return self._derived[key]  # type: ignore[no-any-return]

    def weight_operand(self, prefix: str, layer: int | None) -> tuple[np.ndarray, float]:
        """`prefix.weight` (of one layer) as float32 integers (exact: |w| < 2^24) and its
        max |w|, converted once per model: a decode step would otherwise convert every weight
        again (≈0.5 GB for SmolLM2-135M, the size of this cache)."""
        name = prefix + ".weight"
        if name not in self._operands:
            w = self.t(name)
            axes = tuple(range(1, w.ndim)) if name.startswith("layers.") else None
            self._operands[name] = (w.astype(np.float32), np.abs(w).max(axis=axes))
        w32, absmax = self._operands[name]
        if layer is None:
            return w32, float(absmax)
        return w32[layer], float(absmax[layer])


def validate_graph(manifest: dict[str, Any], tensors: dict[str, np.ndarray], where: str) -> Graph:
    """The graph is one the engines implement (`artifact_graph`: the model's architecture's)
    and every tensor has its shape/dtype; that graph."""
    graph = manifest.get("graph")
    model = manifest.get("model")
    if not isinstance(graph, dict) or not isinstance(model, dict):
        raise QnpuError(f"{where}: manifest lacks the 'graph' or 'model' section")
    if graph.get("format") not in (FORMAT_GRAPH, FORMAT_GRAPH_CHANNELS):
        raise QnpuError(
            f"{where}: graph format {graph.get('format')!r} is not supported (this version "
            f"runs {FORMAT_GRAPH} and {FORMAT_GRAPH_CHANNELS}); export the run again with this "
            "version"
        )
    lists = any(bool(graph.get(k)) for k in ("shadow", "muxq", "weight_zero_points"))
    if (graph.get("format") == FORMAT_GRAPH_CHANNELS) != lists:
        raise QnpuError(
            f"{where}: graph format {FORMAT_GRAPH_CHANNELS} is the one with shadow or MUXQ "
            "channels or asymmetric weights (graph.shadow, graph.muxq, "
            "graph.weight_zero_points), and only it"
        )
    _check_channel_entries(graph, where)
    ops = graph.get("ops")
    if not isinstance(ops, dict):
        raise QnpuError(f"{where}: graph has no op list")
    for part in ("model", "layer"):
        for op in ops.get(part) or []:
            if not isinstance(op, dict):
                raise QnpuError(f"{where}: unknown op {op!r} in the {part} op list")
            op_kind(op.get("op"), f"{where}: the {part} op list has an unknown op")
    try:
        layer_graph = artifact_graph(model, ops)
    except QnpuError as e:
        raise QnpuError(f"{where}: {e}") from None
    _check_weight_zero_entries(graph, layer_graph, where)
    if list(graph.get("layer_activations", [])) != [t.name for t in layer_graph.layer_acts] or list(
        graph.get("global_activations", [])
    ) != [t.name for t in layer_graph.global_acts]:
        raise QnpuError(f"{where}: activation tables differ from graph {FORMAT_GRAPH}")
    _check_constants(manifest, where)
    try:
        expected = expected_tensors(model, graph, layer_graph)
    except (KeyError, TypeError) as e:
        raise QnpuError(f"{where}: incomplete model config or graph: {e}") from e
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise QnpuError(f"{where}: tensors missing from the artifact: {', '.join(missing)}")
    for name, (shape, dtypes) in expected.items():
        a = tensors[name]
        ok = len(a.shape) == len(shape) and all(
            s is None or s == t for s, t in zip(shape, a.shape, strict=True)
        )
        if not ok:
            raise QnpuError(f"{where}: tensor {name} has shape {a.shape}, expected {shape}")
        if a.dtype.name not in dtypes:
            raise QnpuError(f"{where}: tensor {name} has dtype {a.dtype}, expected {dtypes}")
    _check_channel_lists(model, graph, tensors, where)
    for const in graph.get("weight_zero_points") or []:
        z = tensors[f"{const}.weight_zero_point"]
        if z.size and (int(z.min()) < WEIGHT_CODE_RANGE[0] or int(z.max()) > WEIGHT_CODE_RANGE[1]):
            raise QnpuError(
                f"{where}: {const}.weight_zero_point must lie in {list(WEIGHT_CODE_RANGE)} "
                "(int8 weight codes)"
            )
    acts = [t.name for t in layer_graph.layer_acts]
    for op in layer_graph.ops(OpKind.LUT):
        j = acts.index(op.ins[0])
        span = tensors["layers.act.qmax"][:, j] - tensors["layers.act.qmin"][:, j] + 1
        if (span != tensors[f"{op.const}.lut"].shape[1]).any():
            raise QnpuError(
                f"{where}: {op.const}.lut's length does not match the {op.ins[0]} range"
            )
    return layer_graph


def _check_channel_entries(graph: dict[str, Any], where: str) -> None:
    """graph.shadow {tensor: K} and graph.muxq {tensor: {exp, channels: K}}: known tensors,
    counts and shifts in range, no tensor in both (before the tensors are looked up)."""
    shadow, muxq = graph.get("shadow") or {}, graph.get("muxq") or {}
    if not isinstance(shadow, dict) or not isinstance(muxq, dict):
        raise QnpuError(f"{where}: graph shadow / muxq must map tensors to their channel lists")
    for name, k in shadow.items():
        if name not in CHANNEL_INPUTS or not _is_int(k) or k < 1:
            raise QnpuError(f"{where}: graph shadow {name!r}: {k!r} ({CHANNEL_INPUTS})")
    for name, entry in muxq.items():
        ok = isinstance(entry, dict) and set(entry) == {"exp", "channels"}
        if not ok or name not in MUXQ_TENSORS or name in shadow:
            raise QnpuError(f"{where}: graph muxq {name!r}: {entry!r} ({MUXQ_TENSORS})")
        exp, k = entry["exp"], entry["channels"]
        if not (_is_int(exp) and 1 <= exp <= MUXQ_MAX_EXP and _is_int(k) and k >= 1):
            raise QnpuError(f"{where}: graph muxq {name!r}: exp 1..{MUXQ_MAX_EXP}, channels >= 1")


def _check_weight_zero_entries(graph: dict[str, Any], layer_graph: Graph, where: str) -> None:
    """graph.weight_zero_points: distinct layer linears (their constants' prefix)."""
    consts = graph.get("weight_zero_points") or []
    linears = [op.const for op in layer_graph.ops(OpKind.LINEAR)]
    if (
        not isinstance(consts, list)
        or len(set(consts)) != len(consts)
        or any(c not in linears for c in consts)
    ):
        raise QnpuError(
            f"{where}: graph weight_zero_points must list distinct layer linears "
            f"({', '.join(linears)}), got {consts!r}"
        )


def centered_weights(model: IntModel, const: str) -> np.ndarray:
    """The codes of linear `const` minus their row's zero point (int16; the codes as they are
    without one): the operand a matmul without the z_w·Σx term multiplies."""
    w = model.t(f"{const}.weight")
    key = f"{const}.weight_zero_point"
    if key not in model.tensors:
        return w
    return (w.astype(np.int16) - model.t(key).astype(np.int16)[..., None]).astype(np.int16)


def _check_channel_lists(
    model: dict[str, Any], graph: dict[str, Any], tensors: dict[str, np.ndarray], where: str
) -> None:
    """The shadow and MUXQ channel lists: per layer sorted distinct channels of the tensor's
    width, −1 padding after them."""
    widths = layer_widths(model_widths(model))
    keys = [f"layers.shadow.{n}.channels" for n in graph.get("shadow") or {}]
    keys += [f"layers.muxq.{n}.channels" for n in graph.get("muxq") or {}]
    for key in keys:
        name = key.split(".")[2]
        width = widths[name]
        for layer, row in enumerate(tensors[key]):
            used = row[row >= 0]
            if (
                (row[len(used) :] != -1).any()
                or (np.diff(used) <= 0).any()
                or (used >= width).any()
            ):
                raise QnpuError(
                    f"{where}: {key} (layer {layer}) must list sorted distinct channels below "
                    f"{width}, then -1"
                )


def shadow_bounds(model: IntModel, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-channel code bounds [L, C] of activation `name` when it has shadow channels (theirs
    `SHADOW_BITS` wide, the others the tensor's range), else None."""
    mask = model._mask("shadow", name)
    if mask is None:
        return None
    j = list(model.graph["layer_activations"]).index(name)
    lo = model.tensors["layers.act.qmin"][:, j : j + 1].astype(np.int64)
    hi = model.tensors["layers.act.qmax"][:, j : j + 1].astype(np.int64)
    return np.where(mask, SHADOW_RANGE[0], lo), np.where(mask, SHADOW_RANGE[1], hi)


# The fixed-point constants of graph FORMAT_GRAPH: part of the contract, not of an export.
CONTRACT_CONSTANTS = {
    "norm_fraction_bits": NORM_FRACTION_BITS,
    "norm_unit_bits": NORM_UNIT_BITS,
    "rope_fraction_bits": ROPE_FRACTION_BITS,
    "logits_scale": LOGITS_SCALE,
}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_constants(manifest: dict[str, Any], where: str) -> None:
    """Every number the engines read from the manifest (beyond tensor shapes) is the contract's
    or lies in the range the tensors and the model config allow."""
    graph, model = manifest["graph"], manifest["model"]
    for key, value in CONTRACT_CONSTANTS.items():
        got = graph.get(key)
        if type(got) is not type(value) or got != value:
            raise QnpuError(
                f"{where}: graph {key} is {got!r}; graph {FORMAT_GRAPH} fixes it at {value!r}"
            )
    vocab, positions = model.get("vocab_size"), model.get("max_position_embeddings")
    if not _is_int(vocab) or vocab < 1 or not _is_int(positions) or positions < 1:
        raise QnpuError(f"{where}: model config lacks a valid vocab_size / max_position_embeddings")
    max_context, chunk = graph.get("max_context"), graph.get("prefill_chunk")
    if not _is_int(max_context) or not 1 <= max_context <= positions:
        raise QnpuError(
            f"{where}: graph max_context {max_context!r} is not in 1..{positions} (the model's "
            "max_position_embeddings)"
        )
    prefix = graph.get("prefix_tokens")
    if not isinstance(prefix, list) or not all(_is_int(t) and 0 <= t < vocab for t in prefix):
        raise QnpuError(f"{where}: graph prefix_tokens must be a list of token ids < {vocab}")
    if not _is_int(chunk) or not 1 <= chunk <= max_context - len(prefix):
        raise QnpuError(
            f"{where}: graph prefill_chunk {chunk!r} is not in 1..{max_context - len(prefix)} "
            "(the context after the sink prefix)"
        )
    tokenizer = manifest.get("tokenizer") or {}
    for key in ("bos_token_id", "eos_token_id"):
        tid = tokenizer.get(key)
        if tid is not None and (not _is_int(tid) or not 0 <= tid < vocab):
            raise QnpuError(f"{where}: tokenizer {key} {tid!r} is not a token id < {vocab}")


def lpbq_blocks(
    encodings: Mapping[str, Any], where: str, layer_graph: Graph = GRAPH
) -> dict[str, int]:
    """{linear const: block size} of the LPBQ linears of `layer_graph` the manifest's
    encodings declare (one block size for every layer of a linear)."""
    out: dict[str, int] = {}
    for op in layer_graph.layer:
        if op.kind != OpKind.LINEAR:
            continue
        entries = [e for k, e in encodings.items() if k.endswith(f".{op.weight_name}")]
        blocks = {
            e.get("block") if isinstance(e, Mapping) and e.get("block_scale") else None
            for e in entries
        }
        if len(blocks) > 1:
            raise QnpuError(f"{where}: the layers of {op.weight_name} disagree on LPBQ blocks")
        block = blocks.pop() if blocks else None
        if block is not None:
            if isinstance(block, bool) or not isinstance(block, int) or block < 1:
                raise QnpuError(f"{where}: {op.weight_name} has a bad block size {block!r}")
            out[op.const] = block
    return out


def lpbq_weights(
    tensors: Mapping[str, np.ndarray], blocks: Mapping[str, int], where: str
) -> dict[str, np.ndarray]:
    """`tensors` with every LPBQ linear's codes q [L, out, in] replaced by the int8 codes the
    engines multiply, k·q, k its integer block scales `{const}.block_scale` [L, out, in/B]
    repeated over each block of B inputs (what an NPU's LPBQ kernel decompresses; its
    per-channel requantization is already in the linear's M/shift). `blocks` ({const: B},
    `lpbq_blocks`) says which linears have them; any other block scales are refused."""
    suffix = ".block_scale"
    stray = sorted(n for n in tensors if n.endswith(suffix) and n[: -len(suffix)] not in blocks)
    if stray:
        raise QnpuError(f"{where}: {stray[0]} belongs to no LPBQ linear of the encodings")
    out = dict(tensors)
    for const, block in blocks.items():
        name = f"{const}{suffix}"
        if name not in tensors:
            raise QnpuError(f"{where}: the encodings make {const} LPBQ, but {name} is missing")
        k, q = tensors[name], tensors[f"{const}.weight"]
        if q.shape[-1] % block:
            raise QnpuError(f"{where}: blocks of {block} do not split {const}'s inputs {q.shape}")
        want = (*q.shape[:2], q.shape[-1] // block)
        if k.dtype != np.uint8 or k.shape != want:
            raise QnpuError(
                f"{where}: {name} must be uint8 {want} for weights {q.shape}, got "
                f"{k.dtype} {k.shape}"
            )
        if int(k.min(initial=1)) < 1:
            raise QnpuError(f"{where}: {name} holds a block scale of 0")
        wide = q.astype(np.int16) * np.repeat(k.astype(np.int16), block, axis=-1)
        if wide.min(initial=0) < -128 or wide.max(initial=0) > 127:
            raise QnpuError(f"{where}: {name} times the codes leaves the int8 range")
        out[f"{const}.weight"] = wide.astype(np.int8)
    return out


def load_int_model(path: Path | str) -> IntModel:
    """Read and validate an artifact directory (hashes, dtypes, shapes, op list); LPBQ
    weights come folded into int8 codes (`lpbq_weights`)."""
    art: Artifact = read_artifact(Path(path))
    layer_graph = validate_graph(art.manifest, art.tensors, str(path))
    tensors = {k: np.ascontiguousarray(v).reshape(v.shape) for k, v in art.tensors.items()}
    blocks = lpbq_blocks(art.manifest.get("encodings") or {}, str(path), layer_graph)
    tensors = lpbq_weights(tensors, blocks, str(path))
    return IntModel(
        art.path,
        dict(art.manifest["model"]),
        dict(art.manifest["graph"]),
        tensors,
        dict(art.manifest.get("tokenizer") or {}),
        dict(art.files),
        dict(art.manifest.get("source") or {}),
    )


def artifact_tokenizer(model: IntModel) -> Any:
    """The tokenizer stored in the artifact (tokenizer.json + the manifest's BOS/EOS ids)."""
    return stored_tokenizer(model.files, model.tokenizer, model.path)


def stored_tokenizer(files: Mapping[str, bytes], info: Mapping[str, Any], where: Path) -> Any:
    """The tokenizer an export stores: the file `info["file"]` among `files`, with the BOS/EOS
    ids of `info` (the manifest's "tokenizer" entry)."""

    name = info.get("file")
    if not name or name not in files:
        raise QnpuError(f"artifact {where} holds no tokenizer")
    try:
        backend = HFTokenizer.from_str(files[name].decode())
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise QnpuError(f"artifact {where}: unreadable tokenizer: {e}") from e
    return Tokenizer(backend, info.get("bos_token_id"), info.get("eos_token_id"))
