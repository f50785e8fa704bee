"""down_proj's weights in a finished run on three grids (session 66): GPTQ's codes on the run's
learned grid (the run), round-to-nearest on that grid, round-to-nearest on a Max-Min grid; every
other encoding the run's. Usage: QNPU_DATA_DIR=../shared/data python3 down_proj_grid.py RUN DATA
WINDOWS OUT.json"""

import json
import sys
from pathlib import Path

import jax.numpy as jnp

from qnpu_jax.pipeline.run import evaluate
from qnpu_jax.studies.harness import open_run

run = open_run(Path(sys.argv[1]))
windows = run.eval_windows(int(sys.argv[3]), sys.argv[2])
plan, state, model = run.plan, run.state, run.model


def ppl(m, st):
    params, prefix_params = m.params(), m.prefix_params()
    nll = evaluate(params, st, plan, run.cfg, windows, run.prefix, prefix_params=prefix_params)
    return nll["ppl"]


codes = {k: v for k, v in (model.weight_codes or {}).items() if k != "down_proj"}
rtn = model.replace(weight_codes=codes)
enc = state["layers"]["down_proj"]
w = model.unrounded_params()["layers"]["down_proj"]
max_min = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / enc.qmax[:, None, None]
mm_state = {**state, "layers": {**state["layers"], "down_proj": enc.replace(scale=max_min)}}
rows = {
    "float": run.float_ppl(windows),
    "run (GPTQ on the learned grid)": ppl(model, state),
    "down_proj RTN on the learned grid": ppl(rtn, state),
    "down_proj RTN on a Max-Min grid": ppl(rtn.replace(state=mm_state), mm_state),
}
print(rows)
out = {"run": sys.argv[1], "data": sys.argv[2], "windows": int(sys.argv[3]), "ppl": rows}
Path(sys.argv[4]).write_text(json.dumps(out, indent=1))
