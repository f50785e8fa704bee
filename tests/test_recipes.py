"""QuantizedModel, steps and recipes: the README's user recipe end to end, loading a run
without running any step, legacy runs, and the steps' refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from qnpu_jax.errors import QnpuError
from qnpu_jax.models.load import load_model
from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
from qnpu_jax.quant.plan import QuantRule

README = Path(__file__).resolve().parents[1] / "README.md"


def _readme_recipe() -> str:
    text = README.read_text()
    marker = text.index("<!-- example: recipe")
    block = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert block is not None
    return block.group(1)


def _forbid_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every computation a step could run fail: a load that runs one is caught."""

    def refuse(*args, **kwargs):
        raise AssertionError("a recipe step ran")

    for name in ("calibrate_state", "run_stage1", "gptq_round_weights", "tensor_sensitivity"):
        monkeypatch.setattr(steps, name, refuse)
    for name in ("channel_absmax", "randomized_hadamard_rotations"):
        monkeypatch.setattr(steps, name, refuse)
    monkeypatch.setattr(steps.Step, "__call__", refuse)


def test_readme_recipe_runs_through_export_and_both_engines(two_layer_dir, tmp_path, monkeypatch):
    code = _readme_recipe()
    recipe_lines = code[code.index("fp = load_model") :].strip().splitlines()
    assert len(recipe_lines) <= 16, recipe_lines  # the README promises a short recipe
    for old, new in (
        ('"smollm2-135m"', repr(str(two_layer_dir))),
        ("seq_len=128, windows=16", "seq_len=32, windows=48"),  # GPTQ: >= 1536 tokens
        ('"runs/my-recipe"', repr(str(tmp_path / "run"))),
        ('"artifacts/my-recipe"', repr(str(tmp_path / "art"))),
    ):
        assert old in code, old
        code = code.replace(old, new)
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    model = ns["model"]
    assert [s.name for s in model.steps] == [
        "fuse_norms", "hadamard_rotations", "smooth_mlp", "plan", "calibrate", "gptq"
    ]  # fmt: skip
    assert model.transforms.rotated and model.weight_codes
    windows = ns["data"].windows[:2]
    fake = model.perplexity(windows)["ppl"]
    emulator, jax_engine = ns["engines"]
    tokens = np.asarray(windows)
    nll = [np.asarray(e.token_nll(tokens)) for e in (emulator, jax_engine)]
    np.testing.assert_array_equal(nll[0], nll[1])  # the two engines agree bit for bit
    integer_ppl = float(np.exp(nll[0].mean()))
    assert integer_ppl == pytest.approx(fake, rel=0.1)
    # the saved model comes back without any step: same params, encodings and perplexity
    _forbid_steps(monkeypatch)
    loaded = QuantizedModel.load(tmp_path / "run")
    assert loaded.steps == model.steps and loaded.plan == model.plan
    assert loaded.perplexity(windows)["ppl"] == fake


@pytest.fixture(scope="module")
def quick_run(two_layer_dir, tmp_path_factory):
    """A quantnpu run with every piece a run stores: promotion, stage 1, trained scales."""
    from qnpu_jax.cli import main

    tmp = tmp_path_factory.mktemp("recipes")
    data = {
        "model": str(two_layer_dir), "method": "quantnpu", "w_bits": 4, "a_bits": 8,
        "seq_len": 32, "calib_windows": 2, "eval_windows": 2,
        "stage1": {"steps": 1, "batch_size": 1, "checkpoint_every": 1},
    }  # fmt: skip
    (tmp / "c.yaml").write_text(yaml.safe_dump(data))
    out = tmp / "run"
    args = ["quantize", "--config", str(tmp / "c.yaml"), "--out", str(out), "--no-progress"]
    assert main(args) == 0
    return out


def test_load_reproduces_the_reported_perplexity_with_no_step(quick_run, monkeypatch):
    from qnpu_jax.pipeline.run import evaluation_sets, load_run

    report = json.loads((quick_run / "report.json").read_text())
    described = json.loads((quick_run / "model.json").read_text())["steps"]
    assert [s["name"] for s in described] == [
        "fuse_norms", "hadamard_rotations", "plan", "promote", "stage1", "calibrate"
    ]  # fmt: skip
    assert described[3]["info"]["promoted_layers"] == report["sensitivity"]["promoted_layers"]
    _forbid_steps(monkeypatch)
    run = load_run(quick_run)
    cfg = run.model.cfg
    windows = evaluation_sets(
        run.config, run.tokenizer, cfg.max_position_embeddings - len(run.model.prefix)
    )["wiki"]
    ppl = run.model.perplexity(windows)["ppl"]
    assert ppl == report["perplexity"]["wiki"]["quantized_ppl"]
    # the value is a pytree: mapping over its leaves keeps every static fact
    same = jax.tree.map(lambda x: x, run.model)
    assert same.steps == run.model.steps and same.plan == run.model.plan
    assert len(jax.tree.leaves(run.model)) > len(jax.tree.leaves(run.model.base))


def test_a_loaded_run_keeps_its_stage1_scales_through_another_calibration(quick_run):
    """Stage 1's trained scales are saved with the run: stage 2 again on the loaded model (as
    a post-training down_proj output promotion runs it) gives back the stored encodings, and
    without them the initializers' scales would replace what stage 1 learned."""
    from qnpu_jax.pipeline.run import calibration_data, load_run
    from qnpu_jax.quant.state import by_path

    run = load_run(quick_run)
    assert run.model.trained is not None and "layers" in run.model.trained
    data = Calibration(*calibration_data(run.config, run.tokenizer))
    stored = by_path(run.model.require_state())
    again = by_path(steps.calibrate()(run.model.replace(state=None), data).require_state())
    assert set(again) == set(stored)
    for path, entry in stored.items():
        np.testing.assert_array_equal(again[path].scale, entry.scale, err_msg=path)
    lost = steps.calibrate()(run.model.replace(state=None, trained=None), data)
    learned = [f"layers/{name}" for name in run.model.trained["layers"]]
    changed = [
        p
        for p in learned
        if not np.array_equal(by_path(lost.require_state())[p].scale, stored[p].scale)
    ]
    assert changed, "stage 1 left every scale at its initializer's value"


def test_a_run_made_before_quantized_model_still_loads(quick_run, tmp_path):
    """Runs of the earlier layout (no model.json) are rebuilt from their config.yaml."""
    import shutil

    from qnpu_jax.pipeline.run import load_run
    from qnpu_jax.pipeline.run_manifest import seal_run

    old = tmp_path / "old"
    shutil.copytree(quick_run, old)
    (old / "model.json").unlink()
    seal_run(old)
    new, legacy = load_run(quick_run).model, load_run(old).model
    assert [s.name for s in legacy.steps] == ["legacy_run"]
    assert legacy.prefix == new.prefix and legacy.plan == new.plan
    windows = np.asarray([[1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
    assert legacy.perplexity(windows) == new.perplexity(windows)
    # a model.json of another format version is refused with the version named
    meta = json.loads((quick_run / "model.json").read_text())
    (old / "model.json").write_text(json.dumps({**meta, "version": 99}))
    seal_run(old)
    with pytest.raises(QnpuError, match="format version 99"):
        load_run(old)


def test_steps_refuse_an_order_that_makes_no_model(two_layer_dir):
    fp = load_model(str(two_layer_dir))
    start = QuantizedModel.from_float(fp, prefix="bos")
    data = Calibration(np.arange(100), np.arange(64).reshape(2, 32))
    assert start.prefix == (fp.tokenizer.bos_token_id,)
    cases = [
        (steps.hadamard_rotations(jax.random.key(0)), "put fuse_norms"),
        (
            steps.stage1(steps.Stage1Config(steps=1), jax.random.key(0), learn_scales=False),
            "nothing to learn: no rotations",
        ),
        (steps.stage1(steps.Stage1Config(steps=1), jax.random.key(0)), "no quantization plan"),
        (steps.calibrate(), "no quantization plan"),
        (steps.promote("down_in", 0.5), "no quantization plan"),
    ]
    for step, match in cases:
        with pytest.raises(QnpuError, match=match):
            step(start, data)
    fused = steps.fuse_norms()(start, data)
    with pytest.raises(QnpuError, match="fused already"):
        steps.fuse_norms()(fused, data)
    with pytest.raises(QnpuError, match="alpha"):
        steps.smooth_mlp(1.5)
    with pytest.raises(QnpuError, match="chain takes steps"):
        chain(steps.fuse_norms(), "calibrate")  # type: ignore[arg-type]
    with pytest.raises(QnpuError, match="non-empty"):
        Calibration(np.arange(10), np.zeros((0, 8), np.int32))
    # a plan step records its arguments; the model is unchanged but for the plan and record
    planned = steps.plan(w_bits=8, a_bits=8)(fused, data)
    assert planned.steps[-1].args["w_bits"] == 8 and planned.base is fused.base
    # a promotion replaces the one the plan holds (both layers at 16) instead of adding to it,
    # and keeps the other layers at the tensor's base bits (4 at W4A4)
    rules = [QuantRule(pattern="layers/down_out", layer_bits=(16, 16))]
    w4a4 = steps.plan(w_bits=4, a_bits=4, rules=rules)(fused, data)
    for tensor, base in (("down_out", 8), ("mlp_in", 4)):
        promoted = steps.promote(tensor, 0.5)(w4a4, data)
        bits = promoted.require_plan().get(f"layers/{tensor}").layer_bits
        assert sorted(bits) == [base, 16], (tensor, bits)
        assert promoted.steps[-1].info["bits_measured"] == base


def test_calibrate_paths_recalibrates_those_tensors_and_keeps_the_rest(two_layer_dir):
    """calibrate(paths) after a rule changed one tensor equals calibrating the new plan
    whole on that tensor; every other encoding is the one the model had."""
    from qnpu_jax.quant.plan import QuantRule, default_plan
    from qnpu_jax.quant.state import by_path

    fp = load_model(str(two_layer_dir))
    windows = (np.arange(64).reshape(2, 32) * 37) % fp.config.vocab_size
    data = Calibration(np.arange(200), windows)
    start = QuantizedModel.from_float(fp, prefix="none")
    base = chain(steps.fuse_norms(), steps.plan(w_bits=8, a_bits=8), steps.calibrate())(start, data)
    rule = QuantRule(pattern="layers/down_out", init="percentile")
    new_plan = default_plan(fp.config.num_layers, w_bits=8, a_bits=8, rules=[rule])
    part = steps.calibrate(["layers/down_out"])(base.replace(plan=new_plan), data)
    full = steps.calibrate()(base.replace(plan=new_plan, state=None), data)
    old, got, want = by_path(base.state), by_path(part.state), by_path(full.state)
    assert set(got) == set(want) == set(old)
    np.testing.assert_array_equal(got["layers/down_out"].scale, want["layers/down_out"].scale)
    assert not np.array_equal(got["layers/down_out"].scale, old["layers/down_out"].scale)
    assert all(got[p] is old[p] for p in got if p != "layers/down_out")
    assert part.steps[-1].name == "calibrate"
    assert part.steps[-1].args == {"paths": ["layers/down_out"]}
    with pytest.raises(QnpuError, match="not tensors of the plan"):
        steps.calibrate(["layers/nope"])(base, data)
    with pytest.raises(QnpuError, match="empty"):
        steps.calibrate([])


def test_choose_rotation_keeps_the_candidate_with_the_lowest_calibration_loss(two_layer_dir):
    """choose_rotation scores every candidate key by the calibrated model's perplexity and
    keeps that key's rotations, unquantized; the config's candidates start with the run's
    own rotation key, and one candidate is the plain hadamard_rotations step."""
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import config_keys, for_config, rotation_keys

    fp = load_model(str(two_layer_dir))
    windows = (np.arange(96).reshape(3, 32) * 37) % fp.config.vocab_size
    data = Calibration(np.arange(200), windows)
    fused = steps.fuse_norms()(QuantizedModel.from_float(fp, prefix="none"), data)
    config = QuantizeConfig.of(a_bits=4, rotation_candidates=3, seed=5)
    keys = rotation_keys(config)
    assert len(keys) == 3
    np.testing.assert_array_equal(
        jax.random.key_data(keys[0]), jax.random.key_data(config_keys(config)[1])
    )
    score = [steps.plan(w_bits=4, a_bits=4), steps.calibrate()]
    chosen = steps.choose_rotation(keys, score, windows=2)(fused, data)
    info = chosen.steps[-1].info
    ppls = []
    for key in keys:  # each candidate scored by hand
        scored = chain(steps.hadamard_rotations(key), *score)(fused, data)
        ppls.append(scored.perplexity(windows[:2])["ppl"])
    assert info["candidate_ppl"] == pytest.approx(ppls, rel=1e-6)
    assert len(set(np.round(ppls, 6))) == 3  # the candidates differ, so the choice means something
    assert info["chosen"] == int(np.argmin(ppls))
    want = steps.hadamard_rotations(keys[info["chosen"]])(fused, data)
    np.testing.assert_array_equal(chosen.transforms.r1, want.transforms.r1)
    np.testing.assert_array_equal(chosen.transforms.r2, want.transforms.r2)
    assert chosen.plan is None and chosen.state is None
    assert QuantizeConfig().rotation_candidates == 1
    names = [s.name for s in for_config(config)]
    assert "choose_rotation" in names and "hadamard_rotations" not in names
    assert "hadamard_rotations" in [s.name for s in for_config(QuantizeConfig())]
    with pytest.raises(QnpuError, match="rotation_candidates"):
        QuantizeConfig(rotation_candidates=0)
    with pytest.raises(QnpuError, match="no rotations"):
        QuantizeConfig(method="rtn", rotation_candidates=2)


def test_docs_custom_step_round_trips_and_a_base_change_is_refused_at_save(two_layer_dir, tmp_path):
    """docs/pipeline.md's custom step (an encoding read and replaced) saves and loads with
    its record and encodings; a step that changes what `save` does not store (the base
    params, the model config) is refused at save time, before anything is written."""
    import dataclasses

    from qnpu_jax.pipeline import Step
    from qnpu_jax.quant.state import get_entry

    text = (Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text()
    marker = text.index("<!-- custom-step:")
    block = re.search(r"```python\n(.*?)```", text[marker:], re.S)
    assert block is not None
    code = block.group(1).replace('"runs/widened"', repr(str(tmp_path / "widened")))
    fp = load_model(str(two_layer_dir))
    windows = (np.arange(64).reshape(2, 32) * 37) % fp.config.vocab_size
    data = Calibration(np.arange(200), windows)
    start = QuantizedModel.from_float(fp, prefix="bos")
    model = chain(steps.fuse_norms(), steps.plan(w_bits=8, a_bits=8), steps.calibrate())(
        start, data
    )
    ns = {"model": model, "data": data, "Path": Path}
    exec(compile(code, "docs/pipeline.md", "exec"), ns)
    widened = ns["model"]
    record = widened.steps[-1]
    assert record.name == "widen" and record.args == {"path": "layers/down_in", "factor": 1.25}
    before, after = (get_entry(m.state, "layers/down_in").scale for m in (model, widened))
    np.testing.assert_allclose(np.asarray(after), np.asarray(before) * 1.25, rtol=1e-6)
    loaded = QuantizedModel.load(tmp_path / "widened")
    assert loaded.steps == widened.steps
    np.testing.assert_array_equal(get_entry(loaded.state, "layers/down_in").scale, after)
    assert loaded.perplexity(windows)["ppl"] == widened.perplexity(windows)["ppl"]
    loaded.save(tmp_path / "again")  # a loaded model saves again: its base is the one loaded

    def double_embeddings(m, d, ctx):
        return m.replace(base={**m.base, "embed_tokens": m.base["embed_tokens"] * 2}), None

    changed = Step("double_embeddings", {}, double_embeddings, "doubling")(widened, data)
    in_place = widened.replace(base=dict(widened.base))
    in_place.base["norm"] = in_place.base["norm"] + 1  # a dict edited in place
    other_cfg = widened.replace(cfg=dataclasses.replace(widened.cfg, rms_norm_eps=1e-3))
    for bad in (changed, in_place, other_cfg):
        with pytest.raises(QnpuError, match="a step changed `base` or `cfg`"):
            bad.save(tmp_path / "bad")
        assert not (tmp_path / "bad").exists()  # refused before anything was written
