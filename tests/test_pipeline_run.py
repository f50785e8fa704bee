"""`qnpu quantize` end to end on the real weights cut to 2 layers, configs, mixed precision."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import SHARED_DATA, run_artifact_ppl  # tests/ is on sys.path (rootdir conftest)

from qnpu_jax import QnpuError
from qnpu_jax.cli import main
from qnpu_jax.pipeline.config import QuantizeConfig, load_config, read_run_config
from qnpu_jax.pipeline.mixed_precision import (
    down_proj_sensitivity,
    mixed_layer_bits,
    promoted_layers,
    relative_error_sum,
    tensor_sensitivity,
)
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.quant import QuantPlan, default_plan


def _config_file(path, model, **overrides):
    data = {
        "model": str(model),
        "method": "quantnpu",
        "w_bits": 4,
        "a_bits": 8,
        "seq_len": 32,
        "calib_windows": 2,
        "eval_windows": 2,
        "stage1": {"steps": 2, "batch_size": 1, "checkpoint_every": 1},
    } | overrides
    path.write_text(yaml.safe_dump(data))
    return path


def test_quantize_quantnpu_run_and_eval_it(two_layer_dir, tmp_path, capsys):
    config = _config_file(tmp_path / "c.yaml", two_layer_dir)
    out = tmp_path / "run"
    assert main(["quantize", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    # every long phase announces itself when it starts, in order, with the seconds elapsed
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[")]
    phases = ["loading", "sensitivity scan", "stage 1: 2 steps", "stage 2", "evaluation on wiki"]
    assert [p for line in said for p in phases if p in line] == phases, said
    report = json.loads((out / "report.json").read_text())
    wiki = report["perplexity"]["wiki"]
    # two of 30 layers make no language model: only check the numbers are real and differ
    assert np.isfinite(wiki["quantized_ppl"]) and wiki["quantized_ppl"] != wiki["float_ppl"]
    steps = ["fuse_norms", "hadamard_rotations", "plan", "promote_down_in", "stage1", "calibrate"]
    assert list(report["seconds"]) == ["load", *steps, "eval"]
    plan = QuantPlan.from_dict(json.loads((out / "plan.json").read_text()))
    down_in = plan.get("layers/down_in")
    assert down_in is not None and sorted(down_in.layer_bits) == [8, 16]  # ceil(10% of 2) = 1
    assert plan.get("layers/attn_in").init == "max_min"  # A8: Max-Min
    assert plan.get("layers/q_proj").init == "mean_std"  # W4: mean ± 3σ
    steps = [
        json.loads(x)["step"] for x in (out / "stage1" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2]
    assert load_config(out / "config.yaml") == load_config(config)
    run = RunDir(out)  # its readers give the same (issue 39)
    assert run.read_report() == report and run.read_plan() == plan
    assert read_run_config(run) == load_config(config)
    rows = run.read_stage1_metrics()
    assert rows is not None and [row["step"] for _, row in rows] == steps
    assert run.resume.has_model_json  # the model before stage 1: what --resume continues
    assert run.read_sensitivity() == report["sensitivity"]
    capsys.readouterr()
    # the run's fake-quant model evaluated by `qnpu eval --run` on the same windows
    ev = ["eval", "--run", str(out), "--data", "wiki", "--seq-len", "32", "--max-windows", "2"]
    assert main([*ev, "--no-progress", "--json", str(tmp_path / "e.json")]) == 0
    evaluated = json.loads((tmp_path / "e.json").read_text())
    assert evaluated["ppl"] == pytest.approx(wiki["quantized_ppl"], rel=1e-5)
    assert evaluated["path"] == "fake-quant (static)"
    _export_and_run_the_artifact(out, tmp_path, evaluated["ppl"], capsys)
    # an existing run is not overwritten without --resume; a changed config does not resume
    assert main(["quantize", "--config", str(config), "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    changed = _config_file(tmp_path / "d.yaml", two_layer_dir, seed=1)
    assert main(["quantize", "--config", str(changed), "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "differs" in err and err.rstrip().endswith("seed: 0 -> 1")  # what differs, named


def _export_and_run_the_artifact(run, tmp_path, fake_quant_ppl, capsys):
    """`qnpu export` of the run, then the artifact on the emulator and the JAX integer engine:
    the same perplexity windows as the fake-quant eval, identical in both engines."""
    from qnpu_jax.pipeline.run import load_run

    state = load_run(run).model.require_state()
    scales = [np.asarray(e.scale) for g in state.values() for e in g.values()]
    assert all((s > 0).all() for s in scales)  # learned scales are stored as the forward used them
    art = tmp_path / "artifact"
    export = ["export", "--run", str(run), "--max-context", "64", "--prefill-chunk", "16"]
    assert main([*export, "--out", str(art)]) == 0
    again = tmp_path / "again"
    assert main([*export, "--out", str(again)]) == 0  # re-exporting gives the same bytes
    files = sorted(p.relative_to(art) for p in art.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert all((art / f).read_bytes() == (again / f).read_bytes() for f in files)
    reports = {}
    for engine in ("emulator", "jax"):
        path = tmp_path / f"{engine}.json"
        ev = ["eval", "--artifact", str(art), "--engine", engine, "--data", "wiki"]
        ev += ["--seq-len", "32", "--max-windows", "2", "--no-progress", "--json", str(path)]
        assert main(ev) == 0
        reports[engine] = json.loads(path.read_text())
    assert reports["emulator"]["ppl"] == reports["jax"]["ppl"]  # bit-exact logits
    assert reports["emulator"]["path"] == "integer (emulator)"
    # rounding only separates the integer model from the fake-quant one (2 layers, 62 tokens)
    assert reports["emulator"]["ppl"] == pytest.approx(fake_quant_ppl, rel=0.1)
    capsys.readouterr()
    assert (
        main(["emulate", "--artifact", str(art), "--prompt", "The cat", "--max-new-tokens", "3"])
        == 0
    )
    assert capsys.readouterr().out.startswith("The cat")
    for select in ("vote", "beam"):
        sampled = ["emulate", "--artifact", str(art), "--prompt", "The cat", "--engine", "jax"]
        sampled += ["--max-new-tokens", "3", "--samples", "3", "--select", select]
        assert main(sampled) == 0
        out = capsys.readouterr()
        assert out.out.startswith("The cat") and "of 3" in out.err
    assert (
        main(["export", "--run", str(run), "--out", str(tmp_path / "aimet"), "--format", "aimet"])
        == 0
    )
    encodings = json.loads((tmp_path / "aimet" / f"{run.name}.encodings").read_text())
    assert encodings["version"] == "1.0.0" and encodings["param_encodings"]


def test_down_out_promotion_runs_through_eval_and_the_integer_artifact(
    two_layer_dir, tmp_path, capsys
):
    """down_out_mixed_precision: the scan's top layer gets a 16-bit down_proj output, and the
    exported artifact (16-bit codes feeding the residual add) runs bit-exactly."""
    over = {"method": "quarot", "mixed_precision": 0.0, "down_out_mixed_precision": 0.5}
    config = _config_file(tmp_path / "c.yaml", two_layer_dir, **over)
    out = tmp_path / "run"
    assert main(["quantize", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    scan = json.loads((out / "sensitivity_down_out.json").read_text())
    assert report["down_out_sensitivity"] == scan and report["sensitivity"] is None
    top = int(np.argmax(scan["ratios"]))
    assert scan["promoted_layers"] == [top]  # ceil(50% of 2) = 1
    plan = QuantPlan.from_dict(json.loads((out / "plan.json").read_text()))
    assert plan.get("layers/down_out").layer_bits == tuple(16 if i == top else 8 for i in range(2))
    assert plan.get("layers/down_in").layer_bits in (None, (8, 8))
    capsys.readouterr()
    ev = ["eval", "--run", str(out), "--data", "wiki", "--seq-len", "32", "--max-windows", "2"]
    assert main([*ev, "--no-progress", "--json", str(tmp_path / "e.json")]) == 0
    fake_quant_ppl = json.loads((tmp_path / "e.json").read_text())["ppl"]
    assert fake_quant_ppl == pytest.approx(report["perplexity"]["wiki"]["quantized_ppl"], rel=1e-5)
    ppl = run_artifact_ppl(out, tmp_path)
    assert ppl["emulator"] == ppl["jax"]
    assert ppl["emulator"] == pytest.approx(fake_quant_ppl, rel=0.1)


def test_mlp_in_and_attn_out_promotions_scan_at_the_planned_bits_and_run_through_the_artifact(
    two_layer_dir, tmp_path
):
    """mlp_in_mixed_precision and attn_out_mixed_precision at W4A4: the gate/up input and the
    o_proj input are scanned at their 4 bits before stage 1, each one's top layer goes to 16
    bits (stage 1 learns it there), and the exported artifact runs bit-exactly on both
    engines."""
    over = {
        "a_bits": 4,
        "mixed_precision": 0.0,
        "mlp_in_mixed_precision": 0.5,
        "attn_out_mixed_precision": 0.5,
    }
    config = _config_file(tmp_path / "c.yaml", two_layer_dir, **over)
    out = tmp_path / "run"
    assert main(["quantize", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    plan = QuantPlan.from_dict(json.loads((out / "plan.json").read_text()))
    for tensor in ("mlp_in", "attn_out"):
        scan = json.loads((out / f"sensitivity_{tensor}.json").read_text())
        assert scan["bits_measured"] == 4 and scan["fraction"] == 0.5
        top = int(np.argmax(scan["ratios"]))
        assert scan["promoted_layers"] == [top]
        want = tuple(16 if i == top else 4 for i in range(2))
        assert plan.get(f"layers/{tensor}").layer_bits == want
    assert plan.get("layers/attn_in").layer_bits is None and plan.get("layers/attn_in").bits == 4
    steps = json.loads((out / "model.json").read_text())["steps"]
    promoted = [s["args"]["tensor"] for s in steps if s["name"] == "promote"]
    assert promoted == ["mlp_in", "attn_out"]
    names = [s["name"] for s in steps]
    assert max(i for i, n in enumerate(names) if n == "promote") < names.index("stage1")
    ppl = run_artifact_ppl(out, tmp_path)
    assert ppl["emulator"] == ppl["jax"]
    for name in ("mlp_in_mixed_precision", "attn_out_mixed_precision"):
        with pytest.raises(QnpuError, match=name):
            QuantizeConfig.from_dict({name: -0.1})


def test_rtn_run_has_no_stage1(two_layer_dir, tmp_path):
    config = _config_file(tmp_path / "c.yaml", two_layer_dir, method="rtn", mixed_precision=0.0)
    out = tmp_path / "run"
    assert main(["quantize", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "stage1" not in report["seconds"] and not (out / "stage1").exists()
    assert report["sensitivity"] is None
    # a float reference on the same windows replaces the float evaluation; other windows fail
    from qnpu_jax.pipeline.run import quantize

    wiki = report["perplexity"]["wiki"]
    reference = {"ppl": 123.0, "windows": wiki["windows"], "tokens": wiki["tokens"]}
    again = quantize(load_config(config), tmp_path / "again", float_reference={"wiki": reference})
    assert again["perplexity"]["wiki"]["float_ppl"] == 123.0  # taken, not measured
    assert again["perplexity"]["wiki"]["float_from_reference"] is True
    assert again["perplexity"]["wiki"]["quantized_ppl"] == wiki["quantized_ppl"]
    assert wiki["float_from_reference"] is False
    other = {"wiki": {**reference, "windows": wiki["windows"] + 1}}
    with pytest.raises(QnpuError, match="not the same evaluation"):
        quantize(load_config(config), tmp_path / "other", float_reference=other)


def test_config_errors_name_the_problem(tmp_path):
    with pytest.raises(QnpuError, match="unknown config key"):
        QuantizeConfig.from_dict({"w_bit": 4})
    with pytest.raises(QnpuError, match="unknown stage1 key"):
        QuantizeConfig.from_dict({"stage1": {"step": 3}})
    with pytest.raises(QnpuError, match="unknown method"):
        QuantizeConfig.from_dict({"method": "gptq"})
    with pytest.raises(QnpuError, match="never below 8"):
        QuantizeConfig.from_dict({"down_in_bits": 4})
    with pytest.raises(QnpuError, match="down_out_mixed_precision"):
        QuantizeConfig.from_dict({"down_out_mixed_precision": 1.5})
    for alpha in (0.0, 1.5, True, "half"):
        with pytest.raises(QnpuError, match="smooth_mlp"):
            QuantizeConfig.from_dict({"smooth_mlp": alpha})
    bad = tmp_path / "bad.yaml"
    bad.write_text("w_bits: [4\n")
    with pytest.raises(QnpuError, match=r"bad\.yaml"):
        load_config(bad)
    with pytest.raises(QnpuError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    rules = QuantizeConfig.from_dict({"rules": [{"pattern": "layers/down_in", "bits": 16}]})
    assert QuantizeConfig.from_dict(rules.to_dict()) == rules


def test_shipped_configs_load_by_name_and_by_path():
    from pathlib import Path

    from qnpu_jax.pipeline.config import shipped_configs

    files = sorted(Path(__file__).parents[1].glob("configs/*.yaml"))
    shipped = shipped_configs()
    assert len(files) >= 13 and sorted(shipped) == sorted(f.stem for f in files)
    for path in files:
        assert load_config(path.stem) == load_config(path) == load_config(f"{path.stem}.yaml")
    with pytest.raises(QnpuError, match=r"not found: no-such-config .*shipped: .*quick"):
        load_config("no-such-config")


def test_overrides_and_config_free_quantize_configs(capsys):
    from types import SimpleNamespace

    from qnpu_jax.cli import quantize_config
    from qnpu_jax.pipeline.config import apply_overrides, parse_bits

    base = load_config("smollm2-135m-quantnpu-w4a8")
    got = load_config("smollm2-135m-quantnpu-w4a8", ["stage1.steps=120", "eval_data=[wiki, x]"])
    assert got.stage1.steps == 120 and got.eval.data == ("wiki", "x")
    assert got.stage1.lr_scale == base.stage1.lr_scale and got.data.seq_len == base.data.seq_len
    assert parse_bits("W4A8KV8") == {"w_bits": 4, "a_bits": 8, "kv_bits": 8}
    for bad, message in (
        (["seq_len"], "expected KEY=VALUE"),
        (["a.b=1"], "only stage1.KEY and mesh.KEY may be dotted"),
        (["seq_len=[1"], "not YAML"),
    ):
        with pytest.raises(QnpuError, match=message):
            apply_overrides({}, bad)
    with pytest.raises(QnpuError, match="unknown config key"):
        load_config("quick", ["stage_1=3"])
    with pytest.raises(QnpuError, match="expected wXaY"):
        parse_bits("int4")

    def args(**kw):
        defaults = {"config": None, "model": None, "method": None, "bits": None, "mesh": None}
        defaults |= {"overrides": []}
        return SimpleNamespace(**(defaults | kw))

    free = quantize_config(args(method="rtn", bits="w8a8", overrides=["seq_len=64"]))
    assert free == QuantizeConfig.of(method="rtn", w_bits=8, a_bits=8, seq_len=64)
    meshed = quantize_config(args(config="quick", mesh="2x4"))
    assert meshed.mesh.data == 2 and meshed.mesh.fsdp == 4
    named = quantize_config(args(config="quick", bits="w8a8kv8", model="m", method="quarot"))
    assert named == QuantizeConfig.from_dict(
        {**load_config("quick").to_dict(), "w_bits": 8, "method": "quarot", "model": "m"}
    )
    with pytest.raises(QnpuError, match=r"give --config NAME .* or --method and --bits"):
        quantize_config(args(method="rtn"))
    assert main(["configs"]) == 0
    listed = capsys.readouterr().out
    assert "quick " in listed and "smollm2-135m-quantnpu-w4a8 " in listed


def test_promotion_picks_the_top_share_rounded_up():
    ratios = [0.1, 0.9, 0.5, 0.95, 0.2, 0.3, 0.4, 0.6, 0.7, 0.8] * 3  # 30 layers
    assert promoted_layers(ratios, 0.10) == (3, 13, 23)  # 3 of 30, as the paper's 3 of 28
    assert promoted_layers(ratios, 0.0) == ()
    assert len(promoted_layers(ratios, 1.0)) == 30
    assert mixed_layer_bits([0.1, 0.9, 0.5], 0.34) == (8, 16, 16)  # ceil(1.02) = 2
    assert mixed_layer_bits([0.1, 0.9, 0.5], 0.34, 4) == (4, 16, 16)  # a W4A4 input
    with pytest.raises(QnpuError):
        promoted_layers(ratios, 1.5)


def test_relative_error_by_hand_and_vmap_matches_a_loop(tiny_cfg, tiny_params):
    x = jnp.array([1.0, 0.25, -0.5, 0.0])
    # scale 0.5: codes 2, 0 (0.5 rounds to even), -1, 0 -> errors 0, 0.25, 0, 0
    got = relative_error_sum(x, jnp.float32(0.5), jnp.float32(-128), jnp.float32(127))
    assert float(got) == pytest.approx(0.25 / (0.25 + 1e-8))
    ids = np.asarray(jax.random.randint(jax.random.key(2), (2, 16), 0, tiny_cfg.vocab_size))
    from qnpu_jax.models.taps import CaptureTaps, tapped_forward

    _, aux = tapped_forward(
        tiny_params, {"layers": None, "outer": None}, jnp.asarray(ids), cfg=tiny_cfg,
        taps=CaptureTaps(frozenset({"down_in", "down_out", "mlp_in"})),
    )  # fmt: skip
    reports = {  # (report, qmax): a W4A4 plan's 4-bit input is scanned at 4 bits
        "down_in": (down_proj_sensitivity(tiny_params, tiny_cfg, ids), 127),
        "down_out": (tensor_sensitivity(tiny_params, tiny_cfg, ids, "down_out"), 127),
        "mlp_in": (tensor_sensitivity(tiny_params, tiny_cfg, ids, "mlp_in", bits=4), 7),
    }
    for name, (report, qmax) in reports.items():
        acts = np.asarray(aux["layers"][name])
        for layer, ratio in enumerate(report.ratios):
            a, s = acts[layer], report.scales[layer]
            assert s == pytest.approx(np.abs(a).max() / qmax, rel=1e-6)  # Max-Min
            dq = np.clip(np.round(a / s), -qmax - 1, qmax) * s
            want = np.mean(np.abs(dq - a) / (np.abs(a) + 1e-8))
            assert ratio == pytest.approx(want, rel=1e-4)
    assert reports["down_in"][0].ratios != reports["down_out"][0].ratios
    with pytest.raises(QnpuError, match="no sensitivity scan"):
        tensor_sensitivity(tiny_params, tiny_cfg, ids, "scores")


def test_default_plan_round_trips_through_json():
    plan = default_plan(3, w_bits=4, a_bits=4).apply([])
    assert QuantPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    with pytest.raises(QnpuError, match="keys"):
        QuantPlan.from_dict({"tensors": {}})


def test_ablation_knobs_shape_the_plans():
    from qnpu_jax.pipeline.recipes import build_plan
    from qnpu_jax.pipeline.recipes import config_stage1_plan as stage1_plan

    linears = QuantizeConfig.of(scope="linears", selective=False, init_scheme="max_min")
    plan = build_plan(linears, 4)
    assert "layers/q_out" in plan and "layers/down_in" in plan and "layers/q_proj" in plan
    for float_tensor in ("layers/scores", "layers/resid_mlp", "lm_head", "layers/silu_out"):
        assert float_tensor not in plan
    assert plan.get("layers/q_proj").init == "max_min"
    s1 = stage1_plan(plan, linears)
    assert s1.get("layers/o_out").learnable and s1.get("layers/k_rope") is None  # not a linear
    selective = stage1_plan(
        build_plan(QuantizeConfig(), 4, {"down_in": (8, 16, 8, 8)}), QuantizeConfig()
    )
    assert set(selective.paths()) == {
        f"layers/{n}"
        for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "attn_in", "attn_out", "mlp_in", "down_in")
    }  # fmt: skip
    assert all(tq.learnable for _, tq in selective.entries)
    assert selective.get("layers/down_in").layer_bits == (8, 16, 8, 8)
    frozen_down = QuantizeConfig(learn_down_in=False)
    assert not stage1_plan(build_plan(frozen_down, 4), frozen_down).get("layers/down_in").learnable
    spin = QuantizeConfig(method="spinquant")
    assert not any(tq.learnable for _, tq in stage1_plan(build_plan(spin, 4), spin).entries)


def test_eval_zero_shot_tasks_on_a_run_and_float(two_layer_dir, tmp_path, capsys, monkeypatch):
    config = _config_file(tmp_path / "c.yaml", two_layer_dir, method="quarot", mixed_precision=0.0)
    out = tmp_path / "run"
    assert main(["quantize", "--config", str(config), "--out", str(out), "--no-progress"]) == 0
    reports = {}
    for source in (["--run", str(out)], ["--model", str(two_layer_dir)]):
        path = tmp_path / f"{source[0][2:]}.json"
        args = ["eval", *source, "--tasks", "piqa,lambada", "--limit", "4", "--no-progress"]
        assert main([*args, "--task-data", str(SHARED_DATA), "--json", str(path)]) == 0
        reports[source[0]] = json.loads(path.read_text())
    for r in reports.values():
        assert r["tasks"]["piqa"]["n"] == 4 and 0 <= r["tasks"]["piqa"]["metrics"]["acc"] <= 1
        assert r["tasks"]["piqa"]["indices"] == reports["--model"]["tasks"]["piqa"]["indices"]
    assert reports["--run"]["path"] == "fake-quant (static)"
    assert reports["--run"]["task_data"] == str(SHARED_DATA)
    assert main(["eval", "--model", "x", "--tasks", "mmlu"]) == 2
    assert main(["eval", "--model", "x", "--tasks", "ppl"]) == 2  # needs --data and --seq-len
    # without task data, a clear error naming both ways, before the model loads ("x" is none)
    capsys.readouterr()
    monkeypatch.delenv("QNPU_DATA_DIR", raising=False)
    assert main(["eval", "--model", "x", "--tasks", "piqa"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qnpu: error: zero-shot tasks piqa need their data")
    assert "--task-data DIR" in err and "QNPU_DATA_DIR" in err and "--task-data hf" in err
    # --run: --data, --seq-len and --max-windows default to the run's own (eval_windows: 2),
    # which reproduces its perplexity (without the last, every window: issue 55)
    path = tmp_path / "ppl.json"
    assert main(["eval", "--run", str(out), "--json", str(path)]) == 0
    assert "--data wiki --seq-len 32 --max-windows 2 (the run's)" in capsys.readouterr().err
    ppl = json.loads(path.read_text())
    run_report = json.loads((out / "report.json").read_text())["perplexity"]["wiki"]
    assert (ppl["data"], ppl["split"], ppl["seq_len"]) == ("wiki", "eval", 32)
    assert (ppl["windows"], ppl["max_windows"]) == (2, 2)
    assert ppl["ppl"] == pytest.approx(run_report["quantized_ppl"], rel=1e-4)
