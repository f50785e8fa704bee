"""Rotations for outlier smoothing: Hadamard constructions, Cayley SGD on the Stiefel manifold."""

from qnpu_jax.rotation.cayley import CayleySGDState, cayley_sgd, orthogonality_error
from qnpu_jax.rotation.hadamard import (
    hadamard_construction,
    hadamard_matrix,
    normalized_hadamard,
    random_hadamard,
    random_orthogonal,
    supported_hadamard_sizes,
)

__all__ = [
    "CayleySGDState",
    "cayley_sgd",
    "hadamard_construction",
    "hadamard_matrix",
    "normalized_hadamard",
    "orthogonality_error",
    "random_hadamard",
    "random_orthogonal",
    "supported_hadamard_sizes",
]
