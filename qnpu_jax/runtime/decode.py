"""Parallel test-time scaling on the integer engines: batched sampling from one shared prompt,
Best-of-N, majority vote and beam search (the NPU test-time-scaling paper, §3).

Engine-generic and numpy only (the emulator never imports JAX): every function drives an
`IntegerEngine` through its primitives. The prompt is prefilled once at batch 1 and its K/V
rows copied to the N samples (`IntegerEngine.take_rows`), so the prefix is computed once;
then each decode step is one batched chunk of N tokens, which is where an NPU's idle matrix
tiles pay for themselves.

Randomness is explicit: sample `i` of `sample_parallel(..., seed=s)` draws from
`numpy.random.default_rng((s, i))` alone, so N samples decoded together equal the same N
decoded one by one, token for token (engines are row-independent and bit-exact). Token
probabilities come from the integer logit codes (× logits_scale) in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import check_generation_room

SELECTIONS = ("best", "vote", "beam")


@dataclasses.dataclass(frozen=True)
class Sampler:
    """Temperature / nucleus sampling; temperature 0 is greedy (argmax, ties → lowest id)."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise QnpuError(f"Sampler.{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise QnpuError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise QnpuError(f"top_p must be in (0, 1], got {self.top_p}")

    def draw(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One token from float64 logits [V]. A greedy sampler draws nothing from `rng`; any
        other draws exactly one uniform, so a row's stream stays aligned with its steps."""
        if self.temperature == 0:
            return int(np.argmax(logits))
        z = logits / self.temperature
        p = np.exp(z - z.max())
        order = np.argsort(-p, kind="stable")  # descending, ties → lowest id first
        cum = np.cumsum(p[order])
        keep = len(order)
        if self.top_p < 1:  # the smallest prefix holding top_p of the mass
            keep = int(np.searchsorted(cum, self.top_p * cum[-1], side="left")) + 1
        u = rng.random() * cum[keep - 1]
        return int(order[min(int(np.searchsorted(cum[:keep], u, side="right")), keep - 1)])


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclasses.dataclass(frozen=True)
class Sample:
    """New tokens (ending at EOS when one was drawn) and their summed log-probability under
    the model at temperature 1: the model's own likelihood, Best-of-N's default score."""

    tokens: tuple[int, ...]
    logprob: float


def _check(engine: Any, prompt: Sequence[int], n: int, max_new_tokens: int) -> None:
    if not prompt:
        raise QnpuError("the prompt is empty")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QnpuError(f"the number of samples must be an integer >= 1, got {n!r}")
    g = engine.model.graph
    check_generation_room(len(g["prefix_tokens"]), len(prompt), max_new_tokens, g["max_context"])


def sample_parallel(
    engine: Any,
    prompt: Sequence[int],
    n: int,
    max_new_tokens: int,
    sampler: Sampler,
    seed: int,
    eos_token_id: int | None = None,
    rows: Sequence[int] | None = None,
) -> list[Sample]:
    """N samples of up to `max_new_tokens` after `prompt`, decoded as one batch: the prompt
    prefilled once, its cache copied to N rows, one batched chunk per step. `rows` names the
    random streams (default 0..n−1): `rows=[i]` alone reproduces sample i of a larger batch."""
    _check(engine, prompt, n, max_new_tokens)
    rows = list(range(n)) if rows is None else list(rows)
    if len(rows) != n:
        raise QnpuError(f"{len(rows)} rows given for {n} samples")
    if int(seed) < 0 or any(int(r) < 0 for r in rows):
        raise QnpuError(f"the seed and rows must be >= 0, got seed {seed} and rows {rows}")
    rngs = [np.random.default_rng((int(seed), int(r))) for r in rows]
    codes, cache = engine.prefill(np.asarray([list(prompt)]))
    logits = np.repeat(engine.logits_to_float(codes[:, -1]), n, axis=0)  # [n, V]
    cache = engine.take_rows(cache, [0] * n)
    tokens: list[list[int]] = [[] for _ in range(n)]
    logprob = np.zeros(n)
    done = np.zeros(n, bool)
    for step in range(max_new_tokens):
        lp = log_softmax(logits)
        feed = np.zeros((n, 1), np.int32)
        for i in range(n):
            if done[i]:
                continue
            t = sampler.draw(logits[i], rngs[i])
            tokens[i].append(t)
            logprob[i] += lp[i, t]
            feed[i, 0] = t
            done[i] = t == eos_token_id
        if done.all() or step == max_new_tokens - 1:
            break
        codes, cache = engine._extend(feed, cache)
        logits = engine.logits_to_float(codes[:, -1])
    return [Sample(tuple(t), float(p)) for t, p in zip(tokens, logprob, strict=True)]


def beam_search(
    engine: Any,
    prompt: Sequence[int],
    width: int,
    max_new_tokens: int,
    eos_token_id: int | None = None,
) -> list[Sample]:
    """Step-level beam search: at each step every live beam's continuations are ranked by
    summed log-probability and the best `width` kept (ties → earlier beam, lower token id);
    the cache rows follow their beams. Finished beams (EOS) keep their place. Best first."""
    _check(engine, prompt, width, max_new_tokens)
    codes, cache = engine.prefill(np.asarray([list(prompt)]))
    lp = log_softmax(engine.logits_to_float(codes[:, -1]))  # [1, V]
    beams: list[tuple[tuple[int, ...], float, bool]] = [((), 0.0, False)]
    for step in range(max_new_tokens):
        cands: list[tuple[float, int, int]] = []  # (−score, beam, token): sorts best first
        for b, (_, score, finished) in enumerate(beams):
            if finished:
                cands.append((-score, b, -1))
                continue
            top = np.argsort(-lp[b], kind="stable")[:width]
            cands += [(-(score + lp[b, t]), b, int(t)) for t in top]
        cands.sort()
        new = []
        for neg, b, t in cands[:width]:
            toks, _, finished = beams[b]
            new.append((toks if finished else (*toks, t), -neg, finished or t == eos_token_id))
        parents = [b for _, b, _ in cands[:width]]
        beams = new
        if all(f for _, _, f in beams) or step == max_new_tokens - 1:
            break
        cache = engine.take_rows(cache, parents)
        feed = np.asarray([[t[-1]] for t, _, _ in beams], np.int32)
        codes, cache = engine._extend(feed, cache)
        lp = log_softmax(engine.logits_to_float(codes[:, -1]))
    return [Sample(t, s) for t, s, _ in beams]


def select_best(
    samples: Sequence[Sample],
    per_token: bool = False,
    score: Callable[[Sample], float] | None = None,
) -> Sample:
    """Best-of-N, ties → first: by `score` (a reward model, say) when given, else by the
    model's own likelihood, summed or per token."""
    if not samples:
        raise QnpuError("no samples to select from")

    def own(s: Sample) -> float:
        return s.logprob / max(len(s.tokens), 1) if per_token else s.logprob

    return max(samples, key=score or own)


def select_vote(samples: Sequence[Sample], answer: Callable[[Sample], str]) -> str:
    """Majority vote over the samples' answers (`answer` extracts one, "" = none); ties go to
    the answer whose best sample has the highest likelihood."""
    answers = [answer(s) for s in samples]
    counts = Counter(a for a in answers if a)
    if not counts:
        return ""
    best: dict[str, float] = {}
    for a, s in zip(answers, samples, strict=True):
        if a:
            best[a] = max(best.get(a, -math.inf), s.logprob)
    return max(counts, key=lambda a: (counts[a], best[a]))
