"""Model-equivalent rewrites of params: norm fusion and offline rotations (R1, R2)."""

from qnpu_jax.transforms.rotate import (
    apply_rotations,
    fuse_norms,
    norms_are_fused,
    randomized_hadamard_rotations,
)

__all__ = ["apply_rotations", "fuse_norms", "norms_are_fused", "randomized_hadamard_rotations"]
