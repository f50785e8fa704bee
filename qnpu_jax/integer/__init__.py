"""The integer-only forward in JAX: runs an exported integer artifact bit-exactly as the
numpy emulator (`qnpu_jax.emulator`) does, as one jitted program with static shapes."""

from qnpu_jax.integer.forward import (
    IntCache,
    IntConsts,
    IntSpec,
    JaxIntEngine,
    int_consts,
    int_forward,
    isqrt,
)

__all__ = [
    "IntCache",
    "IntConsts",
    "IntSpec",
    "JaxIntEngine",
    "int_consts",
    "int_forward",
    "isqrt",
]
