"""LUT-based computations of npu-test-time-scaling §5.2: 16-entry code → value tables for
4-bit weights (the HVX vlut16 dequantization), and a 32768-entry fp16 exp table for the
FP16 FlashAttention of Algorithm 1, emulated in JAX.

- Dequantization (numpy, offline): a group's 4-bit index selects one of 16 table values, times
  the group's fp16 scale. The table is what vlut16 holds, so it is fp16 (`Lut.table`): Q4_0
  ([-8, 7]) and IQ4_NL (integers) are exact, NF4's levels are rounded to fp16.
- exp (JAX): safe softmax only ever takes exp of x ≤ 0, so one table entry per non-positive
  fp16 value suffices: index = the fp16 bit pattern without its sign bit (the paper drops the
  MSB and shifts left by one for vgather's byte offset). Entries are exp(x) in float64,
  rounded once to fp16. (The paper's code tabulates exp2 instead and folds log2(e) into the fp16
  QK scale; we keep exp, as the paper's text and Algorithm 1 write it.)
- `fp16_lut_attention`: Algorithm 1 (S, P, O, m, l in fp16, exp by the table, products and
  row sums of P accumulated in fp32), with the call semantics of `models.llama._attention`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Final

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError


@dataclasses.dataclass(frozen=True)
class Lut:
    """A 4-bit code book: 16 ascending values (exact decimal constants of the format)."""

    name: str
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.values) != 16:
            raise QnpuError(f"LUT {self.name}: needs 16 values, got {len(self.values)}")
        if any(b <= a for a, b in zip(self.values, self.values[1:], strict=False)):
            raise QnpuError(f"LUT {self.name}: values must be strictly ascending")

    @property
    def table(self) -> np.ndarray:
        """The 16 values as vlut16 holds them (fp16)."""
        return np.asarray(self.values, dtype=np.float64).astype(np.float16)


# Q4_0: nibble n holds the code n - 8.
Q4_0_LUT: Final = Lut("q4_0", tuple(float(v) for v in range(-8, 8)))
# NF4 (QLoRA, Dettmers et al. 2023, Appendix E; bitsandbytes' table).
NF4_LUT: Final = Lut(
    "nf4",
    (
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ),
)
# IQ4_NL: llama.cpp's kvalues_iq4nl (ggml-quants.c / ggml-common.h).
IQ4_NL_LUT: Final = Lut(
    "iq4_nl",
    tuple(float(v) for v in (-127, -104, -83, -65, -49, -35, -22, -10))
    + tuple(float(v) for v in (1, 13, 25, 38, 53, 69, 89, 113)),
)
LUTS: Final = {lut.name: lut for lut in (Q4_0_LUT, NF4_LUT, IQ4_NL_LUT)}


def nearest_index(y: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table value to each y (ascending table; a tie goes to the upper
    value, as llama.cpp's `best_index_int8`)."""
    t = np.asarray(table, np.float64)
    mids = (t[1:] + t[:-1]) / 2
    return np.searchsorted(mids, y, side="right").astype(np.uint8)


def lut_quantize(groups: np.ndarray, lut: Lut, ntry: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices [n, g] (uint8, 0..15) and fp16 scales [n] of groups [n, g] under `lut`.

    ntry = 0: d = (signed element of largest magnitude) / values[0], so that element maps to
    the table's first (most negative) value — Q4_0's rule for the Q4_0 table, absmax for NF4.
    ntry > 0: llama.cpp's IQ4_NL search (`quantize_row_iq4_nl_impl` without an importance
    matrix): weights x², start from d = -max / values[0], take the least-squares scale of
    that and of the 2·ntry + 1 trial scales (itry + values[0]) / max, keep the best.
    The indices are always re-rounded against the fp16 scale that is stored."""
    x = np.asarray(groups, dtype=np.float32)
    if x.ndim != 2:
        raise QnpuError(f"groups must be [n_groups, group], got shape {x.shape}")
    if ntry < 0:
        raise QnpuError(f"ntry must be >= 0, got {ntry}")
    table = lut.table.astype(np.float64)
    v0 = table[0]
    top = np.take_along_axis(x, np.argmax(np.abs(x), axis=1)[:, None], axis=1)[:, 0]
    top = top.astype(np.float64)
    x64 = x.astype(np.float64)
    zero = top == 0
    safe_top = np.where(zero, 1.0, top)
    if ntry == 0:
        d = top / v0
    else:
        w = x64 * x64

        def fit(inv_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            q = table[nearest_index(x64 * inv_scale[:, None], table)]
            return np.sum(w * q * x64, axis=1), np.sum(w * q * q, axis=1)

        sumqx, sumq2 = fit(1.0 / (-safe_top / v0))
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(sumq2 > 0, sumqx / sumq2, 0.0)
        best = d * sumqx
        for itry in range(-ntry, ntry + 1):
            sumqx, sumq2 = fit((itry + v0) / safe_top)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            with np.errstate(divide="ignore", invalid="ignore"):
                d = np.where(better, sumqx / sumq2, d)
            best = np.where(better, d * sumqx, best)
    scales = np.where(zero, 0.0, d).astype(np.float16)
    d16 = scales.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(d16 != 0, x64 / d16, 0.0)
    idx = nearest_index(y, table)
    # An all-zero group (or a scale that underflowed fp16) dequantizes to 0: the index of the
    # table's zero when it has one, else of its smallest magnitude.
    idx = np.where(d16 != 0, idx, np.uint8(np.argmin(np.abs(table)))).astype(np.uint8)
    return idx, scales


def lut_dequantize(indices: np.ndarray, scales: np.ndarray, lut: Lut) -> np.ndarray:
    """table[index] × scale in float32 ([n, g]); the table is the fp16 one vlut16 holds."""
    if indices.ndim != 2 or scales.shape != indices.shape[:1]:
        raise QnpuError(
            f"indices must be [n_groups, group] with one scale per group, got indices "
            f"{indices.shape} and scales {scales.shape}"
        )
    if indices.size and int(indices.max()) > 15:
        raise QnpuError(f"4-bit LUT indices must lie in [0, 15], got {int(indices.max())}")
    values = lut.table.astype(np.float32)[indices.astype(np.intp)]
    return values * np.asarray(scales, np.float16).astype(np.float32)[:, None]


# ---- exp table for FP16 softmax ----

EXP_TABLE_SIZE: Final = 1 << 15  # one entry per fp16 bit pattern with the sign bit set
FP16_SIGN: Final = 0x8000
FP16_LOWEST: Final = -65504.0  # Algorithm 1's m starts here (the paper's code), not at -inf


def build_exp_table() -> np.ndarray:
    """exp(x) for x = the fp16 value with bits (i | 0x8000), i < 32768: computed in float64,
    rounded once to fp16 (numpy converts float64 → float16 directly). -0 → 1, -inf → 0, the
    NaN patterns → NaN."""
    x = (np.arange(EXP_TABLE_SIZE, dtype=np.uint16) | np.uint16(FP16_SIGN)).view(np.float16)
    with np.errstate(invalid="ignore"):
        return np.exp(x.astype(np.float64)).astype(np.float16)


EXP_TABLE: Final = build_exp_table()  # 64 KiB, built once like the device builds it at init


def lut_exp(x: jax.Array, table: np.ndarray = EXP_TABLE) -> jax.Array:
    """exp of fp16 x ≤ 0 by one gather from the table (index = bits & 0x7fff).

    The table has no entries for x > 0: dropping the sign bit would silently return exp(-x),
    so positive inputs (and +inf) give NaN instead; a non-fp16 input is a QnpuError."""
    x = jnp.asarray(x)
    if x.dtype != jnp.float16:
        raise QnpuError(
            f"lut_exp takes float16 inputs (its table is indexed by fp16 bits), got {x.dtype}"
        )
    if table.shape != (EXP_TABLE_SIZE,) or table.dtype != np.float16:
        raise QnpuError(
            f"the exp table must be float16 [{EXP_TABLE_SIZE}], got {table.dtype} {table.shape}"
        )
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
    idx = (bits & jnp.uint16(EXP_TABLE_SIZE - 1)).astype(jnp.int32)
    y = jnp.asarray(table)[idx]
    return jnp.where(x > 0, jnp.float16(jnp.nan), y)


def _round16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float16)


def fp16_lut_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_pos: jax.Array,
    valid_len: jax.Array | int,
    *,
    kv_block: int = 64,
    table: np.ndarray = EXP_TABLE,
) -> jax.Array:
    """Causal GQA attention by Algorithm 1 (FP16 FlashAttention with the LUT exp): a drop-in
    for `models.llama._attention` without its taps.

    q [B, T, Hq, hd]; k, v [B, Hkv, S, hd]; query_pos [B, T]; keys at index >= valid_len or
    after the query's position are masked. Returns float32 [B, T, Hq·hd] (fp16 values).

    Per KV block of `kv_block` keys (the last one padded with masked keys), in fp16 storage:
      S = fp16(fp32(Q Kᵀ) · fp16(1/√hd))       (HMX: fp32 accumulator, fp16 column scale)
      m' = max(m, rowmax S)                    (m starts at -65504, as the paper's code)
      P = lut_exp(fp16(S − m'))                (masked S = -inf → exp 0)
      α = lut_exp(fp16(m − m'))
      l' = fp16(α·l + fp16(Σ_fp32 P))          (row sum of P accumulated in fp32)
      O' = fp16(α·O + Σ_fp32 P V)              (HMX accumulates diag(α)·O and P·V together)
    and at the end O / l rounded to fp16. Products of two fp16 values are exact in fp32, so
    fp32 einsums over fp16-valued operands are the HMX's fp16 × fp16 → fp32 arithmetic."""
    if kv_block < 1:
        raise QnpuError(f"kv_block must be positive, got {kv_block}")
    b, t, hq, hd = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if hq % hkv:
        raise QnpuError(f"{hq} query heads do not split into {hkv} KV-head groups")
    g = hq // hkv
    f32 = jnp.float32
    # fp16 operands, held as fp32 for the fp32-accumulating matmuls
    q16 = _round16(q).reshape(b, t, hkv, g, hd).transpose(0, 2, 3, 1, 4).astype(f32)
    n_blocks = -(-s // kv_block)
    pad = ((0, 0), (0, 0), (0, n_blocks * kv_block - s), (0, 0))

    def blocks(a: jax.Array) -> jax.Array:
        a = jnp.pad(_round16(a).astype(f32), pad)
        return a.reshape(b, hkv, n_blocks, kv_block, hd).transpose(2, 0, 1, 3, 4)

    key_pos = jnp.arange(n_blocks * kv_block, dtype=jnp.int32).reshape(n_blocks, kv_block)
    scale = float(np.float16(1.0 / math.sqrt(hd)))
    valid = jnp.asarray(valid_len, jnp.int32)
    qpos = jnp.asarray(query_pos, jnp.int32)

    def step(
        carry: tuple[jax.Array, jax.Array, jax.Array], xs: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
        m, l, o = carry
        kj, vj, pos = xs
        scores = _round16(jnp.einsum("bkgtd,bksd->bkgts", q16, kj) * scale)
        allowed = (pos[None, None, :] <= qpos[:, :, None]) & (pos < valid)[None, None, :]
        scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        p = lut_exp(_round16(scores.astype(f32) - m_new[..., None].astype(f32)), table)
        alpha = lut_exp(_round16(m.astype(f32) - m_new.astype(f32)), table).astype(f32)
        rowsum = _round16(jnp.sum(p.astype(f32), axis=-1))
        l_new = _round16(alpha * l.astype(f32) + rowsum.astype(f32))
        pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(f32), vj)
        o_new = _round16(alpha[..., None] * o.astype(f32) + pv)
        return (m_new, l_new, o_new), None

    init = (
        jnp.full((b, hkv, g, t), FP16_LOWEST, jnp.float16),
        jnp.zeros((b, hkv, g, t), jnp.float16),
        jnp.zeros((b, hkv, g, t, hd), jnp.float16),
    )
    (_, l, o), _ = jax.lax.scan(step, init, (blocks(k), blocks(v), key_pos))
    out = _round16(o.astype(f32) / l.astype(f32)[..., None])
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq * hd).astype(f32)
