"""Op by op: which ops of the fake-quant forward compute other codes than the integer device.

The emulator runs each window once and records every activation's codes. The fake-quant
forward then runs the same window with every quantized activation *forced* to the device's
codes: each op gets exactly the device's inputs, computes its output the fake-quant way, and
that output's codes are compared with the device's before the device's replace them. So
every op is measured on its own, with no divergence carried from the ops before it.

Per tensor (over layers and windows): the share of codes that differ, the mean signed
difference fake − device in codes (a bias, unlike rounding noise, does not average out), and
the largest difference. Attention scores count the unmasked keys only.

    qnpu study op_gap --run runs/smollm2-135m-quantnpu-w4a8-device --windows 2 --seq-len 512 \
        --simulations fake device --json reports/op_gap.json

Each of `--simulations` (default: both) replaces the run's plan's `simulation`: "fake" is the
float32 forward, "device" the integer contract's softmax and RoPE tables where they differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import study_command
from qnpu_jax.export.artifact import MANIFEST
from qnpu_jax.export.exporter import export_run
from qnpu_jax.export.int_model import load_int_model
from qnpu_jax.ir.graph import SIMULATIONS
from qnpu_jax.models.taps import FakeQuantTaps, effective_state, tapped_forward
from qnpu_jax.pipeline.config_doc import CONFIG_KEYS
from qnpu_jax.pipeline.run import load_run
from qnpu_jax.quant.fake_quant import dequantize, positive_scale, quantize
from qnpu_jax.runtime import emulator as E
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import add_eval_args, run_summary, say, write_study_json

# per tensor: [codes that differ, Σ (fake − device), max |fake − device|, codes compared]
STAT_FIELDS = ("differ", "signed_sum", "max_abs", "count")


@dataclasses.dataclass(frozen=True)
class ForcedTaps:
    """`inner`'s taps, with every traced activation replaced by the device's codes after its
    own codes are compared with them. State: {"layers"/"outer": {"enc": encodings, "trace":
    device codes}}. A tensor whose shape differs from its trace (the sink prefix's pass)
    keeps `inner`'s value."""

    inner: Any

    @property
    def simulation(self) -> str:
        return str(self.inner.simulation)

    def _wrap(self, prefix: str, tap: Any, state: dict[str, Any]) -> tuple[Any, Callable[[], Any]]:


        trace, enc = state["trace"], state["enc"]
        stats: dict[str, Any] = {}

        def forced(name: str, x: Any, where: Any = None) -> Any:
            y = tap(name, x, where)
            device = trace.get(name)
            if device is None or device.size != x.size:
                return y
            device = device.reshape(x.shape)
            e = enc[name]
            codes = quantize(x, positive_scale(e.scale), e.zero_point, e.qmin, e.qmax)
            diff = codes - device
            mask = jnp.broadcast_to(True if where is None else where, diff.shape)
            diff = jnp.where(mask, diff, 0)
            stats[name] = jnp.stack(
                [
                    jnp.sum(diff != 0).astype(jnp.float32),
                    jnp.sum(diff).astype(jnp.float32),
                    jnp.max(jnp.abs(diff)).astype(jnp.float32),
                    jnp.sum(mask).astype(jnp.float32),
                ]
            )
            return dequantize(device, e.scale, e.zero_point).astype(x.dtype)

        return forced, lambda: dict(stats)

    def layer(self, state: Any) -> tuple[Any, Callable[[], Any]]:
        tap, _ = self.inner.layer(state["enc"])
        return self._wrap("layers/", tap, state)

    def outer(self, state: Any) -> tuple[Any, Callable[[], Any]]:
        tap, _ = self.inner.outer(state["enc"])
        forced, stats = self._wrap("", tap, state)
        return forced, lambda: {"outer": stats()}

    def embed(self, state: Any, table: Any, tokens: Any) -> Any:
        return self.inner.embed(state["enc"], table, tokens)


def window_stats(
    params: Any,
    cfg: Any,
    plan: Any,
    state: Any,
    prefix: tuple[int, ...],
    int_model: Any,
    window: np.ndarray,
    simulations: tuple[str, ...] = SIMULATIONS,
    prefix_params: Any = None,
) -> dict[str, dict[str, np.ndarray]]:
    """{simulation: {tensor: [L or 1, 4] stats}} of one window [T] (see `STAT_FIELDS`): the
    fake-quant model (`params`, `plan`, `state`; its prefix on `prefix_params` where not
    `params`) forced onto `int_model`'s codes."""


    trace: dict[str, list[np.ndarray]] = {}
    E.run_chunk(int_model, window[None], E.new_cache(int_model, 1), trace)
    state = effective_state(plan, state)
    outer = {n: jnp.asarray(v[0], jnp.int32) for n, v in trace.items() if n in state["outer"]}
    layers = {
        n: jnp.asarray(np.stack(v), jnp.int32) for n, v in trace.items() if n in state["layers"]
    }
    tap_state = {
        "layers": {"enc": state["layers"], "trace": layers},
        "outer": {"enc": state["outer"], "trace": outer},
    }
    out = {}
    for simulation in simulations:
        taps = ForcedTaps(FakeQuantTaps(dataclasses.replace(plan, simulation=simulation)))
        tokens = jnp.asarray(window[None])
        aux = _forced_aux(
            params, tap_state, tokens, prefix_params, cfg=cfg, taps=taps, prefix=prefix
        )
        stats = {n: np.asarray(v) for n, v in aux["layers"].items()}
        out[simulation] = stats | {n: np.asarray(v)[None] for n, v in aux["outer"].items()}
    return out


@partial(jax.jit, static_argnames=("cfg", "taps", "prefix"))
def _forced_aux(
    params: Any,
    tap_state: Any,
    tokens: Any,
    prefix_params: Any,
    *,
    cfg: Any,
    taps: ForcedTaps,
    prefix: Any,
) -> Any:
    """The forced forward's statistics; compiled once per simulation, not per window."""

    return tapped_forward(
        params, tap_state, tokens, cfg=cfg, taps=taps, prefix=prefix, prefix_params=prefix_params
    )[1]


def summarize(per_window: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """Per tensor: differ share, mean signed difference, max |difference|, and per layer."""
    out: dict[str, Any] = {}
    for name in per_window[0]:
        s = np.stack([w[name] for w in per_window])  # [W, L, 4]
        by_layer = np.concatenate([s[..., :2].sum(0), s[..., 2:3].max(0), s[..., 3:].sum(0)], -1)
        total = by_layer[:, 3].sum()
        out[name] = {
            "differ_share": float(by_layer[:, 0].sum() / total),
            "mean_signed_diff": float(by_layer[:, 1].sum() / total),
            "max_abs_diff": float(by_layer[:, 2].max()),
            "codes": int(total),
            "differ_share_by_layer": (by_layer[:, 0] / by_layer[:, 3]).tolist(),
        }
    return out


def main(argv: list[str] | None = None) -> int:

    parser = study_parser(__name__, __doc__, run=True, json=True)
    parser.add_argument(
        "--artifact",
        type=Path,
        help="the run's integer artifact, exported when missing (default: artifacts/<run name>)",
    )
    add_eval_args(parser, windows=2)
    parser.add_argument(
        "--simulations",
        nargs="+",
        choices=SIMULATIONS,
        default=list(SIMULATIONS),
        help="the run's plan's `simulation` replaced by each in turn; "
        + CONFIG_KEYS["simulation"],
    )
    args = parser.parse_args(argv)
    say(f"reading and verifying the run {args.run}")
    loaded = load_run(args.run)
    art = args.artifact or Path("artifacts") / args.run.resolve().name
    if not (art / MANIFEST).exists():
        say(f"exporting the integer artifact to {art}")
        export_run(args.run, art)
    model = loaded.model
    ids = tokenize_documents(load_documents("wiki", "eval"), loaded.loaded.tokenizer)
    windows = eval_windows(ids, args.seq_len, args.windows)
    int_model = load_int_model(art)
    simulations = tuple(args.simulations)
    plan, state, params = model.require_plan(), model.require_state(), model.params()
    prefix_params = model.prefix_params()  # the sink prefix's float weights (GPTQ runs)
    say(f"{len(windows)} windows of {args.seq_len}: every op's codes against the device's")
    stats = [
        window_stats(
            params,
            model.cfg,
            plan,
            state,
            model.prefix,
            int_model,
            w,
            simulations,
            prefix_params=prefix_params,
        )
        for w in windows
    ]
    report = {
        **run_summary(args.run, loaded.config, windows),
        "artifact": str(art),
        "stat": "fake-quant op on the device's input codes vs the device's output codes",
        "simulations": {sim: summarize([w[sim] for w in stats]) for sim in simulations},
    }
    write_study_json(Path(args.json), report, command=study_command("op_gap", argv))
    for sim, tensors in report["simulations"].items():
        print(f"simulation {sim}: codes that differ from the device's, by tensor")
        for name, t in sorted(tensors.items(), key=lambda kv: -kv[1]["differ_share"]):
            print(
                f"  {name:16s} {100 * t['differ_share']:8.4f}%  mean signed "
                f"{t['mean_signed_diff']:+.2e}  max {t['max_abs_diff']:.0f}"
            )
    return 0
