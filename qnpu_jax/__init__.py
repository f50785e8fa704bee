"""qnpu_jax: fully static, integer-only quantization of small LLMs for mobile NPUs."""

from qnpu_jax.errors import QnpuError

__all__ = ["QnpuError"]
__version__ = "0.1.0"
