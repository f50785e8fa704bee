"""Parallel test-time scaling on an integer artifact, and batched decode throughput.

Accuracy: LAMBADA's last word (`--task-data`), answered generatively: the context is
prefilled once, then greedy decoding; N samples decoded as one batch and selected by the
model's own likelihood (best), by a reward model's (`--scorer MODEL`, any float model: reward)
or by majority vote over their first words (vote), with the oracle any-of-N beside them; and
beam search of width N. The samples of the largest N are
drawn once: N = 1, 4, ... use their first N rows (row i's stream depends on (seed, i) only).
An answer is the first word of the continuation, stripped of punctuation; it is right when it
equals the target word.

Throughput: decode tokens/s at batch B (one prompt's cache copied to B rows, then `--steps`
batched decode steps, timed on their second run) on each engine: the paper's premise is that a
batch costs little more than one row until the matrix tiles are full.

    python scripts/test_time_scaling.py --artifact artifacts/smollm2-135m-quantnpu-w4a8-device \
        --items 200 --samples 1 4 16 --scorer smollm2-135m --json reports/test_time_scaling.json
"""

from __future__ import annotations

import argparse
import string
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from qnpu_jax.argtypes import positive_int
from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.eval.zeroshot import load_task
from qnpu_jax.export.int_model import artifact_tokenizer, load_int_model
from qnpu_jax.files import write_json_atomic
from qnpu_jax.runtime.decode import (
    Sample,
    Sampler,
    beam_search,
    sample_parallel,
    select_best,
    select_vote,
)
from qnpu_jax.runtime.engines import ENGINES, open_engine


def _reward(table: dict[tuple[int, ...], float], sample: Sample) -> float:
    return table[sample.tokens]


def first_word(text: str) -> str:
    words = text.strip().split()
    return words[0].strip(string.punctuation + "“”‘’") if words else ""


def float_scorer(spec: str) -> Callable[[list[int], list[Sample]], dict[tuple[int, ...], float]]:
    """A reward model loaded like any model: the log-likelihood of each sample's tokens after
    the prompt under the float model `spec` (all samples in one padded batch)."""
    import jax
    import jax.numpy as jnp

    from qnpu_jax.models.llama import forward
    from qnpu_jax.models.load import load_model

    model = load_model(spec)

    @jax.jit
    def token_logprobs(params: Any, tokens: jax.Array) -> jax.Array:
        lp = jax.nn.log_softmax(forward(params, tokens, cfg=model.config), axis=-1)
        return jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]

    def scores(prompt: list[int], samples: list[Sample]) -> dict[tuple[int, ...], float]:
        seqs = [prompt + list(s.tokens) for s in samples]
        width = -(-max(map(len, seqs)) // 32) * 32  # few compiled shapes
        batch = np.zeros((len(seqs), width), np.int32)
        for i, q in enumerate(seqs):
            batch[i, : len(q)] = q
        lp = np.asarray(token_logprobs(model.params, jnp.asarray(batch)), np.float64)
        return {
            s.tokens: float(lp[i, len(prompt) - 1 : len(q) - 1].sum())
            for i, (q, s) in enumerate(zip(seqs, samples, strict=True))
        }

    return scores


def accuracy(args: argparse.Namespace, engine: Any, tokenizer: Any) -> dict[str, Any]:
    docs = load_task("lambada", args.task_data)[: args.items]
    scorer = float_scorer(args.scorer) if args.scorer else None
    n_max = max(args.samples)
    sampler = Sampler(temperature=args.temperature, top_p=args.top_p)
    right: dict[str, int] = {"greedy": 0}
    seconds: dict[str, float] = {"greedy": 0.0, "sampling": 0.0}
    for n in args.samples:
        for rule in ("best", "vote", "any") + (("reward",) if args.scorer else ()):
            right[f"{rule}@{n}"] = 0
        if n > 1:
            right[f"beam@{n}"] = 0
            seconds[f"beam@{n}"] = 0.0
    for i, doc in enumerate(docs):
        context, target = doc.requests[0]
        gold = target.strip()
        prompt = tokenizer.encode(context)

        def answer(s: Sample) -> str:
            return first_word(tokenizer.decode(list(s.tokens)))

        t0 = time.perf_counter()
        greedy = engine.generate(prompt, args.max_new_tokens)
        seconds["greedy"] += time.perf_counter() - t0
        right["greedy"] += first_word(tokenizer.decode(greedy)) == gold
        t0 = time.perf_counter()
        samples = sample_parallel(
            engine, prompt, n_max, args.max_new_tokens, sampler, args.seed + i
        )
        seconds["sampling"] += time.perf_counter() - t0
        rewards = scorer(prompt, samples) if scorer else {}
        for n in args.samples:
            head = samples[:n]
            right[f"best@{n}"] += answer(select_best(head)) == gold
            right[f"vote@{n}"] += select_vote(head, answer) == gold
            right[f"any@{n}"] += any(answer(s) == gold for s in head)
            if scorer:
                chosen = select_best(head, score=partial(_reward, rewards))
                right[f"reward@{n}"] += answer(chosen) == gold
            if n > 1:
                t0 = time.perf_counter()
                beams = beam_search(engine, prompt, n, args.max_new_tokens)
                seconds[f"beam@{n}"] += time.perf_counter() - t0
                right[f"beam@{n}"] += answer(beams[0]) == gold
        if (i + 1) % 25 == 0:
            print(f"  {i + 1}/{len(docs)}: " + ", ".join(f"{k} {v}" for k, v in right.items()))
    return {
        "items": len(docs),
        "correct": right,
        "accuracy": {k: v / len(docs) for k, v in right.items()},
        "seconds": seconds,
    }


def greedy_steps(engine: Any, cache: Any, feed: np.ndarray, steps: int) -> None:
    """`steps` batched greedy decode steps from `cache`, which the engine may write into."""
    for _ in range(steps):
        codes, cache = engine._extend(feed, cache)
        feed = np.argmax(codes[:, -1:], axis=-1).astype(np.int32)


def throughput(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    prompt = np.random.default_rng(0).integers(0, int(model.model["vocab_size"]), (1, 64))
    need = len(model.graph["prefix_tokens"]) + 64 + args.steps
    if need > int(model.graph["max_context"]):
        raise SystemExit(f"64 prompt tokens and {args.steps} steps need {need} positions")
    out: dict[str, Any] = {}
    for name in args.engines:
        engine = open_engine(name, model)
        codes, cache = engine.prefill(prompt)
        rows = {}
        for b in args.batches:
            first = np.full((b, 1), int(np.argmax(codes[0, -1])), np.int32)
            # untimed: compiles every window on the way
            greedy_steps(engine, engine.take_rows(cache, [0] * b), first, args.steps)
            batch = engine.take_rows(cache, [0] * b)  # the steps may reuse its buffers
            t0 = time.perf_counter()
            greedy_steps(engine, batch, first, args.steps)
            s = time.perf_counter() - t0
            rows[str(b)] = {"seconds": s, "tokens_per_s": b * args.steps / s}
            print(f"  {name} batch {b}: {b * args.steps / s:.1f} tokens/s")
        out[name] = rows
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--engine", choices=ENGINES, default="jax", help="for the accuracy")
    parser.add_argument("--items", type=positive_int, default=200)
    parser.add_argument(
        "--task-data", default=None, help="LAMBADA's data: DIR or hf (default: $QNPU_DATA_DIR)"
    )
    parser.add_argument("--samples", type=positive_int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=positive_int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scorer", default=None, help="a float model scoring Best-of-N (rule 'reward')"
    )
    parser.add_argument("--engines", choices=ENGINES, nargs="+", default=list(ENGINES))
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("reports/test_time_scaling.json"))
    args = parser.parse_args()
    model = load_int_model(args.artifact)
    report: dict[str, Any] = {
        "artifact": str(args.artifact),
        "task": "lambada (last word, generated)",
        "sampler": {"temperature": args.temperature, "top_p": args.top_p},
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        "scorer": args.scorer,
    }
    if not args.skip_accuracy:
        print(f"accuracy on {args.items} items ({args.engine} engine)")
        engine = open_engine(args.engine, model)
        report["accuracy"] = accuracy(args, engine, artifact_tokenizer(model))
        print(report["accuracy"]["accuracy"])
    print("decode throughput")
    report["decode_throughput"] = throughput(args, model)
    report["environment"] = environment_info()
    report["command"] = script_command(__file__)
    write_json_atomic(args.json, report)
    print(f"-> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
