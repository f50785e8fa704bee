"""The simulation gap: fake-quant perplexity of `qnpu quantize` runs vs their integer artifact.

For each run: export it (unless the artifact exists), then score the same `wiki` eval windows
with the run's fake-quant model (JAX) and with the artifact on the integer engines
(`--engines`: the numpy NPU emulator by default; `jax`, the JAX integer forward, equal bit for
bit and faster). Writes one JSON report: per engine the gap
ppl_int / ppl_fq - 1, with a paired standard error over windows (the same windows go through
both models, so the window-to-window spread of the difference measures how much of the gap
is rounding noise amplified through the layers rather than a systematic difference).

    qnpu study simulation_gap --runs runs/smollm2-135m-quantnpu-w8a8 \
        runs/smollm2-135m-quantnpu-w4a8 --seq-len 512 --windows 32 \
        --json reports/simulation_gap.json

With `--onnx`, each run is also exported to ONNX (`qnpu export --format onnx`, into
`--exports`) and scored in onnxruntime (CPU, level BASIC): the QDQ graphs with the same paired
gap, and the float graphs against the JAX float forward of the same transformed model (the
largest logit difference over the first window, relative to its largest logit). Every row
carries its prefill tokens/s (the windows' tokens over the scoring time):

    qnpu study simulation_gap --runs runs/smollm2-135m-quantnpu-w4a8 \
        runs/smollm2-135m-quarot-w8a8 --seq-len 512 --windows 16 --onnx --aimet \
        --json reports/onnx_fidelity.json

`--simulations` scores the fake-quant model under each simulation given (`QuantPlan.simulation`;
default: the one its plan names) against the same integer scores: the first is the reference of
every gap, each further one adds its own fake-quant scores and gaps under `other_simulations`.
The ONNX QDQ graphs and AIMET's QuantSim run float ops between their QDQ pairs, so their
reference is `fake`:

    qnpu study simulation_gap --runs runs/smollm2-135m-quantnpu-w4a8 --seq-len 512 \
        --windows 64 --simulations device fake --json reports/simulation_gap_device_64.json

`--aimet` adds AIMET's QuantSim (aimet-onnx) over the float prefill graph with the export's
model.encodings loaded by AIMET's own loader, scored the same way.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import study_command
from qnpu_jax.eval import perplexity
from qnpu_jax.export.artifact import MANIFEST
from qnpu_jax.export.exporter import export_run
from qnpu_jax.export.int_model import load_int_model
from qnpu_jax.export.onnx_export import export_run_onnx
from qnpu_jax.ir.graph import SIMULATIONS
from qnpu_jax.models.taps import FakeQuantTaps, tapped_forward
from qnpu_jax.pipeline.run import load_run
from qnpu_jax.runtime.engines import open_engine
from qnpu_jax.runtime.onnx_run import OnnxModel, aimet_quantsim
from qnpu_jax.studies import study_parser
from qnpu_jax.studies.harness import add_eval_args, say, write_study_json


def _ppl(nll_fn: Any, windows: np.ndarray) -> dict[str, Any]:
    r = perplexity(nll_fn, windows, progress=False)
    return {
        "ppl": r.ppl,
        "nll_mean": r.nll_sum / r.predicted_tokens,
        "seconds": r.seconds,
        "prefill_tokens_per_second": windows.size / r.seconds,
        "window_nll": list(r.window_nll),
    }


def _float_logit_gap(run: Any, onnx_dir: Path, window: np.ndarray) -> float:
    """max |logits_onnx − logits_jax| / max |logits_jax| of the float graphs on one window."""


    model = run.model
    ref, _ = tapped_forward(
        model.params(), None, jnp.asarray(window[None]), cfg=model.cfg, taps=None,
        prefix=model.prefix,
    )  # fmt: skip
    ref = np.asarray(ref[0])
    got = OnnxModel(onnx_dir).logits(window)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def fake_quant_argmax(model: Any, windows: np.ndarray) -> np.ndarray:
    """The fake-quant model's greedy prediction [N, T-1] at each position of the windows."""


    params, taps = model.params(), FakeQuantTaps(model.require_plan())
    prefix_params = model.prefix_params()

    @jax.jit  # params and state as arguments: closed over, XLA would constant-fold them
    def top(params: Any, state: Any, tokens: Any, prefix_params: Any) -> Any:
        logits, _ = tapped_forward(
            params, state, tokens, cfg=model.cfg, taps=taps, prefix=model.prefix,
            prefix_params=prefix_params,
        )  # fmt: skip
        return jnp.argmax(logits[:, :-1], axis=-1)

    return np.concatenate(
        [np.asarray(top(params, model.state, jnp.asarray(w[None]), prefix_params)) for w in windows]
    )


def _recording_argmax(model: Any, tops: list[np.ndarray]) -> Callable[[Any], np.ndarray]:
    """An OnnxModel's NLL function that also appends its greedy predictions to `tops`."""

    def nll(windows: Any) -> np.ndarray:
        values, top = model.token_nll_argmax(windows)
        tops.append(top)
        return values

    return nll


def paired_gap(fake: list[float], integer: list[float]) -> dict[str, Any]:
    """The perplexity gap with a paired standard error over windows (equal-length windows:
    log ppl is the mean of the window NLLs), and how many windows each side wins."""
    d = np.asarray(integer) - np.asarray(fake)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
    return {
        "gap": math.expm1(mean),
        "gap_2se_interval": [math.expm1(mean - 2 * se), math.expm1(mean + 2 * se)],
        "nll_diff_mean": mean,
        "nll_diff_se": se,
        "windows_integer_lower": int((d < 0).sum()),
        "windows_integer_higher": int((d > 0).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = study_parser(__name__, __doc__, json=True)
    parser.add_argument(
        "--runs", nargs="+", type=Path, required=True, help="finished `qnpu quantize` runs"
    )
    parser.add_argument(
        "--artifacts",
        type=Path,
        default=Path("artifacts"),
        help="integer artifacts, one per run (ARTIFACTS/<run name>), exported when missing",
    )
    add_eval_args(parser, windows=32)
    parser.add_argument(
        "--engines", nargs="+", choices=("emulator", "jax"), default=["emulator"],
        help="integer engines that score the artifact (default: emulator)",
    )  # fmt: skip
    parser.add_argument(
        "--simulations", nargs="+", choices=SIMULATIONS,
        help="score the fake-quant model under each (default: its plan's); the first is the "
        "reference of the gaps",
    )  # fmt: skip
    parser.add_argument("--onnx", action="store_true", help="also the ONNX export, onnxruntime")
    parser.add_argument(
        "--aimet", action="store_true", help="also AIMET's QuantSim on the export (needs --onnx)"
    )
    parser.add_argument("--exports", type=Path, default=Path("exports"), help="ONNX exports")
    args = parser.parse_args(argv)
    if args.aimet and not args.onnx:
        parser.error("--aimet scores the ONNX export: add --onnx")
    report: dict[str, Any] = {
        "data": "wiki (eval split)",
        "seq_len": args.seq_len,
        "windows": args.windows,
        "runs": {},
    }
    command = study_command("simulation_gap", argv)
    for run in args.runs:
        say(f"reading and verifying the run {run}")
        loaded_run = load_run(run)
        config, model = loaded_run.config, loaded_run.loaded
        plan = loaded_run.model.require_plan()
        simulations = list(dict.fromkeys(args.simulations or [plan.simulation]))
        under = {
            sim: loaded_run.model.replace(plan=dataclasses.replace(plan, simulation=sim))
            for sim in simulations
        }
        quantized = under[simulations[0]]
        art = args.artifacts / run.resolve().name
        export_s = None  # None: an existing artifact was reused

        if not (art / MANIFEST).exists():
            say(f"exporting the integer artifact to {art}")
            t0 = time.perf_counter()
            export_run(run, art)
            export_s = time.perf_counter() - t0
        ids = tokenize_documents(load_documents("wiki", "eval"), model.tokenizer)
        windows = eval_windows(ids, args.seq_len, args.windows)
        say(f"fake-quant perplexity ({', '.join(simulations)}), then the integer engines")
        fakes = {sim: _ppl(m.nll_fn(), windows) for sim, m in under.items()}
        fake = fakes[simulations[0]]
        int_model = load_int_model(art)
        entry: dict[str, Any] = {
            "method": config.method,
            "bits": config.bits.name,
            "artifact": str(art),
            "export_seconds": export_s,
            "simulation": simulations[0],
            "fake_quant": fake,
            "other_simulations": {sim: {"fake_quant": fakes[sim]} for sim in simulations[1:]},
        }
        scorers: dict[str, Callable[[Any], np.ndarray]] = {
            name: open_engine(name, int_model).token_nll for name in args.engines
        }
        tops: dict[str, list[np.ndarray]] = {}
        if args.onnx:

            onnx_dir = args.exports / run.resolve().name
            if not (onnx_dir / MANIFEST).exists():
                t0 = time.perf_counter()
                context = args.seq_len + len(loaded_run.model.prefix)
                chunk = min(64, args.seq_len)
                export_run_onnx(run, onnx_dir, chunk=chunk, max_context=context)
                entry["onnx_export_seconds"] = time.perf_counter() - t0
            entry["onnx"] = str(onnx_dir)
            fake_top = fake_quant_argmax(quantized, windows)
            tops["onnxruntime_qdq"] = []
            qdq = OnnxModel(onnx_dir, qdq=True)
            scorers["onnxruntime_qdq"] = _recording_argmax(qdq, tops["onnxruntime_qdq"])
            if args.aimet:

                sim, loaded = aimet_quantsim(onnx_dir)
                entry["aimet_loaded"] = loaded
                sim_model = OnnxModel(onnx_dir, qdq=True, sessions={"prefill": sim})
                tops["aimet_quantsim"] = []
                scorers["aimet_quantsim"] = _recording_argmax(sim_model, tops["aimet_quantsim"])
            gap = _float_logit_gap(loaded_run, onnx_dir, windows[0])
            entry["onnxruntime_float_max_rel_logit_diff"] = gap
            print(f"{run.name}: onnxruntime float vs JAX float, max relative logit diff {gap:.2e}")
        for name, scorer in scorers.items():
            result = _ppl(scorer, windows)
            result |= paired_gap(fake["window_nll"], result["window_nll"])
            if tops.get(name):
                agree = np.concatenate(tops[name]) == fake_top
                result["argmax_agreement_with_fake_quant"] = float(agree.mean())
            entry[name] = result
            gaps = {simulations[0]: (fake, result)}
            for sim, other in entry["other_simulations"].items():
                other[name] = paired_gap(fakes[sim]["window_nll"], result["window_nll"])
                gaps[sim] = (fakes[sim], other[name])
            for sim, (fq, paired) in gaps.items():
                lo, hi = paired["gap_2se_interval"]
                print(
                    f"{run.name}: fake-quant ({sim}) {fq['ppl']:.4f}, {name} {result['ppl']:.4f} "
                    f"({100 * paired['gap']:+.3f}%, ±2 SE [{100 * lo:+.3f}%, {100 * hi:+.3f}%])"
                )
        report["runs"][run.name] = entry
        write_study_json(args.json, report, command=command)
    worst = max(abs(e[name]["gap"]) for e in report["runs"].values() for name in args.engines)
    print(f"largest |gap| {100 * worst:.3f}% -> {args.json}")
    return 0 if math.isfinite(worst) else 1
