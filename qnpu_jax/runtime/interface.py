"""The engine interface: an artifact's integer model behind two primitives (`new_cache`,
`run_chunk`), with chunked prefill, NLL and greedy decoding written once for every engine.
Numpy only: the emulator subclasses it and must never pull in JAX."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import IntModel
from qnpu_jax.ir.graph import check_generation_room, check_room, nll_from_logit_codes


class KVCache(Protocol):
    """An engine's integer K/V cache: codes [L, B, Hkv, max_context, hd] and the number of
    filled positions (a frozen dataclass with these three fields)."""

    @property
    def k(self) -> Any: ...
    @property
    def v(self) -> Any: ...
    @property
    def length(self) -> int: ...


C = TypeVar("C", bound=KVCache)


def check_tokens(tokens: Any, vocab_size: int) -> np.ndarray:
    """Token ids [batch>0, length>0] of integers in [0, vocab_size), as int32."""
    a = np.asarray(tokens)
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise QnpuError(f"expected token ids [batch>0, length>0], got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise QnpuError(f"token ids must be integers, got {a.dtype}")
    if a.min() < 0 or a.max() >= vocab_size:
        raise QnpuError(f"token ids must be in [0, {vocab_size})")
    return a.astype(np.int32)


def check_cache_batch(cache: KVCache, batch: int) -> None:
    """Refuse a cache made for another batch size than the tokens'."""
    held = np.shape(cache.k)[1]
    if held != batch:
        raise QnpuError(f"the cache holds batch {held}, the tokens {batch}")


class IntegerEngine(abc.ABC, Generic[C]):
    """An artifact's integer model behind its primitives (`new_cache`, `run_chunk`); chunked
    prefill, NLL and greedy decoding are written once here, so every engine (the numpy
    emulator, the JAX integer forward) drives its primitive the same way."""

    model: IntModel

    @abc.abstractmethod
    def new_cache(self, batch: int) -> C:
        """An empty cache holding the sink prefix's K/V at positions 0..P-1."""

    @abc.abstractmethod
    def run_chunk(self, tokens: np.ndarray, cache: KVCache) -> tuple[np.ndarray, C]:
        """Integer logits [B, T, V] (int32 codes) of `tokens` [B, T] placed after the cache's
        filled positions, and a new cache with their K/V written; `cache` is left as it was
        (any engine's cache is accepted)."""

    @abc.abstractmethod
    def _own(self, cache: KVCache) -> C:
        """A cache of this engine's kind, equal to `cache`, that the driver may write into."""

    def take_rows(self, cache: KVCache, rows: Sequence[int]) -> C:
        """A cache whose batch row i is row `rows[i]` of `cache` (same length): copies one
        prompt's K/V to N samples, or reorders beams."""
        idx = np.asarray(rows, np.int64)
        held = np.shape(cache.k)[1]
        if idx.ndim != 1 or idx.size == 0 or idx.min() < 0 or idx.max() >= held:
            raise QnpuError(f"rows must name rows of a batch-{held} cache, got {list(rows)}")
        return self._take_rows(cache, idx)

    @abc.abstractmethod
    def _take_rows(self, cache: KVCache, rows: np.ndarray) -> C:
        """`take_rows` of checked row indices, into a cache of this engine's kind."""

    def _extend(self, tokens: np.ndarray, cache: C) -> tuple[np.ndarray, C]:
        """`run_chunk` on a cache the driver owns: an engine may write into its buffers."""
        return self.run_chunk(tokens, cache)

    def prefill(self, tokens: Any, cache: KVCache | None = None) -> tuple[np.ndarray, C]:
        """Run `tokens` [B, T] in chunks of `prefill_chunk`, the last one padded with token 0
        (its outputs dropped, its K/V slots past the returned length) unless it would run past
        the maximum context: one compiled shape on the device, the same codes as one call."""
        ids = check_tokens(tokens, int(self.model.model["vocab_size"]))
        batch, n = ids.shape
        own = self._own(cache) if cache is not None else self.new_cache(batch)
        check_cache_batch(own, batch)
        chunk, limit = int(self.model.graph["prefill_chunk"]), int(self.model.graph["max_context"])
        check_room(own.length, n, limit)
        pieces = []
        for s in range(0, n, chunk):
            part = ids[:, s : s + chunk]
            real = part.shape[1]
            if real < chunk and own.length + chunk <= limit:
                part = np.pad(part, ((0, 0), (0, chunk - real)))
            logits, own = self._extend(part, own)
            pieces.append(logits[:, :real])
            own = dataclasses.replace(own, length=own.length - (part.shape[1] - real))  # type: ignore[type-var]
        return np.concatenate(pieces, axis=1), own

    def logits_to_float(self, codes: np.ndarray) -> np.ndarray:
        return np.asarray(codes).astype(np.float64) * float(self.model.graph["logits_scale"])

    def token_nll(self, tokens: Any) -> np.ndarray:
        """Next-token NLL [B, T-1] of tokens[:, 1:], each sequence after the sink prefix."""
        codes, _ = self.prefill(tokens)
        return nll_from_logit_codes(codes, np.asarray(tokens), self.model.graph["logits_scale"])

    def token_nll_argmax(self, tokens: Any) -> tuple[np.ndarray, np.ndarray]:
        """NLL of tokens[:, 1:] and the greedy prediction at each of those positions [B, T-1]."""
        codes, _ = self.prefill(tokens)
        nll = nll_from_logit_codes(codes, np.asarray(tokens), self.model.graph["logits_scale"])
        return nll, np.argmax(codes[:, :-1], axis=-1)

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        eos_token_id: int | None = None,
        on_token: Callable[[int], None] | None = None,
    ) -> list[int]:
        """Greedy decoding (argmax ties → lowest id): the prompt through `prefill`, then one
        one-token chunk per new token into the same cache."""
        if not prompt:
            raise QnpuError("the prompt is empty")
        graph = self.model.graph
        check_generation_room(
            len(graph["prefix_tokens"]), len(prompt), max_new_tokens, graph["max_context"]
        )
        codes, cache = self.prefill(np.asarray([list(prompt)]))
        out: list[int] = []
        token = int(np.argmax(codes[0, -1]))
        while True:
            out.append(token)
            if on_token:
                on_token(token)
            if token == eos_token_id or len(out) == max_new_tokens:
                return out
            codes, cache = self._extend(np.asarray([[token]], np.int32), cache)
            token = int(np.argmax(codes[0, -1]))


