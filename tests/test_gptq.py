"""GPTQ rounding: round-to-nearest when the Hessian carries no correlation, a lower layer
error than round-to-nearest when it does, equal to a plain numpy GPTQ, and wired into runs."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script  # tests/ is on sys.path (rootdir conftest)

from qnpu_jax import QnpuError
from qnpu_jax.quant.gptq import gptq_codes, gptq_layers, layer_error


def _grid(w, bits=4):
    qmax = 2 ** (bits - 1) - 1
    scale = np.abs(w).max(axis=1, keepdims=True) / qmax
    return scale.astype(np.float32), np.zeros_like(scale), np.float32(-qmax - 1), np.float32(qmax)


def _rtn(w, scale, zp, qmin, qmax):
    return np.clip(np.round(w / scale) + zp, qmin, qmax)


def _numpy_gptq(w, h, scale, zp, qmin, qmax, damp):
    """GPTQ in the OBQ form: the inverse Hessian updated after every column (no Cholesky)."""
    w = w.astype(np.float64).copy()
    h = h.astype(np.float64) + damp * np.mean(np.diag(h)) * np.eye(len(h))
    h_inv = np.linalg.inv(h)
    codes = np.zeros_like(w)
    for i in range(w.shape[1]):
        q = np.clip(np.round(w[:, i] / scale[:, 0]) + zp[:, 0], qmin, qmax)
        codes[:, i] = q
        err = (w[:, i] - (q - zp[:, 0]) * scale[:, 0]) / h_inv[i, i]
        w[:, i + 1 :] -= np.outer(err, h_inv[i, i + 1 :])
        h_inv -= np.outer(h_inv[:, i], h_inv[i, :]) / h_inv[i, i]
    return codes


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(24, 32)).astype(np.float32)
    mix = rng.normal(size=(32, 32)) + 3 * np.eye(32)
    x = (rng.normal(size=(400, 32)) @ mix).astype(np.float32)  # correlated inputs
    return w, (x.T @ x).astype(np.float32)


def test_uncorrelated_inputs_give_round_to_nearest(problem):
    w, _ = problem
    grid = _grid(w)
    codes = gptq_codes(w, 7.0 * np.eye(32, dtype=np.float32), *grid)
    np.testing.assert_array_equal(np.asarray(codes), _rtn(w, *grid))


def test_gptq_lowers_the_layer_error_and_matches_numpy(problem):
    w, h = problem
    grid = _grid(w)
    scale, zp = grid[0], grid[1]
    codes = np.asarray(gptq_codes(w, h, *grid, damp=0.01))
    assert codes.min() >= grid[2] and codes.max() <= grid[3]
    assert np.array_equal(codes, np.round(codes))
    reference = _numpy_gptq(w, h, *grid, damp=0.01)
    assert np.mean(codes == reference) > 0.99  # float32 vs float64: rare ties may differ
    for block in (1, 5, 32):  # lazy batch updates: the same codes whatever the block size
        blocked = np.asarray(gptq_codes(w, h, *grid, damp=0.01, block=block))
        assert np.mean(blocked == codes) > 0.99
    err_gptq = float(layer_error(w, (codes - zp) * scale, h))
    err_rtn = float(layer_error(w, (_rtn(w, *grid) - zp) * scale, h))
    assert err_gptq < 0.7 * err_rtn
    assert np.mean(codes != _rtn(w, *grid)) > 0.05  # it did move codes


def test_act_order_is_gptq_on_the_columns_sorted_by_their_energy(problem):
    """act_order rounds the columns by decreasing H_ii: GPTQ of the permuted problem, its codes
    put back in place; on the grid, it lowers the layer error too, and an order that is
    already decreasing gives the plain codes."""
    w, h = problem
    d = np.sqrt(np.random.default_rng(1).uniform(0.2, 3.0, 32)).astype(np.float32)
    h = d[:, None] * h * d[None, :]  # D H D: uneven energies, still positive definite
    grid = _grid(w)
    scale, zp = grid[0], grid[1]
    order = np.argsort(-np.diag(h), kind="stable")
    assert not np.array_equal(order, np.arange(32))
    ordered = np.asarray(gptq_codes(w, h, *grid, act_order=True))
    by_hand = np.asarray(gptq_codes(w[:, order], h[order][:, order], *grid))
    np.testing.assert_array_equal(ordered[:, order], by_hand)
    assert np.isfinite(ordered).all()
    err_ordered = float(layer_error(w, (ordered - zp) * scale, h))
    assert err_ordered < 0.7 * float(layer_error(w, (_rtn(w, *grid) - zp) * scale, h))
    plain = np.asarray(gptq_codes(w, h, *grid))  # on this problem also below the plain order
    assert not np.array_equal(ordered, plain)
    assert err_ordered < 0.9 * float(layer_error(w, (plain - zp) * scale, h))
    sorted_h = h[order][:, order]  # already in decreasing order: nothing to move
    np.testing.assert_array_equal(
        np.asarray(gptq_codes(w, sorted_h, *grid, act_order=True)),
        np.asarray(gptq_codes(w, sorted_h, *grid)),
    )


def test_dead_columns_and_stacked_layers(problem):
    w, h = problem
    h = h.copy()
    h[5, :] = h[:, 5] = 0.0  # an input that is always zero
    grid = _grid(w)
    codes = np.asarray(gptq_codes(w, h, *grid))
    assert np.all(codes[:, 5] == 0)  # its weights do not matter: zero (the zero point)
    stacked = gptq_layers(
        jnp.stack([w, 2 * w]),
        jnp.stack([h, h]),
        jnp.stack([grid[0], 2 * grid[0]]),
        jnp.zeros((2, 24, 1)),
        jnp.full((2,), grid[2]),
        jnp.full((2,), grid[3]),
    )
    np.testing.assert_array_equal(np.asarray(stacked[0]), codes)
    with pytest.raises(QnpuError, match="do not match"):
        gptq_layers(jnp.stack([w]), jnp.stack([h, h]), *(jnp.zeros(1),) * 4)


def test_hessians_are_the_quantized_linear_inputs(tiny_cfg, tiny_params):
    from qnpu_jax.pipeline import calibrate
    from qnpu_jax.pipeline.calibrate import capture_activations
    from qnpu_jax.pipeline.weight_rounding import collect_hessians, rounded_weights
    from qnpu_jax.quant import default_plan
    from qnpu_jax.quant.fake_quant import fake_quant
    from qnpu_jax.quant.plan import QuantPlan

    full = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8)
    # decoder layers only: layer 0's input is then the float norm output of the embedding
    plan = QuantPlan(tuple(e for e in full.entries if e[0].startswith("layers/")), 2)
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (3, 20), 0, tiny_cfg.vocab_size))
    state = calibrate(tiny_params, tiny_cfg, plan, tokens)
    assert rounded_weights(plan) == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    )  # fmt: skip
    hessians = collect_hessians(tiny_params, state, plan, tiny_cfg, tokens)
    assert set(hessians) == {"attn_in", "attn_out", "mlp_in", "down_in"}
    assert hessians["down_in"].shape == (2, tiny_cfg.intermediate_size, tiny_cfg.intermediate_size)
    x = capture_activations(tiny_params, tiny_cfg, tokens, ("attn_in",), layer=0)["attn_in"]
    s = state["layers"]["attn_in"]
    xq = (
        np.asarray(fake_quant(jnp.asarray(x), s.scale[0], s.zero_point[0], s.qmin[0], s.qmax[0]))
        .reshape(-1, x.shape[-1])
        .astype(np.float64)
    )
    assert not np.allclose(xq, x.reshape(xq.shape))  # the linear sees the quantized input
    np.testing.assert_allclose(np.asarray(hessians["attn_in"][0]), xq.T @ xq, rtol=1e-4, atol=1e-4)


def test_gptq_refuses_fewer_calibration_tokens_than_a_linears_inputs(tiny_cfg, tiny_params):
    """Fewer token rows than down_proj's inputs leave its Hessian singular (README's recipe on
    4 x 128 tokens of the real model printed perplexity 525,980): refused with the count."""
    from qnpu_jax.pipeline import calibrate
    from qnpu_jax.pipeline.weight_rounding import check_gptq_tokens, gptq_round_weights
    from qnpu_jax.quant import default_plan

    plan = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8)
    width = tiny_cfg.intermediate_size  # 48: down_proj's inputs, the widest
    check_gptq_tokens(plan, tiny_cfg, (4, 12))  # 48 rows: enough
    with pytest.raises(QnpuError, match=rf"give 44 token rows, fewer than the {width} inputs"):
        check_gptq_tokens(plan, tiny_cfg, (4, 10), prefix_len=1)
    tokens = np.asarray(jax.random.randint(jax.random.key(3), (2, 16), 0, tiny_cfg.vocab_size))
    state = calibrate(tiny_params, tiny_cfg, plan, tokens)
    with pytest.raises(QnpuError, match="calibrate on at least 48 tokens"):
        gptq_round_weights(tiny_params, state, plan, tiny_cfg, tokens)


GPTQ_RUN = {
    "method": "quarot", "w_bits": 4, "a_bits": 8, "mixed_precision": 0.0, "seq_len": 32,
    "calib_windows": 48, "eval_windows": 2, "weight_rounding": "gptq",
}  # fmt: skip


@pytest.fixture(scope="module")
def gptq_run(two_layer_dir, tmp_path_factory):
    """A quick QuaRot run with weight_rounding gptq on the two-layer model."""
    import yaml

    from qnpu_jax.cli import main

    tmp = tmp_path_factory.mktemp("gptq_run")
    (tmp / "c.yaml").write_text(yaml.safe_dump({"model": str(two_layer_dir), **GPTQ_RUN}))
    out = tmp / "run"
    args = ["quantize", "--config", str(tmp / "c.yaml"), "--out", str(out), "--no-progress"]
    assert main(args) == 0
    return out


def test_gptq_run_stores_codes_that_eval_and_export_use(gptq_run, tmp_path):
    """The weights load_run rebuilds are on the grid, and the artifact holds exactly the
    stored codes."""
    import orbax.checkpoint as ocp

    from qnpu_jax.cli import main
    from qnpu_jax.export.artifact import read_artifact
    from qnpu_jax.pipeline.run import load_run

    out = gptq_run
    report = json.loads((out / "report.json").read_text())
    assert "gptq" in report["seconds"]
    with ocp.StandardCheckpointer() as ckpt:
        codes = ckpt.restore((out / "learned").resolve())["weight_codes"]
    assert set(codes) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    model = load_run(out).model
    params, s = model.params(), model.require_state()["layers"]["down_proj"]
    on_grid = np.asarray(params["layers"]["down_proj"]) / np.asarray(s.scale)
    np.testing.assert_allclose(on_grid, np.asarray(codes["down_proj"]), atol=1e-3)
    art = tmp_path / "art"
    export = ["export", "--run", str(out), "--out", str(art), "--max-context", "64"]
    assert main([*export, "--prefill-chunk", "16"]) == 0
    for name, q in codes.items():  # the artifact holds GPTQ's codes, not re-rounded ones
        np.testing.assert_array_equal(read_artifact(art).tensor(f"layers.{name}.weight"), q)
    # ONNX: the float graphs hold the rounded weights (what AIMET must quantize), and the
    # manifest and `qnpu eval --onnx` say so (they were called the float model: issue 55)
    onnx_dir = tmp_path / "onnx"
    export = ["export", "--run", str(out), "--format", "onnx", "--out", str(onnx_dir)]
    assert main([*export, "--prefill-chunk", "16", "--max-context", "64"]) == 0
    manifest = json.loads((onnx_dir / "manifest.json").read_text())
    assert manifest["onnx"]["float_weights"] == "gptq_codes"
    ev = [
        "eval",
        "--onnx",
        str(onnx_dir),
        "--data",
        "wiki",
        "--seq-len",
        "16",
        "--max-windows",
        "1",
    ]
    assert main([*ev, "--no-progress", "--json", str(tmp_path / "float.json")]) == 0
    path = json.loads((tmp_path / "float.json").read_text())["path"]
    assert path == "onnxruntime (float graph: GPTQ-rounded weights, float activations)"


def _rtn_coded(model):
    """(the model with round-to-nearest's own codes as its GPTQ codes, the model without
    codes): the two are the same model, unless a forward runs its prefix on rounded weights."""
    assert model.prefix and model.weight_codes
    unrounded = model.prefix_params()
    state = model.require_state()["layers"]
    rtn = {}
    for name in model.weight_codes:
        s, w = state[name], unrounded["layers"][name]
        lo, hi = s.qmin[:, None, None], s.qmax[:, None, None]
        rtn[name] = jnp.clip(jnp.round(w / s.scale) + s.zero_point, lo, hi)
    return model.replace(weight_codes=rtn), model.replace(weight_codes=None)


def test_steps_after_gptq_run_the_prefix_on_the_weights_before_rounding(gptq_run):
    """Steps composed after gptq: a partial calibration keeps the codes and runs the prefix
    on the weights before rounding; a scan that resets the plan, like a transform, drops the
    codes and measures the weights before rounding."""
    from qnpu_jax.pipeline import steps
    from qnpu_jax.pipeline.calibrate import calibrate
    from qnpu_jax.pipeline.run import calibration_data, load_run
    from qnpu_jax.pipeline.steps import Calibration

    run = load_run(gptq_run)
    coded, plain = _rtn_coded(run.model)
    ids, windows = calibration_data(run.config, run.tokenizer)
    data = Calibration(ids, windows[:4])
    # the tokens' statistics take the rounded weights (the model as deployed), the prefix not
    sub = coded.plan.with_entries(e for e in coded.plan.entries if e[0] == "layers/down_in")
    got = steps.calibrate(["layers/down_in"])(coded, data)
    assert got.weight_codes is not None
    kw = {"prefix": coded.prefix}
    want = calibrate(coded.params(), coded.cfg, sub, data.windows, **kw,
                     prefix_params=coded.prefix_params())  # fmt: skip
    rounded = calibrate(coded.params(), coded.cfg, sub, data.windows, **kw)
    enc = got.state["layers"]["down_in"]
    np.testing.assert_array_equal(enc.scale, want["layers"]["down_in"].scale)
    assert not np.array_equal(enc.scale, rounded["layers"]["down_in"].scale)
    promote = steps.promote("down_out", 0.5)
    got, want = promote(coded, data), promote(plain, data)
    assert got.weight_codes is None
    assert got.steps[-1].info["ratios"] == want.steps[-1].info["ratios"]
    smoothed = steps.smooth_mlp(0.3)(coded, data)
    assert smoothed.weight_codes is None  # codes of the weights before smoothing go


def test_the_sink_prefix_runs_on_the_weights_before_rounding(gptq_run, tmp_path):
    """The prefix is computed offline in float, so weight codes must not reach it: codes
    equal to round-to-nearest's give exactly the model without codes (whose taps round the
    weights of the tokens only), in the fake-quant NLL and in the artifact's prefix K/V."""
    from qnpu_jax.export.artifact import read_artifact
    from qnpu_jax.export.exporter import export_quantized
    from qnpu_jax.pipeline.run import load_run

    run = load_run(gptq_run)
    coded, plain = _rtn_coded(run.model)
    model = run.model
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 16)))
    got, want = coded.nll_fn()(tokens), plain.nll_fn()(tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    # without the fix the prefix ran on the rounded weights: the two would differ
    arts = {}
    for label, m in (("coded", coded), ("plain", plain)):
        art = export_quantized(
            m, tmp_path / label, run.loaded.tokenizer, max_context=64, prefill_chunk=16
        )
        arts[label] = read_artifact(art)
    for kv in ("layers.prefix.k", "layers.prefix.v"):
        np.testing.assert_array_equal(arts["coded"].tensor(kv), arts["plain"].tensor(kv))


def test_gptq_study_on_a_gptq_run(gptq_run, two_layer_dir, tmp_path):
    """Both columns of `qnpu study gptq_study` round the weights before rounding: on the
    run's own grid, GPTQ redoes the run's codes (the run's perplexity) and round-to-nearest
    gives another."""
    from qnpu_jax import cli

    args = ["--run", str(gptq_run), "--grids", "learned,max_min", "--eval-windows", "2"]
    args += ["--weights-only", "--act-order", "--second-pass"]
    # through the CLI: `qnpu study gptq_study ...`, which the report records to re-run it
    assert cli.main(["study", "gptq_study", *args, "--json", str(tmp_path / "g.json")]) == 0
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["command"].startswith(f"qnpu study gptq_study --run {gptq_run} --grids")
    rows = {r["grid"]: r for r in doc["rows"]}
    report = json.loads((gptq_run / "report.json").read_text())
    wiki = report["perplexity"]["wiki"]["quantized_ppl"]
    assert rows["learned"]["gptq_ppl"] == pytest.approx(wiki, rel=1e-6)
    assert rows["learned"]["rtn_ppl"] != pytest.approx(wiki, rel=1e-6)
    assert rows["max_min"]["gptq_ppl"] != rows["max_min"]["rtn_ppl"]
    for row in rows.values():  # act-order: other codes from the same Hessians
        assert row["gptq_act_order_ppl"] != pytest.approx(row["gptq_ppl"], rel=1e-6)
        # the second layer's Hessian with the first's codes in place: other codes again
        assert row["gptq_second_pass_ppl"] != pytest.approx(row["gptq_ppl"], rel=1e-6)
    assert doc["gptq_windows"] == GPTQ_RUN["calib_windows"]  # the run's own GPTQ windows
    assert doc["eval"]["data"] == "wiki (eval split)"
    # the config key makes the same second pass: restage2 (no tensor recalibrated, GPTQ redone
    # with gptq_passes 2) scores the study's column
    import yaml

    config = tmp_path / "passes.yaml"
    config.write_text(yaml.safe_dump({"model": str(two_layer_dir), **GPTQ_RUN, "gptq_passes": 2}))
    restage = ["--run", str(gptq_run), "--config", str(config), "--eval-windows", "2"]
    assert cli.main(["study", "restage2", *restage, "--json", str(tmp_path / "r.json")]) == 0
    passes = json.loads((tmp_path / "r.json").read_text())
    assert passes["recalibrated"] == [] and passes["gptq_redone"] is True
    assert passes["new_ppl"] == pytest.approx(rows["learned"]["gptq_second_pass_ppl"], rel=1e-6)
    # the weight floor: the same codes with every activation float
    learned = rows["learned"]
    assert learned["gptq_weights_only_ppl"] != pytest.approx(learned["rtn_weights_only_ppl"])
    assert learned["gptq_weights_only_ppl"] != pytest.approx(wiki, rel=1e-6)
    assert doc["float_ppl"] != pytest.approx(learned["rtn_weights_only_ppl"], rel=1e-6)


def test_restage2_recalibrates_only_what_the_rules_change(
    gptq_run, two_layer_dir, tmp_path, capsys
):
    import yaml

    from qnpu_jax import cli

    restage2 = load_script("restage2")
    base = {"model": str(two_layer_dir), **GPTQ_RUN}

    def run(extra, name):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**base, **extra}))
        args = ["--run", str(gptq_run), "--config", str(tmp_path / f"{name}.yaml")]
        return restage2.main([*args, "--eval-windows", "2", "--json", str(tmp_path / name)])

    clip = {"rules": [{"pattern": "layers/(up_out|down_out)", "init": "percentile"}]}
    assert run(clip, "clip") == 0
    out = json.loads((tmp_path / "clip").read_text())
    assert out["recalibrated"] == ["layers/down_out", "layers/up_out"]
    report = json.loads((gptq_run / "report.json").read_text())
    assert out["run_ppl"] == pytest.approx(report["perplexity"]["wiki"]["quantized_ppl"], rel=1e-6)
    assert out["new_ppl"] != out["run_ppl"]
    assert out["gptq_redone"] is True and out["down_out_promotion"] is None
    # what `qnpu quantize` gives with that config (same seed: same stage 2 and GPTQ; equal
    # here, up to float rounding that GPTQ's codes may carry, as restage2's docstring says)
    full = tmp_path / "full"
    quantize = ["quantize", "--config", str(tmp_path / "clip.yaml"), "--out", str(full)]
    assert cli.main([*quantize, "--no-progress"]) == 0
    wiki = json.loads((full / "report.json").read_text())["perplexity"]["wiki"]
    assert out["new_ppl"] == pytest.approx(wiki["quantized_ppl"], rel=1e-3)
    assert run({"weight_rounding": "rtn"}, "rtn") == 0  # the run's codes go
    out = json.loads((tmp_path / "rtn").read_text())
    assert out["recalibrated"] == [] and out["gptq_redone"] is False
    assert out["new_ppl"] != pytest.approx(out["run_ppl"], rel=1e-6)
    # GPTQ's Hessians over the calibration windows themselves: the run's codes again; over
    # windows drawn beyond them: other codes
    assert run({"gptq_windows": GPTQ_RUN["calib_windows"]}, "same_windows") == 0
    again = json.loads((tmp_path / "same_windows").read_text())
    assert again["gptq_redone"] is True and again["recalibrated"] == []
    assert again["new_ppl"] == pytest.approx(again["run_ppl"], rel=1e-6)
    assert run({"gptq_windows": 2 * GPTQ_RUN["calib_windows"]}, "more_windows") == 0
    more = json.loads((tmp_path / "more_windows").read_text())
    assert more["new_ppl"] != pytest.approx(more["run_ppl"], rel=1e-6)
    assert run({"gptq_act_order": True}, "order") == 0  # GPTQ again, columns by energy
    ordered = json.loads((tmp_path / "order").read_text())
    assert ordered["recalibrated"] == [] and ordered["gptq_redone"] is True
    assert ordered["new_ppl"] != pytest.approx(ordered["run_ppl"], rel=1e-6)
    # more eval sets: each scored for both models, the first one's figures on top
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 97} and more text" for i in range(400)))
    sets = ["--eval-data", f"wiki,{text}", "--json", str(tmp_path / "sets")]
    assert restage2.main(["--run", str(gptq_run), "--config", str(tmp_path / "rtn.yaml"),
                          "--eval-windows", "2", *sets]) == 0  # fmt: skip
    both = json.loads((tmp_path / "sets").read_text())
    assert list(both["perplexity"]) == ["wiki", str(text)]
    assert both["perplexity"]["wiki"]["new_ppl"] == out["new_ppl"] == both["new_ppl"]
    assert both["perplexity"][str(text)]["new_ppl"] != out["new_ppl"]
    missing = ["--eval-data", f"wiki,{tmp_path / 'none.txt'}", "--json", str(tmp_path / "m")]
    rtn_config = ["--config", str(tmp_path / "rtn.yaml")]
    assert restage2.main(["--run", str(gptq_run), *rtn_config, *missing]) == 2  # before any work
    assert "none.txt" in capsys.readouterr().err and not (tmp_path / "m").exists()
    assert run({"down_out_mixed_precision": 0.5}, "dout") == 0  # the scan on the final model
    out = json.loads((tmp_path / "dout").read_text())
    assert out["recalibrated"] == ["layers/down_out"]
    assert len(out["down_out_promotion"]["promoted_layers"]) == 1
    assert sorted(out["down_out_promotion"]["layer_bits"]) == [8, 16]
    flag = ["--run", str(gptq_run), "--eval-windows", "2", "--down-out-mixed-precision"]
    assert restage2.main([*flag, "0.5", "--json", str(tmp_path / "flag")]) == 0
    by_flag = json.loads((tmp_path / "flag").read_text())  # the run's config + the flag
    assert by_flag["config"] is None and by_flag["down_out_mixed_precision"] == 0.5
    assert by_flag["new_ppl"] == out["new_ppl"]
    assert by_flag["down_out_promotion"] == out["down_out_promotion"]
    assert restage2.main([*flag, "1.5", "--json", str(tmp_path / "bad")]) == 2
    capsys.readouterr()
    assert run({**clip, "seed": 1}, "seed") == 2  # more than the rules differ, named
    assert capsys.readouterr().err.rstrip().endswith("the run's -> this one's): seed: 0 -> 1")
    assert run({"rules": [{"pattern": "layers/attn_in", "init": "mean_std"}]}, "s1") == 2
    assert run({}, "same") == 2  # nothing to recalibrate
    assert not (tmp_path / "seed").exists() and not (tmp_path / "bad").exists()


def test_config_names_bad_weight_rounding():
    from qnpu_jax.pipeline.config import QuantizeConfig

    with pytest.raises(QnpuError, match="weight_rounding"):
        QuantizeConfig.of(weight_rounding="awq")
    with pytest.raises(QnpuError, match="gptq_damp"):
        QuantizeConfig.of(weight_rounding="gptq", gptq_damp=0.0)
    assert QuantizeConfig.from_dict({"weight_rounding": "gptq"}).weights.rounding == "gptq"
    with pytest.raises(QnpuError, match=r"gptq_act_order .* needs weight_rounding gptq"):
        QuantizeConfig.of(gptq_act_order=True)
    with pytest.raises(QnpuError, match="gptq_act_order must be true or false"):
        QuantizeConfig.from_dict({"weight_rounding": "gptq", "gptq_act_order": "yes"})
    ordered = QuantizeConfig.of(weight_rounding="gptq", gptq_act_order=True)
    assert ordered.weights.gptq_act_order and not QuantizeConfig.of().weights.gptq_act_order
    with pytest.raises(QnpuError, match=r"gptq_passes repeats GPTQ: it needs weight_rounding"):
        QuantizeConfig.of(gptq_passes=2)
    with pytest.raises(QnpuError, match=r"gptq_passes must be in 1..4"):
        QuantizeConfig.of(weight_rounding="gptq", gptq_passes=0)
    assert QuantizeConfig.of(weight_rounding="gptq", gptq_passes=2).weights.gptq_passes == 2
    with pytest.raises(QnpuError, match=r"gptq_windows .* needs weight_rounding gptq"):
        QuantizeConfig.of(gptq_windows=64)
    with pytest.raises(QnpuError, match="gptq_windows must be null or positive, got 0"):
        QuantizeConfig.of(weight_rounding="gptq", gptq_windows=0)
    with pytest.raises(QnpuError, match="gptq_windows must be at most 4096"):
        QuantizeConfig.of(weight_rounding="gptq", gptq_windows=5000)


def test_gptq_windows_are_the_calibration_windows_then_more_of_the_text():
    """`gptq_windows` N: the calibration windows first, then windows of the calibration text
    drawn with the calibration key folded with 1; unset, GPTQ's step records what it did before
    the key existed (so older runs resume)."""
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import config_keys, gptq_step
    from qnpu_jax.pipeline.steps import Calibration

    ids = np.arange(1000, dtype=np.int32)
    data = Calibration(ids, np.stack([ids[s : s + 16] for s in (48, 144, 320, 656)]))
    np.testing.assert_array_equal(data.first_windows(3, jax.random.key(1)), data.windows[:3])
    ten = data.first_windows(10, jax.random.key(1))
    assert ten.shape == (10, 16) and ten.dtype == np.int32
    np.testing.assert_array_equal(ten[:4], data.windows)
    assert all(np.array_equal(w, np.arange(w[0], w[0] + 16)) for w in ten[4:])  # text slices
    np.testing.assert_array_equal(ten, data.first_windows(10, jax.random.key(1)))
    assert not np.array_equal(ten, data.first_windows(10, jax.random.key(2)))

    plain = QuantizeConfig.of(weight_rounding="gptq", gptq_act_order=True)
    assert gptq_step(plain).args == {"damp": 0.01, "act_order": True}
    wide = gptq_step(plain.replace(gptq_windows=64))
    key = jax.random.fold_in(config_keys(plain)[0], 1)
    assert wide.args["windows"] == 64
    assert wide.args["key"] == np.asarray(jax.random.key_data(key)).tolist()
    assert "64 windows" in wide.describe and "act-order" in wide.describe


def test_mixed_precision_sweep_reproduces_the_run_at_its_own_share(gptq_run, tmp_path):
    """p = 0 keeps every down_proj input at the run's 8 bits and encodings: the run's own
    perplexity; p = 100% promotes both layers to 16-bit Max-Min."""
    sweep = load_script("mixed_precision_sweep")
    args = ["--run", str(gptq_run), "--eval-windows", "2", "--steps", "0,1.0"]
    sys_argv = ["mixed_precision_sweep.py", *args, "--json", str(tmp_path / "s.json")]
    old, sys.argv = sys.argv, sys_argv
    try:
        assert sweep.main() == 0
    finally:
        sys.argv = old
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    report = json.loads((gptq_run / "report.json").read_text())
    assert rows[0]["ppl"] == pytest.approx(report["perplexity"]["wiki"]["quantized_ppl"], rel=1e-6)
    assert rows[1]["promoted_layers"] == [0, 1] and rows[1]["ppl"] != rows[0]["ppl"]


def test_table_cost_and_error_budget_on_a_run(gptq_run, tmp_path):
    """Both scripts end to end on a finished run: their unchanged row is the run's own
    perplexity on the run's windows, and every other row is a real, finite number."""
    report = json.loads((gptq_run / "report.json").read_text())
    wiki = report["perplexity"]["wiki"]["quantized_ppl"]
    tc = load_script("table_cost")
    args = ["--run", str(gptq_run), "--eval-windows", "2"]
    assert tc.main([*args, "--json", str(tmp_path / "t.json"), "--md", str(tmp_path / "t.md")]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert rows[0]["key"] == "run" and rows[0]["ppl"] == pytest.approx(wiki, rel=1e-6)
    assert len(rows) == 10 and all(np.isfinite(r["ppl"]) for r in rows)
    assert "lm_head weight at 4 bits per row" in (tmp_path / "t.md").read_text()
    eb = load_script("error_budget")
    assert eb.main([*args, "--json", str(tmp_path / "e.json")]) == 0
    budget = json.loads((tmp_path / "e.json").read_text())
    assert budget["run_ppl"] == pytest.approx(wiki, rel=1e-6)
    assert {r["group"] for r in budget["rows"]} == {
        "weights", "activations", "down_in", "linear_outputs", "rotated_inputs", "kv", "residual"
    }  # fmt: skip
    # float weights are the weights before GPTQ's rounding, not its codes left in the params
    by_group = {r["group"]: r["ppl"] for r in budget["rows"]}
    assert by_group["weights"] != pytest.approx(wiki, rel=1e-6)
    # --eval-data reads another eval set as eval_data names one: a file holding the wiki eval
    # split's text gives the same windows, so the same numbers; another text, others
    from qnpu_jax.data.sources import load_documents

    same = tmp_path / "wiki_eval.txt"
    same.write_text("\n\n".join(load_documents("wiki", "eval")))
    other = tmp_path / "other.txt"
    other.write_text("The river flows past the old mill and on to the sea. " * 400)
    for text, equal in ((same, True), (other, False)):
        out = tmp_path / f"e_{text.stem}.json"
        assert eb.main([*args, "--eval-data", str(text), "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["eval"]["data"] == str(text)
        assert (doc["run_ppl"] == pytest.approx(wiki, rel=1e-6)) is equal
        assert (doc["rows"] == budget["rows"]) is equal
