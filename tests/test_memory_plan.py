"""`qnpu plan-memory`: shipped architectures, abstract quantizer state equal in shape to
calibration's, XLA's memory analysis of the real stage-1 step, and bad input refused."""

import json

import jax
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.cli import main
from qnpu_jax.memory_plan import (
    MemorySetting,
    abstract_params,
    abstract_state,
    model_architecture,
    shipped_architectures,
    stage1_memory,
)
from qnpu_jax.mesh import make_mesh
from qnpu_jax.pipeline import calibrate
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.recipes import config_stage1_plan
from qnpu_jax.quant import default_plan
from qnpu_jax.transforms import fuse_norms


def test_shipped_architectures_parse_and_smollm2_matches_the_gguf(smollm):
    names = set(shipped_architectures())
    assert {"llama-3.2-1b", "llama-3.2-3b", "qwen2.5-3b", "qwen3-1.7b", "llama-3-8b"} <= names
    for name in names:
        model_architecture(name)
    assert model_architecture("smollm2-135m") == smollm.config
    assert model_architecture("qwen3-1.7b").qk_norm
    assert model_architecture("qwen2.5-3b").attention_bias
    assert model_architecture("llama-3.2-3b").rope.rope_type == "llama3"
    with pytest.raises(QnpuError, match="unknown model 'gpt-9'"):
        model_architecture("gpt-9")


def test_abstract_state_has_calibrations_shapes(tiny_cfg, tiny_params):
    windows = np.asarray(jax.random.randint(jax.random.key(1), (1, 8), 0, tiny_cfg.vocab_size))
    fused = fuse_norms(tiny_params, tiny_cfg)
    for plan in (
        default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8),
        config_stage1_plan(default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8), QuantizeConfig()),
    ):
        real = jax.tree.map(
            lambda a: (a.shape, str(a.dtype)), calibrate(fused, tiny_cfg, plan, windows)
        )
        fake = jax.tree.map(lambda a: (a.shape, str(a.dtype)), abstract_state(plan, tiny_cfg))
        assert real == fake
    shapes = jax.tree.map(lambda a: a.shape, abstract_params(tiny_cfg))
    assert shapes == jax.tree.map(lambda a: a.shape, fused)


def test_stage1_memory_grows_with_the_sequence_and_shrinks_with_remat(tiny_cfg):
    mesh = make_mesh()
    short = stage1_memory(tiny_cfg, mesh, MemorySetting(seq_len=16, batch_size=1, grad_accum=1))
    long = stage1_memory(tiny_cfg, mesh, MemorySetting(seq_len=128, batch_size=1, grad_accum=1))
    assert 0 < short["total_bytes_per_device"] < long["total_bytes_per_device"]
    bf16 = stage1_memory(tiny_cfg, mesh, MemorySetting(seq_len=16, batch_size=1, grad_accum=1,
                                                        base_dtype="bfloat16"))  # fmt: skip
    assert bf16["bytes_per_device"]["arguments"] < short["bytes_per_device"]["arguments"]
    with pytest.raises(QnpuError, match="base_dtype"):
        MemorySetting(base_dtype="int8")


def test_cli_plan_memory_writes_a_report_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "m.json"
    args = ["plan-memory", "--model", "smollm2-135m", "--seq-len", "64", "--json", str(out)]
    assert main(args) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["model"] == "smollm2-135m" and row["mesh"]["devices"] == 1
    assert row["total_gib_per_device"] > 0.5  # SmolLM2's weights alone are 0.5 GiB in f32
    assert report["command"].startswith("qnpu plan-memory")
    said = capsys.readouterr().out.splitlines()
    # the settings it assumed, then the breakdown of each total
    assert said[0].startswith("stage 1's train step (quantnpu W4A8's stage-1 plan): windows of 64")
    assert "batch 2 x accumulation 2, remat on" in said[0] and "budget of 80 GiB" in said[0]
    assert " = arguments " in said[1] and "+ temporaries " in said[1]
    assert main(["plan-memory", "--list"]) == 0
    assert "qwen3-1.7b" in capsys.readouterr().out
    assert main(["plan-memory", "--model", str(tmp_path / "nope.json")]) == 2
    assert "unknown model" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["plan-memory", "--model", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["plan-memory", "--model", "smollm2-135m", "--base-dtype", "int8"]) == 2
    assert "base_dtype" in capsys.readouterr().err
