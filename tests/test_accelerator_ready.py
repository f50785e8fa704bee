"""What runs jitted on an accelerator holds no float64 array and no host callback (a numpy call
on a traced value fails to trace at all, so tracing them is the check for host round trips):
the stage-1 train step, calibration's observation pass, the sensitivity scan's error sums and
the fake-quant NLL, traced with x64 enabled (where a stray numpy float64 would show as f64).
Scalars are exempt: optax computes its learning-rate schedule in the default float type."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.ir.graph import GRAPH
from qnpu_jax.models.taps import FakeQuantTaps, ObserveTaps, tapped_token_nll
from qnpu_jax.pipeline import calibrate
from qnpu_jax.pipeline.calibrate import _empty_stats, _observe_step, _observed_paths
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.mixed_precision import _layer_error_sums
from qnpu_jax.pipeline.recipes import config_stage1_plan
from qnpu_jax.pipeline.stage1 import Stage1Config, init_train_state, train_step
from qnpu_jax.quant import default_plan
from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations

CALLBACKS = ("pure_callback", "io_callback", "debug_callback", "callback")


def _walk(jaxpr, seen):
    for eqn in jaxpr.eqns:
        seen["prims"].add(eqn.primitive.name)
        for var in (*eqn.invars, *eqn.outvars):
            aval = getattr(var, "aval", None)
            if aval is not None and hasattr(aval, "dtype") and aval.ndim:
                seen["dtypes"].add(str(aval.dtype))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            _walk(sub, seen)


def _check(fn, *args):
    with jax.enable_x64(True):
        closed = jax.make_jaxpr(fn)(*args)
    seen = {"prims": set(), "dtypes": set()}
    for var in closed.jaxpr.constvars:
        if var.aval.ndim:
            seen["dtypes"].add(str(var.aval.dtype))
    _walk(closed.jaxpr, seen)
    assert not {"float64", "complex128"} & seen["dtypes"], seen["dtypes"]
    assert not set(CALLBACKS) & seen["prims"], seen["prims"]
    return seen


@pytest.fixture(scope="module")
def setup(tiny_cfg, tiny_params):
    fused = fuse_norms(tiny_params, tiny_cfg)
    r1, r2 = randomized_hadamard_rotations(tiny_cfg, jax.random.key(3))
    plan = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8)
    s1_plan = config_stage1_plan(plan, QuantizeConfig())
    windows = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, tiny_cfg.vocab_size))
    rotated = apply_rotations(fused, tiny_cfg, r1, r2)
    return fused, rotated, r1, r2, plan, s1_plan, windows


def test_stage1_step_is_device_only(tiny_cfg, setup):
    fused, rotated, r1, r2, _, s1_plan, windows = setup
    state = calibrate(rotated, tiny_cfg, s1_plan, windows)
    config = Stage1Config(steps=4, batch_size=2, grad_accum=1)
    ts = init_train_state(r1, r2, state, s1_plan, config)
    step = train_step(tiny_cfg, s1_plan, config)
    seen = _check(step, ts, jnp.asarray(windows[None]), fused, state)
    assert "dot_general" in seen["prims"]  # the walk did reach the model


def test_calibration_scan_and_eval_are_device_only(tiny_cfg, setup):
    _, rotated, *_, plan, _, windows = setup
    paths = _observed_paths(plan)
    stats = _empty_stats(plan, paths, tiny_cfg.num_layers)
    taps = ObserveTaps(paths)
    _check(
        lambda p, s, t: _observe_step.__wrapped__(
            p, s, t, cfg=tiny_cfg, taps=taps, prefix=(), graph=GRAPH
        ),
        rotated, stats, jnp.asarray(windows),
    )  # fmt: skip
    state = calibrate(rotated, tiny_cfg, plan, windows)
    taps_q = FakeQuantTaps(plan)
    _check(
        lambda p, s, t: tapped_token_nll.__wrapped__(p, s, t, cfg=tiny_cfg, taps=taps_q, prefix=()),
        rotated, state, jnp.asarray(windows),
    )  # fmt: skip
    one = jnp.ones((tiny_cfg.num_layers,), jnp.float32)
    _check(
        lambda p, t: _layer_error_sums.__wrapped__(
            p, t, one, -128 * one, 127 * one, cfg=tiny_cfg, prefix=(), name="down_in"
        ),
        rotated, jnp.asarray(windows),
    )  # fmt: skip
