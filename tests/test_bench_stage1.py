"""scripts/bench_stage1.py: the matmul count it reports and the profile it takes."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from conftest import load_script  # tests/ is on sys.path (rootdir conftest)


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_stage1")


def test_xla_counts_a_scan_body_once_so_the_bench_counts_from_the_shapes():
    w = jnp.ones((30, 64, 64))
    x = jnp.ones((128, 64))
    f = jax.jit(lambda x, w: jax.lax.scan(lambda c, wl: (c @ wl, None), x, w)[0])
    cost = f.lower(x, w).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    one_layer = 2 * 128 * 64 * 64
    assert cost["flops"] < 2 * one_layer  # not 30 layers' worth


def test_step_matmul_flops_of_smollm2_at_two_windows(bench):
    cfg = SimpleNamespace(  # SmolLM2-135M's shapes
        hidden_size=576, head_dim=64, intermediate_size=1536, num_heads=9, num_kv_heads=3,
        num_layers=30, vocab_size=49152,
    )  # fmt: skip
    flops = bench.step_matmul_flops(cfg, 1024, 512, remat=True)
    assert flops == pytest.approx(1.375e12, rel=0.001)
    assert bench.step_matmul_flops(cfg, 1024, 512, remat=False) < flops
    # two hidden x hidden rotation linears a layer (Gemma 3's online R1): 2·tokens·Δ forward,
    # twice backward, once more for remat, and R1 rotating Δ more weights (4·d·Δ)
    delta = 30 * 2 * 576 * 576
    online = bench.step_matmul_flops(cfg, 1024, 512, remat=True, online_linears=2)
    assert online - flops == pytest.approx(4 * 2 * 1024 * delta + 4 * 576 * delta)


def test_thunk_kinds(bench):
    kind = bench._thunk_kind
    fwd = "jit(step)/while/body/closed_call/jvp(jit(tapped_forward))/while/body/closed_call/"
    assert (
        kind(fwd + "...i,oi->...o/dot_general", "f32[1024,1536]{1,0}", 8, 49152) == "linear matmul"
    )
    assert kind(fwd + "...i,oi->...o/dot_general", "f32[1024,49152]", 8, 49152) == "lm_head matmul"
    assert (
        kind(fwd + "btkgd,bksd->bkgts/dot_general", "f32[2,3,512,64]", 8, 49152)
        == "attention matmul"
    )
    assert kind(fwd + "add", "f32[2,2,2]{2,1,0}", 8, 49152) == "attention elementwise"
    assert kind(fwd + "add", "f32[2,5]{1,0}", 8, 49152) == "other elementwise"
    assert (
        kind("jit(step)/jvp()/dot_general", "f32[46080,576]", 8, 49152) == "R1 rotating the weights"
    )


def test_profile_step_sorts_the_thunks(bench):
    a = jnp.ones((256, 256))
    compiled = jax.jit(lambda a: jnp.tanh(a @ a)).lower(a).compile()
    profile = bench.profile_step(compiled, (a,), attention_elements=7, vocab_size=49152)
    assert "linear matmul" in profile["by_kind"]
    assert profile["thunk_seconds"] > 0 and profile["process_cpu_seconds"] > 0
    assert sum(v["share"] for v in profile["by_kind"].values()) == pytest.approx(1.0)
