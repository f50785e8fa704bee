"""Smoke tests of the studies compare_methods and init_study: the run grid, the
target checks, the reports, and the init study's encodings on the tiny random model (no real
model runs here; the scripts' docstrings give the full commands)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from conftest import SHARED_DATA, load_script  # tests/ is on sys.path (rootdir conftest)


@pytest.fixture(scope="module")
def cm():
    return load_script("compare_methods")


@pytest.fixture(scope="module")
def ist():
    return load_script("init_study")


def test_compare_grid_matches_the_settings(cm, tmp_path, monkeypatch):
    monkeypatch.setenv("QNPU_DATA_DIR", str(SHARED_DATA))  # the default --wikitext's home
    args = cm.parse_args(["--runs-dir", str(tmp_path), "--steps", "3"])
    table, ablation = cm.grid(args)
    assert len(table) == 2 * 3 * 4 and len(ablation) == 6
    names = {c.run_dir.name for c in table + ablation}
    assert "quantnpu-w4a8kv8-ours" in names and "rtn-w8a8kv8-table1" in names
    assert "quantnpu-w4a4kv8-ablation-static-joint" in names
    for c in table:
        cfg = c.config
        assert cfg.eval.data[0] == "wiki" and cfg.eval.data[1].startswith("wikitext:")
        assert cfg.eval.data[1] == f"wikitext:{SHARED_DATA / 'wikitext-2-raw/wiki.test.raw'}"
        if c.setting == "table1":
            assert (cfg.bits.down_in, cfg.promotions.down_in) == (16, 0.0)
        elif c.method == "quantnpu":
            assert (cfg.bits.down_in, cfg.promotions.down_in) == (8, 0.1)
        else:
            assert (cfg.bits.down_in, cfg.promotions.down_in) == (8, 0.0)
        # stage-1 flags reach only the methods with a stage 1 (so other runs stay reusable)
        assert (cfg.stage1.steps == 3) == (c.method in ("spinquant", "quantnpu"))
    static_joint, init, selective, mixed10, mixed100, frozen = (c.config for c in ablation)
    assert all(c.config.scope == "linears" and c.config.bits.w == 4 for c in ablation)

    def knobs(c):
        return c.init_scheme, c.mobilequant.selective, c.promotions.down_in

    assert knobs(static_joint)[:2] == ("max_min", False)
    assert knobs(init) == ("aware", False, 0.0)
    assert knobs(selective)[1:] == (True, 0.0)
    assert (mixed10.promotions.down_in, mixed100.promotions.down_in) == (0.1, 1.0)
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


def _entry(cm, setting, bits, method, wiki, ratio):
    return {
        "method": method,
        "bits": bits,
        "setting": setting,
        "run_dir": f"runs/{method}",
        "status": "ran",
        "ppl": {"wiki": wiki, "wikitext2": wiki},
        "ratio": {"wiki": ratio, "wikitext2": ratio},
    }


def test_compare_target_checks(cm):
    entries = [
        _entry(cm, "table1", "W8A8", "quantnpu", 20.2, 1.01),
        _entry(cm, "table1", "W4A8", "quantnpu", 22.0, 1.10),
        _entry(cm, "table1", "W4A8", "rtn", 30.0, 1.5),
        _entry(cm, "table1", "W4A8", "quarot", 21.0, 1.05),  # beats Quant.npu
        _entry(cm, "table1", "W4A8", "spinquant", 40.0, 2.0),
        _entry(cm, "table1", "W4A4", "quantnpu", 40.0, 2.0),
        _entry(cm, "ours", "W4A8", "quantnpu", 22.0, 1.10),
        _entry(cm, "ours", "W4A8", "rtn", 30.0, 1.5),
    ]
    checks = cm.target_checks(entries)
    status = {(c["setting"], c["bits"], c["eval"]): c["status"] for c in checks}
    assert status[("table1", "W8A8", "wiki")] == "met"
    assert status[("table1", "W4A8", "wiki")] == "not met"  # ratio fine, not below QuaRot
    assert status[("table1", "W4A4", "wikitext2")] == "not met"
    assert status[("ours", "W4A8", "wiki")] == "incomplete"  # quarot, spinquant not run
    assert status[("ours", "W8A8", "wiki")] == "not run"
    line = next(c["line"] for c in checks if c["setting"] == "table1" and c["bits"] == "W4A8")
    assert "NOT below all" in line and line.endswith("— not met")


def test_compare_grid_scores_zero_shot_tasks_and_reads_them_back(
    cm, two_layer_dir, wikitext_test_path, tmp_path, monkeypatch
):
    """FP32, one RTN cell and one ablation cell (static joint, one stage-1 step) of the 2-layer
    model with --tasks piqa,lambada --limit 3: an evals JSON per row in the `qnpu eval --json`
    layout, scored as `qnpu eval --run` scores it; the report built by qnpu_jax.report from the
    run directories (main table with × float, ablation table, target checks, the cells without
    a row); a second invocation only reads everything back."""
    import json

    import qnpu_jax.cli as cli

    runs = tmp_path / "runs"
    out = tmp_path / "reports" / "c"
    argv = [
        *("--model", str(two_layer_dir), "--methods", "float,rtn", "--bits", "W8A8"),
        *("--settings", "table1", "--seq-len", "32", "--calib-windows", "2"),
        *("--variants", "static-joint", "--ablation-bits", "W8A8", "--steps", "1"),
        *("--stage1-batch-size", "1", "--grad-accum", "1", "--checkpoint-every", "1"),
        *("--eval-windows", "2", "--wikitext", str(wikitext_test_path), "--runs-dir", str(runs)),
        *("--out", str(out), "--no-progress", "--tasks", "piqa,lambada", "--limit", "3"),
        *("--task-data", str(SHARED_DATA)),
    ]
    assert cm.main(argv) == 0
    cell = runs / "rtn-w8a8kv8-table1"
    ablation = runs / "quantnpu-w8a8kv8-ablation-static-joint"
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
    ev += ["--task-data", str(SHARED_DATA)]
    assert cli.main([*ev, "--json", str(e)]) == 0
    assert (
        json.loads(e.read_text())["tasks"]["piqa"]["metrics"] == docs[1]["tasks"]["piqa"]["metrics"]
    )

    assert sorted(p.name for p in out.parent.iterdir()) == ["c.html", "c.json", "c.md"]
    report = json.loads(out.with_suffix(".json").read_text())
    fp, row = report["rows"]  # the FP32 row, then the one finished cell of the main grid
    assert (fp["kind"], fp["method"]) == ("float", "FP32") and row["source"] == str(cell)
    run_report = json.loads((cell / "report.json").read_text())["perplexity"]["wiki"]
    assert row["ratio"]["wiki"] == pytest.approx(run_report["ratio"])
    assert row["tasks"]["piqa"]["value"] == docs[1]["tasks"]["piqa"]["metrics"]["acc_norm"]
    assert row["tasks"]["lambada"]["metric"] == "acc" and row["average"] is not None
    assert fp["tasks"]["piqa"]["value"] == docs[0]["tasks"]["piqa"]["metrics"]["acc_norm"]
    entry = next(g for g in report["grid"] if g["run_dir"] == str(cell))
    assert entry["tasks_status"] == "ran" and entry["evals"] == str(paths[1])
    assert [s["name"] for s in entry["recipe"]] == ["plan", "calibrate"]  # recipes.rtn
    abl = report["ablation"]["rows"]
    assert [r["method"] for r in abl] == ["FP32", "static joint"]
    assert abl[1]["source"] == str(ablation) and abl[1]["ratio"]["wiki"] > 0
    assert [g["status"] for g in report["grid"]].count("ran") == 2
    assert report["command"].startswith("qnpu study compare_methods") and report["environment"]

    md = out.with_suffix(".md").read_text()
    assert "| × float wiki |" in md and "| PIQA | LAMBADA |" in md and "| Avg ↑ |" in md
    rtn_line = next(line for line in md.splitlines() if line.startswith("| RTN |"))
    assert f"| {row['ratio']['wiki']:.3f} |" in rtn_line
    assert f"| {row['cells']['Avg ↑']} |" in rtn_line
    assert "## Ablation (paper Table 2): Quant.npu W8A8 KV8" in md
    assert "[table1] Quant.npu W8A8 KV8 on wiki: <= 1.02x float — not run" in md
    assert f"`{runs / 'quantnpu-w4a4kv8-ours'}`: not run" in md  # the cells without a row
    assert "a seeded subset of 3 items per task (seed 0)" in md and "PIQA 3, LAMBADA 3" in md

    # resumable: a second invocation reads every task back, scores nothing, rewrites nothing
    mtimes = [p.stat().st_mtime_ns for p in paths]

    def no_scoring(*args, **kwargs):
        raise AssertionError("a cached task was scored again")

    monkeypatch.setattr(cm, "zero_shot_report", no_scoring)
    assert cm.main(argv) == 0
    assert [p.stat().st_mtime_ns for p in paths] == mtimes
    again = json.loads(out.with_suffix(".json").read_text())
    entry2 = next(g for g in again["grid"] if g["run_dir"] == str(cell))
    assert entry2["status"] == "reused" and entry2["tasks_status"] == "reused"
    assert again["rows"][1]["tasks"] == row["tasks"] and again["rows"][0]["tasks"] == fp["tasks"]


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
    assert dropped["residual"] == {"layers/resid_attn", "layers/resid_mlp"}
    assert "lm_head" not in dropped["weights"] and "layers/q_proj" in dropped["weights"]
    assert dropped["weights"].isdisjoint(dropped["activations"])
    assert dropped["down_out"] == {"layers/down_out"}  # the per-output rows split the group
    sets = eb.group_sets()
    outputs = set().union(*(dropped[k] for k in sets["outputs"]))
    assert outputs == dropped["linear_outputs"]
    inputs = set().union(*(dropped[k] for k in sets["inputs"]))
    assert inputs == dropped["rotated_inputs"] and dropped["attn_out"] == {"layers/attn_out"}
    weights = set().union(*(dropped[k] for k in sets["weights"]))
    assert weights == dropped["weights"] and dropped["up_proj"] == {"layers/up_proj"}
    assert set().union(*map(set, sets.values())) == set(eb.groups())
    # on Gemma 3's rotation graph the rotated inputs are the rotation linears' outputs (its
    # pre-norms' outputs are 16-bit, read by those linears), and their outputs are outputs
    from qnpu_jax.ir.graph import GEMMA3_ROTATION_GRAPH

    gemma = eb.group_sets(GEMMA3_ROTATION_GRAPH)
    assert gemma["inputs"] == ("attn_in_rot", "attn_out", "mlp_in_rot")
    assert {"attn_in_rot", "o_out", "down_out"} <= set(gemma["outputs"])
    assert {"attn_in_proj", "mlp_in_proj", "up_proj"} <= set(gemma["weights"])  # R1's alone
    # a weight's name is no activation's (each row drops the one path it names; a rotation
    # linear's output is also the next linears' rotated input: one tensor, one row)
    assert set(gemma["weights"]).isdisjoint({*gemma["outputs"], *gemma["inputs"]})
    assert eb.groups(GEMMA3_ROTATION_GRAPH)["mlp_in_proj"][1]("layers/mlp_in_proj")
    assert set().union(*map(set, gemma.values())) == set(eb.groups(GEMMA3_ROTATION_GRAPH))


def test_scale_drift_compares_the_learned_scales_with_their_rule(tiny_cfg, tiny_params):
    from qnpu_jax import QnpuError
    from qnpu_jax.pipeline import calibrate
    from qnpu_jax.pipeline.config import QuantizeConfig
    from qnpu_jax.pipeline.recipes import build_plan

    sd = load_script("scale_drift")
    config = QuantizeConfig.of(model="smollm2-135m", method="quantnpu", w_bits=4, a_bits=8)
    plan = build_plan(config, tiny_cfg.num_layers)
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


def test_matmul_peak_prints_and_reports_a_positive_rate(tmp_path, capsys):
    """scripts/matmul_peak.py (the first line of every CI log): the printed rate and the JSON
    report agree, and a non-positive size is refused."""
    import json

    peak = load_script("matmul_peak")
    assert peak.main(["--size", "64", "--json", str(tmp_path / "p.json")]) == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "p.json").read_text())
    assert report["size"] == 64 and report["matmul_peak_flops_per_second"] > 0
    assert f"{report['matmul_peak_flops_per_second'] / 1e9:.1f} GFLOP/s" in printed
    assert report["command"].startswith("python scripts/matmul_peak.py")
    with pytest.raises(SystemExit):
        peak.main(["--size", "0"])


def test_program_log_counts_programs_compiled_again_and_shape_variants(tmp_path, capsys):
    """scripts/program_log.py, on a log as tests/conftest.py writes it: a program compiled
    twice is counted once as compiled again, and two signatures that differ only in a size are
    one structure with one shape variant; a gzipped log reads the same; a missing log is
    refused."""
    import gzip
    import json

    program_log = load_script("program_log")
    rows = [
        ("jit_f", "(tensor<2x32xi32>) -> tensor<2x32xf32>", "a", "t1", 1.0),
        ("jit_f", "(tensor<2x32xi32>) -> tensor<2x32xf32>", "a", "t2", 1.5),
        ("jit_f", "(tensor<2x24xi32>) -> tensor<2x24xf32>", "b", "t3", 2.0),
        ("jit_f", "(tensor<2x24xf32>) -> tensor<2x24xf32>", "c", "t3", 0.5),
        ("jit_g", "(tensor<i32>) -> tensor<i32>", "d", "t1", 0.25),
    ]
    log = tmp_path / "programs.jsonl"
    keys = ("fun", "signature", "program", "test", "seconds")
    log.write_text("".join(json.dumps(dict(zip(keys, r, strict=True))) + "\n" for r in rows))
    assert program_log.main([str(log), "--json", str(tmp_path / "s.json")]) == 0
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["compiles"] == 5 and doc["seconds"] == 5.2
    f, g = doc["functions"]
    assert (f["fun"], f["compiles"], f["programs"], f["compiled_again"]) == ("jit_f", 4, 3, 1)
    assert f["compiled_again_seconds"] == 1.5 and f["tests"] == 3
    assert (f["signatures"], f["structures"], f["shape_variants"]) == (3, 2, 1)
    # t2's program has t1's signature; t3's 24-token program is 32's at another size (2.0 s
    # against 2.5 s for the 32-token signature)
    assert (f["same_signature_other_programs"], f["same_signature_other_seconds"]) == (1, 1.5)
    assert f["shape_variant_seconds"] == 2.0 and doc["shape_variant_seconds"] == 2.0
    assert (g["fun"], g["shape_variants"], g["compiled_again"]) == ("jit_g", 0, 0)
    assert "5 programs compiled" in capsys.readouterr().out
    gz = tmp_path / "programs.jsonl.gz"
    gz.write_bytes(gzip.compress(log.read_bytes()))
    assert program_log.main([str(gz), "--json", str(tmp_path / "z.json")]) == 0
    assert json.loads((tmp_path / "z.json").read_text()) == doc
    assert program_log.main([str(tmp_path / "none.jsonl")]) == 2
