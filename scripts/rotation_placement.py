"""Where a rotation goes on a model with gained pre-norms -> JSON (issue 54, step 4).

For each layer's pre-norms (the attention's and the MLP's), on real text through the float
model: the residual stream's most energetic channel after normalization (its share of a
token's energy, and the norm's gain there against the median gain), and the relative error
of the linears reading the norm (q/k/v; gate/up), ‖y − y_float‖ / ‖y_float‖, with 8-bit
weights (symmetric, per row), 8-bit activations (asymmetric, per tensor, min-max) or both,
for three placements:
- `unrotated`: the gain stays in the norm, nothing rotates (RTN's model);
- `stream`: the gain folds into the readers and a randomized Hadamard rotates the normalized
  stream (R1 on the residual stream, QuaRot's placement);
- `online`: the gain stays in the norm and the Hadamard rotates the norm's output (a rotation
  linear after the pre-norm: `ir.graph.with_rotation_linears`).

    python scripts/rotation_placement.py --model gemma3-270m --windows 2 --seq-len 256 \
        --json reports/rotation_placement_gemma3.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.files import write_json_atomic
from qnpu_jax.ir.graph import OpKind, norm_readers
from qnpu_jax.models.llama import embed_rows, forward_tapped, graph_of, init_cache
from qnpu_jax.models.load import load_model
from qnpu_jax.rotation import random_hadamard

PLACEMENTS = ("unrotated", "stream", "online")


class _Record:
    """Taps that keep the inputs of the norms named (the residual stream before each)."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def _taps(self, names: frozenset[str]) -> tuple[Any, Any]:
        got: dict[str, jax.Array] = {}

        def tap(name: str, x: jax.Array, where: jax.Array | None = None) -> jax.Array:
            if name in names:
                got[name] = x
            return x

        return tap, lambda: got

    def layer(self, state: Any) -> tuple[Any, Any]:
        return self._taps(self.names)

    def outer(self, state: Any) -> tuple[Any, Any]:
        return self._taps(frozenset({"embed_out"}))

    def embed(self, state: Any, table: jax.Array, tokens: jax.Array) -> jax.Array:
        return embed_rows(table, tokens)


def quantize_rows(w: np.ndarray, bits: int = 8) -> np.ndarray:
    """Symmetric per-row (output channel) fake quantization of w [out, in]."""
    step = np.abs(w).max(1, keepdims=True) / (2 ** (bits - 1) - 1)
    step[step == 0] = 1.0
    return np.round(w / step) * step


def quantize_tensor(a: np.ndarray, bits: int = 8) -> np.ndarray:
    """Asymmetric per-tensor min-max fake quantization."""
    lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
    step = (hi - lo) / (2**bits - 1)
    zero = np.round(-lo / step)
    return (np.clip(np.round(a / step) + zero, 0, 2**bits - 1) - zero) * step


def placement_errors(
    x: np.ndarray, gain: np.ndarray, w: np.ndarray, h: np.ndarray, eps: float
) -> dict[str, dict[str, float]]:
    """Relative output error of y = norm(x) Wᵀ per placement and quantized side."""
    xh = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + eps)
    ref = (xh * gain) @ w.T
    cases = {
        "unrotated": (xh * gain, w),
        "stream": (xh @ h, (w * gain[None, :]) @ h),
        "online": ((xh * gain) @ h, w @ h),
    }

    def rel(y: np.ndarray) -> float:
        return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))

    return {
        name: {
            "weights": rel(a @ quantize_rows(m).T),
            "activations": rel(quantize_tensor(a) @ m.T),
            "both": rel(quantize_tensor(a) @ quantize_rows(m).T),
        }
        for name, (a, m) in cases.items()
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0, help="the Hadamard's signs")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)

    model = load_model(args.model)
    cfg, params = model.config, model.params
    graph = graph_of(cfg)
    readers_of = norm_readers(graph)  # the pre-norms' gains -> the linears reading them
    norms = [  # (gain, input, readers) of each pre-norm
        (op.gain, op.ins[0], readers_of[op.gain])
        for op in graph.ops(OpKind.RMSNORM)
        if op.gain in readers_of
    ]
    ids = tokenize_documents(load_documents("wiki", "calib"), model.tokenizer)
    tokens = jnp.asarray(np.asarray(eval_windows(ids, args.seq_len, args.windows)))
    # a layer's input is the previous layer's output: the last add's (or the embedding's)
    last_add = graph.ops(OpKind.ADD)[-1].out_name
    taps = _Record(frozenset({i for _, i, _ in norms} | {last_add}))
    cache = init_cache(cfg, tokens.shape[0], tokens.shape[1])
    _, _, aux = forward_tapped(params, tokens, cache, jnp.int32(0), cfg=cfg, taps=taps)
    h = np.asarray(random_hadamard(cfg.hidden_size, jax.random.key(args.seed)), np.float64)
    rows: list[dict[str, Any]] = []
    for layer in range(cfg.num_layers):
        for gain_name, source, readers in norms:
            if source == graph.layer_input:
                x = aux["embed_out"] if layer == 0 else aux["layers"][last_add][layer - 1]
            else:
                x = aux["layers"][source][layer]
            x = np.asarray(x, np.float64).reshape(-1, cfg.hidden_size)
            gain = np.asarray(params["layers"][gain_name][layer], np.float64)
            ws = [np.asarray(params["layers"][r][layer], np.float64) for r in readers]
            w = np.concatenate(ws)
            xh2 = x**2 / np.sum(x**2, -1, keepdims=True)
            energy = xh2.mean(0)
            top = int(np.argmax(energy))
            rows.append({
                "layer": layer, "norm": gain_name, "readers": list(readers),
                "massive_channel": top, "massive_share": float(energy[top]),
                "gain_there": float(gain[top]), "median_abs_gain": float(np.median(np.abs(gain))),
                "errors": placement_errors(x, gain, w, h, cfg.rms_norm_eps),
            })  # fmt: skip
    summary = {
        gain_name: {
            p: {
                side: float(np.mean([r["errors"][p][side] for r in rows if r["norm"] == gain_name]))
                for side in ("weights", "activations", "both")
            }
            for p in PLACEMENTS
        }
        for gain_name, _, _ in norms
    }
    for gain_name, by in summary.items():
        print(gain_name, " ".join(f"{p} {by[p]['both']:.4f}" for p in PLACEMENTS))
    report = {
        "command": script_command(__file__),
        "environment": environment_info(),
        "model": args.model,
        "tokens": int(tokens.size),
        "mean_relative_error": summary,
        "rows": rows,
    }
    write_json_atomic(args.json, report)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
