"""The NPU test-time-scaling kernels (qnpu_jax.kernels): HMX tile layout, tile/common group
quantization, super-block packing, 4-bit LUTs, the fp16 exp table and FP16 LUT attention."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.kernels import (
    EXP_TABLE,
    IQ4_NL_LUT,
    LUTS,
    NF4_LUT,
    Q4_0_LUT,
    build_exp_table,
    common_group_dequantize,
    common_group_quantize,
    common_groups,
    fp16_lut_attention,
    from_tile_layout,
    lut_dequantize,
    lut_exp,
    lut_quantize,
    pack_super_blocks,
    tile_group_dequantize,
    tile_group_quantize,
    tile_groups,
    tile_order,
    to_tile_layout,
    unpack_super_blocks,
)
from qnpu_jax.kernels.tile_group import dequantize_groups, quantize_groups
from qnpu_jax.models.llama import _attention

SHAPES = [(32, 32), (64, 96), (96, 64), (192, 576)]


def _weights(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    return (0.02 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


# ---- the HMX tile layout ----


@pytest.mark.parametrize("shape", SHAPES)
def test_tile_layout_is_a_bijection_and_its_inverse_restores_the_matrix(shape):
    perm = tile_order(shape)
    assert perm.shape == (shape[0] * shape[1],)
    assert np.array_equal(np.sort(perm), np.arange(perm.size))
    w = _weights(shape)
    flat = to_tile_layout(w)
    assert np.array_equal(flat, w.reshape(-1)[perm])
    assert np.array_equal(from_tile_layout(flat, shape), w)


def test_tile_layout_matches_figure_4():
    out, inp = 64, 96  # B = Wᵀ is [K=96, N=64]: 3 K tiles × 2 N tiles
    perm = tile_order((out, inp))
    pos = np.empty_like(perm)
    pos[perm] = np.arange(perm.size)  # memory position of each W[n, k]
    n, k = np.meshgrid(np.arange(out), np.arange(inp), indexing="ij")
    # tiles column-major over [K, N]: all K tiles of output tile 0 first
    tile = (n // 32) * (inp // 32) + k // 32
    # inside a tile, input rows 2r and 2r+1 interleave across the 32 output columns
    inner = 64 * ((k % 32) // 2) + 2 * (n % 32) + k % 2
    assert np.array_equal(pos.reshape(out, inp), tile * 1024 + inner)


def test_a_tile_group_of_32_is_2_inputs_by_16_outputs():
    shape = (64, 64)
    groups = tile_order(shape).reshape(-1, 32)
    for g in (0, 1, 2, 37):
        n, k = np.divmod(groups[g], shape[1])
        assert len(set(n)) == 16 and len(set(k)) == 2
        assert n.max() - n.min() == 15 and k.max() - k.min() == 1 and k.min() % 2 == 0
    # llama.cpp's common group: 32 consecutive inputs of one output row
    w = _weights(shape)
    assert np.array_equal(common_groups(w)[3], w[1, 32:64])
    # group 64: a whole row pair (2 × 32)
    n, k = np.divmod(tile_order(shape).reshape(-1, 64)[5], shape[1])
    assert len(set(n)) == 32 and len(set(k)) == 2


# ---- group quantization ----


def _check_error_bound(w: np.ndarray, deq: np.ndarray, scale_of: np.ndarray, bits: int):
    qmax = 2 ** (bits - 1) - 1
    d = np.abs(scale_of.astype(np.float64))
    err = np.abs(deq.astype(np.float64) - w)
    inside = w.astype(np.float64) / scale_of.astype(np.float64) <= qmax + 0.5
    assert inside.mean() > 0.9  # the bound below is about most elements, not a few
    assert np.all(err[inside] <= d[inside] / 2 * (1 + 1e-6))
    # outside: only x/d in (qmax + 0.5, -qmin] clamps to qmax; -qmin·|d| is the group's
    # largest magnitude up to the fp16 rounding of d (2^-11 relative)
    assert np.all(err <= d * (1 + 2**-7))
    assert np.any(err > d / 2 * (1 + 1e-6)) or bits == 8  # the clamped elements exist


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("shape", [(64, 96), (192, 576)])
def test_tile_and_common_groups_err_at_most_half_a_step(shape, bits):
    w = _weights(shape, seed=bits)
    codes, scales = tile_group_quantize(w, bits=bits)
    assert codes.dtype == np.int8 and scales.dtype == np.float16
    assert codes.shape == (w.size // 32, 32) and scales.shape == (w.size // 32,)
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    assert codes.min() >= qmin and codes.max() <= qmax
    deq = tile_group_dequantize(codes, scales, shape)
    scale_of = from_tile_layout(np.repeat(scales, 32), shape)
    _check_error_bound(w, deq, scale_of, bits)

    codes, scales = common_group_quantize(w, bits=bits)
    deq = common_group_dequantize(codes, scales, shape)
    _check_error_bound(w, deq, np.repeat(scales, 32).reshape(shape), bits)


def test_q4_0_scale_rule_puts_the_largest_magnitude_on_minus_8():
    w = _weights((64, 64), seed=3)
    groups = tile_groups(w)
    codes, scales = tile_group_quantize(w)
    top = np.argmax(np.abs(groups), axis=1)
    assert np.all(codes[np.arange(len(codes)), top] == -8)
    expected = (groups[np.arange(len(groups)), top].astype(np.float64) / -8).astype(np.float16)
    assert np.array_equal(scales, expected)
    # the first tile group's scale comes from W[0:16, 0:2] only
    block = w[0:16, 0:2]
    big = block.reshape(-1)[np.argmax(np.abs(block))]
    assert scales[0] == np.float16(big / -8.0)


def test_tile_and_common_groups_differ_but_errors_are_comparable():
    w = _weights((192, 576), seed=5)
    tile = tile_group_dequantize(*tile_group_quantize(w), w.shape)
    common = common_group_dequantize(*common_group_quantize(w), w.shape)
    assert not np.array_equal(tile, common)
    e_tile, e_common = np.mean((tile - w) ** 2), np.mean((common - w) ** 2)
    assert 0.8 < e_tile / e_common < 1.25  # Gaussian weights: the grouping barely matters


def test_all_zero_group_quantizes_to_zero():
    w = _weights((32, 64))
    w[0:16, 0:2] = 0.0  # the first tile group
    codes, scales = tile_group_quantize(w)
    assert scales[0] == 0 and np.all(codes[0] == 0)
    assert np.all(tile_group_dequantize(codes, scales, w.shape)[0:16, 0:2] == 0)


@pytest.mark.parametrize(
    ("shape", "group", "needle"),
    [
        ((33, 64), 32, "(33, 64)"),
        ((64, 48), 32, "(64, 48)"),
        ((64, 64), 48, "group 48"),
        ((0, 32), 32, "(0, 32)"),
    ],
)
def test_tile_shapes_that_do_not_tile_raise(shape, group, needle):
    with pytest.raises(QnpuError, match="tile") as e:
        tile_group_quantize(np.zeros(shape, np.float32), group=group)
    assert needle in str(e.value)


def test_other_bad_inputs_raise():
    with pytest.raises(QnpuError, match=r"\[out, in\]"):
        tile_group_quantize(np.zeros((2, 32, 32), np.float32))
    with pytest.raises(QnpuError, match=r"\(64, 40\)"):
        common_group_quantize(np.zeros((64, 40), np.float32))
    with pytest.raises(QnpuError, match="bits"):
        quantize_groups(np.zeros((1, 32), np.float32), bits=12)
    with pytest.raises(QnpuError, match="one scale per group"):
        dequantize_groups(np.zeros((4, 32), np.int8), np.zeros(3, np.float16))


# ---- super-blocks ----


def test_super_block_round_trip_is_exact():
    rng = np.random.default_rng(1)
    codes = rng.integers(-8, 8, size=(64, 32)).astype(np.int8)
    bits = rng.integers(0, 1 << 16, size=64).astype(np.uint16)
    bits[bits & 0x7C00 == 0x7C00] = 0x3C00  # no inf/NaN patterns: compare by value below
    scales = bits.view(np.float16)
    blocks = pack_super_blocks(codes, scales)
    assert blocks.dtype == np.uint8 and blocks.shape == (8, 144)
    back_codes, back_scales = unpack_super_blocks(blocks)
    assert np.array_equal(back_codes, codes)
    assert np.array_equal(back_scales.view(np.uint16), scales.view(np.uint16))
    # scales first, little-endian fp16
    assert np.array_equal(blocks[0, :16].view("<f2"), scales[:8])


def test_super_block_nibbles_follow_the_vlut16_reading():
    """Emulate the kernel: vlut16 of the low nibbles, then of the high nibbles; each returns
    the even bytes' values, then the odd bytes' — four vectors of 64, in memory order."""
    rng = np.random.default_rng(2)
    codes = rng.integers(-8, 8, size=(8, 32)).astype(np.int8)
    scales = np.arange(1, 9, dtype=np.float16)
    quants = pack_super_blocks(codes, scales)[0, 16:]
    lut = Q4_0_LUT.table
    lo, hi = quants & 0x0F, quants >> 4
    read = np.concatenate([lut[lo[0::2]], lut[lo[1::2]], lut[hi[0::2]], lut[hi[1::2]]])
    assert np.array_equal(read, codes.reshape(-1).astype(np.float16))
    # with the kernel's scale broadcast (element c of the block gets scales[c // 32])
    deq = read.astype(np.float32) * np.repeat(scales, 32).astype(np.float32)
    assert np.array_equal(deq, dequantize_groups(codes, scales).reshape(-1))


def test_super_block_bad_inputs_raise():
    codes = np.zeros((12, 32), np.int8)
    with pytest.raises(QnpuError, match="multiple of 8"):
        pack_super_blocks(codes, np.ones(12, np.float16))
    with pytest.raises(QnpuError, match="nibble"):
        pack_super_blocks(np.full((8, 32), 9, np.int8), np.ones(8, np.float16))
    with pytest.raises(QnpuError, match="groups of 32"):
        pack_super_blocks(np.zeros((8, 16), np.int8), np.ones(8, np.float16))
    with pytest.raises(QnpuError, match="144"):
        unpack_super_blocks(np.zeros((2, 128), np.uint8))


# ---- 4-bit LUTs ----


def test_lut_dequant_of_q4_0_codes_equals_arithmetic_exactly():
    w = _weights((96, 128), seed=7)
    codes, scales = tile_group_quantize(w)
    arithmetic = dequantize_groups(codes, scales)
    via_lut = lut_dequantize((codes + 8).astype(np.uint8), scales, Q4_0_LUT)
    assert np.array_equal(via_lut.view(np.uint32), arithmetic.view(np.uint32))
    # and the LUT quantizer with the Q4_0 table makes the same codes and scales
    idx, lut_scales = lut_quantize(tile_groups(w), Q4_0_LUT)
    assert np.array_equal(idx.astype(np.int16) - 8, codes)
    assert np.array_equal(lut_scales.view(np.uint16), scales.view(np.uint16))


def test_lut_tables():
    assert set(LUTS) == {"q4_0", "nf4", "iq4_nl"}
    for lut in LUTS.values():
        assert len(lut.values) == 16 and lut.table.dtype == np.float16
        assert np.all(np.diff(lut.table.astype(np.float64)) > 0)
    assert IQ4_NL_LUT.values == (
        -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113
    )  # fmt: skip
    assert NF4_LUT.values[0] == -1.0 and NF4_LUT.values[7] == 0.0 and NF4_LUT.values[15] == 1.0
    assert NF4_LUT.values[1] == -0.6961928009986877 and NF4_LUT.values[14] == 0.7229568362236023
    assert Q4_0_LUT.values == tuple(float(v) for v in range(-8, 8))


@pytest.mark.parametrize("lut", [NF4_LUT, IQ4_NL_LUT, Q4_0_LUT], ids=lambda lut: lut.name)
def test_lut_codes_round_trip(lut):
    rng = np.random.default_rng(4)
    idx = rng.integers(0, 16, size=(50, 32)).astype(np.uint8)
    # the table's first value, first in the group (NF4's -1 ties +1 in magnitude; the first
    # largest element sets the scale): the scale rule recovers the scale from it
    idx[:, 0] = 0
    scales = rng.uniform(0.001, 0.05, size=50).astype(np.float16)
    groups = lut_dequantize(idx, scales, lut)
    back_idx, back_scales = lut_quantize(groups, lut)
    assert np.array_equal(back_scales, scales)
    assert np.array_equal(back_idx, idx)


def test_iq4_nl_scale_search_beats_the_plain_rule():
    groups = np.random.default_rng(6).standard_normal((400, 32)).astype(np.float32)

    def weighted_err(ntry: int) -> float:
        deq = lut_dequantize(*lut_quantize(groups, IQ4_NL_LUT, ntry), IQ4_NL_LUT)
        return float(np.sum(groups**2 * (deq - groups) ** 2))

    assert weighted_err(7) < 0.9 * weighted_err(0)


# ---- the fp16 exp table ----


def _neg_fp16() -> np.ndarray:
    return (np.arange(1 << 15, dtype=np.uint16) | np.uint16(0x8000)).view(np.float16)


def test_exp_table_is_float64_exp_rounded_once():
    x = _neg_fp16()
    table = build_exp_table()
    assert table.shape == (32768,) and table.dtype == np.float16
    assert np.array_equal(table.view(np.uint16), EXP_TABLE.view(np.uint16))
    finite = ~np.isnan(x)
    assert np.all(np.isnan(table[~finite]))
    e = np.exp(x[finite].astype(np.float64))
    h = table[finite]
    assert np.all(np.isfinite(h)) and np.all(h >= 0)
    # nearest fp16: no neighbour of h is closer to exp(x) than h
    hb = h.view(np.uint16)
    up = (hb + 1).view(np.float16).astype(np.float64)
    down = np.where(hb > 0, hb - 1, 0).astype(np.uint16).view(np.float16).astype(np.float64)
    dist = np.abs(e - h.astype(np.float64))
    assert np.all(dist <= np.abs(e - up)) and np.all(dist <= np.abs(e - down))
    assert table[0] == 1.0 and table[0x7C00] == 0.0  # -0 and -inf


def test_lut_exp_gathers_the_table_for_every_non_positive_fp16():
    x = _neg_fp16()
    got = np.asarray(jax.jit(lut_exp)(jnp.asarray(x)))
    expected = np.exp(x.astype(np.float64)).astype(np.float16)
    nan = np.isnan(x)
    assert np.array_equal(got[~nan].view(np.uint16), expected[~nan].view(np.uint16))
    assert np.all(np.isnan(got[nan]))


def test_lut_exp_positive_inputs_and_dtypes():
    x = jnp.asarray([0.0, -0.0, 0.5, 3.0, np.inf, -np.inf, -1.0], jnp.float16)
    y = np.asarray(lut_exp(x)).astype(np.float64)
    assert y[0] == 1.0 and y[1] == 1.0 and y[5] == 0.0
    assert np.all(np.isnan(y[2:5]))  # not exp(-x): the table has no x > 0
    assert y[6] == np.float16(np.exp(-1.0))
    with pytest.raises(QnpuError, match="float16"):
        lut_exp(jnp.zeros(3, jnp.float32))


# ---- FP16 LUT attention ----


def _qkv(b: int, t: int, s: int, hq: int, hkv: int, hd: int, seed: int = 0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    q = 2.0 * jax.random.normal(k1, (b, t, hq, hd))
    k = jax.random.normal(k2, (b, hkv, s, hd))
    v = jax.random.normal(k3, (b, hkv, s, hd))
    return q, k, v


@pytest.mark.parametrize("kv_block", [16, 64, 50])  # 50: the last block is padded
def test_fp16_attention_close_to_float32(kv_block):
    b, t, hq, hkv, hd = 2, 100, 6, 2, 64
    q, k, v = _qkv(b, t, t, hq, hkv, hd)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    ref = _attention(q, k, v, pos, jnp.int32(t))
    out = jax.jit(partial(fp16_lut_attention, kv_block=kv_block))(q, k, v, pos, t)
    assert out.shape == ref.shape == (b, t, hq * hd) and out.dtype == jnp.float32
    err = np.abs(np.asarray(out) - np.asarray(ref))
    # fp16 storage of S, P, O, l: ~1e-3 relative on outputs of size ~1
    assert err.max() < 1e-2 and err.mean() < 1e-3
    assert err.max() > 0  # it is not the float32 path


def test_fp16_attention_masks_like_float32():
    b, t, s, hq, hkv, hd = 1, 1, 64, 4, 2, 32
    q, k, v = _qkv(b, t, s, hq, hkv, hd, seed=1)
    pos, valid = jnp.asarray([[40]]), 41  # one decode step at position 40 of a 64-slot cache
    out = fp16_lut_attention(q, k, v, pos, valid, kv_block=16)
    ref = _attention(q, k, v, pos, jnp.int32(valid))
    assert np.abs(np.asarray(out) - np.asarray(ref)).max() < 1e-2
    # keys after the query / beyond valid_len do not matter at all
    k2 = k.at[:, :, 41:].set(100.0)
    v2 = v.at[:, :, 41:].set(-100.0)
    assert np.array_equal(np.asarray(fp16_lut_attention(q, k2, v2, pos, valid, kv_block=16)), out)
    # causal over a prefill: changing the last key changes only the last query's output
    t = 24
    q, k, v = _qkv(1, t, t, hq, hkv, hd, seed=2)
    pos = jnp.arange(t)[None]
    a = np.asarray(fp16_lut_attention(q, k, v, pos, t, kv_block=8))
    c = np.asarray(fp16_lut_attention(q, k.at[:, :, -1].add(1.0), v, pos, t, kv_block=8))
    assert np.array_equal(a[:, :-1], c[:, :-1]) and not np.array_equal(a[:, -1], c[:, -1])


# ---- the forward's attention hook (models.llama.attention_kernel) ----


def test_attention_hook_swaps_only_the_attention(tiny_cfg, tiny_params):
    from qnpu_jax.models.llama import token_nll
    from qnpu_jax.models.taps import tapped_token_nll
    from qnpu_jax.studies import kernel_accuracy as ka

    tokens = jax.random.randint(jax.random.key(3), (2, 40), 0, tiny_cfg.vocab_size, jnp.int32)
    ref = np.asarray(token_nll(tiny_params, tokens, cfg=tiny_cfg))
    taps = ka.KernelAttention(_attention)
    ours = np.asarray(tapped_token_nll(tiny_params, None, tokens, cfg=tiny_cfg, taps=taps))
    assert np.array_equal(ours, ref)
    fp16 = np.asarray(ka.nll_fn(tiny_params, tiny_cfg, "fp16_lut", 16)(tokens))
    assert np.isfinite(fp16).all() and 0 < np.abs(fp16 - ref).max() < 0.05


def test_kernel_accuracy_study_measures_the_kernels_on_a_real_model(two_layer_dir, tmp_path):
    """`qnpu study kernel_accuracy`: every row paired with float32 on both texts; the tile-group
    4-bit weights move the weights (and the NLL), the FP16 LUT-exp attention only the NLL."""
    import json

    from conftest import SHARED_DATA

    from qnpu_jax.cli import main

    report = tmp_path / "ka.json"
    wikitext = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    args = ["study", "kernel_accuracy", "--model", str(two_layer_dir), "--windows", "1"]
    args += ["--seq-len", "32", "--variants", "w4_tile,attn_fp16_lut", "--wikitext", str(wikitext)]
    assert main([*args, "--json", str(report), "--no-progress"]) == 0
    doc = json.loads(report.read_text())
    assert doc["command"].startswith("qnpu study kernel_accuracy --model")
    assert list(doc["variants"]) == ["float32", "w4_tile", "attn_fp16_lut"]
    assert doc["forward_check"]["max_abs_nll_diff"] < 1e-4
    tile, attn = doc["variants"]["w4_tile"], doc["variants"]["attn_fp16_lut"]
    assert tile["weight_rel_sq_err"] > 0 and attn["weight_rel_sq_err"] is None
    for row in (tile, attn):
        assert set(row["delta_nll_vs_float32"]) == {"wiki", "wikitext2"}
        assert row["ppl"]["wiki"] != doc["variants"]["float32"]["ppl"]["wiki"]
