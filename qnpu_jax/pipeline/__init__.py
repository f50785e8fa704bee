"""Recipes over the building blocks: static calibration (and later stage 1, mixed precision)."""

from qnpu_jax.pipeline.calibrate import (
    calibrate,
    collect_activation_stats,
    weight_encodings,
)

__all__ = ["calibrate", "collect_activation_stats", "weight_encodings"]
