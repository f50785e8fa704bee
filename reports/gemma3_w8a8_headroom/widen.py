"""Eval a run with some tensors' calibrated scales multiplied (a wider grid: less clipping).
usage: python widen.py RUN N VARIANTS_JSON OUT_JSON [FIRST]: wiki eval windows FIRST..FIRST+N-1
(FIRST 0: the windows the error budget read; 4: the next ones, held out)."""
import sys, json, time
import numpy as np, jax
from qnpu_jax.studies.harness import open_run
from qnpu_jax.pipeline.run import evaluate

run = open_run(sys.argv[1])
nwin = int(sys.argv[2])
variants = json.loads(sys.argv[3])  # {label: {tensor: factor}}
plan, state, cfg, prefix = run.plan, run.state, run.cfg, run.prefix
first = int(sys.argv[5]) if len(sys.argv) > 5 else 0
windows = run.eval_windows(first + nwin)[first:]
t = time.time()
base = evaluate(run.params, state, plan, cfg, windows, prefix, prefix_params=run.prefix_params)["ppl"]
print(f"float {run.float_ppl(windows):.4f} run {base:.4f} ({time.time()-t:.0f} s)", flush=True)
out = {"run": base, "rows": {}}
for label, factors in variants.items():
    layers = dict(state["layers"])
    for name, f in factors.items():
        s = layers[name]
        layers[name] = s.replace(scale=s.scale * f)
    st = {"layers": layers, "outer": state["outer"]}
    ppl = evaluate(run.params, st, plan, cfg, windows, prefix, prefix_params=run.prefix_params)["ppl"]
    out["rows"][label] = ppl
    print(f"{label}: {ppl:.4f} ({ppl/base-1:+.2%})", flush=True)
json.dump(out, open(sys.argv[4], "w"), indent=1)
