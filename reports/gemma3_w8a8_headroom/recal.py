"""A run's non-stage-1 activation encodings recalibrated on N calibration windows (same seed)."""
import sys, json, time
import numpy as np, jax
from qnpu_jax.pipeline.run import load_run, calibration_data, evaluate
from qnpu_jax.pipeline.steps import calibrate, Calibration, STAGE1_TENSORS
from qnpu_jax.quant.plan import is_weight
from qnpu_jax.studies.harness import open_run

path, nwin, counts = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
run = load_run(path)
h = open_run(path)
windows = h.eval_windows(nwin)
base = h.model if hasattr(h, "model") else run.model
cfg, prefix = run.model.cfg, run.model.prefix
plan = run.model.require_plan()
paths = [p for p, _ in plan.entries if not is_weight(p) and p.removeprefix("layers/") not in STAGE1_TENSORS]
print("recalibrating", paths, flush=True)
def ppl(m):
    return evaluate(m.params(), m.require_state(), m.require_plan(), cfg, windows, prefix, prefix_params=m.prefix_params())["ppl"]
out = {"run": ppl(run.model)}
print("run", out["run"], flush=True)
for n in counts:
    t = time.time()
    config = run.config.replace(calib_windows=n)
    data = Calibration(*calibration_data(config, run.model.tokenizer if hasattr(run.model, "tokenizer") else run.tokenizer))
    m = calibrate(paths)(run.model.replace(weight_codes=run.model.weight_codes), data)
    out[n] = ppl(m)
    print(f"calib_windows {n}: {out[n]:.4f} ({out[n]/out['run']-1:+.2%}) {time.time()-t:.0f} s", flush=True)
json.dump(out, open(sys.argv[4], "w"), indent=1)
