"""Metrics: perplexity (zero-shot tasks come later)."""

from qnpu_jax.eval.perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "perplexity"]
