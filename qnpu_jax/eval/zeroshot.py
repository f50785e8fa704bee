"""Zero-shot multiple-choice and LAMBADA evaluation, formatted and scored as lm-evaluation-harness.

Every task becomes a list of `Doc`s: one (context, continuation) log-likelihood request per
choice, the gold index and the harness's `completion_len` per choice. A request is scored as the
sum of the log-probs of its continuation tokens given the context (harness `_encode_pair`:
encode context + continuation whole, split off the context's tokens). Requests are right-padded
to a few fixed lengths (powers of two, capped at the model context) in fixed-size batches, so a
jitted model compiles a handful of times; causal attention keeps padding out of the scores.

Sources followed (EleutherAI/lm-evaluation-harness): `lm_eval/tasks/{piqa/piqa.yaml,
hellaswag/hellaswag.yaml, hellaswag/utils.py, arc/arc_easy.yaml, winogrande/default.yaml,
winogrande/preprocess_winogrande.py, lambada/lambada_openai.yaml}`, `lm_eval/api/task.py`
(`construct_requests`, `process_results`), `lm_eval/api/metrics.py` (`mean_stderr`,
`perplexity`, `bootstrap_stderr`), `lm_eval/models/huggingface.py` (`_encode_pair`,
`_loglikelihood_tokens`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from qnpu_jax.data.locations import DATA_DIR_ENV, HF, INSTALL_DATASETS, data_location
from qnpu_jax.errors import QnpuError
from qnpu_jax.eval.perplexity import NllFn
from qnpu_jax.files import iter_jsonl, read_text
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import Params, forward, next_token_nll, token_nll

TASKS: tuple[str, ...] = ("piqa", "hellaswag", "arc_easy", "arc_challenge", "winogrande", "lambada")

# tokens [B, T] int32 -> (NLL of tokens[:, 1:] [B, T-1], argmax next-token ids [B, T-1])
NllArgmaxFn = Callable[[np.ndarray], tuple[jax.Array, jax.Array]]
# tokens [B, T], positions [B, K] int32 -> (NLL of tokens[b, p + 1], argmax at p) [B, K] each
SpanNllArgmaxFn = Callable[[np.ndarray, np.ndarray], tuple[jax.Array, jax.Array]]

_MIN_BUCKET = 32
_PPL_BOOTSTRAP_ITERS = 1000


# the files of each task under a task data directory (`qnpu_jax.data.locations`)
TASK_FILES: dict[str, tuple[str, ...]] = {
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt",),
    "arc_easy": ("arc/arc_easy.jsonl",),
    "arc_challenge": ("arc/arc_challenge.jsonl",),
    "winogrande": ("winogrande/winogrande.jsonl",),
    "lambada": ("lambada/lambada_test.jsonl",),
}
# what lm-evaluation-harness loads for each task: (dataset path, config, split)
HF_TASKS: dict[str, tuple[str, str | None, str]] = {
    "piqa": ("baber/piqa", None, "validation"),
    "hellaswag": ("Rowan/hellaswag", None, "validation"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
    "winogrande": ("allenai/winogrande", "winogrande_xl", "validation"),
    "lambada": ("EleutherAI/lambada_openai", "default", "test"),
}
HOW_TO_PROVIDE = (
    f"name a directory holding them with --task-data DIR (or {DATA_DIR_ENV}=DIR), or read "
    f"the Hugging Face `datasets` cache with --task-data hf (or {DATA_DIR_ENV}=hf; "
    f"{INSTALL_DATASETS}, and HF_DATASETS_OFFLINE=1 without a network)"
)


class TextEncoder(Protocol):
    """What the scorer needs of a tokenizer (`qnpu_jax.models.Tokenizer` is one): no BOS."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...


@dataclasses.dataclass(frozen=True)
class LmScorer:
    """A model path as the evaluator sees it: float, fake-quant and integer engines all fit.

    `nll_fn` scores every request; `nll_argmax_fn` (one forward giving NLL and argmax) is only
    needed for LAMBADA's greedy accuracy. `span_nll_argmax_fn`, where the model has one, gives
    both at the continuation's positions alone and is used instead of the two (the head runs
    on those positions only). `max_length` is the longest sequence the model takes.
    """

    nll_fn: NllFn
    nll_argmax_fn: NllArgmaxFn | None = None
    max_length: int = 2048
    span_nll_argmax_fn: SpanNllArgmaxFn | None = None

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise QnpuError(f"max_length must be at least 2, got {self.max_length}")


@partial(jax.jit, static_argnames="cfg")
def _float_nll_argmax(
    params: Params, tokens: jax.Array, *, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    logits = forward(params, tokens, cfg=cfg)
    # argmax ties go to the lowest id, as everywhere in this project
    return next_token_nll(logits, tokens), jnp.argmax(logits[:, :-1], axis=-1).astype(jnp.int32)


def float_scorer(params: Params, cfg: ModelConfig) -> LmScorer:
    """The float model (`qnpu_jax.models.forward`) as an `LmScorer`."""
    return LmScorer(
        nll_fn=partial(token_nll, params, cfg=cfg),
        nll_argmax_fn=partial(_float_nll_argmax, params, cfg=cfg),
        max_length=cfg.max_position_embeddings,
    )


@dataclasses.dataclass(frozen=True)
class Doc:
    """One evaluation item: a log-likelihood request per choice.

    `choice_lengths` is the harness's `completion_len`: `len(choice)` in characters of the
    choice string without the target delimiter (task.py `process_results`), used by acc_norm.
    """

    requests: tuple[tuple[str, str], ...]  # (context, continuation) per choice
    gold: int
    choice_lengths: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class RequestScore:
    logprob: float  # sum of log-probs of the continuation tokens
    greedy: bool  # every continuation token is the argmax (only when asked for)
    n_tokens: int  # continuation tokens scored


# ----------------------------------------------------------------------------- task files


def _require(path: Path) -> Path:
    if not path.is_file():
        raise QnpuError(
            f"task data file not found: {path} (a task data directory holds "
            f"{', '.join(f for files in TASK_FILES.values() for f in files)})"
        )
    return path


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in iter_jsonl(_require(path))]


def _field(row: dict[str, Any], key: str, path: Path, i: int) -> Any:
    if key not in row:
        raise QnpuError(f"{path}: record {i} has no field {key!r}")
    return row[key]


def _gold(value: Any, n_choices: int, where: str) -> int:
    try:
        gold = int(value)
    except (TypeError, ValueError) as e:
        raise QnpuError(f"{where}: gold label {value!r} is not an integer") from e
    if not 0 <= gold < n_choices:
        raise QnpuError(f"{where}: gold label {gold} out of range for {n_choices} choices")
    return gold


def _choices_doc(context: str, choices: Sequence[str], gold: int) -> Doc:
    # task.py construct_requests: (ctx, target_delimiter + choice), target_delimiter " "
    return Doc(
        requests=tuple((context, " " + c) for c in choices),
        gold=gold,
        choice_lengths=tuple(len(c) for c in choices),
    )


def _load_piqa(data_dir: Path) -> list[Doc]:
    # piqa.yaml: doc_to_text "Question: {{goal}}\nAnswer:", doc_to_choice [sol1, sol2]
    path = data_dir / "piqa" / "valid.jsonl"
    rows = _read_jsonl(path)
    labels_path = _require(data_dir / "piqa" / "valid-labels.lst")
    labels = read_text(labels_path, what="task data file").split()
    if len(labels) != len(rows):
        raise QnpuError(f"{labels_path}: {len(labels)} labels for {len(rows)} questions")
    docs = []
    for i, (row, label) in enumerate(zip(rows, labels, strict=True)):
        goal = _field(row, "goal", path, i)
        choices = [_field(row, "sol1", path, i), _field(row, "sol2", path, i)]
        gold = _gold(label, 2, f"{labels_path}:{i + 1}")
        docs.append(_choices_doc(f"Question: {goal}\nAnswer:", choices, gold))
    return docs


_HELLASWAG_TAGS = re.compile(r"\[.*?\]")


def _hellaswag_tags(text: str) -> str:
    # harness utils.preprocess drops every [bracketed] span, then collapses double spaces once;
    # the llama.cpp layout already removed [header]/[step]/[substeps]/[title] and collapsed
    # spaces, so only what it left (e.g. "[www.kiddio.org]") still needs that pass.
    if "[" not in text:
        return text
    return _HELLASWAG_TAGS.sub("", text).replace("  ", " ")


def hellaswag_query(line: str) -> str:
    """The harness query from the llama.cpp first line `activity_label: ctx`.

    The harness builds `activity_label + ": " + ctx_a + " " + ctx_b.capitalize()`; the file
    holds `ctx = ctx_a + " " + ctx_b` uncapitalized. ActivityNet contexts end in the incomplete
    noun phrase ctx_b after ctx_a's last sentence (". "); WikiHow contexts have ctx_b = "" and
    end in ".". So: a context not ending in "." gets the text after its last ". " capitalized.
    """
    if ": " not in line:
        raise QnpuError(f"hellaswag context line has no 'activity_label: ' prefix: {line!r}")
    label, ctx = line.split(": ", 1)
    if not ctx.endswith("."):
        cut = ctx.rfind(". ")
        head, tail = (ctx[: cut + 2], ctx[cut + 2 :]) if cut >= 0 else ("", ctx)
        ctx = head + tail.capitalize()
    return _hellaswag_tags(f"{label}: {ctx}")


def _load_hellaswag(data_dir: Path) -> list[Doc]:
    # hellaswag.yaml: doc_to_text "{{query}}", doc_to_choice "choices" (preprocessed endings)
    path = _require(data_dir / "hellaswag" / "hellaswag_val_full.txt")
    lines = read_text(path, what="task data file").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise QnpuError(f"{path}: {len(lines)} lines is not a multiple of 6 (llama.cpp layout)")
    docs = []
    for i in range(0, len(lines), 6):
        endings = [_hellaswag_tags(e) for e in lines[i + 2 : i + 6]]
        gold = _gold(lines[i + 1], 4, f"{path}:{i + 2}")
        docs.append(_choices_doc(hellaswag_query(lines[i]), endings, gold))
    return docs


def _load_arc(data_dir: Path, name: str) -> list[Doc]:
    # arc_easy.yaml (arc_challenge includes it): "Question: {{question}}\nAnswer:",
    # choices {{choices.text}}. The llm-foundry rows hold query = "Question: " + question.
    path = data_dir / "arc" / f"{name}.jsonl"
    docs = []
    for i, row in enumerate(_read_jsonl(path)):
        query = _field(row, "query", path, i)
        choices = _field(row, "choices", path, i)
        if not query.startswith("Question: "):
            raise QnpuError(f"{path}: record {i} query does not start with 'Question: '")
        context = query if query.endswith("\nAnswer:") else query + "\nAnswer:"
        gold = _gold(_field(row, "gold", path, i), len(choices), f"{path}: record {i}")
        docs.append(_choices_doc(context, choices, gold))
    return docs


def _load_winogrande(data_dir: Path) -> list[Doc]:
    # winogrande default.yaml, multiple_inputs: context = partial_context(option) (the sentence
    # up to the blank, option filled in), continuation = " " + partial_target (text after it).
    path = data_dir / "winogrande" / "winogrande.jsonl"
    docs = []
    for i, row in enumerate(_read_jsonl(path)):
        contexts = _field(row, "context_options", path, i)
        continuation = _field(row, "continuation", path, i)
        gold = _gold(_field(row, "gold", path, i), len(contexts), f"{path}: record {i}")
        docs.append(
            Doc(
                requests=tuple((c, " " + continuation) for c in contexts),
                gold=gold,
                choice_lengths=tuple(len(c) for c in contexts),
            )
        )
    return docs


def _load_lambada(data_dir: Path) -> list[Doc]:
    # lambada_openai.yaml: context = text.split(' ')[:-1] joined, target = ' ' + last word
    path = data_dir / "lambada" / "lambada_test.jsonl"
    docs = []
    for i, row in enumerate(_read_jsonl(path)):
        text = _field(row, "text", path, i)
        if " " not in text:
            raise QnpuError(f"{path}: record {i} has no space to split the last word at")
        context, target = text.rsplit(" ", 1)
        docs.append(Doc(requests=((context, " " + target),), gold=0, choice_lengths=(len(target),)))
    return docs


def task_source(names: Sequence[str], data_dir: Path | str | None = None) -> Path | str:
    """Where tasks `names` are read from: `data_dir` (a directory, or "hf" for the `datasets`
    library), else $QNPU_DATA_DIR; checked without reading the data (every file of a
    directory must be there; `datasets` must be importable)."""
    unknown = [t for t in names if t not in TASKS]
    if unknown:
        raise QnpuError(f"unknown zero-shot task(s) {unknown}; known: {', '.join(TASKS)}")
    where = data_location(data_dir)
    if where is None:
        raise QnpuError(f"zero-shot tasks {', '.join(names)} need their data: {HOW_TO_PROVIDE}")
    if where == HF:
        try:
            import datasets  # noqa: F401
        except ImportError as e:
            raise QnpuError(
                f"--task-data hf needs the `datasets` package: {INSTALL_DATASETS}"
            ) from e
        return HF
    for name in names:
        for file in TASK_FILES[name]:
            _require(Path(where) / file)
    return Path(where)


def load_task(name: str, data_dir: Path | str | None = None) -> list[Doc]:
    """All items of a task, formatted as the harness formats them (zero-shot), from
    `data_dir` (a directory or "hf"; None: $QNPU_DATA_DIR, see `task_source`)."""
    where = data_location(data_dir)
    if where is None:
        raise QnpuError(f"zero-shot task {name} needs its data: {HOW_TO_PROVIDE}")
    if where == HF:
        return load_hf_task(name)
    root = Path(where)
    if name == "piqa":
        return _load_piqa(root)
    if name == "hellaswag":
        return _load_hellaswag(root)
    if name in ("arc_easy", "arc_challenge"):
        return _load_arc(root, name)
    if name == "winogrande":
        return _load_winogrande(root)
    if name == "lambada":
        return _load_lambada(root)
    raise QnpuError(f"unknown zero-shot task {name!r}; known: {', '.join(TASKS)}")


def _hf_preprocess(text: str) -> str:
    # harness hellaswag/utils.py preprocess
    text = text.strip().replace(" [title]", ". ")
    return _HELLASWAG_TAGS.sub("", text).replace("  ", " ")


def _hf_doc(name: str, row: dict[str, Any], where: str) -> Doc:
    """One row of the harness's dataset for task `name` as a Doc (the harness's yaml and
    utils.py: doc_to_text, doc_to_choice, doc_to_target)."""
    if name == "piqa":
        choices = [row["sol1"], row["sol2"]]
        return _choices_doc(
            f"Question: {row['goal']}\nAnswer:", choices, _gold(row["label"], 2, where)
        )
    if name == "hellaswag":
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        endings = [_hf_preprocess(e) for e in row["endings"]]
        query = _hf_preprocess(row["activity_label"] + ": " + ctx)
        return _choices_doc(query, endings, _gold(row["label"], len(endings), where))
    if name in ("arc_easy", "arc_challenge"):
        labels = list(row["choices"]["label"])
        if row["answerKey"] not in labels:
            raise QnpuError(f"{where}: answerKey {row['answerKey']!r} is not among {labels}")
        texts = list(row["choices"]["text"])
        context = f"Question: {row['question']}\nAnswer:"
        return _choices_doc(context, texts, labels.index(row["answerKey"]))
    if name == "winogrande":
        sentence = row["sentence"]
        if "_" not in sentence:
            raise QnpuError(f"{where}: the sentence has no blank '_'")
        cut = sentence.index("_")
        contexts = [sentence[:cut] + row["option1"], sentence[:cut] + row["option2"]]
        gold = {"1": 0, "2": 1}.get(str(row["answer"]))
        if gold is None:
            raise QnpuError(f"{where}: answer {row['answer']!r} is not '1' or '2'")
        continuation = sentence[cut + 1 :].strip()
        return Doc(
            requests=tuple((c, " " + continuation) for c in contexts),
            gold=gold,
            choice_lengths=tuple(len(c) for c in contexts),
        )
    if name == "lambada":
        text = row["text"]
        if " " not in text:
            raise QnpuError(f"{where}: no space to split the last word at")
        context, target = text.rsplit(" ", 1)
        return Doc(requests=((context, " " + target),), gold=0, choice_lengths=(len(target),))
    raise QnpuError(f"unknown zero-shot task {name!r}; known: {', '.join(TASKS)}")


def hf_task_docs(name: str, rows: Any) -> list[Doc]:
    """Task `name`'s Docs from the rows of its Hugging Face dataset (`HF_TASKS`), formatted as
    the harness formats them; a row without a field the task reads is an error naming it."""
    path, config, split = HF_TASKS[name]
    docs = []
    for i, row in enumerate(rows):
        where = f"hf:{path}{f':{config}' if config else ''}:{split} record {i}"
        try:
            docs.append(_hf_doc(name, dict(row), where))
        except (KeyError, TypeError, AttributeError) as e:
            raise QnpuError(f"{where}: not the harness's {name} layout ({e!r})") from e
    return docs


def load_hf_task(name: str) -> list[Doc]:
    """Task `name` from the Hugging Face dataset the harness uses (`HF_TASKS`), through the
    `datasets` library: its local cache, or a download when online."""
    if name not in HF_TASKS:
        raise QnpuError(f"unknown zero-shot task {name!r}; known: {', '.join(TASKS)}")
    try:
        import datasets
    except ImportError as e:
        raise QnpuError(f"--task-data hf needs the `datasets` package: {INSTALL_DATASETS}") from e
    path, config, split = HF_TASKS[name]
    try:
        rows = datasets.load_dataset(path, config, split=split)
    except Exception as e:  # datasets raises many unrelated types for a missing/offline dataset
        raise QnpuError(
            f"task {name}: cannot load the dataset {path}"
            f"{f' ({config})' if config else ''} split {split} through `datasets` "
            f"({type(e).__name__}: {e}); offline, it must be in the `datasets` cache already, "
            f"or name a directory holding the task files with --task-data DIR"
        ) from e
    return hf_task_docs(name, rows)


# ----------------------------------------------------------------------------- tokenizing


def _split_trailing_space(context: str, continuation: str) -> tuple[str, str]:
    # huggingface.py _encode_pair: trailing whitespace of the context moves to the continuation
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        return context[:-n_spaces], context[-n_spaces:] + continuation
    return context, continuation


def encode_requests(
    tokenizer: TextEncoder, requests: Sequence[tuple[str, str]]
) -> list[tuple[list[int], list[int]]]:
    """(context tokens, continuation tokens) per request, as the harness's `_encode_pair`.

    The whole string is encoded and the first len(encode(context)) tokens are the context, so
    the continuation's first token is the one the tokenizer really produces at the seam.
    """
    pairs = [_split_trailing_space(c, x) for c, x in requests]
    if any(not c for c, _ in pairs):
        # the harness would condition on a BOS/EOS prefix token; no task here needs it
        raise QnpuError("empty context in a zero-shot request")
    contexts = sorted({c for c, _ in pairs})
    context_ids = dict(zip(contexts, tokenizer.encode_batch(contexts), strict=True))
    wholes = tokenizer.encode_batch([c + x for c, x in pairs])
    out = []
    for (context, _), whole in zip(pairs, wholes, strict=True):
        n_ctx = len(context_ids[context])
        out.append((whole[:n_ctx], whole[n_ctx:]))
    return out


# ----------------------------------------------------------------------------- scoring


def length_buckets(max_length: int) -> tuple[int, ...]:
    """Padded sequence lengths: powers of two from 32, the last one capped at `max_length`."""
    buckets = []
    b = _MIN_BUCKET
    while b < max_length:
        buckets.append(b)
        b *= 2
    return (*buckets, max_length)


def score_token_requests(
    scorer: LmScorer,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    greedy: bool = False,
    batch_size: int = 8,
    progress: bool = True,
    desc: str = "loglikelihood",
) -> list[RequestScore]:
    """Sum log-prob (and greedy match) of each continuation given its context.

    The sequence fed is (context + continuation)[-max_length:], truncated from the context
    side (the harness keeps max_length + 1 tokens and drops the last, which it never scores
    from; the two differ by one context token only past the model's context). Rows are
    right-padded with token 0 to their bucket and batches are filled with padding rows, so the
    model sees len(buckets) shapes at most. With the scorer's `span_nll_argmax_fn` each row
    is scored at its continuation's positions only, K of them a row in a bucket (`span_width`:
    a shape per bucket and power of two).
    """
    if batch_size < 1:
        raise QnpuError(f"batch_size must be positive, got {batch_size}")
    span_fn = scorer.span_nll_argmax_fn
    nll_argmax_fn = scorer.nll_argmax_fn if greedy and span_fn is None else None
    if greedy and span_fn is None and nll_argmax_fn is None:
        raise QnpuError(
            "greedy accuracy needs an LmScorer with nll_argmax_fn or span_nll_argmax_fn"
        )
    max_length = scorer.max_length
    buckets = length_buckets(max_length)
    seqs: list[np.ndarray] = []
    n_conts: list[int] = []
    for i, (ctx, cont) in enumerate(requests):
        if not cont:
            raise QnpuError(f"request {i} has an empty continuation")
        seq = np.asarray([*ctx, *cont], dtype=np.int32)[-max_length:]
        if len(cont) >= len(seq):
            raise QnpuError(
                f"request {i}: continuation of {len(cont)} tokens leaves no context within "
                f"max_length {max_length}"
            )
        seqs.append(seq)
        n_conts.append(len(cont))
    by_bucket: dict[int, list[int]] = {}
    for i, seq in enumerate(seqs):
        bucket = next(b for b in buckets if b >= len(seq))
        by_bucket.setdefault(bucket, []).append(i)

    logprobs = np.zeros(len(seqs), dtype=np.float64)
    matches = np.zeros(len(seqs), dtype=bool)
    with tqdm(total=len(seqs), desc=desc, unit="req", disable=not progress) as bar:
        for bucket in sorted(by_bucket):
            members = by_bucket[bucket]
            width = span_width(max(n_conts[i] for i in members), bucket)
            for start in range(0, len(members), batch_size):
                rows = members[start : start + batch_size]
                tokens = np.zeros((batch_size, bucket), dtype=np.int32)
                for r, i in enumerate(rows):
                    tokens[r, : len(seqs[i])] = seqs[i]
                # row r's c predictions sit at T-1-c .. T-2 (the NLL columns of targets
                # T-c .. T-1); the rest repeat T-2
                at = np.zeros((batch_size, width), dtype=np.int32)
                for r, i in enumerate(rows):
                    t, c = len(seqs[i]), n_conts[i]
                    at[r] = np.minimum(t - 1 - c + np.arange(width), t - 2)
                if span_fn is not None:
                    nll_j, argmax_j = span_fn(tokens, at)
                    span_nll = np.asarray(nll_j, dtype=np.float64)
                    span_argmax = np.asarray(argmax_j)
                else:
                    if nll_argmax_fn is not None:
                        nll_j, argmax_j = nll_argmax_fn(tokens)
                        span_argmax = np.take_along_axis(np.asarray(argmax_j), at, axis=1)
                    else:
                        nll_j = scorer.nll_fn(tokens)
                    span_nll = np.take_along_axis(np.asarray(nll_j, dtype=np.float64), at, axis=1)
                for r, i in enumerate(rows):
                    t, c = len(seqs[i]), n_conts[i]
                    if not np.isfinite(span_nll[r, :c]).all():
                        raise QnpuError(f"{desc}: non-finite NLL in request {i}")
                    logprobs[i] = -float(span_nll[r, :c].sum())
                    if greedy:
                        matches[i] = bool((span_argmax[r, :c] == seqs[i][t - c :]).all())
                bar.update(len(rows))
    return [
        RequestScore(logprob=float(lp), greedy=bool(m), n_tokens=c)
        for lp, m, c in zip(logprobs, matches, n_conts, strict=True)
    ]


def span_width(longest: int, bucket: int) -> int:
    """Positions scored a row in a bucket whose longest continuation has `longest` tokens:
    the next power of two, at most bucket-1 (a few compiled shapes a bucket: one per power)."""
    return min(1 << max(longest - 1, 0).bit_length(), bucket - 1)


# ----------------------------------------------------------------------------- metrics


def mean_stderr(values: Sequence[float]) -> float | None:
    """lm-eval `mean_stderr`: sample standard deviation (n-1) / sqrt(n); None below 2 items."""
    n = len(values)
    if n < 2:
        return None
    x = np.asarray(values, dtype=np.float64)
    return float(math.sqrt(float(((x - x.mean()) ** 2).sum()) / (n - 1)) / math.sqrt(n))


def multiple_choice_metrics(
    docs: Sequence[Doc], logprobs: Sequence[Sequence[float]], *, with_norm: bool = True
) -> dict[str, float | None]:
    """acc (argmax of summed log-prob) and acc_norm (divided by choice length), with stderr.

    np.argmax breaks ties toward the first choice, as the harness does.
    """
    acc, acc_norm = [], []
    for doc, lls in zip(docs, logprobs, strict=True):
        lls_np = np.asarray(lls, dtype=np.float64)
        acc.append(1.0 if int(np.argmax(lls_np)) == doc.gold else 0.0)
        norm = lls_np / np.asarray(doc.choice_lengths, dtype=np.float64)
        acc_norm.append(1.0 if int(np.argmax(norm)) == doc.gold else 0.0)
    out: dict[str, float | None] = {"acc": float(np.mean(acc)), "acc_stderr": mean_stderr(acc)}
    if with_norm:
        out |= {"acc_norm": float(np.mean(acc_norm)), "acc_norm_stderr": mean_stderr(acc_norm)}
    return out


def lambada_metrics(scores: Sequence[RequestScore], *, seed: int = 0) -> dict[str, float | None]:
    """lambada_openai: acc = greedy last word, perplexity = exp(-mean per-item log-likelihood).

    The harness's perplexity stderr is a bootstrap (python `random`, 100k draws); this one is a
    seeded numpy bootstrap of 1000 resamples, so it agrees in distribution, not digit for digit.
    `token_perplexity` (exp of the mean NLL per target token) is extra, not a harness metric.
    """
    acc = [1.0 if s.greedy else 0.0 for s in scores]
    lls = np.asarray([s.logprob for s in scores], dtype=np.float64)
    n_tokens = sum(s.n_tokens for s in scores)
    stderr = None
    if len(lls) >= 2:
        rng = np.random.default_rng(seed)
        draws = rng.integers(0, len(lls), size=(_PPL_BOOTSTRAP_ITERS, len(lls)))
        stderr = float(np.std(np.exp(-lls[draws].mean(axis=1)), ddof=1))
    return {
        "acc": float(np.mean(acc)),
        "acc_stderr": mean_stderr(acc),
        "perplexity": math.exp(-float(lls.mean())),
        "perplexity_stderr": stderr,
        "token_perplexity": math.exp(-float(lls.sum()) / n_tokens),
    }


def select_indices(n: int, limit: int | None, seed: int = 0) -> list[int]:
    """All items, or a seeded sorted subset of `limit` of them (the same for the same seed)."""
    if limit is None or limit >= n:
        return list(range(n))
    if limit < 1:
        raise QnpuError(f"limit must be positive, got {limit}")
    chosen = np.random.default_rng(seed).choice(n, limit, replace=False)
    return sorted(int(i) for i in chosen)


# ----------------------------------------------------------------------------- evaluation


def _task_kind(name: str) -> Literal["multiple_choice", "lambada"]:
    return "lambada" if name == "lambada" else "multiple_choice"


def evaluate_docs(
    scorer: LmScorer,
    tokenizer: TextEncoder,
    docs: Sequence[Doc],
    *,
    kind: Literal["multiple_choice", "lambada"] = "multiple_choice",
    with_norm: bool = True,
    batch_size: int = 8,
    seed: int = 0,
    progress: bool = True,
    desc: str = "zeroshot",
) -> dict[str, float | None]:
    """Metrics of already formatted docs (all of them)."""
    if not docs:
        raise QnpuError("no items to evaluate")
    flat = [req for doc in docs for req in doc.requests]
    encoded = encode_requests(tokenizer, flat)
    scores = score_token_requests(
        scorer,
        encoded,
        greedy=kind == "lambada",
        batch_size=batch_size,
        progress=progress,
        desc=desc,
    )
    if kind == "lambada":
        return lambada_metrics(scores, seed=seed)
    per_doc, k = [], 0
    for doc in docs:
        per_doc.append([s.logprob for s in scores[k : k + len(doc.requests)]])
        k += len(doc.requests)
    return multiple_choice_metrics(docs, per_doc, with_norm=with_norm)


def evaluate_task(
    scorer: LmScorer,
    tokenizer: TextEncoder,
    name: str,
    *,
    limit: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    data_dir: Path | str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """One task: {"task", "n", "n_total", "metrics", "indices", "seconds"} (JSON-ready)."""
    start = time.perf_counter()
    docs = load_task(name, data_dir)
    indices = select_indices(len(docs), limit, seed)
    metrics = evaluate_docs(
        scorer,
        tokenizer,
        [docs[i] for i in indices],
        kind=_task_kind(name),
        with_norm=name != "winogrande",  # winogrande reports acc only (default.yaml)
        batch_size=batch_size,
        seed=seed,
        progress=progress,
        desc=name,
    )
    return {
        "task": name,
        "n": len(indices),
        "n_total": len(docs),
        "metrics": metrics,
        "indices": indices,
        "seconds": time.perf_counter() - start,
    }


def evaluate_tasks(
    scorer: LmScorer,
    tokenizer: TextEncoder,
    tasks: Sequence[str],
    *,
    limit: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    data_dir: Path | str | None = None,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """Zero-shot results per task name; each task draws its `limit` subset from `seed` alone."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise QnpuError(f"unknown zero-shot task(s) {unknown}; known: {', '.join(TASKS)}")
    return {
        name: evaluate_task(
            scorer,
            tokenizer,
            name,
            limit=limit,
            seed=seed,
            batch_size=batch_size,
            data_dir=data_dir,
            progress=progress,
        )
        for name in dict.fromkeys(tasks)
    }
