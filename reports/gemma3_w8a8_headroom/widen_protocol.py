"""A run at the protocol (wiki + wikitext2, 32 windows of its seq_len) with some tensors'
calibrated scales multiplied (a wider grid on the tensors named)."""
import sys, json, time
from qnpu_jax.pipeline.run import load_run, evaluate, evaluation_sets

run = load_run(sys.argv[1])
variants = json.loads(sys.argv[2])
m = run.model
cfg, prefix, plan, state = m.cfg, m.prefix, m.require_plan(), m.require_state()
config = run.config.replace(eval_data=("wiki", "wikitext2"), eval_windows=32)
sets = evaluation_sets(config, run.tokenizer, cfg.max_position_embeddings - len(prefix))
out = {"run": str(sys.argv[1]), "rows": {}}
for label, factors in {"none": {}, **variants}.items():
    layers = dict(state["layers"])
    for name, f in factors.items():
        layers[name] = layers[name].replace(scale=layers[name].scale * f)
    st = {"layers": layers, "outer": state["outer"]}
    row = {}
    for spec, windows in sets.items():
        t = time.time()
        row[spec] = evaluate(m.params(), st, plan, cfg, windows, prefix, prefix_params=m.prefix_params())["ppl"]
        print(f"{label} {spec} ({len(windows)} windows): {row[spec]:.4f} {time.time()-t:.0f} s", flush=True)
    out["rows"][label] = {"factors": factors, "ppl": row}
    json.dump(out, open(sys.argv[3], "w"), indent=1)
