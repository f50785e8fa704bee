"""Zero-shot evaluation: harness formatting of the real task files, scoring, metrics, batching."""

from __future__ import annotations

import json
import math
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from qnpu_jax import QnpuError
from qnpu_jax.eval import LmScorer, evaluate_docs, evaluate_tasks, float_scorer, load_task
from qnpu_jax.eval.zeroshot import (
    Doc,
    encode_requests,
    hellaswag_query,
    hf_task_docs,
    length_buckets,
    mean_stderr,
    multiple_choice_metrics,
    score_token_requests,
    select_indices,
    task_source,
)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

# A unigram "model": the NLL of a token depends only on that token's character.
COSTS = {" ": 0.5, "a": 1.0, "b": 2.0, "c": 3.0, "x": 0.1}


class CharTokenizer:
    """One token per character (id = code point), so context/continuation seams are exact."""

    def encode_batch(self, texts):
        return [[ord(ch) for ch in text] for text in texts]


def _unigram_nll(tokens):
    table = np.ones(256)
    for ch, cost in COSTS.items():
        table[ord(ch)] = cost
    return table[np.asarray(tokens)[:, 1:]]


def _repeat_argmax(tokens):
    # "predicts" that the previous token repeats: greedy iff the continuation repeats it
    return _unigram_nll(tokens), np.asarray(tokens)[:, :-1]


FAKE = LmScorer(nll_fn=_unigram_nll, nll_argmax_fn=_repeat_argmax, max_length=64)


def test_multiple_choice_metrics_by_hand():
    docs = [
        # " aaa": -(0.5 + 3) = -3.5, " b": -2.5 -> acc picks 1 (wrong); per char -1.17 vs -2.5
        # -> acc_norm picks 0 (right)
        Doc(requests=(("x", " aaa"), ("x", " b")), gold=0, choice_lengths=(3, 1)),
        # the context's trailing space moves into the continuation and is scored: " a" -1.5,
        # " c" -3.5 -> both pick 0 (right)
        Doc(requests=(("x ", "a"), ("x ", "c")), gold=0, choice_lengths=(1, 1)),
        # a tie goes to the first choice (np.argmax) -> both wrong
        Doc(requests=(("x", " b"), ("x", " b")), gold=1, choice_lengths=(1, 1)),
    ]
    got = evaluate_docs(FAKE, CharTokenizer(), docs, progress=False)
    assert got["acc"] == pytest.approx(1 / 3)
    assert got["acc_norm"] == pytest.approx(2 / 3)
    # sample std / sqrt(n) = sqrt(p(1-p)/(n-1)) = sqrt((2/9)/2) = 1/3 for both
    assert got["acc_stderr"] == pytest.approx(1 / 3)
    assert got["acc_norm_stderr"] == pytest.approx(1 / 3)
    scores = score_token_requests(
        FAKE, encode_requests(CharTokenizer(), [("x ", "a")]), progress=False
    )
    assert scores[0].logprob == pytest.approx(-1.5) and scores[0].n_tokens == 2


def test_lambada_metrics_by_hand():
    docs = [
        Doc(requests=(("ab", "bb"),), gold=0, choice_lengths=(2,)),  # ll -4, greedy
        Doc(requests=(("ab", "ba"),), gold=0, choice_lengths=(2,)),  # ll -3, 'a' not greedy
    ]
    got = evaluate_docs(FAKE, CharTokenizer(), docs, kind="lambada", progress=False)
    assert got["acc"] == 0.5
    assert got["acc_stderr"] == pytest.approx(0.5)
    assert got["perplexity"] == pytest.approx(math.exp(3.5))  # exp(-mean per-item ll)
    assert got["token_perplexity"] == pytest.approx(math.exp(7 / 4))
    assert got["perplexity_stderr"] is not None and got["perplexity_stderr"] > 0
    no_greedy = LmScorer(nll_fn=_unigram_nll, max_length=64)
    with pytest.raises(QnpuError, match="nll_argmax_fn"):
        evaluate_docs(no_greedy, CharTokenizer(), docs, kind="lambada", progress=False)


def test_mean_stderr_matches_harness():
    assert mean_stderr([1, 0, 1, 1]) == pytest.approx(0.25)  # sqrt(.75 * .25 / 3)
    assert mean_stderr([1.0]) is None


def _write_fake_data(root: Path) -> None:
    (root / "piqa").mkdir(parents=True)
    rows = [{"goal": "g", "sol1": "a", "sol2": "bb"}, {"goal": "g", "sol1": "c", "sol2": "aaaa"}]
    (root / "piqa" / "valid.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "piqa" / "valid-labels.lst").write_text("1\n1\n")
    (root / "lambada").mkdir()
    (root / "lambada" / "lambada_test.jsonl").write_text('{"text": "x b"}\n{"text": "x a c"}\n')


def test_evaluate_tasks_on_small_files(tmp_path):
    _write_fake_data(tmp_path)
    got = evaluate_tasks(
        FAKE, CharTokenizer(), ["piqa", "lambada"], data_dir=tmp_path, progress=False
    )
    json.dumps(got)  # JSON-ready
    piqa = got["piqa"]
    assert (piqa["n"], piqa["n_total"], piqa["indices"]) == (2, 2, [0, 1])
    # item 0: " a" -1.5 vs " bb" -4.5 (per char -1.5 vs -2.25): both pick 0, gold 1.
    # item 1: " c" -3.5 vs " aaaa" -4.5 (per char -3.5 vs -1.125): acc picks 0, acc_norm 1.
    assert piqa["metrics"]["acc"] == 0.0
    assert piqa["metrics"]["acc_norm"] == 0.5
    # lambada: contexts "x" and "x a", targets " b" (-2.5) and " c" (-3.5); never greedy
    lam = got["lambada"]["metrics"]
    assert lam["acc"] == 0.0 and lam["perplexity"] == pytest.approx(math.exp(3.0))


def test_missing_file_is_a_qnpu_error(tmp_path):
    with pytest.raises(QnpuError, match=re.escape(str(tmp_path / "piqa" / "valid.jsonl"))):
        evaluate_tasks(FAKE, CharTokenizer(), ["piqa"], data_dir=tmp_path, progress=False)
    with pytest.raises(QnpuError, match="unknown zero-shot task"):
        evaluate_tasks(FAKE, CharTokenizer(), ["mmlu"], data_dir=tmp_path, progress=False)


def test_limit_subset_is_deterministic():
    a = select_indices(100, 10, seed=3)
    assert a == select_indices(100, 10, seed=3)
    assert a == sorted(set(a)) and len(a) == 10 and all(0 <= i < 100 for i in a)
    assert a != select_indices(100, 10, seed=4)
    assert select_indices(5, None) == select_indices(5, 9) == [0, 1, 2, 3, 4]


# The first item of each real file, formatted by the harness definitions (zero-shot, target
# delimiter " "): piqa.yaml "Question: {{goal}}\nAnswer:"; hellaswag utils.process_docs
# (ctx_b "he" capitalized); arc_easy.yaml "Question: {{question}}\nAnswer:"; winogrande
# partial_context / " " + partial_target; lambada_openai.yaml split at the last space.
FIRST_ITEMS = {
    "piqa": (
        1838,
        "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
        " Provide the guinea pig with a cage full of a few inches of bedding made of ripped "
        "paper strips, you will also need to supply it with a water bottle and a food dish.",
        0,
    ),
    "hellaswag": (
        10042,
        "Roof shingle removal: A man is sitting on a roof. He",
        " starts pulling up roofing on a roof.",
        3,
    ),
    "arc_easy": (
        2376,
        "Question: Which statement best explains why photosynthesis is the foundation of most "
        "food webs?\nAnswer:",
        " Sunlight is the source of energy for nearly all ecosystems.",
        0,
    ),
    "arc_challenge": (
        1172,
        "Question: An astronomer observes that a planet rotates faster after a meteorite impact. "
        "Which is the most likely effect of this increase in rotation?\nAnswer:",
        " Planetary days will become shorter.",
        2,
    ),
    "winogrande": (
        1267,
        "Sarah was a much better surgeon than Maria so Maria",
        " always got the easier cases.",
        1,
    ),
    "lambada": (
        5153,
        "In my palm is a clear stone, and inside it is a small ivory statuette. A guardian "
        "angel.\n\n\"Figured if you're going to be out at night getting hit by cars, you might "
        'as well have some backup."\n\nI look at him, feeling stunned. Like this is some sort '
        "of sign. But as I stare at Harlin, his mouth curved in a confident grin, I don't care "
        "about",
        " signs",
        0,
    ),
}


@pytest.mark.parametrize("task", sorted(FIRST_ITEMS))
def test_real_task_files(task):
    count, context, gold_continuation, gold = FIRST_ITEMS[task]
    docs = load_task(task, SHARED_DATA)
    assert len(docs) == count
    assert docs[0].gold == gold
    assert docs[0].requests[gold] == (context, gold_continuation)
    # harness completion_len: characters of the choice without the delimiter (winogrande's
    # choices are its contexts; it reports no acc_norm)
    choice = context if task == "winogrande" else gold_continuation[1:]
    assert docs[0].choice_lengths[gold] == len(choice)


def test_hellaswag_query_rebuilds_the_harness_context():
    # ActivityNet: ctx_b (after ctx_a's last ". ") is capitalized as harness's ctx_b.capitalize()
    line = "Clean and jerk: A lady walks to a barbell. She bends down and grabs the pole. the lady"
    assert hellaswag_query(line) == (
        "Clean and jerk: A lady walks to a barbell. She bends down and grabs the pole. The lady"
    )
    # WikiHow: ctx_b is empty (the context ends in "."), the line is kept as is
    wikihow = "Health: How to manage grass allergies. Use over-the-counter allergy medication."
    assert hellaswag_query(wikihow) == wikihow
    # bracketed spans the llama.cpp layout left in are dropped, as harness preprocess does
    assert (
        hellaswag_query("Family Life: Visit [www.x.org] to play.") == "Family Life: Visit to play."
    )


def test_buckets():
    assert length_buckets(128) == (32, 64, 128)
    assert length_buckets(100) == (32, 64, 100)
    assert length_buckets(16) == (16,)


def test_padded_batches_match_unpadded_scoring(tiny_cfg, tiny_params):
    scorer = float_scorer(tiny_params, tiny_cfg)
    assert scorer.max_length == 128
    rng = np.random.default_rng(0)
    # context/continuation lengths hitting every bucket, one longer than max_length
    lengths = [(3, 1), (20, 4), (40, 2), (70, 5), (150, 3), (9, 2), (30, 1)]
    requests = [
        (rng.integers(0, tiny_cfg.vocab_size, c).tolist(), rng.integers(0, 96, k).tolist())
        for c, k in lengths
    ]
    shapes = []

    def nll_argmax(tokens):
        shapes.append(tokens.shape)
        return scorer.nll_argmax_fn(tokens)

    spy = LmScorer(nll_fn=scorer.nll_fn, nll_argmax_fn=nll_argmax, max_length=128)
    batched = score_token_requests(spy, requests, greedy=True, batch_size=3, progress=False)
    assert sorted(set(shapes)) == [(3, 32), (3, 64), (3, 128)]
    for (ctx, cont), got in zip(requests, batched, strict=True):
        seq = np.asarray([ctx + cont], dtype=np.int32)[:, -128:]  # left truncation
        nll, argmax = scorer.nll_argmax_fn(seq)
        k = len(cont)
        want = -float(np.asarray(nll, np.float64)[0, -k:].sum())
        assert got.logprob == pytest.approx(want, rel=1e-5, abs=1e-4)
        assert got.greedy == bool((np.asarray(argmax)[0, -k:] == seq[0, -k:]).all())
    # the NLL-only path (no argmax) gives the same log-likelihoods
    plain = score_token_requests(scorer, requests, batch_size=3, progress=False)
    for a, b in zip(plain, batched, strict=True):
        assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("quantized", [False, True])
def test_scoring_the_continuations_alone_equals_scoring_every_position(
    tiny_cfg, tiny_params, quantized
):
    """`qnpu eval`'s scorers run lm_head on each row's continuation positions only
    (`span_nll_argmax_fn`); the log-likelihoods and greedy matches equal those of the full
    forward, float and fake-quant (W4A8, a sink prefix), in buckets with spans of 2 to 8."""
    import jax

    from qnpu_jax.eval.zeroshot import span_width
    from qnpu_jax.models.load import LoadedModel
    from qnpu_jax.pipeline import Calibration, QuantizedModel, chain, steps
    from qnpu_jax.scoring import scored_quantized

    float_model = LoadedModel(tiny_cfg, tiny_params, None, "tiny")
    if quantized:
        windows = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, 96))
        data = Calibration(np.arange(200) % 96, windows)
        start = QuantizedModel.from_float(float_model, prefix=(1,))
        model = chain(steps.plan(w_bits=4, a_bits=8), steps.calibrate())(start, data)
        scored = scored_quantized(model, None, label="tiny", report={})
    else:
        from qnpu_jax.scoring import _scored

        scored = _scored(tiny_params, None, None, (), tiny_cfg, None, label="tiny", report={})
    assert scored.span_nll_argmax_fn is not None
    full = LmScorer(scored.nll_fn, scored.nll_argmax_fn, scored.max_length)
    span = LmScorer(scored.nll_fn, None, scored.max_length, scored.span_nll_argmax_fn)
    rng = np.random.default_rng(0)
    lengths = [(3, 1), (20, 4), (12, 8), (40, 2), (9, 2), (30, 1)]  # two buckets
    requests = [
        (rng.integers(0, 96, c).tolist(), rng.integers(0, 96, k).tolist()) for c, k in lengths
    ]
    # greedy matches are rare at random: make two continuations the full model's argmax
    for i in (0, 3):
        ctx = requests[i][0]
        _, argmax = full.nll_argmax_fn(np.asarray([[*ctx, 0]], np.int32))
        requests[i] = (ctx, [int(np.asarray(argmax)[0, -1])])
    want = score_token_requests(full, requests, greedy=True, batch_size=3, progress=False)
    got = score_token_requests(span, requests, greedy=True, batch_size=3, progress=False)
    assert [g.greedy for g in got] == [w.greedy for w in want] and want[0].greedy
    for g, w in zip(got, want, strict=True):
        assert g.logprob == pytest.approx(w.logprob, rel=1e-5, abs=1e-5)
    assert [span_width(n, 32) for n in (1, 2, 3, 4, 5, 31, 40)] == [1, 2, 4, 4, 8, 31, 31]


def test_smollm_piqa(smollm):
    # Items picked for short lengths (two buckets); 7 and 14 are easy for SmolLM2-135M: the
    # gold solution wins by > 10 nats and by > 0.1 nat per character.
    picked = [7, 14, 3, 4, 5, 9, 13, 16]
    docs = [load_task("piqa", SHARED_DATA)[i] for i in picked]
    scorer = float_scorer(smollm.params, smollm.config)
    encoded = encode_requests(smollm.tokenizer, [r for d in docs for r in d.requests])
    scores = score_token_requests(scorer, encoded, batch_size=8, progress=False)
    for j in (0, 1):  # items 7 and 14, gold 0
        lls = [scores[2 * j].logprob, scores[2 * j + 1].logprob]
        norm = [ll / n for ll, n in zip(lls, docs[j].choice_lengths, strict=True)]
        assert docs[j].gold == 0
        assert lls[0] - lls[1] > 10 and norm[0] - norm[1] > 0.1
    metrics = multiple_choice_metrics(
        docs, [[scores[2 * j].logprob, scores[2 * j + 1].logprob] for j in range(len(docs))]
    )
    assert 0.25 <= metrics["acc"] <= 1 and 0.25 <= metrics["acc_norm"] <= 1


def test_task_data_comes_from_the_flag_or_env_or_a_clear_error(tmp_path, monkeypatch):
    _write_fake_data(tmp_path)
    monkeypatch.delenv("QNPU_DATA_DIR", raising=False)
    with pytest.raises(QnpuError, match="zero-shot task piqa needs its data") as e:
        load_task("piqa")
    for way in ("--task-data DIR", "QNPU_DATA_DIR=DIR", "--task-data hf", "datasets"):
        assert way in str(e.value)
    assert len(load_task("piqa", tmp_path)) == 2  # the flag's directory
    monkeypatch.setenv("QNPU_DATA_DIR", str(tmp_path))
    assert len(load_task("lambada")) == 2  # the environment's
    assert task_source(["piqa", "lambada"]) == tmp_path
    with pytest.raises(QnpuError, match=re.escape(str(tmp_path / "arc" / "arc_easy.jsonl"))):
        task_source(["arc_easy"])  # checked before any model loads: the missing file by name
    with pytest.raises(QnpuError, match=r"--task-data .*nowhere: no such directory"):
        load_task("piqa", tmp_path / "nowhere")
    monkeypatch.setenv("QNPU_DATA_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(QnpuError, match=r"QNPU_DATA_DIR=.*nowhere: no such directory"):
        load_task("piqa")


def _piqa_hf_rows():
    rows = [json.loads(line) for line in (SHARED_DATA / "piqa" / "valid.jsonl").open()]
    labels = (SHARED_DATA / "piqa" / "valid-labels.lst").read_text().split()
    return [{**r, "label": int(label)} for r, label in zip(rows, labels, strict=True)]


def _arc_hf_rows(name):
    out = []
    for line in (SHARED_DATA / "arc" / f"{name}.jsonl").open():
        row = json.loads(line)
        question = row["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
        keys = list("ABCDE")[: len(row["choices"])]
        choices = {"text": row["choices"], "label": keys}
        out.append({"question": question, "choices": choices, "answerKey": keys[row["gold"]]})
    return out


def test_hf_rows_give_the_docs_of_the_local_files():
    """The `datasets` layout the harness reads (HF_TASKS), formatted by its yaml and
    utils.py, gives the very Docs of the local files: whole tasks where the local layout
    holds every field, the first item of the others."""
    lambada = [json.loads(line) for line in (SHARED_DATA / "lambada" / "lambada_test.jsonl").open()]
    whole = {
        "piqa": _piqa_hf_rows(),
        "arc_easy": _arc_hf_rows("arc_easy"),
        "arc_challenge": _arc_hf_rows("arc_challenge"),
        "lambada": lambada,
    }
    for name, rows in whole.items():
        assert hf_task_docs(name, rows) == load_task(name, SHARED_DATA), name
    local = load_task("hellaswag", SHARED_DATA)[0]
    row = {
        "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.",
        "ctx_b": "he",
        "endings": [continuation.strip() for _, continuation in local.requests],
        "label": "3",
    }
    assert hf_task_docs("hellaswag", [row]) == [local]
    row = {
        "sentence": "Sarah was a much better surgeon than Maria so _ always got the easier cases.",
        "option1": "Sarah",
        "option2": "Maria",
        "answer": "2",
    }
    assert hf_task_docs("winogrande", [row]) == load_task("winogrande", SHARED_DATA)[:1]
    with pytest.raises(QnpuError, match="record 0: not the harness's piqa layout"):
        hf_task_docs("piqa", [{"goal": "g"}])


def test_task_data_hf_reads_the_harness_datasets_through_datasets(monkeypatch):
    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        if path == "EleutherAI/lambada_openai":
            raise ConnectionError("offline and not in the cache")
        return _piqa_hf_rows()[:3]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert task_source(["piqa"], "hf") == "hf"
    assert load_task("piqa", "hf") == load_task("piqa", SHARED_DATA)[:3]
    assert calls == [("baber/piqa", None, "validation")]
    with pytest.raises(QnpuError, match=r"lambada_openai.*ConnectionError.*cache"):
        load_task("lambada", "hf")
    monkeypatch.setenv("QNPU_DATA_DIR", "hf")  # the environment may name it too
    assert len(load_task("piqa")) == 3
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(QnpuError, match=re.escape("pip install 'qnpu_jax[data]'")):
        task_source(["piqa"], "hf")
    with pytest.raises(QnpuError, match=re.escape("pip install 'qnpu_jax[data]'")):
        load_task("piqa")
