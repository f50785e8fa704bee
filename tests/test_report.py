"""`qnpu report`: the Table 1 shaped table from hand-written run dirs and eval JSONs, its
significance marks against the float row, flags for other settings, the plots, bad inputs,
and the activation-histogram helpers (synthetic arrays; the capture on the tiny model)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from qnpu_jax.cli import main
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.run_manifest import seal_run
from qnpu_jax.quant.plan import QuantRule, default_plan
from qnpu_jax.quant.state import Encoding
from qnpu_jax.report.plots import (
    PNG_MAGIC,
    ActivationPanel,
    ClipRange,
    clip_range,
    moving_average,
    plot_activation_distributions,
    share_inside,
)
from qnpu_jax.report.table import Measure, significance

LAYERS = 4


def write_run(
    root: Path,
    name: str,
    *,
    method: str,
    w: int,
    a: int,
    ppl: float,
    float_ppl: float = 15.0,
    windows: int = 32,
    stage1_steps: int = 0,
    down_in_bits: tuple[int, ...] | None = None,
) -> Path:
    """A finished run dir as `qnpu quantize` leaves it (without the orbax checkpoints)."""
    run = root / "runs" / name
    run.mkdir(parents=True)
    config = QuantizeConfig.of(method=method, w_bits=w, a_bits=a, mixed_precision=0.0)
    (run / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    rules = [QuantRule(pattern="layers/down_in", layer_bits=down_in_bits)] if down_in_bits else []
    plan = default_plan(LAYERS, w_bits=w, a_bits=a, rules=rules)
    (run / "plan.json").write_text(json.dumps(plan.to_dict()))
    report = {
        "method": method,
        "bits": f"W{w}A{a}KV8",
        "prefix": "bos",
        "seq_len": 512,
        "stage1_steps": stage1_steps,
        "perplexity": {
            "wiki": {
                "float_ppl": float_ppl,
                "quantized_ppl": ppl,
                "ratio": ppl / float_ppl,
                "windows": windows,
                "tokens": windows * 511,
            }
        },
    }
    (run / "report.json").write_text(json.dumps(report))
    if stage1_steps:
        (run / "stage1").mkdir()
        lines = [
            {
                "step": s,
                "ce": 4.0 - 0.05 * s,
                "grad_norm": 30.0,
                "local": 0.01,
                "local_weight": 1.0 if s <= 2 else 0.0,
                "loss": 4.01 - 0.05 * s,
                "seconds": 20.0,
            }
            for s in range(1, stage1_steps + 1)
        ]
        (run / "stage1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    seal_run(run)
    return run


def task_entry(value: float, stderr: float, n: int, lambada_ppl: tuple[float, float] | None = None):
    # acc and acc_norm differ on purpose: the table must pick the harness's headline metric.
    metrics = {"acc": value, "acc_stderr": stderr, "acc_norm": value, "acc_norm_stderr": stderr}
    if lambada_ppl is not None:
        metrics = {
            "acc": value,
            "acc_stderr": stderr,
            "perplexity": lambada_ppl[0],
            "perplexity_stderr": lambada_ppl[1],
        }
    return {"metrics": metrics, "n": n, "n_total": 1000, "indices": list(range(n))}


def write_eval(file: Path, *, tasks: dict, limit: int | None, **source) -> Path:
    doc = {"model": None, "run": None, "path": "float", "prefix": "bos", "data": "wiki"}
    doc |= source
    doc |= {"tasks": tasks, "limit": limit}
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(doc))
    return file


def with_wrong_acc(entry: dict) -> dict:
    """acc far from acc_norm: a table reading acc for an acc_norm task would show 1.0."""
    m = dict(entry["metrics"])
    m["acc"] = 0.01
    return {**entry, "metrics": m}


# Hand-written scores (fraction, stderr); n = 100 unless said otherwise.
FLOAT = {
    "piqa": (0.70, 0.046),
    "winogrande": (0.60, 0.049),
    "hellaswag": (0.40, 0.049),
    "arc_easy": (0.55, 0.050),
    "arc_challenge": (0.30, 0.046),
    "lambada": (0.40, 0.049),
}
QUAROT = {
    "piqa": (0.55, 0.050),  # −0.15 vs bound 2·sqrt(.046²+.05²) = 0.136 → ▼
    "winogrande": (0.47, 0.050),  # −0.13 vs bound 0.140 → within noise
    "hellaswag": (0.58, 0.049),  # +0.18 vs bound 0.139 → ▲
    "arc_easy": (0.40, 0.049),  # −0.15 vs bound 0.140 → ▼
    "arc_challenge": (0.30, 0.046),  # equal
    "lambada": (0.20, 0.040),  # −0.20 vs bound 0.126 → ▼
}
FLOAT_LAMBADA_PPL = (20.0, 2.0)
QUAROT_LAMBADA_PPL = (60.0, 8.0)  # +40 vs bound 2·sqrt(4+64) = 16.5 → ▲
EXPECTED_QUAROT = {
    "PIQA": "55.0 ±5.0 ▼",
    "Winogrande": "47.0 ±5.0",
    "HellaSwag": "58.0 ±4.9 ▲",
    "ARC-E": "40.0 ±4.9 ▼",
    "ARC-C": "30.0 ±4.6",
    "LAMBADA": "20.0 ±4.0 ▼",
    "LAMBADA ppl ↓": "60.00 ±8.00 ▲",
}


def tasks_of(scores: dict, n: int, lambada_ppl: tuple[float, float]) -> dict:
    out = {}
    for name, (v, se) in scores.items():
        entry = task_entry(v, se, n, lambada_ppl if name == "lambada" else None)
        out[name] = with_wrong_acc(entry) if name in ("piqa", "hellaswag", "arc_easy") else entry
    return out


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """Two runs (QuaRot W8A8 without stage 1; Quant.npu W4A8 with stage 1 and mixed
    down_proj bits), evals of the float model, both runs (Quant.npu at another n) and an
    emulator artifact of the Quant.npu run, and a mixed-precision sweep."""
    monkeypatch.chdir(tmp_path)
    quarot = write_run(tmp_path, "quarot-w8a8", method="quarot", w=8, a=8, ppl=29.7182)
    qnpu = write_run(
        tmp_path,
        "quantnpu-w4a8",
        method="quantnpu",
        w=4,
        a=8,
        ppl=28.111,
        stage1_steps=6,
        down_in_bits=(8, 16, 8, 8),
    )
    evals = tmp_path / "evals"
    float_eval = write_eval(
        evals / "float.json",
        model="smollm2-135m",
        tasks=tasks_of(FLOAT, 100, FLOAT_LAMBADA_PPL),
        limit=100,
    )
    quarot_eval = write_eval(
        evals / "quarot.json",
        run="runs/quarot-w8a8",  # relative to the cwd, as `qnpu eval --run` records it
        path="fake-quant (static)",
        tasks=tasks_of(QUAROT, 100, QUAROT_LAMBADA_PPL),
        limit=100,
    )
    qnpu_eval = write_eval(
        evals / "qnpu.json",
        run=str(qnpu.resolve()),
        tasks={"piqa": task_entry(0.66, 0.067, 50), "winogrande": task_entry(0.58, 0.07, 50)},
        limit=50,
    )
    artifact_eval = evals / "artifact.json"
    artifact_eval.write_text(
        json.dumps(
            {
                "artifact": "artifacts/quantnpu-w4a8",
                "path": "integer (emulator)",
                "prefix": "bos",
                "source": {"run": "quantnpu-w4a8", "method": "quantnpu", "model": "smollm2-135m"},
                "data": "wiki",
                "split": "eval",
                "seq_len": 512,
                "windows": 16,
                "ppl": 28.5,
            }
        )
    )
    sweep = tmp_path / "sweep.json"
    sweep.write_text(
        json.dumps(
            {
                "run": "runs/quantnpu-w4a8",
                "method": "quantnpu",
                "bits": "W4A8KV8",
                "eval": {"data": "wiki (eval split)", "windows": 32},
                "float_ppl": 15.0,
                "rows": [
                    {"fraction": f, "promoted_layers": [], "ppl": p, "ratio_to_float": p / 15}
                    for f, p in ((0.0, 40.0), (0.5, 20.0), (1.0, 16.0))
                ],
            }
        )
    )
    return {
        "runs": [str(quarot), "runs/quantnpu-w4a8"],
        "evals": [str(p) for p in (float_eval, quarot_eval, qnpu_eval, artifact_eval)],
        "sweep": str(sweep),
        "out": tmp_path / "reports" / "table1",
    }


def md_table(text: str) -> list[dict[str, str]]:
    """The first Markdown table of `text` as header -> cell dicts."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split(" | ")]
    rows = []
    for line in lines[2:]:
        if line.startswith("|---"):
            break
        cells = [c.strip() for c in line.strip().removeprefix("| ").removesuffix(" |").split(" | ")]
        if len(cells) != len(header):
            break
        rows.append(dict(zip(header, cells, strict=True)))
    return rows


def report_args(inputs: dict, *, sweep: bool = True) -> list[str]:
    args = ["report", "--runs", *inputs["runs"], "--evals", *inputs["evals"]]
    if sweep:
        args += ["--sweep", inputs["sweep"]]
    return [*args, "--out", str(inputs["out"])]


def test_report_table_marks_and_flags(inputs, capsys):
    assert main(report_args(inputs)) == 0
    out: Path = inputs["out"]
    md = out.with_name("table1.md").read_text()
    rows = md_table(md)
    headers = list(rows[0])
    assert headers == [
        "Method",
        "Source",
        "W-A-KV",
        "Granularity",
        "down_proj in",
        "n / task",
        "PPL wiki ↓",
        "PIQA",
        "Winogrande",
        "HellaSwag",
        "ARC-E",
        "ARC-C",
        "LAMBADA",
        "LAMBADA ppl ↓",
        "Avg ↑",
    ]
    assert [r["Method"] for r in rows] == [
        "FP32",
        "QuaRot",
        "Quant.npu",
        "Quant.npu (integer, emulator)",
    ]
    fp, quarot, qnpu, artifact = rows

    # Float row: the float eval's tasks, the float PPL the runs recorded on their own windows.
    assert fp["PIQA"] == "70.0 ±4.6" and fp["PPL wiki ↓"] == "15.00" and fp["n / task"] == "100"
    assert fp["LAMBADA ppl ↓"] == "20.00 ±2.00"
    # Avg: (0.70+0.60+0.40+0.55+0.30+0.40)/6 = 49.17%, se sqrt(Σse²)/6 = 1.97%.
    assert fp["Avg ↑"] == "49.2 ±2.0"

    # QuaRot: marks exactly where |diff| > 2·sqrt(se² + se_float²).
    assert quarot["W-A-KV"] == "W8A8KV8" and quarot["PPL wiki ↓"] == "29.72"
    assert quarot["Granularity"] == "W per-channel / A per-tensor static"
    assert quarot["down_proj in"] == "8" and quarot["n / task"] == "100"
    assert {k: quarot[k] for k in EXPECTED_QUAROT} == EXPECTED_QUAROT
    # Avg 41.67% ±1.94 vs 49.17% ±1.97: −7.5 > 2·sqrt(1.94² + 1.97²) = 5.52 → ▼
    assert quarot["Avg ↑"] == "41.7 ±1.9 ▼"
    table_text = "\n".join(line for line in md.splitlines() if line.startswith("|"))
    assert table_text.count("▲") == 2 and table_text.count("▼") == 4

    # Quant.npu: other n (50 vs 100): every task cell flagged, never silently compared.
    assert qnpu["down_proj in"] == "8; 16 in layer 1" and qnpu["n / task"] == "50"
    assert qnpu["W-A-KV"] == "W4A8KV8"
    assert qnpu["PIQA"] == "66.0 ±6.7†"  # −4.0 within 2·sqrt(4.6² + 6.7²) = 16.3: no mark
    assert qnpu["Winogrande"] == "58.0 ±7.0†"
    assert qnpu["HellaSwag"] == "–" and qnpu["Avg ↑"] == "–"
    assert "Quant.npu (runs/quantnpu-w4a8), PIQA: n 50 vs 100" in md
    # The artifact row: its own PPL over 16 windows, flagged against the float's 32.
    assert artifact["PPL wiki ↓"] == "28.50†" and artifact["W-A-KV"] == "W4A8KV8"
    assert "PPL wiki ↓: windows 16 vs 32" in md

    assert "within noise" in md and "two standard errors" in md
    assert "Runs without stage 1" in md and f"`{inputs['runs'][0]}`" in md
    assert "![Stage-1 loss (paper Figure 1b)](table1/stage1_loss.png)" in md
    assert "| 50% |" in md  # the sweep's rows

    html = out.with_name("table1.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html
    assert html.count("data:image/png;base64,") == 2 and "55.0 ±5.0 ▼" in html

    doc = json.loads(out.with_name("table1.json").read_text())
    assert doc["columns"] == headers and len(doc["rows"]) == 4
    q = doc["rows"][1]
    assert q["tasks"]["piqa"]["mark"] == "▼" and q["tasks"]["piqa"]["metric"] == "acc_norm"
    assert q["tasks"]["winogrande"]["metric"] == "acc" and q["tasks"]["winogrande"]["mark"] == ""
    assert q["cells"]["HellaSwag"] == "58.0 ±4.9 ▲"
    assert doc["rows"][2]["tasks"]["piqa"]["flag"].startswith("Quant.npu")

    for png in ("stage1_loss.png", "mixed_precision_sweep.png"):
        data = (out / png).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == ["table1", "table1.html", "table1.json", "table1.md"]  # no temporaries
    assert sorted(p.name for p in out.iterdir()) == ["mixed_precision_sweep.png", "stage1_loss.png"]
    assert "flag: Quant.npu" in capsys.readouterr().err

    # Again without --sweep: the stale sweep picture goes, the rest is rewritten.
    assert main(report_args(inputs, sweep=False)) == 0
    assert sorted(p.name for p in out.iterdir()) == ["stage1_loss.png"]
    assert "Figure 4" not in out.with_name("table1.md").read_text()


def test_ratio_columns_divide_by_the_float_row_and_keep_its_flags(inputs):
    """`ratios=True` (the compare study's table): "× float" after each perplexity the float
    row has; a cell measured on other windows carries the perplexity's flag."""
    from qnpu_jax.report.table import build_rows, build_table, rows_json

    rows, notes = build_rows([Path(r) for r in inputs["runs"]], [Path(e) for e in inputs["evals"]])
    assert "ratio:wiki" not in dict(build_table(rows, notes).columns)  # opt-in
    table = build_table(rows, notes, ratios=True)
    headers = [h for _, h in table.columns]
    assert headers[headers.index("PPL wiki ↓") + 1] == "× float wiki"
    texts = [cells["ratio:wiki"].render() for cells in table.cells]
    assert texts == ["1.000", f"{29.7182 / 15:.3f}", f"{28.111 / 15:.3f}", f"{28.5 / 15:.3f}†"]
    assert rows_json(table)[1]["ratio"] == {"wiki": pytest.approx(29.7182 / 15)}


def test_report_runs_only(tmp_path):
    """No eval JSONs: an FP32 row from the float PPL the runs recorded, no task columns."""
    run = write_run(tmp_path, "rtn", method="rtn", w=8, a=8, ppl=61.12)
    out = tmp_path / "reports" / "runs"
    assert main(["report", "--runs", str(run), "--out", str(out)]) == 0
    rows = md_table(out.with_name("runs.md").read_text())
    assert list(rows[0])[-1] == "PPL wiki ↓"
    assert [(r["Method"], r["PPL wiki ↓"]) for r in rows] == [("FP32", "15.00"), ("RTN", "61.12")]
    assert not out.exists()  # no stage 1, no sweep: no pictures


def _no_outputs(root: Path) -> bool:
    reports = root / "reports"
    return not reports.exists() or not any(reports.iterdir())


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing_run", "run directory not found"),
        ("unfinished_run", "report.json is missing"),
        ("unsealed_run", "quantnpu-w4a8 is not a finished run: manifest.json is missing"),
        ("tampered_run", "plan.json: hash mismatch"),
        ("malformed_eval", "malformed JSON"),
        ("unmatched_eval", "is not among --runs"),
        ("unmatched_artifact", "no run in --runs has that name"),
        ("missing_metric", "metric 'acc_norm' is missing"),
        ("bad_metrics_line", "metrics.jsonl:2"),
        ("bad_sweep", "not a mixed-precision sweep"),
        ("two_float_models", "2 float models"),
        ("duplicate_task", "pass one of them"),
    ],
)
def test_bad_inputs_exit_2_and_write_nothing(inputs, tmp_path, capsys, case, message):
    args = report_args(inputs)
    evals = tmp_path / "evals"
    if case == "missing_run":
        args[args.index(inputs["runs"][1])] = "runs/nope"
    elif case == "unfinished_run":  # resealed: the report's own check is what it meets
        (tmp_path / "runs" / "quantnpu-w4a8" / "report.json").unlink()
        seal_run(tmp_path / "runs" / "quantnpu-w4a8")
    elif case == "unsealed_run":
        (tmp_path / "runs" / "quantnpu-w4a8" / "manifest.json").unlink()
    elif case == "tampered_run":
        plan = tmp_path / "runs" / "quantnpu-w4a8" / "plan.json"
        plan.write_text(plan.read_text().replace('"bits": 4', '"bits": 5', 1))
    elif case == "malformed_eval":
        (evals / "quarot.json").write_text('{"run": "runs/quarot-w8a8", "tasks": ')
    elif case == "unmatched_eval":
        doc = json.loads((evals / "quarot.json").read_text())
        (evals / "quarot.json").write_text(json.dumps({**doc, "run": "runs/other"}))
    elif case == "unmatched_artifact":
        doc = json.loads((evals / "artifact.json").read_text())
        doc["source"]["run"] = "other"
        (evals / "artifact.json").write_text(json.dumps(doc))
    elif case == "missing_metric":
        doc = json.loads((evals / "float.json").read_text())
        del doc["tasks"]["piqa"]["metrics"]["acc_norm"]
        (evals / "float.json").write_text(json.dumps(doc))
    elif case == "bad_metrics_line":
        path = tmp_path / "runs" / "quantnpu-w4a8" / "stage1" / "metrics.jsonl"
        path.write_text(path.read_text().splitlines()[0] + "\n{not json\n")
        seal_run(path.parents[1])
    elif case == "bad_sweep":
        Path(inputs["sweep"]).write_text(json.dumps({"rows": "none"}))
    elif case == "two_float_models":
        doc = json.loads((evals / "float.json").read_text())
        write_eval(evals / "float2.json", model="other-model", tasks={}, limit=None, ppl=1.0)
        args[args.index("--sweep") : args.index("--sweep")] = [str(evals / "float2.json")]
        assert doc["model"] == "smollm2-135m"
    elif case == "duplicate_task":
        args[args.index("--sweep") : args.index("--sweep")] = [str(evals / "dup.json")]
        doc = json.loads((evals / "quarot.json").read_text())
        (evals / "dup.json").write_text(json.dumps(doc))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("qnpu: error: ") and message in err, err
    assert _no_outputs(tmp_path)


def test_out_with_extension_is_refused(inputs, capsys):
    args = report_args(inputs)
    args[-1] += ".md"
    assert main(args) == 2
    assert "without an extension" in capsys.readouterr().err


def test_significance_rule():
    f = Measure(0.5, 0.03)
    bound = 2 * math.sqrt(0.03**2 + 0.04**2)  # 0.1
    assert significance(Measure(0.5 - bound - 1e-9, 0.04), f) == "▼"
    assert significance(Measure(0.5 - bound + 1e-9, 0.04), f) == ""
    assert significance(Measure(0.5 + bound + 1e-9, 0.04), f) == "▲"
    assert significance(Measure(0.9, None), f) == ""  # no stderr: nothing is claimed


def test_moving_average():
    np.testing.assert_allclose(moving_average([1, 2, 3, 4], 2), [1, 1.5, 2.5, 3.5])
    np.testing.assert_allclose(moving_average([1, 2], 1), [1, 2])


# ------------------------------------------------------------------------------ Figures 5–6


def test_clip_range_and_share_inside():
    r = clip_range("8 bits", 0.1, 0.0, -128, 127)
    assert (r.lo, r.hi) == pytest.approx((-12.8, 12.7))
    r = clip_range("asym", 0.5, 3.4, 0, 255)  # zero point rounded as fake_quant does: 3
    assert (r.lo, r.hi) == pytest.approx((-1.5, 126.0))
    v = np.array([-2.0, -1.0, 0.0, 1.0, 5.0])
    assert share_inside(v, -1.0, 1.0) == pytest.approx(0.6)


def test_plot_activation_distributions_on_synthetic_values():
    rng = np.random.default_rng(0)
    gaussian = rng.normal(0, 1, 20000).astype(np.float32)
    heavy = rng.standard_t(1.5, 20000).astype(np.float32)
    mu, sigma = float(gaussian.mean()), float(gaussian.std())
    panels = [
        ActivationPanel(
            "rotated", gaussian, (ClipRange("mean ± 3σ", mu - 3 * sigma, mu + 3 * sigma),)
        ),
        ActivationPanel(
            "unrotated",
            heavy,
            (ClipRange("max-min", float(heavy.min()), float(heavy.max())), ClipRange("±1", -1, 1)),
        ),
        ActivationPanel("constant, no range", np.zeros(10, np.float32)),
    ]
    png = plot_activation_distributions(panels, columns=2, title="synthetic")
    assert png.startswith(PNG_MAGIC) and len(png) > 5000
    assert 0.99 < share_inside(gaussian, mu - 3 * sigma, mu + 3 * sigma) < 0.999


def test_capture_activations_on_tiny_model(tiny_cfg, tiny_params):
    """The capture runs the calibration forward and returns one layer's raw values."""
    import jax.numpy as jnp

    from qnpu_jax.models.llama import embed_rows, rms_norm
    from qnpu_jax.pipeline.calibrate import capture_activations

    windows = np.arange(2 * 12, dtype=np.int32).reshape(2, 12) % tiny_cfg.vocab_size
    names = ("attn_in", "attn_out", "down_in")
    acts = capture_activations(tiny_params, tiny_cfg, windows, names, layer=0, prefix=(1,))
    assert acts["attn_in"].shape == (2, 12, tiny_cfg.hidden_size)
    assert acts["attn_out"].shape == (2, 12, tiny_cfg.q_size)
    assert acts["down_in"].shape == (2, 12, tiny_cfg.intermediate_size)
    x = embed_rows(tiny_params["embed_tokens"], jnp.asarray(windows))
    expected = rms_norm(x, tiny_params["layers"]["input_layernorm"][0], tiny_cfg.rms_norm_eps)
    np.testing.assert_allclose(acts["attn_in"], np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_plot_activations_script_ranges():
    """The script's range helpers without a model: the plan initializer on given values and
    the run's stored encoding of one layer."""
    import jax.numpy as jnp
    from conftest import load_script

    from qnpu_jax.quant.plan import TensorQuant

    script = load_script("plot_activations")
    values = np.array([-2.0, -1.0, 0.0, 0.5, 4.0], np.float32)
    r = script.init_range(values, TensorQuant(bits=8), 0, "max_min")
    assert (r.lo, r.hi) == pytest.approx((-4.0 * 128 / 127, 4.0))  # s = max|x| / 127
    mu, sigma = float(values.mean()), float(values.std())
    r = script.init_range(values, TensorQuant(bits=8), 0, "mean_std")
    amax = max(abs(mu - 3 * sigma), abs(mu + 3 * sigma))  # s = amax / 2^7 (the paper's eq.)
    assert (r.lo, r.hi) == pytest.approx((-amax, amax * 127 / 128), rel=1e-5)
    entry = Encoding(
        scale=jnp.array([0.5, 0.25]),
        zero_point=jnp.zeros(2),
        qmin=jnp.array([-128.0, -32768.0]),
        qmax=jnp.array([127.0, 32767.0]),
    )
    r = script.run_range(entry, 1, "run")
    assert (r.lo, r.hi) == (-8192.0, 8191.75)
    # shadow outliers: the hot channels' integer range is unbounded (they run on the CPU);
    # the run's range is the ordinary channels', and says how many it leaves out
    big = float(2**23)
    shadowed = Encoding(
        scale=jnp.array([0.5]),
        zero_point=jnp.zeros(1),
        qmin=jnp.array([[-128.0, -big, -128.0, -big]]),
        qmax=jnp.array([[127.0, big - 1, 127.0, big - 1]]),
    )
    r = script.run_range(shadowed, 0, "run")
    assert (r.lo, r.hi) == (-64.0, 63.5) and r.label == "run, 2 shadow channels unclipped"


def test_mixed_precision_sweep_refuses_a_run_with_outlier_channels(monkeypatch, capsys):
    """A run whose down_proj inputs have shadow (or MUXQ) channels: the sweep re-encodes those
    inputs per layer, so it refuses in its first second with what to do instead."""
    import types

    from conftest import load_script

    from qnpu_jax.cli import main
    from qnpu_jax.quant.plan import default_plan

    plan = default_plan(2, w_bits=8)
    plan = plan.with_entries(
        (p, dataclasses.replace(t, shadow_channels=((3,), ())) if p == "layers/down_in" else t)
        for p, t in plan.entries
    )
    sweep = load_script("mixed_precision_sweep")
    run = types.SimpleNamespace(plan=plan, state=None, params=None, cfg=None, prefix=())
    monkeypatch.setattr(sweep, "open_run", lambda path: run)
    assert main(["study", "mixed_precision_sweep", "--run", "r", "--json", "s.json"]) == 2
    assert "outlier channels of the down_proj inputs (shadow outliers)" in capsys.readouterr().err
