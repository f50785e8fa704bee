import math

import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.eval import perplexity


def _constant_nll(values):
    """An NLL function that returns, for window row r, the value values[first token of r]."""

    def nll_fn(tokens):
        return np.repeat(np.asarray(values)[tokens[:, :1]], tokens.shape[1] - 1, axis=1)

    return nll_fn


def test_padded_rows_are_discarded():
    windows = np.array([[0, 9, 9], [1, 9, 9], [2, 9, 9]])
    seen = []

    def nll_fn(tokens):
        seen.append(tokens.shape)
        return _constant_nll([1.0, 2.0, 3.0])(tokens)

    result = perplexity(nll_fn, windows, batch_size=2, progress=False)
    assert seen == [(2, 3), (2, 3)]  # one shape only: the last batch is padded
    assert result.predicted_tokens == 6
    assert math.isclose(result.ppl, math.exp(2.0))  # mean of 1, 2, 3; padding not counted
    assert result.window_nll == (1.0, 2.0, 3.0)  # per window, in order, padding dropped


def test_non_finite_nll_is_an_error():
    windows = np.array([[0, 9], [1, 9]])
    with pytest.raises(QnpuError, match=r"non-finite NLL in windows 0\.\.1"):
        perplexity(_constant_nll([1.0, np.nan]), windows, batch_size=2, progress=False)
    with pytest.raises(QnpuError, match="batch_size must be positive"):
        perplexity(_constant_nll([1.0, 1.0]), windows, batch_size=0, progress=False)
