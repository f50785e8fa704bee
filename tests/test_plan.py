import dataclasses

import pytest

from qnpu_jax import QnpuError
from qnpu_jax.quant.plan import (
    QuantPlan,
    QuantRule,
    TensorQuant,
    all_paths,
    default_plan,
    uniform_plan,
)


def test_default_plan_is_the_design_table():
    plan = default_plan(30, w_bits=4, a_bits=8)
    assert set(plan.paths()) == set(all_paths())
    assert plan.get("layers/q_proj") == TensorQuant(bits=4, axis=0)
    assert plan.get("layers/attn_in").bits == 8 and plan.get("layers/attn_in").axis is None
    assert plan.get("layers/gate_out").bits == 16  # SiLU input stays wide (D.2)
    assert plan.get("layers/k_rope").bits == 8 and plan.get("layers/v_out").bits == 8
    assert plan.get("layers/scores").bits == 16
    probs = plan.get("layers/probs")
    assert (probs.bits, probs.signed, probs.init) == (16, False, "fixed")
    assert plan.get("embed_tokens") == TensorQuant(bits=8, axis=0)
    assert plan.get("lm_head").bits == 8 and plan.get("final_norm_out").bits == 16
    same = default_plan(30, w_bits=4, a_bits=8)
    assert plan == same and hash(plan) == hash(same)  # a static jit argument: one compilation
    assert QuantPlan(tuple(reversed(plan.entries)), 30) == plan  # order does not matter


def test_rules_override_in_order_and_per_layer_bits():
    bits = (8,) * 27 + (16,) * 3
    plan = default_plan(
        30,
        w_bits=4,
        a_bits=4,
        rules=[
            QuantRule(pattern=r"layers/(attn_in|mlp_in)", init="mean_std", learnable=True),
            QuantRule(pattern="layers/down_in", layer_bits=bits),
            QuantRule(pattern="lm_head", quantize=False),
        ],
    )
    assert plan.get("layers/mlp_in") == TensorQuant(bits=4, init="mean_std", learnable=True)
    assert plan.get("layers/down_in").bits_for_layer(29) == 16
    assert plan.get("layers/down_in").bits_for_layer(0) == 8
    assert "lm_head" not in plan and "embed_tokens" in plan


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        (QuantRule(pattern="layers/qproj"), "matches no tensor"),
        (QuantRule(pattern="layers/down_in", bits=4), "never below 8 bits"),
        (QuantRule(pattern="layers/attn_in", axis=0), "per-tensor"),
        (QuantRule(pattern="embed_tokens", symmetric=False), "only the decoder linears'"),
        (QuantRule(pattern="layers/q_proj", symmetric=False, axis=None), "per-channel weights"),
        (QuantRule(pattern="layers/q_proj", symmetric=False, block=32), "per-block weights are"),
        (QuantRule(pattern="layers/probs", init="max_min"), "fixed unsigned 16-bit encoding"),
        (QuantRule(pattern="layers/(o_out|probs)", bits=8), "fixed unsigned 16-bit encoding"),
        (QuantRule(pattern="layers/o_out", init="mse"), "weights only"),
        (QuantRule(pattern="embed_tokens", axis=None), "per row"),
        (QuantRule(pattern="layers/o_out", init="fixed"), "only softmax probabilities"),
        (QuantRule(pattern="layers/o_out", bits=17), "2..16"),
        (QuantRule(pattern="layers/o_out", init="magic"), "unknown initializer 'magic'"),
        (QuantRule(pattern="layers/down_in", layer_bits=(8, 16)), "2 entries for 30 layers"),
        (QuantRule(pattern="lm_head", layer_bits=(8,) * 30), "layers/ tensors only"),
        (QuantRule(pattern="layers/o_proj", headroom=2), "a weight's range is exact"),
        (QuantRule(pattern="layers/probs", headroom=2), "headroom widens a symmetric"),
    ],
)
def test_impossible_rules_are_clear_errors(rule, message):
    with pytest.raises(QnpuError, match=message):
        default_plan(30, rules=[rule])


def test_layer_bits_given_as_a_list_stay_hashable():
    tq = TensorQuant(bits=8, layer_bits=[8, 16])
    assert tq.layer_bits == (8, 16) and hash(tq)


def test_bad_pattern_and_unknown_path():
    with pytest.raises(QnpuError, match="bad rule pattern"):
        QuantRule(pattern="layers/(")
    with pytest.raises(QnpuError, match="unknown tensor path 'layers/nope'"):
        QuantPlan((("layers/nope", TensorQuant(bits=8)),), 2)
    with pytest.raises(QnpuError, match="must be a string"):
        QuantRule(pattern=None)  # type: ignore[arg-type]
    with pytest.raises(QnpuError, match="twice"):
        QuantPlan((("lm_head", TensorQuant(bits=8)), ("lm_head", TensorQuant(bits=4))), 2)
    with pytest.raises(QnpuError, match="num_layers must be positive"):
        default_plan(0)


def test_uniform_plan_keeps_probs_fixed():
    plan = uniform_plan(2, 16)
    assert {tq.bits for _, tq in plan.entries} == {16}
    assert plan.get("layers/probs").init == "fixed"
    assert dataclasses.replace(plan.get("layers/q_proj"), bits=8) == TensorQuant(bits=8, axis=0)


def test_state_paths_round_trip():
    from qnpu_jax.quant.state import by_path, from_paths, get_entry, state_key, with_entry

    state = {"layers": {"q_proj": {"scale": 1}, "down_in": {"scale": 2}}, "outer": {"lm_head": 3}}
    flat = by_path(state)
    assert flat == {"layers/q_proj": {"scale": 1}, "layers/down_in": {"scale": 2}, "lm_head": 3}
    assert from_paths(flat) == state
    assert from_paths({}) == {"layers": {}, "outer": {}}
    assert state_key("layers/down_in") == ("layers", "down_in")
    assert state_key("embed_out") == ("outer", "embed_out")
    assert get_entry(state, "layers/down_in") == {"scale": 2}
    new = with_entry(state, "lm_head", 4)
    assert new["outer"]["lm_head"] == 4 and state["outer"]["lm_head"] == 3  # pure
    assert new["layers"] is state["layers"]  # the other group is shared, not copied


def test_a_stored_state_reads_back_as_encodings():
    from qnpu_jax import QnpuError
    from qnpu_jax.quant.state import Encoding, state_from_tree

    fields = {"scale": 1.0, "zero_point": 0.0, "qmin": -8.0, "qmax": 7.0}
    state = state_from_tree({"layers": {"down_in": fields}, "outer": {}})
    assert state["layers"]["down_in"] == Encoding(**fields)
    with pytest.raises(QnpuError, match=r"layers/down_in: an encoding has the fields"):
        state_from_tree({"layers": {"down_in": {"scale": 1.0}}, "outer": {}})
    with pytest.raises(QnpuError, match="groups 'layers' and 'outer'"):
        state_from_tree({"layers": {}})


def test_headroom_rule_round_trips_and_refuses_what_it_cannot_widen():
    plan = default_plan(2, rules=[QuantRule(pattern="layers/(q_out|down_out)", headroom=2)])
    assert plan.get("layers/q_out").headroom == 2.0 and plan.get("layers/k_out").headroom == 1.0
    stored = plan.to_dict()["tensors"]
    assert stored["layers/q_out"]["headroom"] == 2.0
    assert "headroom" not in stored["layers/k_out"]  # the default: plans read as before it
    assert QuantPlan.from_dict(plan.to_dict()) == plan
    from qnpu_jax.pipeline.config import QuantizeConfig  # a config's `rules:` carry it too

    config = QuantizeConfig.from_dict({"rules": [{"pattern": "layers/q_out", "headroom": 2}]})
    assert config.rules == (QuantRule(pattern="layers/q_out", headroom=2),)
    assert QuantizeConfig.from_dict(config.to_dict()) == config
    for bad in (0.5, 257, True, "2", float("nan")):
        with pytest.raises(QnpuError, match="headroom must be"):
            QuantRule(pattern="layers/q_out", headroom=bad)  # type: ignore[arg-type]
    with pytest.raises(QnpuError, match="headroom widens a symmetric"):
        default_plan(2, rules=[QuantRule(pattern="layers/q_out", symmetric=False, headroom=2)])
