"""A numpy NPU emulator: executes an integer artifact as the device would.

Integer codes in, integer logits out: integer matmuls with wide accumulators, fixed-point
requantization, LUT non-linearities, integer RMSNorm and softmax, an integer KV cache and a
fixed prefill chunk (the last chunk padded). No JAX: this is the independent reference the
JAX integer forward is checked against, bit for bit.

Matmuls run as float64 BLAS on integer values: exact while every partial sum stays below
2^53, which `exact_matmul` checks from the operands' magnitudes before it trusts the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.artifact import Artifact, read_artifact
from qnpu_jax.export.graph import (
    FORMAT_GRAPH,
    GLOBAL_ACTS,
    LAYER_ACTS,
    LAYER_INPUT,
    LOGITS_RANGE,
    LOGITS_SCALE,
    NORM_FRACTION_BITS,
    NORM_UNIT_BITS,
    OPS,
    ROPE_FRACTION_BITS,
    check_generation_room,
    check_room,
    expected_tensors,
    graph_ops,
    nll_from_logit_codes,
)

I64 = np.int64
EXACT_LIMIT = float(2**53)
INT64_MAX = np.iinfo(np.int64).max


# ---------------------------------------------------------------------------- kernels


def requantize(
    acc: np.ndarray, m: Any, shift: Any, zero_point: Any, qmin: Any, qmax: Any
) -> np.ndarray:
    """clamp(z + ((acc·M + 2^(sh−1)) >> sh), qmin, qmax), int64 with an overflow check."""
    a = np.asarray(acc, I64)
    m = np.asarray(m, I64)
    sh = np.asarray(shift, I64)
    half = np.left_shift(I64(1), sh - 1)
    limit = (INT64_MAX - half) // m
    if (np.abs(a) > limit).any():
        raise QnpuError("requantization overflows int64 (accumulator too large)")
    y = np.right_shift(a * m + half, sh) + np.asarray(zero_point, I64)
    return np.clip(y, qmin, qmax)


def exact_matmul(
    a: np.ndarray, b: np.ndarray, subscripts: str, *, b_absmax: float | None = None
) -> np.ndarray:
    """einsum of integer arrays through float64, exact when Σ|a|·|b| < 2^53 (checked).

    `b` may already be float64 holding integers, with its max |b| given as `b_absmax` (the
    emulator keeps its weights so, instead of converting them at every call)."""
    k = a.shape[-1]
    b_max = float(np.abs(b).max(initial=0)) if b_absmax is None else b_absmax
    bound = float(np.abs(a).max(initial=0)) * b_max * k
    if bound >= EXACT_LIMIT:
        raise QnpuError(f"integer matmul bound {bound:.3g} exceeds 2^53: not exact in float64")
    b64 = b if b.dtype == np.float64 else b.astype(np.float64)
    out = np.einsum(subscripts, a.astype(np.float64), b64, optimize=True)
    return out.astype(I64)


def isqrt(v: np.ndarray) -> np.ndarray:
    """floor(sqrt(v)) of non-negative int64 values below 2^62, exactly."""
    r = np.floor(np.sqrt(v.astype(np.float64))).astype(I64)
    for _ in range(2):  # float64 sqrt is within one unit; correct both ways
        r = np.where(r * r > v, r - 1, r)
        r = np.where((r + 1) * (r + 1) <= v, r + 1, r)
    return r


def rmsnorm(
    xc: np.ndarray, c: dict[str, np.ndarray], out: tuple[int, int, int], f: int, k: int
) -> np.ndarray:
    """Integer RMSNorm of centered codes xc [..., D] (docs/artifact.md, "RMSNorm")."""
    d = xc.shape[-1]
    ss = np.sum(xc * xc, axis=-1, keepdims=True)
    v = np.left_shift(ss, 2 * f) // d + c["eps"]
    r = np.maximum(isqrt(v), 1)
    t = (np.left_shift(xc, f + k + 1) + r) // (2 * r)
    return requantize(t * c["sign"].astype(I64), c["M"], c["shift"], *out)


def softmax_codes(scores: np.ndarray, allowed: np.ndarray, exp_lut: np.ndarray) -> np.ndarray:
    """Integer softmax over the last axis: unsigned 16-bit probability codes."""
    masked = np.where(allowed, scores, np.iinfo(I64).min)
    d = np.minimum(masked.max(axis=-1, keepdims=True) - scores, (1 << 16) - 1)
    d = np.where(allowed, d, 0)
    e = np.where(allowed, exp_lut[d].astype(I64), 0)
    total = e.sum(axis=-1, keepdims=True)
    return (e * ((1 << 16) - 1) + total // 2) // total


# ---------------------------------------------------------------------------- the model


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

    @property
    def num_layers(self) -> int:
        return int(self.model["num_layers"])

    def t(self, name: str) -> np.ndarray:
        return self.tensors[name]

    def weight_operand(self, prefix: str, layer: int | None) -> tuple[np.ndarray, float]:
        """`prefix.weight` (of one layer) as float64 integers and its max |w|, converted once
        per model: a decode step would otherwise convert every weight again (≈1 GB for
        SmolLM2-135M, the size of this cache)."""
        name = prefix + ".weight"
        if name not in self._operands:
            w = self.t(name)
            axes = tuple(range(1, w.ndim)) if name.startswith("layers.") else None
            self._operands[name] = (w.astype(np.float64), np.abs(w).max(axis=axes))
        w64, absmax = self._operands[name]
        if layer is None:
            return w64, float(absmax)
        return w64[layer], float(absmax[layer])


def validate_graph(manifest: dict[str, Any], tensors: dict[str, np.ndarray], where: str) -> None:
    """The graph is the one this emulator implements and every tensor has its shape/dtype."""
    graph = manifest.get("graph")
    model = manifest.get("model")
    if not isinstance(graph, dict) or not isinstance(model, dict):
        raise QnpuError(f"{where}: manifest lacks the 'graph' or 'model' section")
    if graph.get("format") != FORMAT_GRAPH:
        raise QnpuError(
            f"{where}: graph format {graph.get('format')!r} is not supported ({FORMAT_GRAPH})"
        )
    ops = graph.get("ops")
    if not isinstance(ops, dict):
        raise QnpuError(f"{where}: graph has no op list")
    for part in ("model", "layer"):
        for op in ops.get(part) or []:
            if not isinstance(op, dict) or op.get("op") not in OPS:
                kind = op.get("op") if isinstance(op, dict) else op
                raise QnpuError(f"{where}: unknown op {kind!r} in the {part} op list")
    if ops != graph_ops():
        raise QnpuError(f"{where}: the op list differs from graph {FORMAT_GRAPH}")
    if list(graph.get("layer_activations", [])) != list(LAYER_ACTS) or list(
        graph.get("global_activations", [])
    ) != list(GLOBAL_ACTS):
        raise QnpuError(f"{where}: activation tables differ from graph {FORMAT_GRAPH}")
    _check_constants(manifest, where)
    try:
        expected = expected_tensors(model, graph)
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
    gate = LAYER_ACTS.index("gate_out")
    span = tensors["layers.act.qmax"][:, gate] - tensors["layers.act.qmin"][:, gate] + 1
    if (span != tensors["layers.silu.lut"].shape[1]).any():
        raise QnpuError(f"{where}: SiLU LUT length does not match the gate_out range")


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


def load_int_model(path: Path | str) -> IntModel:
    """Read and validate an artifact directory (hashes, dtypes, shapes, op list)."""
    art: Artifact = read_artifact(Path(path))
    validate_graph(art.manifest, art.tensors, str(path))
    tensors = {k: np.ascontiguousarray(v).reshape(v.shape) for k, v in art.tensors.items()}
    return IntModel(
        art.path,
        dict(art.manifest["model"]),
        dict(art.manifest["graph"]),
        tensors,
        dict(art.manifest.get("tokenizer") or {}),
        dict(art.files),
        dict(art.manifest.get("source") or {}),
    )


@dataclasses.dataclass(frozen=True)
class Cache:
    """Integer K/V cache codes [L, B, Hkv, S, hd] and the number of filled positions."""

    k: np.ndarray
    v: np.ndarray
    length: int


def new_cache(model: IntModel, batch: int) -> Cache:
    """An empty cache holding the sink prefix's K/V at positions 0..P-1."""
    m = model.model
    shape = (m["num_layers"], batch, m["num_kv_heads"], model.graph["max_context"], m["head_dim"])
    k, v = np.zeros(shape, np.int16), np.zeros(shape, np.int16)
    p = len(model.graph["prefix_tokens"])
    if p:
        k[:, :, :, :p] = model.t("layers.prefix.k")[:, None]
        v[:, :, :, :p] = model.t("layers.prefix.v")[:, None]
    return Cache(k, v, p)


Value = tuple[np.ndarray, int]  # codes and their zero point


def _act(model: IntModel, layer: int, name: str) -> tuple[int, int, int]:
    j = LAYER_ACTS.index(name)
    return tuple(  # type: ignore[return-value]
        int(model.t(f"layers.act.{f}")[layer, j]) for f in ("zero_point", "qmin", "qmax")
    )


def _global_act(model: IntModel, name: str) -> tuple[int, int, int]:
    j = GLOBAL_ACTS.index(name)
    return tuple(  # type: ignore[return-value]
        int(model.t(f"act.{f}")[j]) for f in ("zero_point", "qmin", "qmax")
    )


def _layer_slice(model: IntModel, prefix: str, layer: int | None) -> dict[str, np.ndarray]:
    """The constants named `prefix.*` (of one layer when `layer` is set)."""
    out = {}
    for name, a in model.tensors.items():
        if name.startswith(prefix + "."):
            out[name[len(prefix) + 1 :]] = a if layer is None else a[layer]
    return out


def _linear(
    x: Value,
    c: dict[str, np.ndarray],
    out: tuple[int, int, int],
    weight: tuple[np.ndarray, float],
) -> np.ndarray:
    codes, z = x
    w64, w_max = weight
    acc = exact_matmul(codes.astype(I64) - z, w64, "...i,oi->...o", b_absmax=w_max)
    if "bias" in c:
        acc = acc + c["bias"].astype(I64)
    return requantize(acc, c["M"], c["shift"], *out)


def _rope(
    x: Value,
    c: dict[str, np.ndarray],
    out: tuple[int, int, int],
    cos: np.ndarray,
    sin: np.ndarray,
    head_dim: int,
) -> np.ndarray:
    codes, z = x
    b, t, width = codes.shape
    xc = (codes.astype(I64) - z).reshape(b, t, width // head_dim, head_dim)
    half = head_dim // 2
    rot = np.concatenate([-xc[..., half:], xc[..., :half]], axis=-1)
    acc = xc * cos[None, :, None, :] + rot * sin[None, :, None, :]
    return requantize(acc, c["M"], c["shift"], *out).reshape(b, t, width)


def _attention(
    model: IntModel,
    layer: int,
    q: Value,
    k: Value,
    v: Value,
    cache: Cache,
    start: int,
    out: tuple[int, int, int],
) -> np.ndarray:
    m = model.model
    hd, hkv, hq = m["head_dim"], m["num_kv_heads"], m["num_heads"]
    b, t, _ = q[0].shape
    end = start + t
    cache.k[layer, :, :, start:end] = k[0].reshape(b, t, hkv, hd).transpose(0, 2, 1, 3)
    cache.v[layer, :, :, start:end] = v[0].reshape(b, t, hkv, hd).transpose(0, 2, 1, 3)
    kc = cache.k[layer, :, :, :end].astype(I64) - k[1]  # [B, Hkv, S, hd]
    vc = cache.v[layer, :, :, :end].astype(I64) - v[1]
    qc = (q[0].astype(I64) - q[1]).reshape(b, t, hkv, hq // hkv, hd)
    acc = exact_matmul(qc, kc, "btkgd,bksd->bkgts")
    z_s, lo_s, hi_s = _act(model, layer, "scores")
    m_s, sh_s = model.t("layers.scores.M")[layer], model.t("layers.scores.shift")[layer]
    scores = requantize(acc, m_s, sh_s, z_s, lo_s, hi_s)
    allowed = np.arange(end)[None, :] <= (start + np.arange(t))[:, None]  # [T, S]
    probs = softmax_codes(scores, allowed, model.t("layers.softmax.exp_lut")[layer])
    pv = exact_matmul(probs, vc, "bkgts,bksd->btkgd")
    res = requantize(pv, model.t("layers.pv.M")[layer], model.t("layers.pv.shift")[layer], *out)
    return res.reshape(b, t, hq * hd)


def _add(a: Value, b: Value, c: dict[str, np.ndarray], out: tuple[int, int, int]) -> np.ndarray:
    acc = (a[0].astype(I64) - a[1]) * I64(c["Ma"]) + (b[0].astype(I64) - b[1]) * I64(c["Mb"])
    sh = I64(c["shift"])
    y = np.right_shift(acc + np.left_shift(I64(1), sh - 1), sh) + out[0]
    return np.clip(y, out[1], out[2])


def _run_layer(
    model: IntModel,
    layer: int,
    x: Value,
    cache: Cache,
    start: int,
    positions: np.ndarray,
    trace: dict[str, list[np.ndarray]] | None = None,
) -> Value:
    env: dict[str, Value] = {LAYER_INPUT: x}
    f, k = model.graph["norm_fraction_bits"], model.graph["norm_unit_bits"]
    cos, sin = model.t("rope.cos")[positions], model.t("rope.sin")[positions]
    for op in model.graph["ops"]["layer"]:
        out = _act(model, layer, op["out"])
        ins = [env[n] for n in op["in"]]
        kind = op["op"]
        c = _layer_slice(model, op["const"], layer) if kind != "attention" else {}
        if kind == "rmsnorm":
            y = rmsnorm(ins[0][0].astype(I64) - ins[0][1], c, out, f, k)
        elif kind == "linear":
            y = _linear(ins[0], c, out, model.weight_operand(op["const"], layer))
        elif kind == "rope":
            y = _rope(ins[0], c, out, cos.astype(I64), sin.astype(I64), model.model["head_dim"])
        elif kind == "attention":
            y = _attention(model, layer, ins[0], ins[1], ins[2], cache, start, out)
        elif kind == "add":
            y = _add(ins[0], ins[1], c, out)
        elif kind == "lut":
            codes, _ = ins[0]
            lo = _act(model, layer, op["in"][0])[1]
            y = c["lut"][codes.astype(I64) - lo].astype(I64)
        elif kind == "mul":
            prod = (ins[0][0].astype(I64) - ins[0][1]) * (ins[1][0].astype(I64) - ins[1][1])
            y = requantize(prod, c["M"], c["shift"], *out)
        else:  # validate_graph refuses anything else
            raise QnpuError(f"unknown op {kind!r}")
        env[op["out"]] = (y, out[0])
        if trace is not None:
            trace.setdefault(op["out"], []).append(y)
    return env["resid_mlp"]


def run_chunk(
    model: IntModel,
    tokens: np.ndarray,
    cache: Cache,
    trace: dict[str, list[np.ndarray]] | None = None,
) -> tuple[np.ndarray, Cache]:
    """Integer logits [B, T, V] (int32 codes) of `tokens` [B, T] placed after the cache's
    filled positions, and a new cache with their K/V written (the given one is left as it
    was). `trace`, when given, collects every layer's activation codes by name (a list over
    layers)."""
    return _run_chunk_into(model, tokens, _own(cache), trace)


def _own(cache: Cache) -> Cache:
    return Cache(cache.k.copy(), cache.v.copy(), cache.length)


def _run_chunk_into(
    model: IntModel,
    tokens: np.ndarray,
    cache: Cache,
    trace: dict[str, list[np.ndarray]] | None = None,
) -> tuple[np.ndarray, Cache]:
    """`run_chunk` writing K/V into `cache`'s buffers: for callers that own the cache, so a
    decode step does not copy the whole cache."""
    t = tokens.shape[1]
    start = cache.length
    check_room(start, t, model.graph["max_context"])
    vocab = model.model["vocab_size"]
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise QnpuError(f"token ids must be in [0, {vocab})")
    positions = start + np.arange(t)
    z, lo, hi = _global_act(model, "embed_out")
    rows = model.t("embed.table")[tokens].astype(I64)
    x = requantize(
        rows,
        model.t("embed.M")[tokens][..., None],
        model.t("embed.shift")[tokens][..., None],
        z,
        lo,
        hi,
    )
    value: Value = (x, z)
    for layer in range(model.num_layers):
        value = _run_layer(model, layer, value, cache, start, positions, trace)
    f, k = model.graph["norm_fraction_bits"], model.graph["norm_unit_bits"]
    out = _global_act(model, "final_norm_out")
    h = rmsnorm(value[0] - value[1], _layer_slice(model, "final_norm", None), out, f, k)
    logits = _linear(
        (h, out[0]),
        _layer_slice(model, "lm_head", None),
        (0, *LOGITS_RANGE),
        model.weight_operand("lm_head", None),
    )
    return np.ascontiguousarray(logits, np.int32), Cache(cache.k, cache.v, start + t)


def prefill(
    model: IntModel, tokens: np.ndarray, cache: Cache | None = None
) -> tuple[np.ndarray, Cache]:
    """Run `tokens` [B, T] in fixed chunks of `prefill_chunk` (the last one padded with token 0
    whose outputs are dropped; its cache slots are overwritten before any query sees them)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise QnpuError(f"prefill needs token ids [batch, length>0], got shape {tokens.shape}")
    cache = _own(cache) if cache is not None else new_cache(model, tokens.shape[0])
    chunk = int(model.graph["prefill_chunk"])
    pieces = []
    n = tokens.shape[1]
    check_room(cache.length, n, model.graph["max_context"])
    for s in range(0, n, chunk):
        part = tokens[:, s : s + chunk]
        real = part.shape[1]
        if real < chunk:
            part = np.pad(part, ((0, 0), (0, chunk - real)))
            if cache.length + chunk > model.graph["max_context"]:
                part = part[:, :real]  # no room to pad at the very end of the context
        logits, cache = _run_chunk_into(model, part, cache)
        pieces.append(logits[:, :real])
        cache = Cache(cache.k, cache.v, cache.length - (part.shape[1] - real))
    return np.concatenate(pieces, axis=1), cache


def logits_to_float(model: IntModel, codes: np.ndarray) -> np.ndarray:
    return codes.astype(np.float64) * float(model.graph["logits_scale"])


def token_nll(model: IntModel, tokens: np.ndarray) -> np.ndarray:
    """Next-token NLL [B, T-1] of tokens[:, 1:], each sequence after the sink prefix."""
    codes, _ = prefill(model, tokens)
    return nll_from_logit_codes(codes, tokens, model.graph["logits_scale"])


def token_nll_argmax(model: IntModel, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """NLL of tokens[:, 1:] and the greedy prediction at each of those positions [B, T-1]."""
    codes, _ = prefill(model, tokens)
    return nll_from_logit_codes(codes, tokens, model.graph["logits_scale"]), np.argmax(
        codes[:, :-1], axis=-1
    )


def artifact_tokenizer(model: IntModel) -> Any:
    """The tokenizer stored in the artifact (tokenizer.json + the manifest's BOS/EOS ids)."""
    from tokenizers import Tokenizer as HFTokenizer

    from qnpu_jax.models.tokenizer import Tokenizer

    name = model.tokenizer.get("file")
    if not name or name not in model.files:
        raise QnpuError(f"artifact {model.path} holds no tokenizer")
    try:
        backend = HFTokenizer.from_str(model.files[name].decode())
    except Exception as e:  # tokenizers raises a bare Exception on bad JSON
        raise QnpuError(f"artifact {model.path}: unreadable tokenizer: {e}") from e
    info = model.tokenizer
    return Tokenizer(backend, info.get("bos_token_id"), info.get("eos_token_id"))


def generate(
    model: IntModel,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """Greedy decoding (argmax ties → lowest id), one token per decode step."""
    if not prompt:
        raise QnpuError("the prompt is empty")
    prefix = len(model.graph["prefix_tokens"])
    check_generation_room(prefix, len(prompt), max_new_tokens, model.graph["max_context"])
    codes, cache = prefill(model, np.asarray([list(prompt)]))
    out: list[int] = []
    token = int(np.argmax(codes[0, -1]))
    while len(out) < max_new_tokens:
        out.append(token)
        if on_token:
            on_token(token)
        if token == eos_token_id or len(out) == max_new_tokens:
            break
        codes, cache = _run_chunk_into(model, np.asarray([[token]]), cache)  # prefill's own
        token = int(np.argmax(codes[0, -1]))
    return out


@dataclasses.dataclass(frozen=True)
class EmulatorEngine:
    """The emulator behind the engine interface `qnpu eval/emulate` use (JaxIntEngine's twin)."""

    model: IntModel

    def prefill(self, tokens: np.ndarray, cache: Cache | None = None) -> tuple[np.ndarray, Cache]:
        return prefill(self.model, tokens, cache)

    def token_nll(self, tokens: np.ndarray) -> np.ndarray:
        return token_nll(self.model, tokens)

    def token_nll_argmax(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return token_nll_argmax(self.model, tokens)

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, eos_token_id: int | None = None
    ) -> list[int]:
        return generate(self.model, prompt, max_new_tokens, eos_token_id)
