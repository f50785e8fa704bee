"""The cost model: exact counts against hand counts, the fit against its anchors, the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qnpu_jax import cost
from qnpu_jax.cli import main
from qnpu_jax.errors import QnpuError
from qnpu_jax.memory_plan import model_architecture
from qnpu_jax.models.llama import graph_of
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.quant.plan import QuantRule, default_plan

SMOL = model_architecture("smollm2-135m")
ANCHOR = model_architecture(cost.ANCHOR_MODEL)
PROJS = "layers/(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def _layer(costs: tuple[cost.OpCost, ...], layer: int) -> list[cost.OpCost]:
    return [c for c in costs if c.layer == layer]


def test_phases_count_causal_key_visits_and_reads():
    p = cost.prefill(10, chunk=4, prefix=2)
    assert p.key_visits() == sum(2 + i for i in range(1, 11))
    assert p.kv_reads() == (2 + 4) + (2 + 8) + (2 + 10)  # the cache up to each chunk's end
    assert p.weight_reads == 3
    d = cost.decode(prompt=5, steps=3, prefix=1)
    assert d.key_visits() == d.kv_reads() == (1 + 5 + 1) + (1 + 5 + 2) + (1 + 5 + 3)
    assert d.weight_reads == d.tokens == d.logit_tokens == 3
    assert p.logit_tokens == 1 and cost.prefill(10, all_logits=True).logit_tokens == 10
    for bad in (lambda: cost.prefill(0), lambda: cost.decode(4, 0), lambda: cost.prefill(8, 0)):
        with pytest.raises(QnpuError, match="must be an integer >= 1"):
            bad()


def test_windowed_counts_equal_a_brute_force_count():
    """A sliding layer's query at position p sees min(p + 1, window) keys; a pass reads the
    cache from the first position any of its queries sees to its last query."""

    def brute(first, tokens, chunk, window):
        seen = [min(p + 1, window or p + 1) for p in range(first, first + tokens)]
        reads = 0
        for s in range(first, first + tokens, chunk):
            e = min(s + chunk, first + tokens)
            reads += e - (0 if window is None else max(0, s - window + 1))
        return sum(seen), reads

    for first, tokens, chunk, window in [
        (0, 10, 4, None), (0, 10, 4, 3), (2, 10, 4, 5), (0, 1024, 64, 512), (7, 1, 1, 4),
        (600, 9, 1, 512), (0, 512, 512, 512), (3, 40, 7, 1),
    ]:  # fmt: skip
        phase = cost.Phase("p", tokens, first, chunk, 1)
        assert (phase.key_visits(window), phase.kv_reads(window)) == brute(
            first, tokens, chunk, window
        ), (first, tokens, chunk, window)
    assert cost.Phase("p", 10, 0, 4, 1).key_visits(10) == cost.Phase("p", 10, 0, 4, 1).key_visits()


def test_gemma3_costs_count_its_ops_the_262k_lm_head_and_the_sliding_window():
    """Gemma 3's graph priced op by op: the GELU table, the post-norms, the window of its
    sliding layers (keys beyond 512 back are neither scored nor read) and lm_head's 262,144
    rows, which hold most of a decode step's weight bytes."""
    gemma = model_architecture("gemma3-270m")
    d, f, v = gemma.hidden_size, gemma.intermediate_size, gemma.vocab_size
    hq, hd, w = gemma.num_heads, gemma.head_dim, gemma.sliding_window
    assert (d, v, w) == (640, 262144, 512)
    plan = default_plan(gemma.num_layers, graph=graph_of(gemma))
    t = 1024
    costs = cost.plan_costs(plan, gemma, cost.prefill(t, all_logits=True))
    by = {(c.layer, c.name): c for c in costs}
    causal = t * (t + 1) // 2
    windowed = w * (w + 1) // 2 + (t - w) * w  # query p sees min(p + 1, 512) keys
    for layer, sliding in enumerate(gemma.sliding_layers):
        att = by[(layer, "attn_out")]
        assert sum(att.macs.values()) == 2 * (windowed if sliding else causal) * hq * hd
        assert att.lut_lookups == (windowed if sliding else causal) * hq
    assert by[(0, "gelu_out")].lut_lookups == t * f
    assert by[(0, "attn_post")].kind == by[(0, "mlp_post")].kind == cost.OpKind.RMSNORM
    head = costs[-1]  # the model's ops come last: embedding, final norm, lm_head
    assert head.layer is None and head.kind == cost.OpKind.LINEAR
    assert head.macs == {"A16W8": t * d * v}
    # one decode step at context 2,048: lm_head's weights are most of the bytes it moves
    step = cost.plan_costs(plan, gemma, cost.decode(2047, 1))
    weights = sum(c.weight_bytes for c in step)
    assert step[-1].weight_bytes > 0.6 * weights
    # and a sliding layer's step reads 512 positions of its cache, a global one all 2,048
    kv = {c.layer: c.kv_bytes for c in step if c.name == "attn_out"}
    assert kv[0] * 2048 == kv[5] * 512
    # a plan over LLaMA's graph is not priced on Gemma's
    with pytest.raises(QnpuError, match="another graph than the model's"):
        cost.plan_costs(default_plan(gemma.num_layers), gemma, cost.prefill(4))
    # a config's promotions start from the graph's bits, as the scan does: Gemma's down_proj
    # outputs stay 16-bit in every layer under down_out_mixed_precision (it once priced 8-bit
    # outputs in 16 of 18 layers), while its inputs take the config's share
    priced = cost.config_plan("smollm2-135m-quantnpu-w8a8", ["model=gemma3-270m"],
                              model_architecture)  # fmt: skip
    down = {t: priced.plan.get(f"layers/{t}") for t in ("down_in", "down_out")}
    assert [down["down_out"].bits_for_layer(i) for i in range(18)] == [16] * 18
    assert sorted(down["down_in"].bits_for_layer(i) for i in range(18)) == [8] * 16 + [16] * 2


def test_w8a8_layer_macs_equal_a_hand_count():
    t, d, q, kv, f = 16, 576, 576, 192, 1536
    hq, hd = 9, 64
    phase = cost.prefill(t)
    costs = cost.plan_costs(default_plan(SMOL.num_layers), SMOL, phase)
    layer = _layer(costs, 3)
    macs: dict[str, int] = {}
    for c in layer:
        for pair, n in c.macs.items():
            macs[pair] = macs.get(pair, 0) + n
    linears = t * (d * q + 2 * d * kv + q * d + 2 * d * f + f * d)
    visits = t * (t + 1) // 2  # causal: query i sees i keys
    # q, k and v read 8-bit codes, gate/up 8-bit; down_proj's input is 8-bit here (W8A8)
    assert macs == {"A8W8": linears, "A8A8": visits * hq * hd, "A16A8": visits * hq * hd}
    by_name = {c.name: c for c in layer}
    assert by_name["q_out"].weight_bytes == d * q + q * cost.SCALE_BYTES
    assert by_name["q_out"].requants == t * q
    assert by_name["silu_out"].lut_lookups == t * f
    assert by_name["attn_out"].lut_lookups == visits * hq
    # K and V of the 3 kv heads, 8-bit each, read once (one chunk)
    assert by_name["attn_out"].kv_bytes == phase.kv_reads() * kv * 2
    head = costs[-1]  # generation: the prompt's last position only; scoring: every one
    assert head.layer is None and head.macs == {"A16W8": d * SMOL.vocab_size}
    scored = cost.plan_costs(default_plan(SMOL.num_layers), SMOL, cost.prefill(t, all_logits=True))
    assert scored[-1].macs == {"A16W8": t * d * SMOL.vocab_size}
    assert scored[-1].weight_bytes == head.weight_bytes  # one chunk: read once either way


def test_promotion_and_blocks_move_exactly_their_macs():
    n = SMOL.num_layers
    base = default_plan(n, w_bits=4, a_bits=8, down_in_bits=8)
    bits = tuple(16 if i in (0, 7, 29) else 8 for i in range(n))
    promoted = base.apply([QuantRule(pattern="layers/down_in", layer_bits=bits)])
    phase = cost.prefill(32)
    a, b = (cost.totals(cost.plan_costs(p, SMOL, phase)) for p in (base, promoted))
    down = 32 * SMOL.intermediate_size * SMOL.hidden_size
    assert b["macs"]["A16W4"] == 3 * down
    assert a["macs"]["A8W4"] - b["macs"]["A8W4"] == 3 * down
    assert a["npu_macs"] == b["npu_macs"]
    lpbq = base.apply([QuantRule(pattern=PROJS, block=64, block_scale_bits=4)])
    c = cost.totals(cost.plan_costs(lpbq, SMOL, phase))
    assert c["per_block_macs"] == a["macs"]["A8W4"]
    blocks = sum(o * (i // 64) for o, i in _weight_shapes())  # a 4-bit scale each, per layer
    assert c["weight_bytes"] - a["weight_bytes"] == pytest.approx(n * blocks * 4 / 8)


def _weight_shapes() -> list[tuple[int, int]]:
    d, q, kv, f = SMOL.hidden_size, SMOL.q_size, SMOL.kv_size, SMOL.intermediate_size
    return [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)]


def test_float_tensors_count_as_float_pairs_and_fp16_bytes():
    n = SMOL.num_layers
    plan = default_plan(n).apply([QuantRule(pattern="layers/(attn_in|q_proj)", quantize=False)])
    q = next(c for c in cost.plan_costs(plan, SMOL, cost.prefill(4)) if c.name == "q_out")
    assert q.macs == {"AFWF": 4 * 576 * 576}
    assert q.weight_bytes == 576 * 576 * cost.FLOAT_BYTES


def test_device_fit_reproduces_its_anchors():
    device = cost.fit_device(ANCHOR)
    plans = cost.anchor_plans(ANCHOR)
    n_lin = cost.num_linears(ANCHOR)

    def run(plan: str, phase: cost.Phase) -> float:
        return cost.latency(cost.plan_costs(plans[plan], ANCHOR, phase), device, n_lin)["total_s"]

    assert run("w8a8", cost.prefill(256)) == pytest.approx(0.089, rel=1e-9)
    assert run("w8a16", cost.prefill(256)) == pytest.approx(0.510, rel=1e-9)
    assert run("w8a8", cost.decode(1023, 1)) == pytest.approx(0.042, rel=1e-9)
    assert device.a16 > 1 and device.pair_factor("A16W8") == device.a16
    assert device.pair_factor("A16A16") == pytest.approx(device.a16**2)
    assert device.pair_factor("A8W4") == 1.0 and device.pair_factor("AFWF") == 2.0
    readings = cost.devices(ANCHOR)
    assert readings["quantnpu-table3"].a16 == pytest.approx(2.0 / 1.67)
    assert readings["mobilequant-table6"] == device


def test_latency_roofline_blocks_and_syncs():
    device = cost.DeviceModel(mac_s=1e-12, byte_s=1e-9, a16=3.0)
    compute = cost.OpCost(0, "y", "linear", {"A16W4": 1000}, weight_bytes=1)
    assert cost.op_seconds(compute, device) == pytest.approx(3000e-12)
    memory = cost.OpCost(0, "y", "linear", {"A8W4": 10}, act_bytes=100)
    assert cost.op_seconds(memory, device) == pytest.approx(100e-9)
    blocked = dataclasses.replace(compute, per_block=True)
    assert cost.op_seconds(blocked, device) == pytest.approx(3000e-12 * 1.2)
    shadowed = dataclasses.replace(compute, syncs=2, cpu_macs=50)
    lat = cost.latency([shadowed], dataclasses.replace(device, cpu_mac_s=1e-10), num_linears=4)
    assert lat["sync_s"] == pytest.approx(0.297 * 3000e-12 * 2 / 4)
    assert lat["cpu_s"] == pytest.approx(50e-10)
    assert lat["total_s"] == pytest.approx(lat["npu_s"] + lat["cpu_s"] + lat["sync_s"])
    with pytest.raises(QnpuError, match="a16 must be a finite number"):
        cost.DeviceModel(mac_s=1e-12, byte_s=1e-9, a16=float("nan"))


def test_plan_for_another_model_is_refused():
    with pytest.raises(QnpuError, match="the plan has 30 layers, the model config 22"):
        cost.plan_costs(default_plan(30), ANCHOR, cost.prefill(4))


def test_cli_cost_of_a_config_writes_its_report(tmp_path, capsys):
    out = tmp_path / "cost.json"
    rc = main(
        [
            "cost",
            "--config",
            "smollm2-135m-quantnpu-w4a8",
            "--prefill",
            "64",
            "--decode",
            "8",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    pre = report["phases"]["prefill"]
    down = 64 * SMOL.intermediate_size * SMOL.hidden_size
    assert pre["macs"]["A16W4"] == 3 * down  # 10% of 30 layers promoted
    assert set(pre["latency"]) == {"mobilequant-table6", "quantnpu-table3"}
    said = capsys.readouterr().out
    assert "modelled latency" in said
    # which model and plan, and what the readings mean, before the numbers
    lines = said.splitlines()
    assert lines[0].startswith("model smollm2-135m: 30 layers, hidden 576")
    assert lines[1].startswith("plan of config smollm2-135m-quantnpu-w4a8 (quantnpu W4A8KV8):")
    assert "down_proj inputs 16-bit in 3 of 30 layers" in lines[1]
    assert "up_out 16-bit in 30 of 30 layers" in lines[1]  # the default's rule
    assert "not measured" in lines[2]
    assert lines[3].startswith("  mobilequant-table6: a MAC with one 16-bit operand takes")
    assert lines[4].startswith("  quantnpu-table3: a MAC with one 16-bit operand takes 1.20")
    assert main(["cost", "--config", "quick", "--set", "bogus=1"]) == 2
    assert "unknown config key" in capsys.readouterr().err
    assert main(["cost", "--run", str(tmp_path / "none")]) == 2
    assert "plan.json is missing" in capsys.readouterr().err
    # a run's plan of 2 layers priced on a model of 30: refused, not an IndexError
    run = tmp_path / "two-layer-run"
    run.mkdir()
    (run / RunDir.PLAN).write_text(json.dumps(default_plan(2, w_bits=4).to_dict()))
    assert main(["cost", "--run", str(run), "--model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert "its plan covers 2 layers and smollm2-135m has 30" in err and "Traceback" not in err
