"""Perplexity over fixed-shape windows, for any model path that maps tokens to next-token NLL."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh
from tqdm import tqdm

from qnpu_jax.errors import QnpuError
from qnpu_jax.mesh import host_array, put_batch

# tokens [B, T] int32 -> NLL of tokens[:, 1:] [B, T-1]
NllFn = Callable[[np.ndarray], jax.Array]


@dataclasses.dataclass(frozen=True)
class PerplexityResult:
    windows: int
    seq_len: int
    predicted_tokens: int
    nll_sum: float
    ppl: float
    seconds: float
    window_nll: tuple[float, ...] = ()  # mean NLL of each window, in order (paired comparisons)


def perplexity(
    nll_fn: NllFn,
    windows: np.ndarray,
    *,
    batch_size: int = 1,
    progress: bool = True,
    mesh: Mesh | None = None,
) -> PerplexityResult:
    """exp(mean next-token NLL over every predicted position of every window).

    The last batch is padded with copies of its first row (and their NLL discarded), so the
    model compiles for one shape only. On `mesh`, each batch is split along its data axis
    (`batch_size` a multiple of it).
    """
    if batch_size < 1:
        raise QnpuError(f"batch_size must be positive, got {batch_size}")
    n, seq_len = windows.shape
    total = 0.0
    per_window: list[float] = []
    start = time.perf_counter()
    with tqdm(total=n, desc="perplexity", unit="win", disable=not progress) as bar:
        for i in range(0, n, batch_size):
            batch = windows[i : i + batch_size]
            real = len(batch)
            if real < batch_size:
                batch = np.concatenate([batch, np.repeat(batch[:1], batch_size - real, 0)])
            nll = np.asarray(host_array(nll_fn(put_batch(mesh, batch))), np.float64)[:real]
            if not np.isfinite(nll).all():
                raise QnpuError(f"non-finite NLL in windows {i}..{i + real - 1}")
            total += float(nll.sum())
            per_window += [float(w) for w in nll.mean(axis=1)]
            bar.update(real)
            bar.set_postfix(ppl=f"{math.exp(total / ((i + real) * (seq_len - 1))):.3f}")
    predicted = n * (seq_len - 1)
    return PerplexityResult(
        windows=n,
        seq_len=seq_len,
        predicted_tokens=predicted,
        nll_sum=total,
        ppl=math.exp(total / predicted),
        seconds=time.perf_counter() - start,
        window_nll=tuple(per_window),
    )
