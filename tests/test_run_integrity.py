"""Run directories and outputs that stay what they claim (issue 42, items 14-16, 18, 20): one
writer per run directory, a run tied to the digest of its base weights, `eval --onnx` scoring
the bytes it verified, outputs that never land inside an input or on a user's file, and temp
names that fit any legal output name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from qnpu_jax.cli import main
from qnpu_jax.pipeline.config import load_config, read_run_config
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.pipeline.run_manifest import RUN_LOCK, seal_run, verify_run
from qnpu_jax.quant import QuantPlan

DEAD_PID = 99_999_999  # above any pid_max: kill(pid, 0) says there is no such process


def _quantize_args(model: Path | str, out: Path) -> list[str]:
    sets = ["seq_len=32", "calib_windows=2", "eval_windows=1", "prefix=bos"]
    args = ["quantize", "--model", str(model), "--method", "rtn", "--bits", "w8a8"]
    return [*args, *(a for s in sets for a in ("--set", s)), "--out", str(out), "--no-progress"]


def _tree(root: Path) -> dict[str, bytes | str]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else "dir")
        for p in sorted(root.rglob("*"))
    }


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("qnpu: error: ")]


@pytest.fixture(scope="module")
def rtn_run(two_layer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An RTN W8A8 run of the 2-layer model, made over a lock file a killed qnpu left behind."""
    run = tmp_path_factory.mktemp("integrity") / "run"
    run.mkdir()
    (run / RUN_LOCK).write_text(f"{DEAD_PID}\n")  # stale: nobody holds its flock
    assert main(_quantize_args(two_layer_dir, run)) == 0
    assert not (run / RUN_LOCK).exists()  # removed at the end, never sealed
    verify_run(run)
    return run


def test_run_dir_names_and_reads_a_finished_run(rtn_run: Path) -> None:
    """`RunDir` (issue 39): every file of a finished run by its property, each reader giving
    what the file holds."""
    run = RunDir(rtn_run)
    assert run.is_sealed and run.has_config and run.has_model_json and run.has_report
    named = {
        run.config_path,
        run.model_json_path,
        run.plan_path,
        run.learned_path,
        run.report_path,
        run.manifest_path,
    }
    report = json.loads((rtn_run / "report.json").read_text())
    if report["sensitivity"] is not None:
        named.add(run.sensitivity_path())
    assert set(rtn_run.iterdir()) == named  # no stage 1, no resume/, the lock removed
    sealed = {rel.split("/", 1)[0] for rel in verify_run(rtn_run)["files"]}
    assert sealed == {p.name for p in named - {run.manifest_path}}
    assert read_run_config(run) == load_config(rtn_run / "config.yaml")
    assert run.read_report() == report
    assert run.read_plan() == QuantPlan.from_dict(json.loads((rtn_run / "plan.json").read_text()))
    meta = run.read_model_json()
    assert meta == json.loads((rtn_run / "model.json").read_text())
    assert meta["format"] == "qnpu-quantized-model" and [s["name"] for s in meta["steps"]]
    assert run.read_stage1_metrics() is None and not run.resume.has_model_json
    assert run.read_sensitivity() == report["sensitivity"]


# ------------------------------------------------------------------ 14: one writer per run


def test_a_second_quantize_is_refused_while_the_first_writes_the_run(
    two_layer_dir: Path, tmp_path: Path, capsys
) -> None:
    """Process A is held (deterministically, by a file handshake) right after it checked the
    empty --out; a second quantize on the same --out must be refused by name, not run beside
    it. Before the lock, B passed the same check and both exited 0."""
    run, ready, go = tmp_path / "run", tmp_path / "ready", tmp_path / "go"
    prelude = (
        "import pathlib, time\nimport qnpu_jax.pipeline.run as r\n_m = r.make_mesh\n"
        f"def held(*a):\n    pathlib.Path({str(ready)!r}).touch()\n"
        f"    while not pathlib.Path({str(go)!r}).exists():\n        time.sleep(0.01)\n"
        "    return _m(*a)\nr.make_mesh = held\n"
    )
    code = f"import sys\n{prelude}from qnpu_jax.cli import main\n"
    code += f"sys.exit(main({_quantize_args(two_layer_dir, run)!r}))\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "process A never reached the handshake"
            time.sleep(0.02)
        capsys.readouterr()
        for resume in ([], ["--resume"]):
            assert main([*_quantize_args(two_layer_dir, run), *resume]) == 2
            errors = _errors(capsys.readouterr().err)
            assert len(errors) == 1, errors
            assert (
                f"run directory {run} is in use by another qnpu process (pid {proc.pid})"
                in (errors[0])
            )
        assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK]  # B wrote nothing
        go.touch()
        assert proc.wait(timeout=600) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    verify_run(run)  # A's run, whole and sealed; its lock is gone
    assert not (run / RUN_LOCK).exists()


def test_resume_of_a_finished_run_says_it_is_complete(rtn_run: Path, tmp_path: Path, capsys):
    """--resume of a sealed run runs nothing (it used to redo stage 2 and the evaluation)."""
    run = tmp_path / "run"
    shutil.copytree(rtn_run, run)
    before = _tree(run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    args = ["quantize", "--config", str(run / "config.yaml"), "--out", str(run)]
    capsys.readouterr()
    assert main([*args, "--resume", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "is a finished run (its manifest.json is sealed): nothing to resume" in out.err
    assert _tree(run) == before
    # its evaluation cannot change this way: `qnpu eval --run` does that
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**config, "eval_windows": 2}))
    args = ["quantize", "--config", str(tmp_path / "c.yaml"), "--out", str(run)]
    assert main([*args, "--resume"]) == 2
    assert "qnpu eval --run" in capsys.readouterr().err
    assert _tree(run) == before


def test_quantize_out_a_dangling_symlink_says_so(two_layer_dir: Path, tmp_path: Path, capsys):
    link = tmp_path / "runs"
    link.symlink_to(tmp_path / "gone")
    for out in (link, link / "run"):
        capsys.readouterr()
        assert main(_quantize_args(two_layer_dir, out)) == 2
        (error,) = _errors(capsys.readouterr().err)
        assert f"{link}" in error and ("does not exist" in error or "dangling symlink" in error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


# ------------------------------------------------------------ 15: the base weights' digest


def _changed_copy(model: Path, out: Path) -> Path:
    """A copy of the HF checkpoint `model` with one tensor changed (still finite)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(model, out)
    state = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = (state[name] * np.float32(1.5)).astype(state[name].dtype)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_run_refuses_other_weights_found_by_its_model_spec(
    two_layer_dir: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A run made with a relative --model from folder A, then used from folder B, whose same
    relative path holds other weights: refused, naming both. Before the digest was recorded
    this evaluated and exported the other model with exit 0."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    shutil.copytree(two_layer_dir, a / "model")
    _changed_copy(two_layer_dir, b / "model")
    run = tmp_path / "run"
    monkeypatch.chdir(a)
    assert main(_quantize_args("model", run)) == 0
    weights = json.loads((run / "model.json").read_text())["weights"]
    assert weights["location"] == str((a / "model").resolve())
    assert list(weights["sha256"]) == ["model.safetensors"]
    ev = ["eval", "--run", str(run), "--data", "wiki", "--seq-len", "32", "--max-windows", "1"]
    capsys.readouterr()
    assert main([*ev, "--no-progress"]) == 0
    monkeypatch.chdir(b)
    for args in (ev, ["export", "--run", str(run), "--out", str(tmp_path / "art")]):
        assert main(args) == 2
        (error,) = _errors(capsys.readouterr().err)
        assert str((a / "model").resolve()) in error and str((b / "model").resolve()) in error
        assert "other weights" in error
    assert not (tmp_path / "art").exists()
    # a run saved before the digest was recorded still loads (on whatever the spec finds)
    meta = json.loads((run / "model.json").read_text())
    del meta["weights"]
    (run / "model.json").write_text(json.dumps(meta))
    seal_run(run)
    assert main([*ev, "--no-progress"]) == 0


# ------------------------------------------------------------ 16: eval --onnx, bytes once


@pytest.fixture(scope="module")
def onnx_export(rtn_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("onnx") / "export"
    args = ["export", "--run", str(rtn_run), "--format", "onnx", "--out", str(out)]
    assert main([*args, "--prefill-chunk", "16", "--max-context", "64"]) == 0
    return out


def test_eval_onnx_scores_the_bytes_it_verified(
    onnx_export: Path, tmp_path: Path, monkeypatch
) -> None:
    """Files replaced on disk right after the verification (a re-export landing in between,
    made deterministic by a hook) do not reach onnxruntime. Before, the sessions reopened the
    files by path and scored the other weights with exit 0."""
    import qnpu_jax.export.artifact as artifact
    import qnpu_jax.runtime.onnx_run as onnx_run

    export = tmp_path / "export"
    shutil.copytree(onnx_export, export)
    ev = ["eval", "--onnx", str(export), "--data", "wiki", "--seq-len", "32", "--max-windows"]
    ev += ["1", "--no-progress", "--json"]
    assert main([*ev, str(tmp_path / "before.json")]) == 0
    real = artifact.read_artifact

    def then_replaced(path: Path):
        art = real(path)
        data = (export / "model.data").read_bytes()  # other weights, the same layout
        half = len(data) // 2
        (export / "model.data").write_bytes(data[:half] + bytes(len(data) - half))
        return art

    monkeypatch.setattr(onnx_run, "read_artifact", then_replaced)
    assert main([*ev, str(tmp_path / "after.json")]) == 0
    before, after = (json.loads((tmp_path / f).read_text()) for f in ("before.json", "after.json"))
    assert after["ppl"] == before["ppl"]
    monkeypatch.setattr(onnx_run, "read_artifact", real)
    assert main([*ev, str(tmp_path / "later.json")]) == 2  # the next read sees the change


def test_onnx_graph_with_its_weights_inline_scores_the_same(onnx_export: Path) -> None:
    """The fallback for an onnxruntime without in-memory external data: the initializers
    copied into the graph give the same logits."""
    import onnxruntime as ort

    from qnpu_jax.runtime.onnx_run import OnnxModel, _inlined

    graph = (onnx_export / "model.onnx").read_bytes()
    data = (onnx_export / "model.data").read_bytes()
    session = ort.InferenceSession(
        _inlined(graph, "model.data", data), providers=["CPUExecutionProvider"]
    )
    tokens = np.arange(1, 17)  # one prefill chunk
    inline = OnnxModel(onnx_export, sessions={"prefill": session}).logits(tokens)
    np.testing.assert_allclose(inline, OnnxModel(onnx_export).logits(tokens), atol=1e-4)


# ---------------------------------------------------------- 18: outputs and users' files


def test_aimet_export_replaces_its_own_file_and_nothing_else(
    rtn_run: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "aimet"
    args = ["export", "--run", str(rtn_run), "--format", "aimet", "--out", str(out)]
    assert main(args) == 0
    assert main([*args, "--aimet-version", "0.6.1"]) == 0  # ours: replaced
    path = out / f"{rtn_run.name}.encodings"
    assert json.loads(path.read_text())["version"] == "0.6.1"
    path.write_text(json.dumps(json.loads(path.read_text())))  # re-indented by a user
    before = path.read_bytes()
    capsys.readouterr()
    assert main(args) == 2
    assert "not an encodings file that qnpu wrote" in capsys.readouterr().err
    assert path.read_bytes() == before
    assert main(["export", "--run", str(rtn_run), "--format", "aimet", "--out", str(rtn_run)]) == 2
    assert "is inside --run" in capsys.readouterr().err


# --------------------------------------------------------------------- 20: minor rough edges


def test_export_to_a_250_byte_name_and_the_leftovers_of_killed_exports(
    rtn_run: Path, tmp_path: Path, capsys
) -> None:
    art = tmp_path / ("a" * 250)
    export = ["export", "--run", str(rtn_run), "--max-context", "64", "--prefill-chunk", "16"]
    assert main([*export, "--out", str(art)]) == 0
    assert main([*export, "--out", str(art)]) == 0  # replaced, through bounded temp names
    assert sorted(p.name for p in tmp_path.iterdir()) == [art.name]
    capsys.readouterr()
    assert main([*export, "--out", str(tmp_path / ("b" * 256))]) == 2  # refused up front
    assert "the name is 256 bytes" in capsys.readouterr().err
    # a kill between the two renames: the message says where the previous artifact is
    short = tmp_path / "art"
    aside = tmp_path / f".art.old-{DEAD_PID}-abcd1234"
    aside.mkdir()
    art.rename(aside / "old")
    emulate = ["emulate", "--artifact", str(short), "--prompt", "hi", "--max-new-tokens", "1"]
    assert main(emulate) == 2
    assert f"the previous artifact is at {aside / 'old'}" in capsys.readouterr().err
    # the next export into this directory removes every dead writer's temp dirs, whatever
    # their name; a live process's stay
    stale = tmp_path / f".other.tmp-{DEAD_PID}-abcd1234"
    live = tmp_path / f".other.tmp-{os.getpid()}-abcd1234"
    for d in (stale, live):
        d.mkdir()
    assert main([*export, "--out", str(short)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["art", live.name])
