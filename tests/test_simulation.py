"""The device simulation: the fake-quant forward computing the integer contract's softmax,
RoPE tables and rounding, checked against the emulator op by op."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.models.llama import device_softmax, probability_codes
from qnpu_jax.quant.plan import QuantPlan, default_plan
from qnpu_jax.runtime import emulator as E


def _probabilities_int64(e: np.ndarray) -> np.ndarray:
    total = e.sum(axis=-1, keepdims=True)
    return (e * 65535 + total // 2) // total


@pytest.mark.parametrize("keys", [1, 7, 513, 32767])
def test_probability_codes_divide_exactly(keys):
    """The uint32 division equals the int64 formula, up to full rows of 65535s."""
    rng = np.random.default_rng(keys)
    e = rng.integers(0, 65536, (6, keys)).astype(np.int64)
    e[0] = 65535  # the largest total
    e[1, :] = 0
    e[1, 0] = 65535  # one key takes all
    e[2] = rng.integers(0, 3, keys)
    e[2, -1] = 65535  # many tiny ones beside the row maximum
    e[3, ::2] = 65535
    got = np.asarray(probability_codes(jnp.asarray(e, jnp.float32)))
    assert np.array_equal(got, _probabilities_int64(e))
    with pytest.raises(ValueError, match="32767 keys"):
        probability_codes(jnp.ones((1, 32768), jnp.float32))


def test_device_softmax_is_the_emulators_softmax():
    """On 16-bit score codes at a scores scale, the device softmax gives the emulator's
    probability codes (its float32 exp may move an occasional e by one), and the float
    softmax's gradient."""
    rng = np.random.default_rng(0)
    s = np.float32(0.0021)
    codes = rng.integers(-32768, 32768, (4, 8, 300)).astype(np.int64)
    codes[..., :40] = rng.integers(-200, 200, (4, 8, 40)) + codes[..., :1].max()  # near the top
    allowed = np.tril(np.ones((8, 300), bool), 292)[None].repeat(4, 0)
    exp_lut = np.rint(np.exp(-np.arange(65536) * np.float64(s)) * 65535).astype(np.uint16)
    want = E.softmax_codes(codes, allowed, exp_lut)
    scores = jnp.where(allowed, jnp.asarray(codes, jnp.float32) * s, -jnp.inf)
    got = np.rint(np.asarray(device_softmax(scores, jnp.asarray(allowed))) * 65535).astype(int)
    differ = got != want
    assert differ.mean() < 1e-3 and np.abs(got - want).max() <= 1
    fake = np.rint(np.asarray(jax.nn.softmax(scores, axis=-1)) * 65535).astype(int)
    assert (fake != want).mean() > 10 * differ.mean()  # what the float softmax misses

    def loss(f, x):
        return jnp.sum(f(x) * jnp.arange(300.0))

    g_dev = jax.grad(lambda x: loss(lambda y: device_softmax(y, jnp.asarray(allowed)), x))(scores)
    g_flt = jax.grad(lambda x: loss(lambda y: jax.nn.softmax(y, axis=-1), x))(scores)
    assert np.allclose(np.asarray(g_dev), np.asarray(g_flt), atol=1e-6)


def test_the_plan_carries_the_simulation():
    plan = default_plan(2)
    assert plan.simulation == "device"
    fake = default_plan(2, simulation="fake")
    assert QuantPlan.from_dict(fake.to_dict()) == fake
    assert QuantPlan.from_dict(plan.to_dict()) == plan
    old = {k: v for k, v in fake.to_dict().items() if k != "simulation"}
    assert QuantPlan.from_dict(old).simulation == "fake"  # plans written before the key
    assert plan.with_entries(plan.entries[:3]).simulation == "device"
    assert fake.apply([]).simulation == "fake"
    with pytest.raises(QnpuError, match="unknown simulation 'exact'"):
        dataclasses.replace(plan, simulation="exact")
    from qnpu_jax.pipeline.config import QuantizeConfig

    with pytest.raises(QnpuError, match="unknown simulation"):
        QuantizeConfig.from_dict({"simulation": "float"})


def test_op_gap_finds_what_the_float_ops_miss(smollm, int_sources, int_artifacts, tmp_path):
    """Forced onto the device's codes, op by op: the float softmax misses the integer
    softmax's codes on a share of the probabilities; the device simulation matches them and
    the Q14 RoPE, and no op of it is off by more than one code."""
    from qnpu_jax.data import load_documents, tokenize_documents
    from qnpu_jax.data.sources import sample_windows
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.studies.op_gap import summarize, window_stats

    src = int_sources["w4a8"]
    window = sample_windows(
        tokenize_documents(load_documents("wiki", "eval"), smollm.tokenizer),
        128,
        1,
        jax.random.key(3),
    )[0]
    stats = window_stats(
        src["params"], src["cfg"], src["plan"], src["state"], src["prefix"],
        load_int_model(int_artifacts["w4a8"]), window,
    )  # fmt: skip
    fake, device = summarize([stats["fake"]]), summarize([stats["device"]])
    assert set(fake) == set(device) and "probs" in fake and "final_norm_out" in fake
    assert fake["probs"]["differ_share"] > 0.01
    assert device["probs"]["differ_share"] < fake["probs"]["differ_share"] / 20
    for name in ("q_rope", "k_rope"):
        assert device[name]["differ_share"] <= fake[name]["differ_share"]
    assert max(t["max_abs_diff"] for t in device.values()) <= 1
    assert all(t["codes"] > 0 for t in device.values())
    json.dumps(device)  # the report is plain JSON


def test_device_simulation_tracks_the_integer_model_closer(smollm, int_sources, int_artifacts):
    """Whole windows, nothing forced: the device simulation's NLL is closer to the integer
    model's than the float ops' (2 layers, 4 windows of 64)."""
    from qnpu_jax.data import load_documents, sample_windows, tokenize_documents
    from qnpu_jax.export.int_model import load_int_model
    from qnpu_jax.models.taps import FakeQuantTaps, tapped_token_nll

    src = int_sources["w4a8"]
    windows = sample_windows(
        tokenize_documents(load_documents("wiki", "eval"), smollm.tokenizer),
        64,
        4,
        jax.random.key(5),
    )
    nll_int = E.EmulatorEngine(load_int_model(int_artifacts["w4a8"])).token_nll(windows)
    gaps = {}
    for sim in ("fake", "device"):
        taps = FakeQuantTaps(dataclasses.replace(src["plan"], simulation=sim))
        nll = tapped_token_nll(
            src["params"], src["state"], jnp.asarray(windows), cfg=src["cfg"], taps=taps,
            prefix=src["prefix"],
        )  # fmt: skip
        gaps[sim] = float(np.abs(np.asarray(nll) - nll_int).mean())
    assert gaps["device"] < gaps["fake"], gaps
