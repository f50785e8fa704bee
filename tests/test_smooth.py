"""Up→down channel smoothing (SmoothQuant-Edge): model-equivalent, commutes with R1/R2, moves
range from the down_proj input into down_proj's columns, and is wired into runs."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import load_script, run_artifact_ppl  # tests/ is on sys.path (rootdir conftest)

from qnpu_jax import QnpuError
from qnpu_jax.models.llama import forward
from qnpu_jax.pipeline.calibrate import capture_activations, channel_absmax
from qnpu_jax.transforms import (
    apply_rotations,
    fuse_norms,
    randomized_hadamard_rotations,
    smooth_mlp,
    smoothing_scales,
)


@pytest.fixture(scope="module")
def windows(tiny_cfg):
    return np.asarray(jax.random.randint(jax.random.key(5), (3, 16), 0, tiny_cfg.vocab_size))


def test_channel_absmax_is_the_max_of_the_captured_values(tiny_cfg, tiny_params, windows):
    prefix = (1,)
    absmax = channel_absmax(tiny_params, tiny_cfg, windows, ("down_in", "attn_in"), prefix=prefix)
    assert absmax["down_in"].shape == (tiny_cfg.num_layers, tiny_cfg.intermediate_size)
    for layer in range(tiny_cfg.num_layers):
        got = capture_activations(
            tiny_params, tiny_cfg, windows, ("down_in", "attn_in"), layer=layer, prefix=prefix
        )
        for name in ("down_in", "attn_in"):
            expected = np.abs(got[name]).max(axis=(0, 1))
            np.testing.assert_allclose(absmax[name][layer], expected, rtol=1e-6)
    for name in ("down_input", "scores"):
        with pytest.raises(QnpuError, match="no channel ranges"):
            channel_absmax(tiny_params, tiny_cfg, windows, (name,))


def test_smoothing_scales_formula_dead_channels_and_errors():
    rng = np.random.default_rng(0)
    act = rng.uniform(0.1, 9.0, size=(2, 6)).astype(np.float32)
    down = rng.normal(size=(2, 4, 6)).astype(np.float32)
    act[0, 2] = 0.0  # never active
    down[1, :, 4] = 0.0  # no weight
    w = np.abs(down).max(axis=1)  # the readers' column ranges
    s = np.asarray(smoothing_scales(act, w, 0.6))
    expected = act**0.6 / np.where(w > 0, w, 1.0) ** 0.4
    expected[0, 2] = expected[1, 4] = 1.0
    np.testing.assert_allclose(s, expected, rtol=1e-5)
    for alpha in (0.0, 1.0, -0.5):
        with pytest.raises(QnpuError, match="alpha"):
            smoothing_scales(act, w, alpha)
    with pytest.raises(QnpuError, match="do not match"):
        smoothing_scales(act[:, :5], w, 0.5)
    act[1, 1] = np.nan
    with pytest.raises(QnpuError, match="not finite"):
        smoothing_scales(act, w, 0.5)


def test_smoothing_is_equivalent_commutes_with_rotations_and_balances_ranges(
    tiny_cfg, tiny_params, windows
):
    base = fuse_norms(tiny_params, tiny_cfg)
    r1, r2 = randomized_hadamard_rotations(tiny_cfg, jax.random.key(2))
    rotated = apply_rotations(base, tiny_cfg, r1, r2)
    absmax = channel_absmax(rotated, tiny_cfg, windows, ("down_in",))["down_in"]
    s = smoothing_scales(absmax, np.abs(rotated["layers"]["down_proj"]).max(axis=1), 0.5)
    assert not np.allclose(s, 1.0)
    smoothed = apply_rotations(smooth_mlp(base, s), tiny_cfg, r1, r2)
    for name in ("up_proj", "down_proj"):
        assert not np.allclose(smoothed["layers"][name], rotated["layers"][name])
        np.testing.assert_allclose(  # smoothing before or after the rotations: the same
            smoothed["layers"][name], smooth_mlp(rotated, s)["layers"][name], rtol=1e-5, atol=1e-6
        )
    tokens = jnp.asarray(windows)
    np.testing.assert_allclose(
        forward(smoothed, tokens, cfg=tiny_cfg),
        forward(tiny_params, tokens, cfg=tiny_cfg),
        atol=1e-4,
    )
    # α = 0.5 leaves every channel's activation range equal to its weight column's range
    after = channel_absmax(smoothed, tiny_cfg, windows, ("down_in",))["down_in"]
    np.testing.assert_allclose(after, absmax / np.asarray(s), rtol=1e-4)
    w_cols = np.abs(np.asarray(smoothed["layers"]["down_proj"])).max(axis=1)
    np.testing.assert_allclose(after, w_cols, rtol=1e-4)
    with pytest.raises(QnpuError, match="do not match"):
        smooth_mlp(base, s[:, :-1])
    with pytest.raises(QnpuError, match="positive"):
        smooth_mlp(base, s.at[0, 0].set(0.0))


def test_smoothed_run_stores_scales_that_eval_and_export_use(two_layer_dir, tmp_path, capsys):
    import orbax.checkpoint as ocp

    from qnpu_jax.cli import main
    from qnpu_jax.pipeline.quantized_model import save_learned
    from qnpu_jax.pipeline.run import load_run
    from qnpu_jax.pipeline.run_manifest import seal_run

    data = {
        "model": str(two_layer_dir), "method": "quarot", "w_bits": 4, "a_bits": 8,
        "mixed_precision": 0.0, "seq_len": 32, "calib_windows": 2, "eval_windows": 2,
        "smooth_mlp": 0.5,
    }  # fmt: skip
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "run"
    args = ["quantize", "--config", str(tmp_path / "c.yaml"), "--out", str(out), "--no-progress"]
    assert main(args) == 0
    report = json.loads((out / "report.json").read_text())
    assert "smooth_mlp" in report["seconds"]
    wiki = report["perplexity"]["wiki"]
    run = load_run(out)
    params, model = run.model.params(), run.loaded
    with ocp.StandardCheckpointer() as ckpt:
        learned = ckpt.restore((out / "learned").resolve())
    assert float(learned["mlp_smoothing_alpha"]) == 0.5
    scales = np.asarray(learned["mlp_smoothing"])
    assert [s["name"] for s in json.loads((out / "model.json").read_text())["steps"]] == [
        "fuse_norms", "hadamard_rotations", "smooth_mlp", "plan", "calibrate"
    ]  # fmt: skip
    r1, r2 = jnp.asarray(learned["r1"]), jnp.asarray(learned["r2"])
    plain = apply_rotations(fuse_norms(model.params, model.config), model.config, r1, r2)
    smoothed = apply_rotations(
        smooth_mlp(fuse_norms(model.params, model.config), scales), model.config, r1, r2
    )
    for name in ("up_proj", "down_proj"):  # load_run rebuilds the smoothed weights
        assert not np.allclose(params["layers"][name], plain["layers"][name], atol=1e-4)
        np.testing.assert_allclose(params["layers"][name], smoothed["layers"][name], atol=1e-6)
    capsys.readouterr()
    ev = ["eval", "--run", str(out), "--data", "wiki", "--seq-len", "32", "--max-windows", "2"]
    assert main([*ev, "--no-progress", "--json", str(tmp_path / "e.json")]) == 0
    evaluated = json.loads((tmp_path / "e.json").read_text())
    assert evaluated["ppl"] == pytest.approx(wiki["quantized_ppl"], rel=1e-5)
    # the integer artifact carries the smoothed weights: emulator == JAX engine, near fake-quant
    ppl = run_artifact_ppl(out, tmp_path)
    assert ppl["emulator"] == ppl["jax"]
    assert ppl["emulator"] == pytest.approx(wiki["quantized_ppl"], rel=0.1)
    # qnpu study smooth_study calibrates as the run does: its α = 0.5 row is the run
    study = load_script("smooth_study")
    args = ["--model", str(two_layer_dir), "--alphas", "none,0.5", "--seq-len", "32"]
    args += ["--calib-windows", "2", "--eval-windows", "2", "--json", str(tmp_path / "s.json")]
    assert study.main(args) == 0
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["alpha"] for r in rows] == [None, 0.5]
    assert rows[1]["ppl"] == pytest.approx(wiki["quantized_ppl"], rel=1e-6)
    assert rows[0]["ppl"] != rows[1]["ppl"]
    # --resume of a finished run runs nothing: the run is complete, its model and report kept
    args = ["quantize", "--config", str(tmp_path / "c.yaml"), "--out", str(out), "--resume"]
    assert main([*args, "--no-progress"]) == 0
    with ocp.StandardCheckpointer() as ckpt:
        resumed = ckpt.restore((out / "learned").resolve())["mlp_smoothing"]
    np.testing.assert_array_equal(resumed, scales)
    again = json.loads((out / "report.json").read_text())["perplexity"]["wiki"]
    assert again["quantized_ppl"] == wiki["quantized_ppl"]
    # a run whose config no longer matches its stored scales is refused: first by the run's
    # manifest, and behind it (a re-sealed run) by load_run's own consistency checks
    config = yaml.safe_load((out / "config.yaml").read_text())
    (out / "config.yaml").write_text(yaml.safe_dump({**config, "smooth_mlp": 0.3}))
    with pytest.raises(QnpuError, match=r"config\.yaml: (size|hash) mismatch"):
        load_run(out)
    for alpha, match in ((None, "scales are present"), (0.3, "made with 0.5")):
        (out / "config.yaml").write_text(yaml.safe_dump({**config, "smooth_mlp": alpha}))
        seal_run(out)
        with pytest.raises(QnpuError, match=match):
            load_run(out)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    save_learned(out, learned["r1"], learned["r2"], learned["state"])  # scales dropped
    seal_run(out)
    with pytest.raises(QnpuError, match="scales are missing"):
        load_run(out)


def test_report_labels_name_the_options_beyond_the_paper():
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.report.table import run_label

    assert run_label("quantnpu", QuantizeConfig()) == "Quant.npu"
    both = QuantizeConfig.of(smooth_mlp=0.3, weight_rounding="gptq")
    assert run_label("quantnpu", both) == "Quant.npu + smoothing α=0.3 + GPTQ"
    assert both.summary()["smooth_mlp"] == 0.3
    # the outlier paths are structure the deployed graph carries: the label names them
    shadow = QuantizeConfig.of(shadow_outliers=99.99)
    assert run_label("quantnpu", shadow) == "Quant.npu + shadow outliers (P99.99)"
    assert run_label("quantnpu", QuantizeConfig.of(muxq_exp=3)) == "Quant.npu + MUXQ (exp 3)"
    split = QuantizeConfig.of(residual_split=8.0)
    assert run_label("quantnpu", split) == "Quant.npu + residual split (1/8)"
