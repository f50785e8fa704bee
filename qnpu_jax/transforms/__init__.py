"""Model-equivalent rewrites of params: norm fusion, offline rotations (R1, R2) and channel
smoothing between up_proj and down_proj."""

from qnpu_jax.transforms.rotate import (
    apply_rotations,
    fuse_norms,
    norms_are_fused,
    randomized_hadamard_rotations,
)
from qnpu_jax.transforms.smooth import smooth_mlp, smoothing_scales

__all__ = [
    "apply_rotations",
    "fuse_norms",
    "norms_are_fused",
    "randomized_hadamard_rotations",
    "smooth_mlp",
    "smoothing_scales",
]
