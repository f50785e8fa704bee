"""Cross-check the JAX float forward against transformers' PyTorch LlamaForCausalLM -> JSON.

Loads the model our way, writes it as an HF directory (save_hf_dir), loads that directory with
transformers in float32, and compares logits and perplexity on the same evaluation windows.
Needs `pip install torch==2.13.0 transformers` (CPU wheel; never plain `torch`).

    python scripts/crosscheck_hf.py --data wiki --seq-len 512 --windows 8 \
        --json reports/hf_crosscheck.json
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_json_atomic
from qnpu_jax.models.hf import save_hf_dir
from qnpu_jax.models.llama import forward, next_token_nll
from qnpu_jax.models.load import load_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--split", default=None)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--json", default="reports/hf_crosscheck.json")
    args = parser.parse_args()
    import torch
    import transformers

    split = args.split or ("eval" if args.data == "wiki" else None)
    try:
        model = load_model(args.model)
        ids = tokenize_documents(load_documents(args.data, split), model.tokenizer)
    except QnpuError as e:
        print(f"crosscheck_hf: error: {e}", file=sys.stderr)
        return 2
    windows = eval_windows(ids, args.seq_len, args.windows)
    with tempfile.TemporaryDirectory() as tmp:
        directory = save_hf_dir(Path(tmp) / "model", model.config, model.params, model.tokenizer)
        ref = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        ref.eval()
    ours_nll, ref_nll, max_diff, max_abs = [], [], 0.0, 0.0
    argmax_agree = 0
    for w in windows:
        tokens = jnp.asarray(w[None])
        with torch.no_grad():
            r = ref(torch.tensor(w[None], dtype=torch.long)).logits.numpy()
        o = np.asarray(forward(model.params, tokens, cfg=model.config))
        max_diff = max(max_diff, float(np.abs(o - r).max()))
        max_abs = max(max_abs, float(np.abs(r).max()))
        argmax_agree += int((o.argmax(-1) == r.argmax(-1)).sum())
        ours_nll.append(np.asarray(next_token_nll(jnp.asarray(o), tokens)))
        ref_nll.append(np.asarray(next_token_nll(jnp.asarray(r), tokens)))
    ppl_ours = math.exp(float(np.mean(np.asarray(ours_nll, np.float64))))
    ppl_ref = math.exp(float(np.mean(np.asarray(ref_nll, np.float64))))
    report = {
        "model": args.model,
        "data": args.data,
        "split": split,
        "seq_len": args.seq_len,
        "windows": len(windows),
        "ppl_jax": ppl_ours,
        "ppl_transformers": ppl_ref,
        "ppl_relative_difference": ppl_ours / ppl_ref - 1,
        "max_abs_logit_difference": max_diff,
        "max_abs_logit": max_abs,
        "argmax_agreement": argmax_agree / windows.size,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    print(
        f"ppl jax {ppl_ours:.4f} vs transformers {ppl_ref:.4f} "
        f"({100 * report['ppl_relative_difference']:+.4f}%), max |logit diff| {max_diff:.2e}"
    )
    write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
