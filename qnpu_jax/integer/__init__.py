"""The integer-only forward in JAX: runs an exported integer artifact bit-exactly as the
numpy emulator (`qnpu_jax.emulator.engine`) does, as one jitted program with static shapes."""

from qnpu_jax.integer.forward import (
    IntCache,
    IntConsts,
    IntSpec,
    JaxIntEngine,
    generate,
    int_consts,
    int_forward,
    isqrt,
    logits_to_float,
    new_cache,
    prefill,
    run_chunk,
    token_nll,
    token_nll_argmax,
)

__all__ = [
    "IntCache",
    "IntConsts",
    "IntSpec",
    "JaxIntEngine",
    "generate",
    "int_consts",
    "int_forward",
    "isqrt",
    "logits_to_float",
    "new_cache",
    "prefill",
    "run_chunk",
    "token_nll",
    "token_nll_argmax",
]
