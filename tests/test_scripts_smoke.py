"""Smoke tests of the studies compare_methods and init_study: the run grid, the
target checks, the reports, and the init study's encodings on the tiny random model (no real
model runs here; the scripts' docstrings give the full commands)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import load_script  # tests/ is on sys.path (rootdir conftest)


@pytest.fixture(scope="module")
def cm():
    return load_script("compare_methods")


@pytest.fixture(scope="module")
def ist():
    return load_script("init_study")


def test_compare_grid_matches_the_settings(cm, tmp_path):
    args = cm.parse_args(["--runs-dir", str(tmp_path), "--steps", "3"])
    table, ablation = cm.grid(args)
    assert len(table) == 2 * 3 * 4 and len(ablation) == 6
    names = {c.run_dir.name for c in table + ablation}
    assert "quantnpu-w4a8kv8-ours" in names and "rtn-w8a8kv8-table1" in names
    assert "quantnpu-w4a4kv8-ablation-static-joint" in names
    for c in table:
        cfg = c.config
        assert cfg.eval_data[0] == "wiki" and cfg.eval_data[1].startswith("wikitext:")
        assert cfg.eval_data[1].endswith("wikitext-2-raw/wiki.test.raw")
        if c.setting == "table1":
            assert (cfg.down_in_bits, cfg.mixed_precision) == (16, 0.0)
        elif c.method == "quantnpu":
            assert (cfg.down_in_bits, cfg.mixed_precision) == (8, 0.1)
        else:
            assert (cfg.down_in_bits, cfg.mixed_precision) == (8, 0.0)
        # stage-1 flags reach only the methods with a stage 1 (so other runs stay reusable)
        assert (cfg.stage1.steps == 3) == (c.method in ("spinquant", "quantnpu"))
    static_joint, init, selective, mixed10, mixed100, frozen = (c.config for c in ablation)
    assert all(c.config.scope == "linears" and c.config.w_bits == 4 for c in ablation)
    assert (static_joint.init_scheme, static_joint.selective) == ("max_min", False)
    assert (init.init_scheme, init.selective, init.mixed_precision) == ("aware", False, 0.0)
    assert (selective.selective, selective.mixed_precision) == (True, 0.0)
    assert (mixed10.mixed_precision, mixed100.mixed_precision) == (0.1, 1.0)
    # the down_proj flag both ways: the chain learns it (§4.3.1), the side row does not
    assert all(c.learn_down_in for c in (static_joint, init, selective, mixed10, mixed100))
    assert frozen == dataclasses.replace(mixed10, learn_down_in=False)

    only = cm.parse_args(["--only-ablation", "--variants", "init"])
    assert [c.setting for c in ablation if cm.selected(c, only)] == ["ablation-init"]
    assert not any(cm.selected(c, only) for c in table)
    part = cm.parse_args(["--methods", "rtn", "--bits", "W4A4", "--skip-ablation"])
    assert [c.run_dir.name for c in table if cm.selected(c, part)] == [
        "rtn-w4a4kv8-table1",
        "rtn-w4a4kv8-ours",
    ]


def _row(cm, setting, bits, method, wiki, ratio):
    w, a = cm.parse_bits(bits)
    return {
        "method": method,
        "bits": bits,
        "w_bits": w,
        "a_bits": a,
        "kv_bits": 8,
        "setting": setting,
        "label": cm.METHOD_LABELS[method],
        "down_in": "16",
        "run_dir": f"runs/{method}",
        "config": {"init_scheme": "aware", "selective": True, "mixed_precision": 0.0},
        "status": "ran",
        "ppl": {"wiki": wiki, "wikitext2": wiki},
        "float_ppl": {"wiki": wiki / ratio, "wikitext2": wiki / ratio},
        "ratio": {"wiki": ratio, "wikitext2": ratio},
        "windows": {"wiki": 2, "wikitext2": 2},
        "tokens": {"wiki": 1022, "wikitext2": 1022},
    }


def test_compare_target_checks_and_markdown(cm, tmp_path):
    rows = [
        _row(cm, "table1", "W8A8", "quantnpu", 20.2, 1.01),
        _row(cm, "table1", "W4A8", "quantnpu", 22.0, 1.10),
        _row(cm, "table1", "W4A8", "rtn", 30.0, 1.5),
        _row(cm, "table1", "W4A8", "quarot", 21.0, 1.05),  # beats Quant.npu
        _row(cm, "table1", "W4A8", "spinquant", 40.0, 2.0),
        _row(cm, "table1", "W4A4", "quantnpu", 40.0, 2.0),
        _row(cm, "ours", "W4A8", "quantnpu", 22.0, 1.10),
        _row(cm, "ours", "W4A8", "rtn", 30.0, 1.5),
    ]
    status = {(c["setting"], c["bits"], c["eval"]): c["status"] for c in cm.target_checks(rows)}
    assert status[("table1", "W8A8", "wiki")] == "met"
    assert status[("table1", "W4A8", "wiki")] == "not met"  # ratio fine, not below QuaRot
    assert status[("table1", "W4A4", "wikitext2")] == "not met"
    assert status[("ours", "W4A8", "wiki")] == "incomplete"  # quarot, spinquant not run
    assert status[("ours", "W8A8", "wiki")] == "not run"

    args = cm.parse_args(["--runs-dir", str(tmp_path)])
    report = cm.build_report(args, rows, [], None, "qnpu study compare_methods", 1.0)
    assert report["float"]["ppl"]["wiki"] == pytest.approx(20.2 / 1.01)
    md = cm.render_markdown(report)
    assert "| Quant.npu | 8-8-8 | per-channel | 16 | 20.20 |" in md
    assert "— not met" in md and "— met" in md and "Command: `qnpu study compare_methods" in md
    assert "PIQA" not in md and "zero-shot" not in md  # no --tasks: no zero-shot columns
    assert "earlier invocations" not in md  # every cell ran in this one

    chain = _row(cm, "ablation-mixed10", "W4A4", "quantnpu", 30.0, 2.0)
    frozen = _row(cm, "ablation-mixed10-frozen-down-in", "W4A4", "quantnpu", 28.0, 1.9)
    chain["config"] |= {"mixed_precision": 0.1, "learn_down_in": True}
    frozen["config"] |= {"mixed_precision": 0.1, "learn_down_in": False}
    frozen["label"] = "frozen"
    report = cm.build_report(args, rows, [chain, frozen], None, "python x", 1.0)
    md = cm.render_markdown(report)
    assert "| FP32 | – | – | – | – | 20.00 | 20.00 | 1.000 | 1.000 |" in md  # ablation table
    assert "| Quant.npu | aware | ✓ | 10% | ✓ | 30.00 |" in md
    assert "| frozen | aware | ✓ | 10% | – (init kept) | 28.00 |" in md

    rows[0] |= {"status": "reused", "command": "qnpu study compare_methods --bits W8A8"}
    rows[1] |= {"status": "reused", "command": "qnpu study compare_methods"}  # this one
    report = cm.build_report(args, rows, [], None, "qnpu study compare_methods", 1.0)
    md = cm.render_markdown(report)
    earlier = "- `qnpu study compare_methods --bits W8A8`\n\n"
    assert "earlier invocations were run by:\n" + earlier in md


def _task(name, metric, value, stderr):
    from qnpu_jax.report.table import Measure, TaskResult

    score = Measure(value, stderr)
    return TaskResult(name, metric, score, 500, None, None, "none", 500, "evals.json")


def test_compare_zero_shot_columns_and_marks(cm, tmp_path):
    rows = [
        _row(cm, "table1", "W4A8", "quantnpu", 22.0, 1.10),
        _row(cm, "table1", "W4A8", "rtn", 30.0, 1.5),
    ]
    rows[1]["status"] = "error"
    rows[1]["error"] = "boom"
    args = cm.parse_args(["--runs-dir", str(tmp_path), "--tasks", "lambada,piqa", "--limit", "500"])
    assert args.tasks == ("lambada", "piqa")
    scores = {
        cm.FLOAT_KEY: cm.TaskScores(
            "reused",
            {
                "piqa": _task("piqa", "acc_norm", 0.60, 0.02),
                "lambada": _task("lambada", "acc", 0.40, 0.02),
            },
            tmp_path / "float.json",
        ),
        # PIQA 0.10 below float: beyond 2·sqrt(0.02² + 0.02²) = 0.057, so ▼; LAMBADA 0.01
        # above: within noise; the average 0.045 below, beyond 2·sqrt(2·0.01414²) = 0.04: ▼
        "runs/quantnpu": cm.TaskScores(
            "ran",
            {
                "piqa": _task("piqa", "acc_norm", 0.50, 0.02),
                "lambada": _task("lambada", "acc", 0.41, 0.02),
            },
            tmp_path / "q.json",
        ),
    }
    report = cm.build_report(args, rows, [], None, "cmd", 1.0, scores)
    q = report["rows"][0]
    piqa = {"metric": "acc_norm", "value": 0.5, "stderr": 0.02, "n": 500, "mark": "▼"}
    assert q["tasks"]["piqa"] == piqa and q["tasks"]["lambada"]["mark"] == ""
    assert q["tasks_average"]["value"] == pytest.approx(0.455)
    assert q["tasks_average"]["mark"] == "▼" and q["tasks_status"] == "ran"
    assert report["float"]["tasks"]["piqa"]["mark"] == ""  # the reference itself
    assert report["protocol"]["task_n"] == {"piqa": 500, "lambada": 500}
    md = cm.render_markdown(report)
    # paper column order (PIQA before LAMBADA), percent ± stderr, the average with its mark
    assert "| × float (WikiText-2) | PIQA ↑ | LAMBADA ↑ | Avg ↑ |" in md
    assert "| 1.000 | 1.000 | 60.0 ±2.0 | 40.0 ±2.0 | 50.0 ±1.4 |" in md
    assert "| 1.100 | 1.100 | 50.0 ±2.0 ▼ | 41.0 ±2.0 | 45.5 ±1.4 ▼ |" in md
    assert "| error | error | error |" in md  # the failed cell
    assert "a seeded subset of 500 items per task (seed 0)" in md and "PIQA 500, LAMBADA 500" in md
    assert "a difference smaller than two standard errors is not called a difference" in md


def test_compare_grid_scores_zero_shot_tasks_and_reads_them_back(
    cm, two_layer_dir, wikitext_test_path, tmp_path, monkeypatch
):
    """FP32 + one RTN cell of the 2-layer model with --tasks piqa,lambada --limit 3: an evals
    JSON per row in the `qnpu eval --json` layout, scored as `qnpu eval --run` scores it, the
    columns in the markdown and the JSON; a second invocation only reads them back."""
    import json

    import qnpu_jax.cli as cli

    runs = tmp_path / "runs"
    argv = [
        *("--model", str(two_layer_dir), "--methods", "float,rtn", "--bits", "W8A8"),
        *("--settings", "table1", "--skip-ablation", "--seq-len", "32", "--calib-windows", "2"),
        *("--eval-windows", "2", "--wikitext", str(wikitext_test_path), "--runs-dir", str(runs)),
        *("--json", str(tmp_path / "c.json"), "--md", str(tmp_path / "c.md"), "--no-progress"),
        *("--tasks", "piqa,lambada", "--limit", "3"),
    ]
    assert cm.main(argv) == 0
    cell = runs / "rtn-w8a8kv8-table1"
    paths = [runs / "float" / "evals" / "tasks-3-0.json", cell / "evals" / "tasks-3-0.json"]
    docs = [json.loads(p.read_text()) for p in paths]
    assert docs[0]["model"] == str(two_layer_dir) and docs[0]["path"] == "float"
    assert docs[1]["run"] == str(cell) and docs[1]["path"] == "fake-quant (static)"
    for doc in docs:
        assert (doc["limit"], doc["seed"], doc["prefix"]) == (3, 0, "none")
        assert set(doc["tasks"]) == {"piqa", "lambada"}
        assert [doc["tasks"][t]["indices"] for t in doc["tasks"]] == [
            docs[0]["tasks"][t]["indices"] for t in doc["tasks"]
        ]  # the same items in every row
    # exactly what `qnpu eval --run` gives
    e = tmp_path / "e.json"
    ev = ["eval", "--run", str(cell), "--tasks", "piqa", "--limit", "3", "--no-progress"]
    assert cli.main([*ev, "--json", str(e)]) == 0
    assert (
        json.loads(e.read_text())["tasks"]["piqa"]["metrics"] == docs[1]["tasks"]["piqa"]["metrics"]
    )

    report = json.loads((tmp_path / "c.json").read_text())
    row = next(r for r in report["rows"] if r["run_dir"] == str(cell))
    assert row["tasks_status"] == "ran" and row["evals"] == str(paths[1])
    piqa = docs[1]["tasks"]["piqa"]["metrics"]
    assert row["tasks"]["piqa"]["value"] == piqa["acc_norm"]
    assert row["tasks"]["lambada"]["metric"] == "acc" and row["tasks_average"] is not None
    assert report["float"]["tasks_status"] == "ran"
    assert report["protocol"]["task_n"] == {"piqa": 3, "lambada": 3}
    md = (tmp_path / "c.md").read_text()
    assert "| PIQA ↑ | LAMBADA ↑ | Avg ↑ |" in md
    cells = [row["tasks"]["piqa"], row["tasks"]["lambada"], row["tasks_average"]]
    rtn_line = next(
        line for line in md.splitlines() if line.startswith("| RTN (ExecuTorch-like) | 8-8-8")
    )
    assert rtn_line.endswith(" | ".join(cm._score_text(c) for c in cells) + " |")
    assert "(seed 0)" in md and "PIQA 3, LAMBADA 3" in md

    # resumable: a second invocation reads every task back, scores nothing, rewrites nothing
    mtimes = [p.stat().st_mtime_ns for p in paths]

    def no_scoring(*args, **kwargs):
        raise AssertionError("a cached task was scored again")

    monkeypatch.setattr(cli, "zero_shot_report", no_scoring)
    assert cm.main(argv) == 0
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    again = json.loads((tmp_path / "c.json").read_text())
    row2 = next(r for r in again["rows"] if r["run_dir"] == str(cell))
    assert row2["tasks_status"] == "reused" and row2["tasks"] == row["tasks"]
    assert again["float"]["tasks"] == report["float"]["tasks"]


def test_init_study_encodings_on_the_tiny_model(ist, tiny_cfg, tiny_params):
    from qnpu_jax.pipeline.calibrate import build_state
    from qnpu_jax.pipeline.run import evaluate

    windows = np.asarray(jax.random.randint(jax.random.key(1), (2, 16), 0, tiny_cfg.vocab_size))
    cells = [(4, init) for init in ist.INITS]
    stats = ist.activation_stats(tiny_params, tiny_cfg, windows, 256, ())
    acts = ist.activation_encodings(stats, cells, tiny_cfg.num_layers)
    weights = ist.weight_encodings(tiny_params, cells, tiny_cfg.num_layers)
    for encodings, path in ((acts, "layers/mlp_in"), (weights, "layers/up_proj")):
        s = {init: encodings[(4, init)][path][0] for init in ist.INITS}
        # clipping at a higher percentile never gives a smaller range; Max-Min is the widest
        assert np.all(s["clip99"] <= s["clip99.9"] + 1e-7)
        assert np.all(s["clip99.9"] <= s["clip99.99"] + 1e-7)
        assert np.all(s["clip99.99"] <= s["max_min"] + 1e-7)
        assert not np.allclose(s["clip99"], s["max_min"])
    assert acts[(4, "mean")]["layers/attn_in"][0].shape == (tiny_cfg.num_layers,)
    assert weights[(4, "mean")]["layers/down_proj"][0].shape == (
        tiny_cfg.num_layers,
        tiny_cfg.hidden_size,
        1,
    )
    for target, encodings in (("activations", acts), ("weights", weights)):
        plan = ist.eval_plan(target, 4, tiny_cfg.num_layers)
        assert set(plan.paths()) == {f"layers/{n}" for n in ist.TARGETS[target]}
        state = build_state(plan, tiny_cfg, encodings[(4, "clip99.9")])
        ppl = evaluate(tiny_params, state, plan, tiny_cfg, windows, ())["ppl"]
        assert np.isfinite(ppl)


def test_init_study_markdown_and_claims(ist):
    rows = [
        {"target": t, "rotation": r, "bits": b, "init": i, "ppl": p}
        for t in ist.TARGETS
        for r, b, i, p in [
            ("none", 8, "max_min", 20.0),
            ("none", 8, "mean", 900.0),
            ("hadamard", 8, "max_min", 19.0),
            ("hadamard", 8, "mean", 25.0),
            ("hadamard", 4, "max_min", 500.0),
            ("hadamard", 4, "mean", 40.0),
            ("hadamard", 4, "clip99.9", 140.0),
        ]
    ]
    claims = ist.claim_checks(rows)
    assert len(claims) == 7 and not any("NOT" in c for c in claims)
    report = {
        "model": "m",
        "command": "qnpu study init_study",
        "protocol": {
            "seq_len": 512,
            "eval_windows_used": 32,
            "eval_tokens": 16352,
            "calib_windows": 16,
            "seed": 0,
            "num_bins": 32768,
            "prefix": "none",
        },
        "float": {"ppl": 18.0, "rotated_ppl": 18.0},
        "rows": rows,
    }
    md = ist.render_markdown(report)
    assert "| 4-bit + with rotation | 500.00 | 40.00 | 140.00 | Mean (μ±3σ) |" in md
    assert "| 8-bit + without rotation | 20.00 | 900.00 | – | Max-Min |" in md


@pytest.fixture(scope="module")
def tc():
    return load_script("table_cost")


def test_table_cost_variants_change_only_the_table_tensors(tc, tiny_cfg, tiny_params):
    from qnpu_jax import QnpuError
    from qnpu_jax.pipeline import calibrate
    from qnpu_jax.pipeline.run import evaluate
    from qnpu_jax.quant import default_plan

    plan = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8)
    tokens = np.asarray(jax.random.randint(jax.random.key(5), (4, 24), 0, tiny_cfg.vocab_size))
    state = calibrate(tiny_params, tiny_cfg, plan, tokens)
    variants = {v.key: v for v in tc.table_variants(plan, state, tiny_params, tiny_cfg)}
    assert next(iter(variants)) == "run" and variants["run"].plan is plan
    assert variants["float-all"].plan.get("embed_tokens") is None
    assert {p for p, _ in plan.entries} - {p for p, _ in variants["float-all"].plan.entries} == {
        "embed_tokens", "embed_out", "final_norm_out", "lm_head"
    }  # fmt: skip
    assert set(variants["float-all"].state["outer"]) == set()  # only table tensors are outer
    w16 = variants["lm_head-w16"]
    assert w16.plan.get("lm_head").bits == 16 and w16.plan.get("embed_tokens").bits == 8
    head = np.asarray(tiny_params["lm_head"])
    np.testing.assert_allclose(
        np.asarray(w16.state["outer"]["lm_head"].scale)[:, 0],
        np.abs(head).max(axis=1) / 32767,
        rtol=1e-6,
    )
    assert float(w16.state["outer"]["lm_head"].qmax) == 32767
    assert w16.state["layers"] is state["layers"]
    # fewer bits on a table cost perplexity on these windows; float tables are the 16-bit ones'
    ppl = {
        k: evaluate(tiny_params, v.state, v.plan, tiny_cfg, tokens, ())["ppl"]
        for k, v in variants.items()
    }
    assert ppl["embed_tokens-w4"] != ppl["run"]
    assert abs(ppl["lm_head-w16"] / ppl["float-lm_head"] - 1) < 1e-3
    assert tc.table_bytes(10, 8, 4) == 40 + 40 and tc.table_bytes(10, 8, None) == 320
    with pytest.raises(QnpuError, match="embed_tokens"):
        tc.table_variants(variants["float-embed_tokens"].plan, state, tiny_params, tiny_cfg)


def test_error_budget_groups_drop_what_they_name(tiny_cfg):
    from qnpu_jax.quant import default_plan

    eb = load_script("error_budget")
    plan = default_plan(tiny_cfg.num_layers, w_bits=4, a_bits=8)
    paths = [p for p, _ in plan.entries]
    state = {
        "layers": {p[7:]: p for p in paths if p.startswith("layers/")},
        "outer": {p: p for p in paths if not p.startswith("layers/")},
    }
    dropped = {}
    for key, (_, drop) in eb.groups().items():
        kept_plan, kept_state = eb.without(plan, state, drop)
        gone = {p for p, _ in plan.entries} - {p for p, _ in kept_plan.entries}
        assert gone and all(drop(p) for p in gone)
        assert set(kept_state["layers"]) | set(kept_state["outer"]) == {
            p.removeprefix("layers/") for p, _ in kept_plan.entries
        }
        dropped[key] = gone
    assert dropped["down_in"] == {"layers/down_in"}
    assert dropped["kv"] == {"layers/k_rope", "layers/v_out"}
    assert "lm_head" not in dropped["weights"] and "layers/q_proj" in dropped["weights"]
    assert dropped["weights"].isdisjoint(dropped["activations"])
    assert dropped["down_out"] == {"layers/down_out"}  # the per-output rows split the group
    outputs = set().union(*(dropped[k] for k in eb.GROUP_SETS["outputs"]))
    assert outputs == dropped["linear_outputs"]
    assert set(eb.GROUP_SETS["groups"]) | set(eb.GROUP_SETS["outputs"]) == set(eb.groups())


def test_scale_drift_compares_the_learned_scales_with_their_rule(tiny_cfg, tiny_params):
    from qnpu_jax import QnpuError
    from qnpu_jax.pipeline import calibrate
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import build_plan

    sd = load_script("scale_drift")
    config = QuantizeConfig(model="smollm2-135m", method="quantnpu", w_bits=4, a_bits=8)
    plan = build_plan(config, tiny_cfg.num_layers, None)
    sub = sd.learnable_plan(plan, config)
    paths = [p for p, _ in sub.entries]
    assert {"layers/q_proj", "layers/attn_in", "layers/down_in"} <= set(paths)
    assert "layers/q_out" not in paths and "lm_head" not in paths  # stage 2 tensors
    frozen = sd.learnable_plan(plan, dataclasses.replace(config, learn_down_in=False))
    assert {p for p, _ in frozen.entries} == set(paths) - {"layers/down_in"}
    with pytest.raises(QnpuError, match="quarot run learns no encoding"):
        sd.learnable_plan(plan, dataclasses.replace(config, method="quarot"))

    tokens = np.asarray(jax.random.randint(jax.random.key(6), (4, 24), 0, tiny_cfg.vocab_size))
    ref = calibrate(tiny_params, tiny_cfg, sub, tokens)
    rows = sd.drift_rows(ref, ref, paths)
    assert [r["path"] for r in rows] == paths
    assert all(r["max_abs_log_ratio"] == 0 and r["at_floor"] == 0 for r in rows)
    scale = np.array(ref["layers"]["v_proj"].scale)  # [L, out, 1]
    scale[0, 0] *= np.e
    scale[1, 2] = 1e-8  # stage 1's positivity floor
    v = ref["layers"]["v_proj"].replace(scale=scale)
    moved = {**ref, "layers": {**ref["layers"], "v_proj": v}}
    row = {r["path"]: r for r in sd.drift_rows(moved, ref, paths)}["layers/v_proj"]
    assert row["scales"] == scale.size and row["at_floor"] == 1
    assert row["max_abs_log_ratio"] == pytest.approx(1.0)
    assert row["median_ratio"] == pytest.approx(1.0)
    short = {**moved, "layers": {**ref["layers"], "v_proj": v.replace(scale=scale[:1])}}
    with pytest.raises(ValueError, match="layers/v_proj"):
        sd.drift_rows(short, ref, ["layers/v_proj"])


def test_compare_passes_the_fp32_row_as_float_reference(cm):
    specs = {"wiki": "wiki", "wikitext2": "wikitext:/data/wiki.test.raw"}
    row = {"ppl": 15.2, "windows": 32, "tokens": 16352}
    got = cm.float_reference({"perplexity": {"wiki": row}}, specs)
    assert got == {"wiki": row}  # keyed by the spec quantize evaluates; missing sets omitted
    assert cm.float_reference(None, specs) is None


def test_script_command_records_a_rerunnable_line(monkeypatch):
    from qnpu_jax.environment import script_command, study_command

    line = study_command("restage2", ["--run", "runs/a b", "--json=x.json"])
    assert line == "qnpu study restage2 --run 'runs/a b' --json=x.json"
    monkeypatch.setattr("sys.argv", ["/venv/bin/qnpu", "study", "table_cost", "--run", "r"])
    assert study_command("table_cost") == "qnpu study table_cost --run r"
    monkeypatch.setattr("sys.argv", ["/abs/path/scripts/bench_forward.py", "--windows", "4"])
    assert script_command("/abs/path/scripts/bench_forward.py") == (
        "python scripts/bench_forward.py --windows 4"
    )
