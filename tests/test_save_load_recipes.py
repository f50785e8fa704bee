"""Every shipped recipe survives save -> load: the same perplexity bit for bit and the same
integer export. Configs whose recipes store the same kinds of values (the same steps and
options, other bit widths, initializers, data or schedule) share a shape; one config of each
shape runs (on two real layers, two stage-1 steps)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from qnpu_jax.export.exporter import export_quantized
from qnpu_jax.models.load import load_model
from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
from qnpu_jax.pipeline.config import load_config, shipped_configs
from qnpu_jax.pipeline.recipes import describe, for_config

_SHORT = ["seq_len=32", "calib_windows=2", "stage1.steps=2", "stage1.batch_size=1"]


def _shape(name: str) -> str:
    """What a config's recipe stores, less its numbers: its steps, and the options that add a
    kind of learned value (clip factors, asymmetric ranges, per-block weight scales)."""
    config = load_config(name, ["model=smollm2-135m"])
    steps = [s["name"] for s in describe(for_config(config))]
    stored = (
        config.mobilequant.weight_clipping,
        config.mobilequant.asymmetric_activations,
        config.weights.block is not None,
        config.mobilequant.selective,
    )
    return json.dumps([steps, stored])


def _one_per_shape() -> list[str]:
    shapes: dict[str, str] = {}
    for name in shipped_configs():
        shapes.setdefault(_shape(name), name)
    return sorted(shapes.values())


CONFIGS = _one_per_shape()


def test_the_shapes_cover_equalization_and_gptq() -> None:
    shapes = {n: json.loads(_shape(n))[0] for n in CONFIGS}
    assert any("equalize" in s for s in shapes.values()), shapes
    assert any("gptq" in s for s in shapes.values()), shapes
    assert any("smooth_mlp" in s for s in shapes.values()), shapes


def _assert_save_load_same(model: QuantizedModel, fp, data: Calibration, tmp_path: Path) -> None:
    model.save(tmp_path / "run")
    loaded = QuantizedModel.load(tmp_path / "run", fp)
    windows = data.windows[:1]
    assert loaded.perplexity(windows)["ppl"] == model.perplexity(windows)["ppl"]
    for a, b in zip(jax.tree.leaves(model.params()), jax.tree.leaves(loaded.params()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    arts = [
        export_quantized(m, tmp_path / tag, fp.tokenizer, max_context=64, prefill_chunk=16)
        for tag, m in (("saved", model), ("loaded", loaded))
    ]
    tensors = [json.loads((a / "manifest.json").read_text())["tensors"] for a in arts]
    assert tensors[0] == tensors[1]


@pytest.mark.parametrize("name", CONFIGS)
def test_load_of_save_is_the_same_model(name: str, two_layer_dir: Path, tmp_path: Path) -> None:
    config = load_config(name, [f"model={two_layer_dir}", *_SHORT])
    if config.weights.rounding == "gptq":  # GPTQ needs as many tokens as down_proj's inputs
        config = load_config(name, [f"model={two_layer_dir}", *_SHORT, "calib_windows=48"])
    fp = load_model(config.model)
    data = _calibration(fp, config.data.seq_len, config.data.windows)
    model = for_config(config)(QuantizedModel.from_float(fp, prefix=config.prefix), data)
    _assert_save_load_same(model, fp, data, tmp_path)


def test_equalization_without_stage1_survives_save_load(two_layer_dir: Path, tmp_path: Path):
    """The pairs share tensors (up_proj reads mlp_in and produces down_in): a model saved in
    the step's order and loaded in another once folded them differently (issue: 11.707 in
    memory, 11.025 loaded)."""
    fp = load_model(str(two_layer_dir))
    data = _calibration(fp, 32, 2)
    recipe = chain(
        steps.fuse_norms(),
        steps.hadamard_rotations(jax.random.key(1)),
        steps.equalize(0.5),
        steps.plan(w_bits=4, a_bits=8),
        steps.calibrate(),
    )
    model = recipe(QuantizedModel.from_float(fp, prefix="bos"), data)
    _assert_save_load_same(model, fp, data, tmp_path)


def _calibration(fp, seq_len: int, windows: int) -> Calibration:
    return Calibration.from_text(
        "wiki", fp.tokenizer, seq_len=seq_len, windows=windows, key=jax.random.key(0)
    )
