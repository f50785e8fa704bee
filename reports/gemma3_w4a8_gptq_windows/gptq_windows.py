"""Session 57's first check of `gptq_windows` (before the key existed): GPTQ's Hessians from N
calibration windows (drawn from the calib text with another key),
on a finished run: the run's own codes vs the new codes, wiki + wikitext2 at 32 windows."""

import json
import sys
import time
from pathlib import Path

import jax

from qnpu_jax.data.sources import sample_windows
from qnpu_jax.pipeline.quantized_model import nll_perplexity
from qnpu_jax.pipeline.recipes import config_keys
from qnpu_jax.pipeline.run import calibration_data, evaluation_sets, load_run
from qnpu_jax.pipeline.steps import Calibration, gptq

run_dir, counts, out = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], sys.argv[3]
t0 = time.time()
run = load_run(run_dir)
config, model = run.config, run.loaded
ids, windows = calibration_data(config, model.tokenizer)
print("calib tokens", len(ids), "windows", windows.shape, flush=True)
evaluated = config.replace(eval_data=("wiki", "wikitext2"), eval_windows=32)
room = model.config.max_position_embeddings - len(run.model.prefix)
sets = evaluation_sets(evaluated, model.tokenizer, room)
w = config.weights
res = {"run": run_dir, "config": config.summary(), "rows": []}
for spec, win in sets.items():
    p = nll_perplexity(run.model.nll_fn(), win)["ppl"]
    res.setdefault("run_ppl", {})[spec] = p
    print(f"{spec}: run {p:.4f} ({time.time() - t0:.0f}s)", flush=True)
for n in counts:
    key = jax.random.fold_in(config_keys(config)[0], 1000 + n)
    data = Calibration(ids, sample_windows(ids, windows.shape[1], n, key))
    m = run.model.replace(weight_codes=None)
    m = gptq(w.gptq_damp, act_order=w.gptq_act_order)(m, data)
    row = {"gptq_windows": n}
    for spec, win in sets.items():
        row[spec] = nll_perplexity(m.nll_fn(), win)["ppl"]
        print(f"{spec}: gptq on {n} windows {row[spec]:.4f} ({time.time() - t0:.0f}s)", flush=True)
    res["rows"].append(row)
    Path(out).write_text(json.dumps(res, indent=1))
