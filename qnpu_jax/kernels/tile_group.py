"""Tile-group weight quantization for the Hexagon HMX matrix unit (npu-test-time-scaling §5.1,
Figures 4 and 7), next to llama.cpp's common groups, in numpy (offline weight preparation).

Our reading of §5.1 and Figure 4, checked against the HVX/HMX kernels of the paper's code
(htp-ops-lib, `mat_mul.c`: `dequantize_common_weight_q4_0_to_fp16_hvx_task` scatters a
common group into a tile, `dequantize_permuted_weight_q4_0_to_fp16_hvx_task` reads a
super-block):

- The HMX computes Y = X · B with B = Wᵀ of shape [K, N] = [in, out]. B is cut into 32 × 32
  tiles (rows: 32 input indices, columns: 32 output channels). The tiles are stored
  "column-major": all K tiles of output tile 0, then all of output tile 1, ... (the tile-level
  inner product runs along K).
- Inside a tile, "every two rows are permuted, having the same layout as the transposed 2 × 32
  sub-matrix": input rows 2r and 2r+1 are interleaved element by element across the 32 output
  columns, so tile element (k, n) sits at 64·(k // 2) + 2·n + k % 2.
- Quantizing 32 consecutive elements of that memory order therefore groups 2 input indices ×
  16 output channels: the paper's "group quantization in units of 2 × 16 tiles". A group of
  g elements covers 2 inputs × g/2 outputs while g ≤ 64 (g must divide the 1024-element tile).
- Eight consecutive groups (256 codes) are coalesced into one super-block: eight fp16 scales
  (16 bytes) followed by the 128 bytes of 4-bit codes that fill one HVX register, 144 bytes in
  all (`my_block_q4_0 {__fp16 scales[8]; uint8_t quants[128];}`). The nibble order inside the
  128 bytes is the one the kernel's two vlut16 lookups undo (see `pack_super_blocks`).

The quantizer is llama.cpp's Q4_0 rule for any bit width: per group, d = (the element of
largest magnitude, with its sign) / qmin, stored as fp16, so that element lands exactly on
qmin = -2^(bits-1); codes = clip(floor(x / d + 0.5), qmin, qmax) (round half up, as
llama.cpp's `(int)(x*id + 8.5f)`). d may be negative. One deviation: the codes are rounded
against the fp16 scale that is stored, not llama.cpp's float32 one, so every element inside
the code range is within |d| / 2 of its dequantized value (the element at +8·|d| clamps to 7).
"""

from __future__ import annotations

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.quant.spec import qrange

TILE = 32  # HMX FP16 tile: 32 × 32 elements, 2 KiB
TILE_ELEMS = TILE * TILE
GROUP = 32  # Q4_0's group size and the paper's
SUPER_BLOCK_GROUPS = 8  # groups coalesced into one super-block (Figure 7)
SUPER_BLOCK_CODES = 256  # 4-bit codes of one super-block: one 128-byte HVX register
SUPER_BLOCK_BYTES = 2 * SUPER_BLOCK_GROUPS + SUPER_BLOCK_CODES // 2  # 16 B scales + 128 B codes
Q4_0_OFFSET = 8  # Q4_0 stores code + 8 in a nibble


def _check_matrix(w: np.ndarray, what: str) -> None:
    if w.ndim != 2:
        raise QnpuError(f"{what} needs a weight matrix [out, in], got shape {tuple(w.shape)}")


def _check_group(group: int, what: str) -> None:
    if isinstance(group, bool) or not isinstance(group, int | np.integer) or group < 1:
        raise QnpuError(f"{what}: group size must be a positive integer, got {group!r}")


def check_tile_shape(shape: tuple[int, ...], group: int = GROUP) -> None:
    """QnpuError unless a weight [out, in] of `shape` cuts into 32 × 32 HMX tiles and `group`
    divides a tile (a group never straddles two tiles)."""
    _check_group(group, "tile-group quantization")
    if len(shape) != 2:
        raise QnpuError(f"tile-group quantization needs a weight [out, in], got shape {shape}")
    out, inp = shape
    if out % TILE or inp % TILE or out == 0 or inp == 0:
        raise QnpuError(
            f"tile-group quantization needs both dims of a weight [out, in] to be positive "
            f"multiples of the {TILE} × {TILE} HMX tile, got shape {tuple(shape)}"
        )
    if TILE_ELEMS % group:
        raise QnpuError(
            f"tile-group quantization needs the group size to divide the {TILE_ELEMS}-element "
            f"tile, got group {group}"
        )


def to_tile_layout(w: np.ndarray) -> np.ndarray:
    """The elements of w [out, in] in the HMX weight layout's memory order (1-D).

    n = 32·nt + nc (output), k = 32·kt + 2·kp + kb (input); memory order (nt, kt, kp, nc, kb)."""
    _check_matrix(w, "the HMX tile layout")
    check_tile_shape(tuple(w.shape), 1)
    out, inp = w.shape
    split = w.reshape(out // TILE, TILE, inp // TILE, TILE // 2, 2)  # nt, nc, kt, kp, kb
    return split.transpose(0, 2, 3, 1, 4).reshape(-1)


def from_tile_layout(flat: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Inverse of `to_tile_layout`: the weight [out, in] from its memory-order elements."""
    check_tile_shape(tuple(shape), 1)
    out, inp = shape
    if flat.size != out * inp:
        raise QnpuError(f"{flat.size} elements do not fill a weight of shape {tuple(shape)}")
    split = flat.reshape(out // TILE, inp // TILE, TILE // 2, TILE, 2)  # nt, kt, kp, nc, kb
    return split.transpose(0, 3, 1, 2, 4).reshape(out, inp)


def tile_order(shape: tuple[int, int]) -> np.ndarray:
    """Flat index into w [out, in] of each memory position of the tile layout (a permutation)."""
    return to_tile_layout(np.arange(shape[0] * shape[1], dtype=np.int64).reshape(shape))


def tile_groups(w: np.ndarray, group: int = GROUP) -> np.ndarray:
    """Tile groups [n_groups, group]: consecutive runs of the tile layout's memory order."""
    _check_matrix(w, "tile-group quantization")
    check_tile_shape(tuple(w.shape), group)
    return to_tile_layout(w).reshape(-1, group)


def from_tile_groups(groups: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return from_tile_layout(groups.reshape(-1), shape)


def common_groups(w: np.ndarray, group: int = GROUP) -> np.ndarray:
    """llama.cpp's groups [n_groups, group]: `group` consecutive inputs of one output row."""
    _check_matrix(w, "common-group quantization")
    _check_group(group, "common-group quantization")
    if w.shape[1] % group or w.size == 0:
        raise QnpuError(
            f"common-group quantization needs the input dim of a weight [out, in] to be a "
            f"positive multiple of the group size {group}, got shape {tuple(w.shape)}"
        )
    return w.reshape(-1, group)


def from_common_groups(groups: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return groups.reshape(shape)


def group_scales(groups: np.ndarray, qmin: float) -> np.ndarray:
    """llama.cpp's Q4_0 scale per group: (signed element of largest magnitude) / qmin, fp16.
    Ties in magnitude go to the first such element (llama.cpp's strict `>` scan)."""
    x = np.asarray(groups, dtype=np.float32)
    top = np.take_along_axis(x, np.argmax(np.abs(x), axis=1)[:, None], axis=1)[:, 0]
    return (top.astype(np.float64) / qmin).astype(np.float16)


def quantize_groups(groups: np.ndarray, bits: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Round-to-nearest symmetric codes [n, g] (int8, in [qmin, qmax]) and fp16 scales [n]."""
    qmin, qmax = qrange(bits)
    if bits > 8:
        raise QnpuError(f"group quantization stores codes in int8: bits must be <= 8, got {bits}")
    x = np.asarray(groups, dtype=np.float32)
    if x.ndim != 2:
        raise QnpuError(f"groups must be [n_groups, group], got shape {x.shape}")
    scales = group_scales(x, qmin)
    d = scales.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        y = np.where(d != 0, x.astype(np.float64) / d, 0.0)  # an all-zero group: codes 0
    codes = np.clip(np.floor(y + 0.5), qmin, qmax).astype(np.int8)
    return codes, scales


def dequantize_groups(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """codes [n, g] × fp16 scales [n] in float32 (exact: a ≤ 8-bit code times an fp16 scale)."""
    if codes.ndim != 2 or scales.shape != codes.shape[:1]:
        raise QnpuError(
            f"codes must be [n_groups, group] with one scale per group, got codes "
            f"{codes.shape} and scales {scales.shape}"
        )
    return codes.astype(np.float32) * np.asarray(scales, np.float16).astype(np.float32)[:, None]


def tile_group_quantize(
    w: np.ndarray, group: int = GROUP, bits: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize w [out, in] in tile groups: (codes [n_groups, group] int8 in the tile layout's
    memory order, fp16 scales [n_groups])."""
    return quantize_groups(tile_groups(np.asarray(w, np.float32), group), bits)


def tile_group_dequantize(
    codes: np.ndarray, scales: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    """The float32 weight [out, in] of `tile_group_quantize`'s codes and scales."""
    return from_tile_groups(dequantize_groups(codes, scales), shape)


def common_group_quantize(
    w: np.ndarray, group: int = GROUP, bits: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """Quantize w [out, in] in llama.cpp's groups (consecutive inputs of one row): codes
    [out · in / group, group] int8 in row-major order, fp16 scales."""
    return quantize_groups(common_groups(np.asarray(w, np.float32), group), bits)


def common_group_dequantize(
    codes: np.ndarray, scales: np.ndarray, shape: tuple[int, int]
) -> np.ndarray:
    return from_common_groups(dequantize_groups(codes, scales), shape)


def pack_super_blocks(
    codes: np.ndarray, scales: np.ndarray, offset: int = Q4_0_OFFSET
) -> np.ndarray:
    """Coalesce 4-bit groups of 32 into super-blocks uint8 [n_blocks, 144] (Figure 7).

    codes [n_groups, 32] (memory order; nibble = code + offset must lie in [0, 15]: Q4_0's
    signed codes with offset 8, LUT indices with offset 0), scales [n_groups] fp16;
    n_groups a multiple of 8. Block layout: 8 little-endian fp16 scales, then 128 code bytes.
    Code c of the block's 256 (group c // 32) sits in byte 2·(c % 64) + (c // 64) % 2, low
    nibble for c < 128, high nibble otherwise: the order in which the kernel's two vlut16
    lookups (low nibbles, then high nibbles; each returns even bytes, then odd bytes) write
    the 4 × 64 fp16 values of the block in memory order."""
    codes = np.asarray(codes)
    scales = np.asarray(scales)
    if codes.ndim != 2 or codes.shape[1] != GROUP or scales.shape != codes.shape[:1]:
        raise QnpuError(
            f"super-blocks hold groups of {GROUP} codes with one scale each: got codes "
            f"{codes.shape} and scales {scales.shape}"
        )
    if len(codes) % SUPER_BLOCK_GROUPS or len(codes) == 0:
        raise QnpuError(
            f"super-blocks coalesce {SUPER_BLOCK_GROUPS} groups: got {len(codes)} groups, not a "
            f"positive multiple of {SUPER_BLOCK_GROUPS}"
        )
    nibbles = codes.astype(np.int64) + offset
    if nibbles.min() < 0 or nibbles.max() > 15:
        raise QnpuError(
            f"codes + offset {offset} must fit a nibble [0, 15], got "
            f"[{int(nibbles.min())}, {int(nibbles.max())}]"
        )
    n_blocks = len(codes) // SUPER_BLOCK_GROUPS
    # c = 128·h + 64·o + e  ->  byte 2·e + o, nibble h
    split = nibbles.astype(np.uint8).reshape(n_blocks, 2, 2, 64)  # block, h, o, e
    halves = split.transpose(0, 1, 3, 2).reshape(n_blocks, 2, 128)  # block, h, byte
    quants = halves[:, 0] | (halves[:, 1] << 4)
    scale_bytes = (
        scales.astype("<f2").reshape(n_blocks, SUPER_BLOCK_GROUPS).view(np.uint8)
    )  # 16 bytes a block
    return np.concatenate([scale_bytes, quants], axis=1)


def unpack_super_blocks(
    blocks: np.ndarray, offset: int = Q4_0_OFFSET
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of `pack_super_blocks`: (codes [n_groups, 32] int8, scales [n_groups] fp16)."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2 or blocks.shape[1] != SUPER_BLOCK_BYTES:
        raise QnpuError(
            f"super-blocks are uint8 [n_blocks, {SUPER_BLOCK_BYTES}], got {blocks.dtype} "
            f"{blocks.shape}"
        )
    n_blocks = len(blocks)
    scales = np.ascontiguousarray(blocks[:, : 2 * SUPER_BLOCK_GROUPS]).view("<f2")
    quants = blocks[:, 2 * SUPER_BLOCK_GROUPS :]
    halves = np.stack([quants & 0x0F, quants >> 4], axis=1)  # block, h, byte
    split = halves.reshape(n_blocks, 2, 64, 2).transpose(0, 1, 3, 2)  # block, h, o, e
    codes = split.reshape(-1, GROUP).astype(np.int16) - offset
    return codes.astype(np.int8), scales.reshape(-1).astype(np.float16)
