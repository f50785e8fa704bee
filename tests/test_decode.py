"""Parallel sampling, Best-of-N, voting and beam search on the integer engines."""

from __future__ import annotations

import numpy as np
import pytest

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import load_int_model
from qnpu_jax.runtime.decode import (
    Sample,
    Sampler,
    beam_search,
    log_softmax,
    sample_parallel,
    select_best,
    select_vote,
)
from qnpu_jax.runtime.emulator import EmulatorEngine
from qnpu_jax.runtime.jax_engine import JaxIntEngine

PROMPT_TEXT = "The history of the town goes back to the twelfth century, when"


@pytest.fixture(scope="module")
def engines(int_artifacts):
    model = load_int_model(int_artifacts["w8a8"])
    return EmulatorEngine(model), JaxIntEngine(model)


@pytest.fixture(scope="module")
def prompt(smollm):
    return smollm.tokenizer.encode(PROMPT_TEXT)


def test_sampler_validates_and_draws_from_the_softmax():
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"temperature": True}):
        with pytest.raises(QnpuError):
            Sampler(**bad)
    with pytest.raises(QnpuError, match="finite"):
        Sampler(temperature=float("nan"))
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = [Sampler().draw(logits, rng) for _ in range(20000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    # top_p 0.7: the nucleus is {0, 1} (0.5 + 0.3 >= 0.7), renormalized
    draws = [Sampler(top_p=0.7).draw(logits, rng) for _ in range(20000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.625) < 0.015
    assert Sampler(temperature=0).draw(np.array([1.0, 3.0, 3.0]), rng) == 1  # ties → lowest id
    assert {Sampler(temperature=0.01).draw(logits, rng) for _ in range(50)} == {0}


def test_parallel_samples_equal_single_decodes_on_both_engines(engines, prompt):
    emulator, jax_engine = engines
    sampler = Sampler(temperature=1.0, top_p=0.95)
    together = sample_parallel(emulator, prompt, 4, 6, sampler, seed=7)
    alone = [
        sample_parallel(emulator, prompt, 1, 6, sampler, seed=7, rows=[i])[0] for i in range(4)
    ]
    assert together == alone
    assert len({s.tokens for s in together}) > 1  # the rows really draw different streams
    assert sample_parallel(jax_engine, prompt, 4, 6, sampler, seed=7) == together
    assert sample_parallel(emulator, prompt, 4, 6, sampler, seed=8) != together


def test_sample_likelihoods_are_the_models(engines, prompt):
    """Each sample's log-probability equals the NLL of prompt + sample from a fresh prefill."""
    emulator = engines[0]
    for s in sample_parallel(emulator, prompt, 3, 5, Sampler(), seed=1):
        nll = emulator.token_nll(np.asarray([prompt + list(s.tokens)]))[0]
        assert s.logprob == pytest.approx(-nll[len(prompt) - 1 :].sum(), abs=1e-9)


def test_greedy_rows_and_width_one_beams_are_greedy_decoding(engines, prompt):
    emulator = engines[0]
    greedy = tuple(emulator.generate(prompt, 6))
    rows = sample_parallel(emulator, prompt, 3, 6, Sampler(temperature=0), seed=0)
    assert all(s.tokens == greedy for s in rows)
    assert beam_search(emulator, prompt, 1, 6)[0].tokens == greedy


def test_beam_search_follows_its_beams_through_the_cache(engines, prompt):
    """Every beam's score is its own likelihood recomputed from scratch (so the cache rows
    were reordered with their beams), beams come best first, and both engines agree."""
    emulator, jax_engine = engines
    beams = beam_search(emulator, prompt, 4, 5)
    assert len(beams) == 4 and len({b.tokens for b in beams}) == 4
    assert [b.logprob for b in beams] == sorted((b.logprob for b in beams), reverse=True)
    for b in beams:
        nll = emulator.token_nll(np.asarray([prompt + list(b.tokens)]))[0]
        assert b.logprob == pytest.approx(-nll[len(prompt) - 1 :].sum(), abs=1e-9)
    assert beams[0].logprob >= sample_parallel(emulator, prompt, 1, 5, Sampler(0), 0)[0].logprob
    assert beam_search(jax_engine, prompt, 4, 5) == beams


def test_selection_rules():
    a, b, c = Sample((1, 2), -1.0), Sample((3,), -0.9), Sample((1, 2, 5), -1.2)
    assert select_best([a, b, c]) == b
    assert select_best([a, Sample((9,), -0.6)], per_token=True) == a  # −0.5 per token
    assert select_best([a, b, c], score=lambda s: len(s.tokens)) == c  # an outside scorer
    word = {(1, 2): "paris", (3,): "lyon", (1, 2, 5): "paris"}
    assert select_vote([a, b, c], lambda s: word[s.tokens]) == "paris"
    assert select_vote([a, b], lambda s: word[s.tokens]) == "lyon"  # tie → likelier answer
    assert select_vote([a], lambda s: "") == ""
    with pytest.raises(QnpuError, match="no samples"):
        select_best([])


def test_refusals(engines, prompt):
    emulator = engines[0]
    _, cache = emulator.prefill(np.asarray([prompt]))
    with pytest.raises(QnpuError, match="rows must name rows of a batch-1 cache"):
        emulator.take_rows(cache, [1])
    two = engines[1].take_rows(cache, [0, 0])  # any engine's cache is accepted
    assert np.array_equal(np.asarray(two.k), np.repeat(cache.k, 2, axis=1))
    assert two.length == cache.length
    with pytest.raises(QnpuError, match="samples must be an integer >= 1"):
        sample_parallel(emulator, prompt, 0, 3, Sampler(), 0)
    with pytest.raises(QnpuError, match="seed and rows must be >= 0"):
        sample_parallel(emulator, prompt, 2, 3, Sampler(), -1)
    with pytest.raises(QnpuError, match="prompt is empty"):
        beam_search(emulator, [], 2, 3)
    with pytest.raises(QnpuError, match="maximum context"):
        sample_parallel(emulator, prompt, 2, 1000, Sampler(), 0)
    assert np.allclose(np.exp(log_softmax(np.array([[1.0, 2.0]]))).sum(), 1)
