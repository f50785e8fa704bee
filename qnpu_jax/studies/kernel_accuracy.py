"""Accuracy cost of the NPU test-time-scaling paper's kernels (Tables 4 and 5) on a real model.

Perplexity on the `wiki` eval split and the WikiText-2 raw test, non-overlapping windows from
the start (the project's `eval_windows` + `perplexity`), for:
- float32: the float model (`models.llama.token_nll`);
- f16: every weight matrix (the decoder linears and the embedding / tied lm_head) rounded to
  fp16, float32 arithmetic (Table 4's "F16" column);
- weight-only 4-bit Q4_0 of the decoder linears, dequantized into the float model: common
  groups of 32 (llama.cpp), the same shifted by 16 inputs (a control, see below), and tile
  groups of 32 in the HMX layout (2 inputs × 16 outputs); NF4 and IQ4_NL (llama.cpp's scale
  search) in tile groups through their 16-entry LUTs; the embedding stays float;
- FP16 LUT-exp attention (Algorithm 1) in place of float32 attention, on the float weights and
  on the tile-group W4 weights (Table 5).
Each row also gives its paired change of mean NLL against float32 (mean ± standard error over
windows; = Δ ln ppl), the per-window NLLs, and for the weight variants the relative squared
error of the changed weights; `comparisons` pairs the variants of interest directly.

Caveat: `smollm2-135m` is the dequantized Q4_1 GGUF, so its decoder weights already sit on a
4-bit affine grid per common group of 32 inputs. Re-quantizing exactly those groups is easier
than any other grouping; the shifted common groups (each straddles two Q4_1 groups) are the
layout-neutral control for the tile-vs-common comparison.

    qnpu study kernel_accuracy --json reports/kernel_accuracy.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.argtypes import comma_choices, positive_int
from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import environment_info, study_command
from qnpu_jax.eval import perplexity
from qnpu_jax.files import check_writable, write_json_atomic
from qnpu_jax.ir.graph import EMBED_TABLE, GRAPH, LM_HEAD, OpKind
from qnpu_jax.kernels import (
    IQ4_NL_LUT,
    NF4_LUT,
    common_group_dequantize,
    common_group_quantize,
    fp16_lut_attention,
    from_tile_groups,
    lut_dequantize,
    lut_quantize,
    tile_group_dequantize,
    tile_group_quantize,
    tile_groups,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params, _attention, embed_rows, no_aux, no_tap, token_nll
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import tapped_token_nll
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.compare_methods import eval_specs

SHIFT = 16  # the control's offset: half a group, so each group straddles two Q4_1 groups

# name -> (weights, attention, description)
VARIANTS: dict[str, tuple[str, str, str]] = {
    "float32": ("float", "float32", "float32 weights, float32 attention"),
    "f16": ("f16", "float32", "all weight matrices rounded to fp16 (Table 4 'F16')"),
    "w4_common": ("q4_0_common", "float32", "Q4_0 common groups of 32 (Table 4 'Common')"),
    "w4_common_shift16": (
        "q4_0_common_shift16",
        "float32",
        "Q4_0 common groups of 32 starting at input 16 (control)",
    ),
    "w4_tile": ("q4_0_tile", "float32", "Q4_0 tile groups 2x16 (Table 4 'Tile group')"),
    "nf4_tile": ("nf4_tile", "float32", "NF4 LUT, tile groups of 32, absmax scale"),
    "iq4nl_tile": ("iq4_nl_tile", "float32", "IQ4_NL LUT, tile groups of 32, ntry=7 search"),
    "attn_fp16_lut": ("float", "fp16_lut", "float32 weights, FP16 LUT-exp attention"),
    "w4_tile_attn_fp16_lut": (
        "q4_0_tile",
        "fp16_lut",
        "Q4_0 tile groups + FP16 LUT-exp attention (Table 5 'LUT16 FA')",
    ),
}


# paired comparisons reported beside the rows: (variant, reference)
COMPARISONS = (
    ("w4_tile", "w4_common"),
    ("w4_tile", "w4_common_shift16"),
    ("w4_common_shift16", "w4_common"),
    ("iq4nl_tile", "w4_tile"),
    ("nf4_tile", "w4_tile"),
    ("attn_fp16_lut", "float32"),
    ("w4_tile_attn_fp16_lut", "w4_tile"),
)


def dequantized(w: np.ndarray, scheme: str) -> np.ndarray:
    """The float32 weight [out, in] after `scheme`'s 4-bit quantization and dequantization."""
    if scheme == "q4_0_common":
        return common_group_dequantize(*common_group_quantize(w), w.shape)
    if scheme == "q4_0_common_shift16":
        rolled = np.roll(w, -SHIFT, axis=1)  # groups cover inputs [16 + 32j, 48 + 32j) mod in
        return np.roll(common_group_dequantize(*common_group_quantize(rolled), w.shape), SHIFT, 1)
    if scheme == "q4_0_tile":
        return tile_group_dequantize(*tile_group_quantize(w), w.shape)
    lut, ntry = {"nf4_tile": (NF4_LUT, 0), "iq4_nl_tile": (IQ4_NL_LUT, 7)}[scheme]
    idx, scales = lut_quantize(tile_groups(w), lut, ntry)
    return from_tile_groups(lut_dequantize(idx, scales, lut), (w.shape[0], w.shape[1]))


def variant_params(params: Params, scheme: str) -> tuple[Params, float | None]:
    """Params with the weights of `scheme` and the relative squared error Σ(ŵ−w)²/Σw² of the
    matrices it changes (None for the float weights)."""
    if scheme == "float":
        return params, None
    names = [op.weight_name for op in GRAPH.ops(OpKind.LINEAR)]
    err = ref = 0.0
    layers = dict(params["layers"])
    for name in names:
        w = np.asarray(params["layers"][name], np.float32)
        if scheme == "f16":
            q = w.astype(np.float16).astype(np.float32)
        else:
            q = np.stack([dequantized(w[i], scheme) for i in range(w.shape[0])])
        err += float(np.sum((q.astype(np.float64) - w) ** 2))
        ref += float(np.sum(w.astype(np.float64) ** 2))
        layers[name] = jnp.asarray(q)
    out = {**params, "layers": layers}
    if scheme == "f16":  # the embedding (tied lm_head) too; the norms' gains stay float32
        for key in (k for k in (EMBED_TABLE, LM_HEAD) if k in params):
            w = np.asarray(params[key], np.float32)
            q = w.astype(np.float16).astype(np.float32)
            err += float(np.sum((q.astype(np.float64) - w) ** 2))
            ref += float(np.sum(w.astype(np.float64) ** 2))
            out[key] = jnp.asarray(q)
    return out, err / ref


@dataclasses.dataclass(frozen=True)
class KernelAttention:
    """Taps that change nothing but the attention (`models.llama.attention_kernel`): the
    float forward with `attention` in place of the float32 one."""

    attention: Callable[..., jax.Array]

    def layer(self, state: Any) -> tuple[Any, Callable[[], Any]]:
        return no_tap, no_aux

    def outer(self, state: Any) -> tuple[Any, Callable[[], Any]]:
        return no_tap, no_aux

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        return embed_rows(table, tokens)


def nll_fn(params: Params, cfg: ModelConfig, attention: str, kv_block: int) -> Callable:
    if attention == "float32":
        return partial(token_nll, params, cfg=cfg)
    taps = KernelAttention(partial(fp16_lut_attention, kv_block=kv_block))
    return partial(tapped_token_nll, params, None, cfg=cfg, taps=taps)


def forward_check(params: Params, cfg: ModelConfig, window: np.ndarray) -> dict[str, float]:
    """The kernel taps with the float32 `_attention` against `token_nll` on one window: the
    FP16 rows differ from float32 by the attention only if this is ~0."""
    taps = KernelAttention(_attention)
    ours = tapped_token_nll(params, None, jnp.asarray(window), cfg=cfg, taps=taps)
    ref = token_nll(params, window, cfg=cfg)
    return {"max_abs_nll_diff": float(jnp.max(jnp.abs(ours - ref)))}


def paired(base: tuple[float, ...], other: tuple[float, ...]) -> dict[str, float]:
    """Mean and standard error over windows of the change in mean NLL (= Δ ln ppl)."""
    d = np.asarray(other, np.float64) - np.asarray(base, np.float64)
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return {"mean": float(d.mean()), "stderr": se}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = study_parser(__name__, __doc__, json=True)
    parser.add_argument("--model", default="smollm2-135m", help="the float model (a model spec)")
    parser.add_argument("--windows", type=positive_int, default=24, help="windows per set")
    parser.add_argument("--seq-len", type=positive_int, default=512, help="tokens per window")
    parser.add_argument(
        "--wikitext",
        default=None,
        help="WikiText-2 raw test file (default: $QNPU_DATA_DIR/wikitext-2-raw/wiki.test.raw, "
        "the `wikitext2` data spec)",
    )
    parser.add_argument(
        "--variants",
        type=comma_choices(tuple(VARIANTS)),
        default=tuple(VARIANTS),
        help="the rows to measure (comma-separated); float32 always runs",
    )
    parser.add_argument(
        "--kv-block", type=positive_int, default=64, help="keys per block of the FP16 attention"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser.parse_args(argv)


def table(report: dict[str, Any]) -> str:
    sets = list(report["data"])
    head = " | ".join(f"{s} ppl | Δ NLL ± se" for s in sets)
    lines = [f"| variant | {head} | weight rel. sq. err |", "|" + "---|" * (2 + 2 * len(sets))]
    for name, row in report["variants"].items():
        cells = []
        for s in sets:
            d = row["delta_nll_vs_float32"].get(s)
            delta = f"{d['mean']:+.5f} ± {d['stderr']:.5f}" if d else "—"
            cells += [f"{row['ppl'][s]:.3f}", delta]
        err = row["weight_rel_sq_err"]
        lines.append(f"| {name} | {' | '.join(cells)} | {'—' if err is None else f'{err:.2e}'} |")
    lines += ["", "| paired Δ NLL | " + " | ".join(sets) + " |", "|" + "---|" * (1 + len(sets))]
    for c in report["comparisons"]:
        cells = [
            f"{c['delta_nll'][s]['mean']:+.5f} ± {c['delta_nll'][s]['stderr']:.5f}" for s in sets
        ]
        lines.append(f"| {c['variant']} − {c['reference']} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    check_writable(args.json)
    model = load_model(args.model)
    cfg, tok = model.config, model.tokenizer
    texts = {
        "wiki": load_documents("wiki", "eval"),
        "wikitext2": load_documents(eval_specs(args)["wikitext2"]),
    }
    windows = {
        k: eval_windows(tokenize_documents(d, tok), args.seq_len, args.windows)
        for k, d in texts.items()
    }
    report: dict[str, Any] = {
        "model": args.model,
        "seq_len": args.seq_len,
        "data": {k: {"windows": len(w)} for k, w in windows.items()},
        "kv_block": args.kv_block,
        "forward_check": forward_check(model.params, cfg, windows["wiki"][:1]),
        "variants": {},
    }
    print(f"forward check: {report['forward_check']}", file=sys.stderr)
    base: dict[str, tuple[float, ...]] = {}
    # float32 always runs first: every other row is paired with it
    for name in ["float32", *[v for v in args.variants if v != "float32"]]:
        scheme, attention, description = VARIANTS[name]
        t0 = time.perf_counter()
        params, err = variant_params(model.params, scheme)
        row: dict[str, Any] = {
            "description": description,
            "weights": scheme,
            "attention": attention,
            "weight_rel_sq_err": err,
            "prepare_seconds": time.perf_counter() - t0,
            "ppl": {},
            "nll_mean": {},
            "delta_nll_vs_float32": {},
            "seconds": {},
            "window_nll": {},
        }
        fn = nll_fn(params, cfg, attention, args.kv_block)
        for data, win in windows.items():
            result = perplexity(fn, win, progress=not args.no_progress)
            row["ppl"][data] = result.ppl
            row["nll_mean"][data] = result.nll_sum / result.predicted_tokens
            row["seconds"][data] = result.seconds
            row["window_nll"][data] = list(result.window_nll)
            if name == "float32":
                base[data] = result.window_nll
            else:
                row["delta_nll_vs_float32"][data] = paired(base[data], result.window_nll)
            print(f"{name} {data}: ppl {result.ppl:.4f} ({result.seconds:.0f} s)", file=sys.stderr)
        report["variants"][name] = row
    rows = report["variants"]
    report["comparisons"] = [
        {
            "variant": a,
            "reference": b,
            "delta_nll": {
                d: paired(rows[b]["window_nll"][d], rows[a]["window_nll"][d]) for d in windows
            },
        }
        for a, b in COMPARISONS
        if a in rows and b in rows
    ]
    report["seconds"] = time.perf_counter() - started
    report["environment"] = environment_info()
    report["command"] = study_command("kernel_accuracy", argv)
    write_json_atomic(args.json, report)
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
