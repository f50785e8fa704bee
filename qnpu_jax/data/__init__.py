"""Text corpora and token windows."""

from qnpu_jax.data.sources import (
    eval_windows,
    load_documents,
    sample_windows,
    tokenize_documents,
)

__all__ = ["eval_windows", "load_documents", "sample_windows", "tokenize_documents"]
