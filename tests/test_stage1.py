"""Stage 1: the jitted train step learns, keeps rotations orthogonal, and resumes exactly."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.models.llama import init_random_params
from qnpu_jax.pipeline import calibrate
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.recipes import config_stage1_plan as stage1_plan
from qnpu_jax.pipeline.stage1 import (
    Stage1Config,
    Stage1Problem,
    init_train_state,
    learnable_scales,
    learned_scales,
    make_train_step,
    merge_scales,
    run_stage1,
    step_batch,
)
from qnpu_jax.quant import default_plan
from qnpu_jax.rotation import orthogonality_error
from qnpu_jax.transforms import fuse_norms, randomized_hadamard_rotations


@pytest.fixture(scope="module")
def setup(tiny_cfg):
    # larger weights than the shared fixture: peaked logits that 4-bit quantization disturbs
    params = init_random_params(tiny_cfg, jax.random.key(4), scale=0.25)
    ids = np.asarray(jax.random.randint(jax.random.key(21), (4000,), 0, tiny_cfg.vocab_size))
    fused = fuse_norms(params, tiny_cfg)
    r1, r2 = randomized_hadamard_rotations(tiny_cfg, jax.random.key(3))
    plan = stage1_plan(default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=4), QuantizeConfig())
    from qnpu_jax.transforms import apply_rotations

    calib = step_batch(ids, 0, Stage1Config(batch_size=2), 16, jax.random.key(0)).reshape(-1, 16)
    state = calibrate(apply_rotations(fused, tiny_cfg, r1, r2), tiny_cfg, plan, calib)
    return ids, fused, r1, r2, plan, state


def _config(**kw):
    base = dict(steps=6, batch_size=2, grad_accum=2, checkpoint_every=2, lr_scale=0.001)
    return Stage1Config(**(base | kw))


def test_learnable_scales_are_the_learnable_tensors_only(setup):
    *_, plan, state = setup
    scales = learnable_scales(state, plan)
    assert set(scales["layers"]) == {
        "attn_in", "attn_out", "mlp_in", "down_in", "q_proj", "k_proj", "v_proj", "o_proj",
        "gate_proj", "up_proj", "down_proj",
    }  # fmt: skip
    assert set(scales["layers"]["attn_in"]) == {"scale"}  # symmetric: no zero point
    doubled = jax.tree.map(lambda s: 2 * s, scales)
    merged = merge_scales(state, doubled)
    np.testing.assert_allclose(
        merged["layers"]["q_proj"].scale, 2 * state["layers"]["q_proj"].scale
    )
    assert merged["layers"]["q_proj"].qmax is state["layers"]["q_proj"].qmax


def test_train_step_lowers_the_loss_and_keeps_rotations_orthogonal(tiny_cfg, setup):
    ids, fused, r1, r2, plan, state = setup
    config = _config(steps=8, lr_rotation=0.2, lr_scale=0.001)
    ts = init_train_state(r1, r2, state, plan, config)
    step = make_train_step(tiny_cfg, plan, config)
    batch = jnp.asarray(step_batch(ids, 0, config, 16, jax.random.key(1)))
    losses, weights = [], []
    for _ in range(8):  # the same batch: the loss must go down
        ts, metrics = step(ts, batch, fused, state)
        losses.append(float(metrics["ce"]))
        weights.append(float(metrics["local_weight"]))
        assert float(metrics["local"]) > 0
    assert losses[-1] < losses[0]
    assert weights == [1.0, 1.0, 0, 0, 0, 0, 0, 0]  # eq. (3) in the first 25% of steps only
    assert float(metrics["loss"]) == float(metrics["ce"])
    assert int(ts["step"]) == 8
    assert float(orthogonality_error(ts["params"]["r1"])) < 1e-4
    assert float(jnp.max(jax.vmap(orthogonality_error)(ts["params"]["r2"]))) < 1e-4
    assert not np.allclose(ts["params"]["r1"], r1)


def _run(tiny_cfg, setup, config, run_dir, seed=9, **kw):
    """run_stage1 from the setup's start, data order `seed`, writing `run_dir`."""
    ids, fused, r1, r2, plan, state = setup
    problem = Stage1Problem(
        cfg=tiny_cfg, plan=plan, config=config, base_params=fused, frozen_state=state,
        calib_ids=ids, seq_len=16, key=jax.random.key(seed),
    )  # fmt: skip
    start = init_train_state(r1, r2, state, plan, config)
    return run_stage1(start, problem, progress=False, run_dir=run_dir, **kw)


def _whole_killed_resumed(tiny_cfg, setup, config, tmp_path, seed=9, whole=None):
    """run_stage1 uninterrupted (in tmp_path/a, unless `whole` is that run's state), killed
    after step 3 and resumed (tmp_path/b): (whole, resumed) train states."""
    if whole is None:
        whole = _run(tiny_cfg, setup, config, tmp_path / "a", seed)
    _run(tiny_cfg, setup, config, tmp_path / "b", seed, stop_after=3)
    resumed = _run(tiny_cfg, setup, config, tmp_path / "b", seed)
    return whole, resumed


def test_killed_run_resumes_to_the_uninterrupted_result(tiny_cfg, setup, tmp_path):
    config = _config()
    # step 3 is not checkpointed (every 2): its metrics line is dropped on resume
    whole, resumed = _whole_killed_resumed(tiny_cfg, setup, config, tmp_path)
    killed_dir = tmp_path / "b"
    assert int(resumed["step"]) == config.steps
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    steps = [
        json.loads(line)["step"] for line in (killed_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, config.steps + 1))


def test_stage1_config_is_validated():
    with pytest.raises(QnpuError, match="steps"):
        Stage1Config(steps=0)
    with pytest.raises(QnpuError, match="activation_mode"):
        Stage1Config(activation_mode="per-token")
    with pytest.raises(QnpuError, match="momentum"):
        Stage1Config(momentum=1.0)
    with pytest.raises(QnpuError, match="scale_param"):
        Stage1Config(scale_param="sqrt")


def test_log_scale_parameterization(tiny_cfg, setup):
    """Log-parameterized scales start from the same forward (same loss), train, stay positive
    however far they step, and come back as plain scales for export."""
    ids, fused, r1, r2, plan, state = setup
    linear, log = _config(steps=4), _config(steps=4, scale_param="log", lr_scale=0.05)
    ts_lin = init_train_state(r1, r2, state, plan, linear)
    ts_log = init_train_state(r1, r2, state, plan, log)
    np.testing.assert_allclose(
        ts_log["params"]["scales"]["layers"]["q_proj"]["scale"],
        np.log(state["layers"]["q_proj"].scale),
    )
    batch = jnp.asarray(step_batch(ids, 0, log, 16, jax.random.key(1)))
    _, m_lin = make_train_step(tiny_cfg, plan, linear)(ts_lin, batch, fused, state)
    step = make_train_step(tiny_cfg, plan, log)
    ts, m_log = step(ts_log, batch, fused, state)
    assert float(m_log["loss"]) == pytest.approx(float(m_lin["loss"]), rel=1e-6)
    moved = learned_scales(ts["params"]["scales"], "log")
    before = state["layers"]["q_proj"].scale
    after = moved["layers"]["q_proj"]["scale"]
    assert not np.allclose(after, before) and bool(jnp.all(after > 0))
    # a step of -5 in log s shrinks every scale by e^-5 and keeps it positive, where a linear
    # step past the scale itself would have crossed zero (and been clipped to the floor)
    far = jax.tree.map(lambda v: v - 5.0, ts["params"]["scales"])
    small = learned_scales(far, "log")["layers"]["q_proj"]["scale"]
    np.testing.assert_allclose(small, after * np.exp(-5.0), rtol=1e-5)
    assert bool(jnp.all(small > 1e-8))


@pytest.mark.parametrize("prefix", [(), (5,)])
def test_float_tables_rotate_activations_not_tables(tiny_cfg, setup, prefix):
    """Rotating the gathered embedding rows and the final hidden state (stage 1's fast path)
    gives the loss and the gradients of rotating both [V, D] tables."""
    from qnpu_jax.models.taps import FakeQuantTaps
    from qnpu_jax.pipeline.stage1 import stage1_loss

    ids, fused, r1, r2, plan, state = setup
    assert plan.get("embed_tokens") is None and plan.get("lm_head") is None
    config = _config()
    ts = init_train_state(r1, r2, state, plan, config)
    taps = FakeQuantTaps(plan, lsq_grad_scaling=True, cfg=tiny_cfg, local_loss=True)
    tokens = jnp.asarray(step_batch(ids, 0, config, 16, jax.random.key(1)))[0]
    kw = dict(cfg=tiny_cfg, taps=taps, prefix=prefix, remat=True)

    def run(float_tables):
        fn = jax.value_and_grad(stage1_loss, has_aux=True)
        return fn(ts["params"], fused, state, tokens, 1.0, **kw, float_tables=float_tables)

    (loss_fast, parts_fast), grads_fast = run(True)
    (loss_full, parts_full), grads_full = run(False)
    assert float(parts_fast["local"]) > 0
    np.testing.assert_allclose(float(loss_fast), float(loss_full), rtol=1e-5)
    np.testing.assert_allclose(float(parts_fast["local"]), float(parts_full["local"]), rtol=1e-4)
    for fast, full in zip(jax.tree.leaves(grads_fast), jax.tree.leaves(grads_full), strict=True):
        np.testing.assert_allclose(fast, full, rtol=2e-3, atol=1e-5 * float(jnp.abs(full).max()))
    assert float(jnp.abs(grads_fast["r1"]).max()) > 0


def test_bf16_compute_keeps_float32_master_copies(tiny_cfg, setup):
    """compute_dtype bfloat16: the linears run on bf16 operands (float32 accumulation), the
    loss stays close to float32's, and R1/R2 and the scales stay float32."""
    ids, fused, r1, r2, plan, state = setup
    batch = jnp.asarray(step_batch(ids, 0, _config(), 16, jax.random.key(1)))
    out = {}
    for dtype in ("float32", "bfloat16"):
        config = _config(compute_dtype=dtype)
        ts = init_train_state(r1, r2, state, plan, config)
        step = make_train_step(tiny_cfg, plan, config)
        new, metrics = step(ts, batch, fused, state)
        assert {str(x.dtype) for x in jax.tree.leaves(new["params"])} == {"float32"}
        out[dtype] = (float(metrics["ce"]), new)
        text = str(jax.make_jaxpr(step)(ts, batch, fused, state))
        assert ("bf16" in text) == (dtype == "bfloat16")
    assert out["bfloat16"][0] == pytest.approx(out["float32"][0], rel=2e-2)
    assert out["bfloat16"][0] != out["float32"][0]
    with pytest.raises(QnpuError, match="compute_dtype"):
        Stage1Config(compute_dtype="float16")


def test_stage1_step_records_new_keys_only_off_their_default():
    """A run saved before `compute_dtype` existed still resumes: the step's recorded config
    equals the old record unless the new key is set."""
    from qnpu_jax.pipeline.steps import stage1 as stage1_step

    old = stage1_step(Stage1Config(), jax.random.key(0)).args["config"]
    assert "compute_dtype" not in old
    new = stage1_step(Stage1Config(compute_dtype="bfloat16"), jax.random.key(0)).args["config"]
    assert new["compute_dtype"] == "bfloat16"


def test_distillation_objective_is_the_kl_from_the_float_model_and_training_lowers_it(
    tiny_cfg, setup
):
    """objective "kl": the fit term is the mean KL(float || fake-quant) of the next-token
    distributions (checked against a direct computation), 0 between equal distributions,
    and the jitted step trains on it while reporting the cross-entropy. (Whether it trains
    a better model is measured on SmolLM2, docs/changelog.md: on this 2-layer model at W4A4
    the loss moves by the rounding noise either way.)"""
    from qnpu_jax.models.taps import FakeQuantTaps, tapped_forward
    from qnpu_jax.pipeline.stage1 import distillation_kl, stage1_loss, transformed_params

    ids, fused, r1, r2, plan, state = setup
    config = _config(steps=8, objective="kl", local_loss_fraction=0.0, lr_rotation=0.2)
    ts = init_train_state(r1, r2, state, plan, config)
    batch = jnp.asarray(step_batch(ids, 0, config, 16, jax.random.key(1)))
    taps = FakeQuantTaps(plan, cfg=tiny_cfg)
    student, _ = tapped_forward(
        transformed_params(fused, tiny_cfg, ts["params"]), state, batch[0], cfg=tiny_cfg, taps=taps
    )
    teacher, _ = tapped_forward(fused, None, batch[0], cfg=tiny_cfg, taps=None)
    log_t, log_s = jax.nn.log_softmax(teacher), jax.nn.log_softmax(student)
    direct = float(jnp.mean(jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)))
    loss, parts = stage1_loss(
        ts["params"], fused, state, batch[0], jnp.float32(0.0), cfg=tiny_cfg, taps=taps,
        prefix=(), remat=False, objective="kl",
    )  # fmt: skip
    assert direct > 1e-3 and float(loss) == pytest.approx(direct, rel=1e-4)
    assert float(parts["ce"]) > float(loss)  # the cross-entropy is still what it reports
    assert float(jnp.max(jnp.abs(distillation_kl(teacher, teacher)))) < 1e-6
    step = make_train_step(tiny_cfg, plan, config)
    new, metrics = step(ts, batch, fused, state)
    assert np.isfinite(float(metrics["grad_norm"])) and float(metrics["grad_norm"]) > 0
    assert float(metrics["ce"]) > float(metrics["loss"]) > 0
    assert not np.allclose(new["params"]["r1"], ts["params"]["r1"])


def test_checkpoint_selection_keeps_the_best_held_out_step_and_resumes_exactly(
    tiny_cfg, setup, tmp_path
):
    """select_every: the returned parameters are those of the scored step with the lowest
    held-out cross-entropy (recomputed here with the score function), training never draws
    the held-out tail, and a killed run resumes to the same choice."""
    from qnpu_jax.pipeline.stage1 import held_out_split, make_held_out_score

    ids, fused, r1, _, plan, state = setup
    # a learning rate that overshoots, so that an earlier step can score best. Which step
    # does depends on float rounding (4-bit training flips codes): the first of these data
    # orders whose best step comes before the last is the one checked
    config = _config(steps=6, select_every=2, select_windows=3, lr_rotation=2.0, lr_scale=0.05)
    tried = {}
    for seed in (9, 1, 2, 3):
        whole = _run(tiny_cfg, setup, config, tmp_path / "a", seed)
        lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
        scored = {r["step"]: r["held_out_ce"] for r in map(json.loads, lines) if "held_out_ce" in r}
        assert sorted(scored) == [0, 2, 4, 6]
        best_step = min(scored, key=scored.__getitem__)
        tried[seed] = scored
        if best_step < config.steps:
            break
        shutil.rmtree(tmp_path / "a")
    else:
        pytest.fail(f"the last step scored best for every data order: {tried}")
    whole, resumed = _whole_killed_resumed(tiny_cfg, setup, config, tmp_path, seed, whole)
    assert int(whole["best"]["step"]) == best_step
    assert float(whole["best"]["loss"]) == pytest.approx(scored[best_step], rel=1e-6)
    assert int(whole["step"]) == 6
    train_ids, held = held_out_split(ids, 16, 3)
    assert held.shape == (3, 16) and len(train_ids) == len(ids) - 48
    np.testing.assert_array_equal(held.reshape(-1), ids[-48:])
    score = make_held_out_score(tiny_cfg, plan, config)
    again = float(score(whole["params"], jnp.asarray(held), fused, state))
    assert again == pytest.approx(scored[best_step], rel=1e-5)
    if best_step == 0:  # the start was best: the parameters are the initial ones
        np.testing.assert_array_equal(np.asarray(whole["params"]["r1"]), np.asarray(r1))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(QnpuError, match="holds out 3 windows"):
        held_out_split(ids[:40], 16, 3)
    with pytest.raises(QnpuError, match="select_every"):
        Stage1Config(select_every=-1)
