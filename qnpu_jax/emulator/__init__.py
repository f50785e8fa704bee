"""The numpy NPU emulator: the independent, JAX-free reference that runs an integer artifact."""

from qnpu_jax.emulator.engine import Cache, EmulatorEngine, run_chunk

__all__ = ["Cache", "EmulatorEngine", "run_chunk"]
