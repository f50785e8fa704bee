"""qnpu_jax: fully static, integer-only quantization of small LLMs for mobile NPUs."""

from qnpu_jax.errors import QnpuError
from qnpu_jax.version import __version__

__all__ = ["QnpuError", "__version__"]
