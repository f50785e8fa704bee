"""Model-equivalent rewrites of params: norm fusion, offline rotations (R1, R2) and equivalent
channel scaling of linear pairs (up→down smoothing is one of them)."""

from qnpu_jax.transforms.equalize import (
    EQUALIZED,
    equalization_widths,
    equalize,
    reader_absmax,
    smoothing_scales,
)
from qnpu_jax.transforms.rotate import (
    add_rotation_linears,
    apply_rotations,
    fuse_norms,
    norms_are_fused,
    randomized_hadamard_rotations,
)
from qnpu_jax.transforms.smooth import smooth_mlp

__all__ = [
    "EQUALIZED",
    "add_rotation_linears",
    "apply_rotations",
    "equalization_widths",
    "equalize",
    "fuse_norms",
    "norms_are_fused",
    "randomized_hadamard_rotations",
    "reader_absmax",
    "smooth_mlp",
    "smoothing_scales",
]
