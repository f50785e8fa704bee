"""Quantization as values and steps: a `QuantizedModel` pytree, steps that map it to a new one
(`steps`), methods as chains of steps (`recipes`), and `qnpu quantize`'s runner (`run`)."""

from qnpu_jax.pipeline import recipes, steps
from qnpu_jax.pipeline.calibrate import (
    calibrate,
    collect_activation_stats,
    weight_encodings,
)
from qnpu_jax.pipeline.quantized_model import QuantizedModel, StepRecord, Transforms
from qnpu_jax.pipeline.recipes import Recipe, chain
from qnpu_jax.pipeline.steps import Calibration, Context, Step

__all__ = [
    "Calibration",
    "Context",
    "QuantizedModel",
    "Recipe",
    "Step",
    "StepRecord",
    "Transforms",
    "calibrate",
    "chain",
    "collect_activation_stats",
    "recipes",
    "steps",
    "weight_encodings",
]
