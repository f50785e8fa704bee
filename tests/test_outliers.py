"""mllm-NPU's shadow outliers: the channel choice, the plan field, per-channel bounds, the
identity the device relies on, and the step on the real two-layer model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (  # tests/ is on sys.path (rootdir conftest)
    SHARED_DATA,
    engines_agree_with_fake_quant,
)

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import SHADOW_BITS
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import FakeQuantTaps, shadow_bounds, state_entry
from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
from qnpu_jax.pipeline.outlier_paths import choose_shadows, shadow_matmul
from qnpu_jax.quant.fake_quant import fake_quant
from qnpu_jax.quant.plan import QuantPlan, QuantRule, TensorQuant, default_plan

WIDE = (-(2 ** (SHADOW_BITS - 1)), 2 ** (SHADOW_BITS - 1) - 1)


def test_choose_shadows_keeps_the_most_important_layers_and_their_overflowing_channels():
    absmax = np.array(
        [
            [1.0, 2.0, 30.0, 1.0],  # importance 30 / 0.1 = 300
            [1.0, 1.0, 1.0, 1.0],  # 10: no channel overflows
            [50.0, 1.0, 13.0, 1.0],  # 500, but promoted to 16 bits
            [1.0, 20.0, 12.8, 20.0],  # 200
        ]
    )
    scale = np.full(4, 0.1)
    tq = TensorQuant(bits=8, layer_bits=(8, 8, 16, 8))
    choice = choose_shadows(absmax, scale, np.zeros(4), tq, keep=0.5)
    assert choice.kept_layers == (0, 3)  # layer 2 is not eligible at 16 bits
    # 12.8 / 0.1 = 128 codes: past +127, so hot; 13.0 in layer 2 is not looked at
    assert choice.channels == ((2,), (), (), (1, 2, 3))
    assert choice.importance[2] == 0.0 and choice.importance[0] == pytest.approx(300)
    assert choose_shadows(absmax, scale, np.zeros(4), tq, keep=1.0).kept_layers == (0, 1, 3)
    for keep in (0.0, 1.5):
        with pytest.raises(QnpuError, match="keep must be in"):
            choose_shadows(absmax, scale, np.zeros(4), tq, keep=keep)


def test_shadow_channels_in_the_plan_round_trip_and_are_checked():
    plan = default_plan(2, rules=[QuantRule(pattern="layers/down_in", bits=8)])
    tq = dataclasses.replace(plan.get("layers/down_in"), shadow_channels=[[3, 7], []])
    assert tq.shadow_channels == ((3, 7), ())
    shadowed = plan.with_entries((p, tq if p == "layers/down_in" else t) for p, t in plan.entries)
    again = QuantPlan.from_dict(json.loads(json.dumps(shadowed.to_dict())))
    assert again == shadowed
    with pytest.raises(QnpuError, match="sorted and distinct"):
        TensorQuant(bits=8, shadow_channels=((7, 3),))
    with pytest.raises(QnpuError, match="integers >= 0"):
        TensorQuant(bits=8, shadow_channels=((-1,),))
    bad_paths = ("layers/down_out", "layers/q_proj", "layers/attn_out")
    for path, match in ((p, "linear's input written channel by channel") for p in bad_paths):
        bad = dataclasses.replace(plan.get(path), shadow_channels=((), ()))
        with pytest.raises(QnpuError, match=match):
            plan.with_entries((p, bad if p == path else t) for p, t in plan.entries)
    short = dataclasses.replace(tq, shadow_channels=((1,),))
    with pytest.raises(QnpuError, match="1 entries for 2 layers"):
        plan.with_entries((p, short if p == "layers/down_in" else t) for p, t in plan.entries)


def test_shadow_bounds_and_fake_quant_leave_shadow_channels_unclamped():
    tq = TensorQuant(bits=8, shadow_channels=((1,), ()))
    entry = state_entry(tq, np.full(2, 0.5), np.zeros(2), layers=2, width=3)
    assert np.asarray(entry.qmin).shape == (2, 3)
    np.testing.assert_array_equal(entry.qmax[0], [127, WIDE[1], 127])
    np.testing.assert_array_equal(entry.qmin[1], [-128, -128, -128])
    x = jnp.asarray([[400.0, 400.0, -400.0]])  # 800 codes at scale 0.5
    y = fake_quant(x, 0.5, 0.0, entry.qmin[0], entry.qmax[0])
    np.testing.assert_array_equal(np.asarray(y), [[63.5, 400.0, -64.0]])
    with pytest.raises(QnpuError, match="needs its width"):
        state_entry(tq, np.full(2, 0.5), np.zeros(2), layers=2)
    with pytest.raises(QnpuError, match="past the tensor's width 1"):
        shadow_bounds(tq.shadow_channels, np.zeros(2), np.ones(2), 1)
    plan = default_plan(2).apply([QuantRule(pattern="layers/down_in", bits=8)])
    shadowed = plan.with_entries(
        (p, dataclasses.replace(t, shadow_channels=((1,), ())) if p == "layers/down_in" else t)
        for p, t in plan.entries
    )
    with pytest.raises(QnpuError, match="dynamic fake quantization has no shadow"):
        FakeQuantTaps(shadowed, mode="dynamic")


def test_clamped_matmul_plus_shadow_equals_the_unclamped_matmul_bit_for_bit():
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, size=(5, 16))
    q[:, 3] = rng.integers(-5000, 5000, size=5)  # a hot channel far past int8
    q[2, 9] = 300  # and one more
    w = rng.integers(-8, 8, size=(16, 6))
    lo, hi = np.full(16, -128), np.full(16, 127)
    got = shadow_matmul(q, w, lo, hi, (3, 9))
    np.testing.assert_array_equal(got, q @ w)
    with pytest.raises(QnpuError, match="outside the shadow channels"):
        shadow_matmul(q, w, lo, hi, (3,))  # channel 9 overflows and has no shadow


@pytest.fixture(scope="module")
def shadowed(two_layer_dir):
    """The real two-layer model at W8A8 (down_proj input 8-bit), calibrated, then shadow
    outliers in one of its two layers at a P99 clip: (float model, base, shadowed, windows)."""
    fp = load_model(str(two_layer_dir))
    windows = (np.arange(4 * 48).reshape(4, 48) * 37 + 11) % fp.config.vocab_size
    data = Calibration(np.arange(300), windows)
    base = chain(
        steps.fuse_norms(),
        steps.plan(w_bits=8, a_bits=8, down_in_bits=8),
        steps.calibrate(),
    )(QuantizedModel.from_float(fp, prefix="bos"), data)
    model = steps.shadow_outliers("down_in", clip=99.0, keep=0.5)(base, data)
    return fp, base, model, windows, data


def test_shadow_outliers_step_on_the_two_layer_model(shadowed):
    fp, base, model, windows, data = shadowed
    info = model.steps[-1].info
    assert len(info["kept_layers"]) == 1  # ceil(0.5 · 2)
    (kept,) = info["kept_layers"]
    tq = model.plan.get("layers/down_in")
    assert tq.shadow_channels is not None and len(tq.shadow_channels[kept]) >= 1
    assert tq.shadow_channels[1 - kept] == ()
    entry = model.state["layers"]["down_in"]
    old = base.state["layers"]["down_in"]
    assert np.asarray(entry.qmax).shape == (2, fp.config.intermediate_size)
    assert float(entry.scale[1 - kept]) == float(old.scale[1 - kept])  # not kept: as it was
    assert float(entry.scale[kept]) < float(old.scale[kept])  # clipped at P99
    for c in tq.shadow_channels[kept]:
        assert float(entry.qmax[kept, c]) == WIDE[1]
    # the clipped scale with shadows beats the clipped scale alone. Measured as each token's
    # NLL distance from the float model's: two layers of SmolLM2 score ppl ~3e14, so their
    # perplexities differ by noise (seen here: shadows 1.05 nats, clipped alone 1.87)
    clipped_only = model.replace(
        state={
            **model.state,
            "layers": {**model.state["layers"], "down_in": state_entry(
                base.plan.get("layers/down_in"), np.asarray(entry.scale),
                np.asarray(entry.zero_point), layers=2,
            )},
        },
        plan=base.plan,
    )  # fmt: skip
    tokens = jnp.asarray(windows)
    float_nll = np.asarray(QuantizedModel.from_float(fp, prefix="bos").nll_fn()(tokens))

    def distance(m: QuantizedModel) -> float:
        return float(np.abs(np.asarray(m.nll_fn()(tokens)) - float_nll).mean())

    assert distance(model) < 0.8 * distance(clipped_only)
    from qnpu_jax.export.aimet import aimet_encodings
    from qnpu_jax.export.exporter import run_encodings

    table = run_encodings(model.plan, model.state, model.cfg)
    assert table[f"layers.{kept}.down_in"]["shadow_channels"] == list(tq.shadow_channels[kept])
    assert "shadow_channels" not in table[f"layers.{1 - kept}.down_in"]
    with pytest.raises(QnpuError, match="shadow_channels has no AIMET encoding"):
        aimet_encodings(table)
    with pytest.raises(QnpuError, match="has outlier channels already"):
        steps.shadow_outliers("down_in")(model, data)
    with pytest.raises(QnpuError, match="not a quantized linear input"):
        steps.shadow_outliers("down_out")(base, data)
    with pytest.raises(QnpuError, match="clip must be a percentile"):
        steps.shadow_outliers(clip=0.0)


def test_shadow_artifact_runs_bit_exact_on_both_engines(shadowed, tmp_path):
    """The artifact lists the hot channels; the emulator runs the device's split (clamped
    matmul + overflow on the shadow path), the JAX forward the unclamped matmul: same codes,
    and the integer model scores as its fake-quant model does."""
    from qnpu_jax.export.artifact import read_artifact
    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model, validate_graph
    from qnpu_jax.runtime.engines import open_engine

    fp, _, model, windows, _ = shadowed
    out = export_quantized(model, tmp_path / "art", fp.tokenizer)
    manifest = json.loads((out / "manifest.json").read_text())
    (kept,) = model.steps[-1].info["kept_layers"]
    hot = model.plan.get("layers/down_in").shadow_channels[kept]
    assert manifest["graph"]["shadow"] == {"down_in": len(hot)}
    assert manifest["graph"]["format"] == "qnpu-llama-int/3"  # a /2 reader would clamp them
    int_model = load_int_model(out)
    np.testing.assert_array_equal(int_model.shadow_channels("down_in", kept), hot)
    assert len(int_model.shadow_channels("down_in", 1 - kept)) == 0
    from qnpu_jax.runtime.emulator import run_chunk

    ids = np.asarray(windows[:1, :40])
    trace: dict = {}
    run_chunk(int_model, ids, open_engine("emulator", int_model).new_cache(1), trace)
    codes = trace["down_in"][kept]
    assert np.abs(codes[..., list(hot)]).max() > 127  # the shadow path carries real overflow
    engines_agree_with_fake_quant(int_model, model, ids)
    # tampered channel lists are refused on load
    art = read_artifact(out)
    key = "layers.shadow.down_in.channels"
    for bad in (np.flip(art.tensors[key], axis=1), art.tensors[key] + 10**6):
        tensors = {**art.tensors, key: np.ascontiguousarray(bad)}
        with pytest.raises(QnpuError, match="must list sorted distinct channels"):
            validate_graph(art.manifest, tensors, "art")
    old_format = {**art.manifest, "graph": {**art.manifest["graph"], "format": "qnpu-llama-int/2"}}
    with pytest.raises(QnpuError, match="the one with shadow or MUXQ channels"):
        validate_graph(old_format, dict(art.tensors), "art")


def test_config_and_recipe_carry_the_shadow_step():
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import describe, for_config

    config = QuantizeConfig.from_dict(
        {"method": "rtn", "shadow_outliers": 99.9, "shadow_keep": 0.3}
    )
    last = describe(for_config(config))[-1]
    assert last == {
        "name": "shadow_outliers",
        "args": {"tensor": "down_in", "clip": 99.9, "keep": 0.3},
    }
    assert config.summary()["shadow_outliers"] == 99.9
    assert "shadow_outliers" not in [s["name"] for s in describe(for_config(QuantizeConfig()))]
    muxq = QuantizeConfig.from_dict({"muxq_exp": 3, "muxq_threshold": 20})
    assert describe(for_config(muxq))[-1] == {
        "name": "muxq",
        "args": {"tensor": "down_in", "exp": 3, "threshold": 20},
    }
    for bad, match in (
        ({"shadow_outliers": 0}, "percentile in"),
        ({"shadow_outliers": True}, "must be null or a number, got True"),
        ({"shadow_keep": 1.5}, "shadow_keep must be in"),
        ({"muxq_exp": 9}, "muxq_exp must be null or in"),
        ({"muxq_exp": 2, "muxq_threshold": -1}, "muxq_threshold must be positive"),
        ({"muxq_exp": 2, "shadow_outliers": 99.9}, "choose one"),
    ):
        with pytest.raises(QnpuError, match=match):
            QuantizeConfig.from_dict(bad)


def test_cost_model_counts_the_shadow_path():
    from qnpu_jax import cost
    from qnpu_jax.memory_plan import model_architecture

    cfg = model_architecture("smollm2-135m")
    plan = default_plan(cfg.num_layers, w_bits=4)
    chans = tuple((1, 5, 9) if i == 4 else () for i in range(cfg.num_layers))
    shadowed = plan.with_entries(
        (p, dataclasses.replace(t, shadow_channels=chans) if p == "layers/down_in" else t)
        for p, t in plan.entries
    )
    phase = cost.prefill(32)
    a, b = (cost.totals(cost.plan_costs(p, cfg, phase)) for p in (plan, shadowed))
    assert b["cpu_macs"] == 32 * 3 * cfg.hidden_size and b["syncs"] == 1
    assert a["cpu_macs"] == a["syncs"] == 0 and a["npu_macs"] == b["npu_macs"]
    # moved between NPU and CPU: the 3 hot channels of act_fn's and up_proj's outputs (their
    # bits), the int32 accumulator, the down_proj output's codes back
    names = ("silu_out", "up_out", "down_out")
    bits = {n: plan.get(f"layers/{n}").bits_for_layer(4) for n in names}
    d = cfg.hidden_size
    want = 32 * (3 * (bits["silu_out"] + bits["up_out"]) / 8 + 4 * d + d * bits["down_out"] / 8)
    assert b["cross_bytes"] == want and a["cross_bytes"] == 0


def test_outliers_study_end_to_end_on_the_two_layer_model(two_layer_dir, tmp_path):
    from qnpu_jax.studies import outliers

    shared = str(SHARED_DATA)
    text = tmp_path / "wt2.raw"
    text.write_text(
        " = Heading = \n" + "The river flows past the old mill and on to the sea . " * 60
    )
    report = tmp_path / "outliers.json"
    argv = [
        "--model", str(two_layer_dir), "--steps", "1", "--stage1-batch-size", "1",
        "--seq-len", "32", "--calib-windows", "2", "--eval-windows", "1",
        "--wikitext", str(text), "--runs-dir", str(tmp_path / "runs"), "--json", str(report),
        "--shadow-keep", "1.0", "--muxq-exp", "3", "--muxq-threshold", "0.5", "--no-progress",
        "--recipes", "mobilequant", "--down-out", "0.5",
    ]  # fmt: skip
    assert outliers.main(argv) == 0
    doc = json.loads(report.read_text())
    base, shadow, muxq, down_out, shadow_down_out, muxq_down_out, mobilequant = doc["rows"][:7]
    mq_shadow, mq_muxq, *mq_down_out = doc["rows"][7:]
    ran = [base, shadow, muxq, down_out, shadow_down_out, muxq_down_out, mobilequant]
    assert [r["status"] for r in ran] == ["ran"] * 7
    # the mechanisms on the recipe's run too: MUXQ refuses its asymmetric down_proj input,
    # the promotion its learned linear outputs (no selective optimization)
    assert mq_shadow["status"] == "ran" and mq_shadow["base"] == mobilequant["key"]
    assert mq_muxq["status"] == "refused" and "symmetric down_proj input" in mq_muxq["why"]
    assert len(mq_down_out) == 3
    assert [r["status"] for r in mq_down_out] == ["refused"] * 3
    assert "selective" in mq_down_out[0]["why"] and "selective" in mq_down_out[1]["why"]
    # the promotion: eq. (4)'s scan, stage 2 again, then the mechanism on top
    assert shadow["steps"] == ["shadow_outliers"] and down_out["steps"] == ["promote", "calibrate"]
    assert shadow_down_out["steps"] == ["promote", "calibrate", "shadow_outliers"]
    assert shadow_down_out["options"] == {**shadow["options"], **down_out["options"]}
    assert len(down_out["info"]["promote"]["promoted_layers"]) == 1  # ceil(0.5 · 2)
    assert shadow_down_out["info"]["promote"] == down_out["info"]["promote"]
    assert muxq_down_out["steps"][-1] == "muxq"
    assert mobilequant["key"] == "mobilequant-w4a8kv8-ours-prefix-bos"
    assert "MobileQuant" in mobilequant["label"] and set(mobilequant["ppl"]) == set(base["ppl"])
    # its asymmetric weights' z_w·Σx term: more NPU MACs than Quant.npu's symmetric plan
    mq_macs = sum(mobilequant["cost"]["prefill"]["macs"].values())
    assert mq_macs > sum(base["cost"]["prefill"]["macs"].values())
    assert muxq["options"] == {"muxq_exp": 3, "muxq_threshold": 0.5}
    assert sum(muxq["info"]["muxq"]["channels_per_layer"])
    # the Aux matmul: more NPU MACs than the run itself, at the same pairs
    base_macs, muxq_macs = (r["cost"]["prefill"]["macs"] for r in (base, muxq))
    assert set(base_macs) == set(muxq_macs) and sum(muxq_macs.values()) > sum(base_macs.values())
    # keep 1.0 of 2 layers, but ceil(0.1 · 2) = 1 is promoted to 16 bits: the other one
    assert len(shadow["info"]["shadow_outliers"]["kept_layers"]) == 1
    assert set(shadow["ppl"]) == {"wiki", "wikitext2"}
    pre = shadow["cost"]["prefill"]
    assert set(pre["latency_s"]) == {"mobilequant-table6", "quantnpu-table3"}
    per_layer = shadow["info"]["shadow_outliers"]["channels_per_layer"]
    assert pre["syncs"] == sum(1 for n in per_layer if n)
    assert base["cost"]["prefill"]["cpu_macs"] == 0
    assert report.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert "shadow outliers" in report.with_suffix(".md").read_text()
    front = doc["pareto_front"]["keys"]
    assert front and set(front) <= {r["key"] for r in doc["rows"] if "ppl" in r}
    assert outliers.main(argv) == 0  # everything read back, nothing run again
    statuses = [r["status"] for r in json.loads(report.read_text())["rows"]]
    assert statuses == ["reused"] * 8 + ["refused"] * 4

    # zero-shot on the rows named: a run and two post-training rows (their models rebuilt:
    # promote + calibrate, then shadow outliers or MUXQ). Which rows "all" and "best" name:
    # test_tasks_rows_selects_every_row_the_best_rows_or_the_rows_named
    named = [base["key"], muxq_down_out["key"], shadow_down_out["key"]]
    tasks = ["--tasks", "piqa", "--limit", "3", "--tasks-rows", ",".join(named)]
    assert outliers.main([*argv, *tasks, "--task-data", shared]) == 0
    doc = json.loads(report.read_text())
    scored = [r for r in doc["rows"] if "tasks" in r]
    assert [r["key"] for r in scored] == [base["key"], shadow_down_out["key"], muxq_down_out["key"]]
    assert doc["tasks"]["float"]["tasks"]["piqa"]["n"] == 3
    runs = tmp_path / "runs"
    for row in scored:
        assert row["tasks_status"] == "ran" and row["tasks"]["piqa"]["n"] == 3
        where = runs / "post" / row["key"] if "options" in row else runs / row["key"]
        assert row["evals"] == str(where / "evals" / "tasks-3-0.json")
        assert json.loads(Path(row["evals"]).read_text())["prefix"] == "bos"
    post = json.loads(Path(combined_row(scored)["evals"]).read_text())
    assert post["base_run"] == shadow["base_dir"]
    assert [s["name"] for s in post["post_steps"]] == shadow_down_out["steps"]
    assert "| FP32 | " in report.with_suffix(".md").read_text().split("Zero-shot")[1]
    from qnpu_jax.report.table import build_rows

    with pytest.raises(QnpuError, match="post-training steps applied in memory"):
        build_rows([Path(shadow["base_dir"])], [Path(combined_row(scored)["evals"])])
    # the rebuilt model is the row's model: its perplexity on the row's windows is the row's
    from qnpu_jax.pipeline.config import load_config
    from qnpu_jax.pipeline.quantized_model import nll_perplexity
    from qnpu_jax.pipeline.run import evaluation_sets

    loaded = load_model(str(two_layer_dir))
    config = load_config(Path(shadow["base_dir"]) / "config.yaml")
    rebuilt = outliers._post_scored(combined_row(scored), config, loaded)
    windows = evaluation_sets(config, loaded.tokenizer, rebuilt.max_length)["wiki"]
    ppl = nll_perplexity(rebuilt.nll_fn, windows)["ppl"]
    assert ppl == pytest.approx(shadow_down_out["ppl"]["wiki"], rel=1e-5)
    # and it is the model `qnpu quantize` makes with the row's options (same stage 1)
    from qnpu_jax.pipeline.run import load_run, quantize

    full = config.replace(**shadow_down_out["options"])
    quantize(full, tmp_path / "full", progress=False)
    again = load_run(tmp_path / "full").model
    assert [r.name for r in again.steps][-3:] == shadow_down_out["steps"]
    assert again.perplexity(windows)["ppl"] == pytest.approx(ppl, rel=1e-5)


def combined_row(rows):
    return next(r for r in rows if r.get("steps") == ["promote", "calibrate", "shadow_outliers"])


def test_tasks_rows_selects_every_row_the_best_rows_or_the_rows_named():
    from qnpu_jax.studies.outliers import parse_args, tasks_rows

    def row(key, bits, wiki=None):
        return {"key": key, "bits": bits, **({"ppl": {"wiki": wiki}} if wiki else {})}

    rows = [
        row("q8", "W8A8", 20.0), row("q8-shadow", "W8A8", 16.0), row("q8-muxq", "W8A8", 19.0),
        row("q4", "W4A8", 27.0), row("q4-muxq", "W4A8", 28.0), row("q4-refused", "W4A8"),
    ]  # fmt: skip
    assert [r["key"] for r in tasks_rows(rows, "best")] == ["q8", "q8-shadow", "q4"]
    assert [r["key"] for r in tasks_rows(rows, "all")] == ["q8", "q8-shadow", "q8-muxq", "q4",
                                                           "q4-muxq"]  # fmt: skip
    # named: in table order, whatever the list's
    assert [r["key"] for r in tasks_rows(rows, ("q4", "q8-muxq"))] == ["q8-muxq", "q4"]
    with pytest.raises(QnpuError, match="no row with a perplexity has the key q4-refused, nope"):
        tasks_rows(rows, ("q4", "q4-refused", "nope"))
    for text, which in (("all", "all"), ("best", "best"), ("q4, q8-muxq,", ("q4", "q8-muxq"))):
        assert parse_args(["--tasks-rows", text]).tasks_rows == which
    with pytest.raises(SystemExit):
        parse_args(["--tasks-rows", " , "])


def test_muxq_body_plus_aux_equals_the_input_exactly():
    from qnpu_jax.pipeline.outlier_paths import choose_muxq, muxq_split

    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 7, 12)).astype(np.float32)
    x[..., 4] *= 300.0
    x[..., 9] *= 41.0
    for exp in (1, 2, 5):
        body, aux = muxq_split(x, (4, 9), exp)
        rebuilt = body.copy()
        rebuilt[..., [4, 9]] = body[..., [4, 9]] + ((1 << exp) - 1) * aux
        np.testing.assert_array_equal(rebuilt, x)  # powers of two: exact in float32
        np.testing.assert_array_equal(np.delete(body, [4, 9], -1), np.delete(x, [4, 9], -1))
    absmax = np.abs(x).max(axis=(0, 1))[None]
    choice = choose_muxq(absmax, 2, threshold=6.0)
    assert choice.channels == ((4, 9),)
    assert choice.body_absmax[0] == pytest.approx(max(absmax[0, 4] / 4, absmax[0, 9] / 4))
    with pytest.raises(QnpuError, match="threshold must be positive"):
        choose_muxq(absmax, 2, threshold=0.0)
    two = np.concatenate([absmax, absmax])  # the second layer promoted to 16 bits: no Body
    promoted = TensorQuant(bits=8, layer_bits=(8, 16))
    assert choose_muxq(two, 2, 6.0, promoted).channels == ((4, 9), ())


def test_muxq_fields_in_the_plan_are_checked():
    tq = TensorQuant(bits=8, muxq_channels=[[1, 3], []], muxq_exp=3)
    assert tq.muxq_channels == ((1, 3), ())
    np.testing.assert_array_equal(tq.muxq_multipliers(4), [[1, 8, 1, 8], [1, 1, 1, 1]])
    with pytest.raises(QnpuError, match="come together"):
        TensorQuant(bits=8, muxq_exp=2)
    with pytest.raises(QnpuError, match=r"muxq_exp must be an integer in 1\.\.8"):
        TensorQuant(bits=8, muxq_channels=((),), muxq_exp=9)
    with pytest.raises(QnpuError, match="not both"):
        TensorQuant(bits=8, muxq_channels=((),), muxq_exp=2, shadow_channels=((),))
    with pytest.raises(QnpuError, match="past the tensor's width 2"):
        tq.muxq_multipliers(2)


def test_residual_split_choice_plan_fields_and_config():
    """`choose_residual_split`: per layer the channels above 1/div of the largest (none in a
    layer where every channel is), one exp for the tensor (the smallest that brings every
    layer's split channels under its other channels' max, 1..8), each layer's largest Body;
    the plan takes MUXQ fields on a residual add's output and refuses them on any other
    non-linear-input tensor; `residual_split: D` adds the step after stage 2's calibration."""
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.outlier_paths import choose_residual_split
    from qnpu_jax.pipeline.recipes import describe, for_config

    absmax = np.array([[1.0, 2.0, 100.0, 3.0], [5.0, 1.0, 1.0, 1.0], [40.0, 2.0, 1.0, 9.0]])
    split = choose_residual_split(absmax, 8.0)
    assert split.channels == ((2,), (), (0, 3))
    assert split.exp == 6  # 100 / 3 > 32
    np.testing.assert_allclose(split.body_absmax, [3.0, 5.0, 2.0])
    capped = choose_residual_split(np.array([[1e6, 1.0, 0.5]]), 8.0)
    assert capped.exp == 8 and capped.body_absmax == (1e6 / 256,)
    with pytest.raises(QnpuError, match="div must be above 1"):
        choose_residual_split(absmax, 1.0)
    plan = default_plan(2, w_bits=8)
    tq = dataclasses.replace(plan.get("layers/resid_mlp"), muxq_channels=((1,), ()), muxq_exp=3)
    plan.with_entries((p, tq if p == "layers/resid_mlp" else t) for p, t in plan.entries)
    with pytest.raises(QnpuError, match="a residual add's output"):
        plan.with_entries((p, tq if p == "layers/gate_out" else t) for p, t in plan.entries)
    config = QuantizeConfig.from_dict({"residual_split": 8})
    names = [s["name"] for s in describe(for_config(config))]
    assert names[names.index("calibrate") + 1] == "split_residual"
    assert "split_residual" not in [s["name"] for s in describe(for_config(QuantizeConfig()))]
    assert config.summary()["residual_split"] == 8
    for bad, match in (
        ({"residual_split": 1}, "residual_split must be null or > 1, got 1"),
        ({"residual_split": 8, "method": "mobilequant"}, "symmetric residual stream"),
    ):
        with pytest.raises(QnpuError, match=match):
            QuantizeConfig.from_dict(bad)


def test_muxq_step_artifact_and_engines_on_the_two_layer_model(shadowed, tmp_path):
    """MUXQ on the down_proj input: per-channel scales s·2^exp, the integer artifact lists
    the channels, the emulator runs Body·W + (2^exp − 1)·Aux·W, the JAX forward the one
    matmul of the codes times 2^exp: the same logits; the integer model scores as the fake
    one does, and better than the same model without MUXQ."""
    from qnpu_jax.export.exporter import export_quantized, run_encodings
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.pipeline.calibrate import channel_absmax

    fp, base, _, windows, data = shadowed
    absmax = channel_absmax(base.params(), base.cfg, data.windows, ("down_in",), prefix=base.prefix)
    threshold = float(np.sort(absmax["down_in"][0])[-5])  # a few channels of layer 0
    model = steps.muxq("down_in", exp=3, threshold=threshold)(base, data)
    tq = model.plan.get("layers/down_in")
    assert tq.muxq_exp == 3 and len(tq.muxq_channels[0]) >= 4
    scale = np.asarray(model.state["layers"]["down_in"].scale)
    assert scale.shape == (2, fp.config.intermediate_size)
    hot = list(tq.muxq_channels[0])
    cold = np.setdiff1d(np.arange(scale.shape[1]), hot)
    np.testing.assert_array_equal(scale[0, hot], 8 * scale[0, cold[0]])
    assert len(set(scale[0, cold].tolist())) == 1
    fake = model.perplexity(windows)["ppl"]
    assert fake < base.perplexity(windows)["ppl"]
    table = run_encodings(model.plan, model.state, model.cfg)
    assert table["layers.0.down_in"]["muxq"] == {"exp": 3, "channels": hot}
    out = export_quantized(model, tmp_path / "art", fp.tokenizer)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graph"]["muxq"]["down_in"]["exp"] == 3
    int_model = load_int_model(out)
    np.testing.assert_array_equal(int_model.muxq_channels("down_in", 0), hot)
    engines_agree_with_fake_quant(int_model, model, np.asarray(windows[:1, :40]))
    with pytest.raises(QnpuError, match="has outlier channels already"):
        steps.muxq("down_in", exp=2, threshold=threshold)(model, data)
    with pytest.raises(QnpuError, match="exp must be an integer"):
        steps.muxq(exp=0)


def test_residual_split_on_the_llama_graph(shadowed, tmp_path):
    """The residual split on LLaMA's graph (the real two-layer model, unrotated: SmolLM2's
    massive residual channels): split channels in both layers of both residual outputs, a
    fake-quant NLL no worse than the one grid's, a saved run that loads as it was, and the
    artifact bit for bit on both engines near the fake-quant model."""
    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.export.int_model import load_int_model

    fp, base, _, windows, data = shadowed
    model = steps.split_residual(8.0)(base, data)
    for name in ("resid_attn", "resid_mlp"):
        tq = model.plan.get(f"layers/{name}")
        assert tq.muxq_exp is not None and all(tq.muxq_channels), tq.muxq_channels
    ppl = model.perplexity(windows)["ppl"]
    assert ppl <= base.perplexity(windows)["ppl"] * 1.001
    loaded = QuantizedModel.load(model.save(tmp_path / "run"), base=fp)  # plan.json and state
    assert loaded.require_plan() == model.require_plan()
    assert loaded.perplexity(windows)["ppl"] == ppl
    int_model = load_int_model(export_quantized(loaded, tmp_path / "art", fp.tokenizer))
    assert int_model.read_exp("x") == model.plan.get("layers/resid_mlp").muxq_exp
    assert not int_model.read_shifts("x")[0].any()  # layer 0 reads the embedding
    engines_agree_with_fake_quant(int_model, model, np.asarray(windows[:1, :40]))
    with pytest.raises(QnpuError, match="has outlier channels already"):
        steps.split_residual(8.0)(model, data)


@pytest.mark.parametrize("mechanism", ["shadow", "muxq"])
def test_onnx_export_of_shadow_and_muxq_channels_is_deployable(shadowed, mechanism, tmp_path):
    """Shadow and MUXQ channels are graph structure, every activation one grid per tensor:
    the shadow layer's down_proj input is clamped on the NPU and a CPU path adds the
    overflow of its hot channels (recomputed from the Mul's quantized inputs, rounded on the
    input's grid) times their weight rows; MUXQ's Body carries the outlier channels shifted
    and its Aux matmul adds them back (2^exp − 1)·Aux·W. The float graph stays the float
    model (the overflow is exactly zero without quantizers); onnxruntime's QDQ graph scores
    as the fake-quant model does, and AIMET loads model.encodings onto the float graph with
    nothing missing and nothing extra (`aimet_quantsim` refuses otherwise). The scores are on
    English text: on the fixture's arithmetic ids (25-56 nats a token) one code that a CPU's
    float order flipped moved every later token by up to 7% (MUXQ, an AVX-512 Xeon). On
    English text (about 20 nats a token) a flipped code still moves one token, or every later
    token of its row, by up to 2.7 nats (an AMD EPYC), so the scores are compared token by
    token: most tokens equal, the mean within 1%. The structure's codes are checked code for
    code (`_structure_gives_the_fake_quant_codes`)."""
    import dataclasses

    import jax.numpy as jnp
    import onnx

    from qnpu_jax.export.onnx_export import (
        CPU_SIDE,
        check_models,
        export_onnx,
        node_side,
        op_inventory,
    )
    from qnpu_jax.runtime.onnx_run import OnnxModel, aimet_quantsim

    fp, base, model, _, data = shadowed
    if mechanism == "muxq":
        model = steps.muxq("down_in", exp=2, threshold=1.0)(base, data)
    model = model.replace(plan=dataclasses.replace(model.plan, simulation="fake"))
    out = export_onnx(model, tmp_path / "onnx", fp.tokenizer, chunk=16, max_context=96)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["onnx"]["encodings"]["file"] == "model.encodings"
    check_models(out)  # onnx.checker, full check, on all four graphs
    enc = json.loads((out / "model.encodings").read_text())
    acts = {e["name"]: e for e in enc["activation_encodings"]}
    params = {e["name"]: e for e in enc["param_encodings"]}
    tq = model.plan.get("layers/down_in")
    layers = [
        i
        for i, ch in enumerate(tq.shadow_channels if mechanism == "shadow" else tq.muxq_channels)
        if ch
    ]
    assert layers
    graph = onnx.load(str(out / "model_qdq.onnx"), load_external_data=False).graph
    produced = {o for n in graph.node for o in n.output}
    inits = {t.name for t in graph.initializer}
    for i in layers:
        x = f"model.layers.{i}.mlp.down_proj.input"
        assert acts[x]["enc_type"] == "PER_TENSOR"
        assert (
            params[f"model.layers.{i}.mlp.down_proj.weight_rows"]["scale"]
            == (params[f"model.layers.{i}.mlp.down_proj.weight"]["scale"])
        )
        assert f"model.layers.{i}.mlp.down_proj.weight_rows_quantized" in inits
        if mechanism == "shadow":
            overflow = acts[f"{x}_overflow"]
            assert (overflow["bw"], overflow["is_sym"]) == (16, True)
            assert overflow["scale"] == acts[x]["scale"]
        else:
            assert f"{x}_aux" in produced and f"{x}_unshifted" in produced
    assert not any(n.op_type == "Where" and "shadow" in n.output[0] for n in graph.node)
    per_axis = [n for n in graph.node if n.op_type == "QuantizeLinear" and n.attribute]
    assert not per_axis  # every activation on one grid
    inventory = op_inventory(graph)
    assert not inventory["unlisted"]  # every op one that onnxruntime's QNN EP lists
    assert inventory[CPU_SIDE].get("Round", 0) == 0  # (the overflow rounds in its QDQ)
    cpu = [n for n in graph.node if node_side(n) == CPU_SIDE]
    assert bool(cpu) == (mechanism == "shadow")  # MUXQ stays on the NPU
    if cpu:
        assert {n.op_type for n in cpu} >= {"Gather", "Mul", "Sub", "MatMul", "Add"}
    from qnpu_jax.report.onnx_layer import draw_layer

    sides = draw_layer(out, layers[0], tmp_path / "layer.png")  # docs/deploy.md's picture
    assert (tmp_path / "layer.png").read_bytes()[:4] == b"\x89PNG"
    assert (sides["cpu"] > 0) == (mechanism == "shadow") and sides["npu"] > 40
    ids = np.asarray([fp.tokenizer.encode(t)[:40] for t in _TEXTS])
    _structure_gives_the_fake_quant_codes(out, layers[0], mechanism, tq)
    nll_qdq = OnnxModel(out, qdq=True).token_nll(ids)
    nll_fake = np.asarray(model.nll_fn()(jnp.asarray(ids)))
    # most tokens equal to float32's last bits; the rest follow a code that the two float
    # orders rounded apart (an AMD EPYC: 64% and 74% equal, means 0.24% and 0.25% apart)
    assert np.mean(np.abs(nll_qdq - nll_fake) < 1e-4) >= 0.5
    assert abs(nll_qdq.mean() / nll_fake.mean() - 1) < 0.01
    nll_float = OnnxModel(out).token_nll(ids)
    float_model = QuantizedModel.from_float(fp, prefix="bos")
    nll_fp = np.asarray(float_model.nll_fn()(jnp.asarray(ids)))
    np.testing.assert_allclose(nll_float, nll_fp, rtol=1e-4, atol=1e-4)
    session, loaded = aimet_quantsim(out)
    assert loaded["quantizers"] == len(acts) + len(params)
    nll_sim = OnnxModel(out, qdq=True, sessions={"prefill": session}).token_nll(ids)
    assert abs(nll_sim.mean() / nll_qdq.mean() - 1) < 0.02


_TEXTS = (
    "The river rises in the hills to the north of the town and runs south through a wide valley"
    " of farms and small villages before it reaches the sea at the old harbour, where the"
    " fishing boats have landed their catch for more than three hundred years.",
    "In the spring of that year the council met to decide whether the bridge should be rebuilt"
    " in stone, as the merchants wanted, or repaired in wood, which would cost far less and"
    " could be finished before the autumn floods came down the valley again.",
)


def _structure_gives_the_fake_quant_codes(out, layer, mechanism, tq):
    """In the QDQ graph, on one chunk, from the value x the Mul writes: shadows' clamped
    codes plus the overflow's codes are round(x/s) exactly (the fake-quant model's unclamped
    code), clamped codes elsewhere; MUXQ's Body codes are round(x/(s·2^exp)) on its channels
    and round(x/s) elsewhere (the fake-quant model's per-channel grid), code for code."""
    import onnx

    from qnpu_jax.export.artifact import read_artifact
    from qnpu_jax.runtime.onnx_run import OnnxModel, _session

    x = f"model.layers.{layer}.mlp.down_proj.input"
    art = read_artifact(out)
    model = onnx.load_from_string(art.files["model_qdq.onnx"])
    pre = x if mechanism == "shadow" else f"{x}_unshifted"
    taps = [pre, f"{x}_dequantized"] + (
        [f"{x}_overflow_dequantized"] if mechanism == "shadow" else []
    )
    for t in taps:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    session = _session(
        model.SerializeToString(), "model_qdq.data", art.files["model_qdq.data"], "basic"
    )
    om = OnnxModel(out, qdq=True)
    ids = (np.arange(om.chunk) * 37 + 11) % om.table.shape[0]
    p = len(om.prefix)
    feeds = {om.input_name: om.table[ids][None], "position_ids": np.arange(p, p + om.chunk)[None]}
    for i, c in enumerate(om.new_cache()):
        feeds[f"past_{'key' if i % 2 == 0 else 'value'}.{i // 2}"] = c
    got = session.run(taps, feeds)
    enc = json.loads((out / "model.encodings").read_text())
    e = next(a for a in enc["activation_encodings"] if a["name"] == x)
    s, off, top = np.float32(e["scale"][0]), int(e["offset"][0]), (1 << e["bw"]) - 1
    value, deq = got[0], got[1]
    codes = np.rint(deq / s)
    if mechanism == "shadow":
        hot = list(tq.shadow_channels[layer])
        want = np.clip(np.rint(value / s), off, off + top)
        want[..., hot] = np.rint(value[..., hot] / s)
        codes[..., hot] += np.rint(got[2] / s)
        assert np.abs(np.rint(value[..., hot] / s)).max() > off + top  # real overflow
    else:
        shift = np.ones(value.shape[-1], np.float32)
        shift[list(tq.muxq_channels[layer])] = np.float32(1 << tq.muxq_exp)
        want = np.clip(np.rint(value / (s * shift)), off, off + top)
    np.testing.assert_array_equal(codes, want)


def test_pareto_front_keeps_the_rows_no_other_row_beats_on_latency_and_perplexity():
    from qnpu_jax.studies.outliers import LATENCY_READING, pareto_front

    def row(key, ms, wiki):
        cost = {"prefill": {"latency_s": {LATENCY_READING: ms / 1e3}}}
        return {"key": key, "ppl": {"wiki": wiki}, "cost": cost}

    rows = [row("a", 1, 10), row("b", 2, 8), row("c", 2, 9), row("d", 3, 8), row("e", 0.5, 20)]
    rows.append({"key": "refused", "status": "refused"})
    assert pareto_front(rows) == ["e", "a", "b"]  # c and d: b is as fast or faster and lower


def test_zero_shot_table_marks_differences_from_float_beyond_two_standard_errors():
    from qnpu_jax.report.table import Measure, TaskResult
    from qnpu_jax.studies.compare_methods import TaskScores
    from qnpu_jax.studies.outliers import _tasks_table

    def scores(piqa, lambada, ppl):
        def result(task, metric, value, perplexity=None):
            m = Measure(value, 0.02)
            return TaskResult(task, metric, m, 500, None, perplexity, "bos", 500, "x")

        return TaskScores(
            "reused",
            {
                "piqa": result("piqa", "acc_norm", piqa),
                "lambada": result("lambada", "acc", lambada, Measure(ppl, 5.0)),
            },
            Path("x"),
        )

    rows = [("FP32", scores(0.62, 0.27, 40.0)), ("Q", scores(0.60, 0.14, 300.0))]
    head, _, fp, q = _tasks_table(rows, ["piqa", "lambada"])
    assert head == "| Row | PIQA | LAMBADA | Avg | LAMBADA ppl |"
    assert fp == "| FP32 | 62.0 ±2.0 | 27.0 ±2.0 | 44.5 ±1.4 | 40.00 ±5.00 |"
    # PIQA 2 points apart (2 SE of the difference: 5.7): no mark; LAMBADA far below, ppl above
    assert q == "| Q | 60.0 ±2.0 | 14.0 ±2.0 ▼ | 37.0 ±1.4 ▼ | 300.00 ±5.00 ▲ |"


def test_every_recipe_row_is_a_valid_config_with_a_run_directory_of_its_own(monkeypatch):
    from qnpu_jax.studies import compare_methods as cm
    from qnpu_jax.studies import outliers

    monkeypatch.setenv("QNPU_DATA_DIR", str(SHARED_DATA))  # the default --wikitext's home
    args = outliers.parse_args([])
    base = cm.base_config(args).replace(down_in_bits=8, mixed_precision=0.1)
    dirs = {cm._run_dir(args, "quantnpu", 4, 8, 8, "ours")}
    for method, setting, _, options in outliers.RECIPE_ROWS.values():
        config = base.replace(method=method, **options)  # validated on construction
        assert all(config.value(k) == v for k, v in options.items())
        dirs.add(cm._run_dir(args, method, 4, 8, 8, setting))
    assert len(dirs) == len(outliers.RECIPE_ROWS) + 1
