"""Emulations of the mobile-NPU kernels of "Scaling LLM Test-Time Compute with Mobile NPU on
Smartphones" (npu-test-time-scaling §5): tile-group weight quantization in the HMX layout with
coalesced super-blocks, and LUT-based dequantization, exp and FP16 FlashAttention."""

from qnpu_jax.kernels.lut import (
    EXP_TABLE,
    IQ4_NL_LUT,
    LUTS,
    NF4_LUT,
    Q4_0_LUT,
    Lut,
    build_exp_table,
    fp16_lut_attention,
    lut_dequantize,
    lut_exp,
    lut_quantize,
)
from qnpu_jax.kernels.tile_group import (
    common_group_dequantize,
    common_group_quantize,
    common_groups,
    from_common_groups,
    from_tile_groups,
    from_tile_layout,
    pack_super_blocks,
    tile_group_dequantize,
    tile_group_quantize,
    tile_groups,
    tile_order,
    to_tile_layout,
    unpack_super_blocks,
)

__all__ = [
    "EXP_TABLE",
    "IQ4_NL_LUT",
    "LUTS",
    "NF4_LUT",
    "Q4_0_LUT",
    "Lut",
    "build_exp_table",
    "common_group_dequantize",
    "common_group_quantize",
    "common_groups",
    "fp16_lut_attention",
    "from_common_groups",
    "from_tile_groups",
    "from_tile_layout",
    "lut_dequantize",
    "lut_exp",
    "lut_quantize",
    "pack_super_blocks",
    "tile_group_dequantize",
    "tile_group_quantize",
    "tile_groups",
    "tile_order",
    "to_tile_layout",
    "unpack_super_blocks",
]
