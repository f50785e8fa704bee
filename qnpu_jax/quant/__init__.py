"""Quantizer math: specs, fake quantization with LSQ/LSQ+ gradients, static-range initializers
and the integer primitives of the integer contract (docs/artifact.md). Imports only jax and
numpy."""

from qnpu_jax.quant.fake_quant import (
    MIN_SCALE,
    check_scales,
    dequantize,
    dynamic_fake_quant,
    fake_quant,
    log_to_scale,
    lsq_grad_scale,
    positive_scale,
    quantize,
    round_ste,
    scale_to_log,
)
from qnpu_jax.quant.init import (
    RANGE_INITS,
    RangeStats,
    init_range_stats,
    mse_scale,
    scale_from_stats,
    update_range_stats,
)
from qnpu_jax.quant.plan import QuantPlan, QuantRule, TensorQuant, default_plan, uniform_plan
from qnpu_jax.quant.requantize import (
    build_lut,
    fixed_point_multiplier,
    quantize_to_int,
    requantize_jax,
    requantize_np,
)
from qnpu_jax.quant.spec import QuantSpec, code_dtype, qrange, reduced_shape, resolve_axis

__all__ = [
    "MIN_SCALE",
    "RANGE_INITS",
    "QuantPlan",
    "QuantRule",
    "QuantSpec",
    "RangeStats",
    "TensorQuant",
    "build_lut",
    "check_scales",
    "code_dtype",
    "default_plan",
    "dequantize",
    "dynamic_fake_quant",
    "fake_quant",
    "fixed_point_multiplier",
    "init_range_stats",
    "log_to_scale",
    "lsq_grad_scale",
    "mse_scale",
    "positive_scale",
    "qrange",
    "quantize",
    "quantize_to_int",
    "reduced_shape",
    "requantize_jax",
    "requantize_np",
    "resolve_axis",
    "round_ste",
    "scale_from_stats",
    "scale_to_log",
    "uniform_plan",
    "update_range_stats",
]
