"""The fault matrix: bad input against a small real run and its artifact, through `qnpu`.

Each row corrupts a copy of the run or the artifact (or gives a command a bad argument), runs
the command and checks three things: the exit status is 2, the message names the problem, and
nothing outside the command's intended output changed (the output itself must not appear).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import yaml

from qnpu_jax.cli import main
from qnpu_jax.files import exclusive_lock
from qnpu_jax.integrity import seal
from qnpu_jax.limits import MAX_TEXT_BYTES
from qnpu_jax.pipeline.run_manifest import RUN_LOCK, seal_run

STEPS = 3


def _config(model: Path, **overrides: object) -> dict:
    return {
        "model": str(model),
        "method": "quantnpu",
        "w_bits": 4,
        "a_bits": 8,
        "seq_len": 32,
        "calib_windows": 2,
        "eval_windows": 1,
        "stage1": {"steps": STEPS, "batch_size": 1, "checkpoint_every": 1},
    } | overrides


@pytest.fixture(scope="module")
def pristine(two_layer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished 2-layer quick run, its artifact, its ONNX export and its config file (never
    modified)."""
    root = tmp_path_factory.mktemp("pristine")
    config = root / "c.yaml"
    config.write_text(yaml.safe_dump(_config(two_layer_dir)))
    run, art = root / "run", root / "art"
    assert main(["quantize", "--config", str(config), "--out", str(run), "--no-progress"]) == 0
    export = ["export", "--run", str(run), "--out", str(art), "--max-context", "64"]
    assert main([*export, "--prefill-chunk", "16"]) == 0
    onnx = root / "onnx"
    export = ["export", "--run", str(run), "--format", "onnx", "--out", str(onnx)]
    assert main([*export, "--max-context", "64", "--prefill-chunk", "16"]) == 0
    return {"run": run, "artifact": art, "onnx": onnx, "config": config, "model": two_layer_dir}


def _snapshot(root: Path) -> dict[str, str]:
    """sha256 (or link target) of every entry below `root`."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        else:
            out[rel] = "dir"
    return out


# ----------------------------------------------------------------------------- corruptions


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _edit_json(path: Path, edit: Callable[[dict], object], *, reseal: bool) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(seal(doc) if reseal else doc))


def _artifact_manifest(reseal: bool, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    return lambda art: _edit_json(art / "manifest.json", edit, reseal=reseal)


def _retensor(name: str, array: np.ndarray, *, dtype: str | None = None) -> Callable[[Path], None]:
    """Replace tensor `name`'s file by `array` and make the manifest match it again (hash,
    size, digest), so that only the .npy checks stand between it and the engines."""

    def apply(art: Path) -> None:
        path = art / "tensors" / f"{name}.npy"
        np.save(path, array, allow_pickle=True)
        data = path.read_bytes()

        def edit(doc: dict) -> None:
            entry = doc["tensors"][name]
            entry["sha256"], entry["nbytes"] = hashlib.sha256(data).hexdigest(), len(data)
            if dtype is not None:
                entry["dtype"] = dtype

        _edit_json(art / "manifest.json", edit, reseal=True)

    return apply


def _tensor_file(name: str, change: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda art: change(art / "tensors" / f"{name}.npy")


def _symlink_out(art: Path) -> None:
    path = art / "tensors" / "layers.pv.M.npy"
    outside = art.parent / "outside.npy"
    outside.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(outside)


def _learned_data_file(run: Path) -> Path:
    return max((run / "learned").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)


def _run_file(pick: Callable[[Path], Path], change: Callable[[Path], None], *, reseal: bool):
    def apply(run: Path) -> None:
        change(pick(run))
        if reseal:
            seal_run(run)

    return apply


def _scaled_rotation(run: Path) -> None:
    """R1 scaled by 1.01 (no longer orthogonal), written back as a valid checkpoint and a
    valid manifest: only the orthogonality check can refuse it."""
    from qnpu_jax.pipeline.quantized_model import restore_learned, save_learned

    learned = restore_learned(run)
    save_learned(run, np.asarray(learned["r1"]) * 1.01, learned["r2"], learned["state"])
    seal_run(run)


def _extra_learned_file(run: Path) -> None:
    (run / "learned" / "d" / "extra").write_bytes(b"x")


def _unsafe_run_path(run: Path) -> None:
    def edit(doc: dict) -> None:
        doc["files"]["../outside.txt"] = doc["files"].pop("plan.json")

    _edit_json(run / "manifest.json", edit, reseal=True)


# A lock held as a running `qnpu quantize` holds it: two open()s' flocks conflict even within
# one process, so a second qnpu in this process is refused deterministically (no sleeps).
_HELD = contextlib.ExitStack()


def _hold_run_lock(run: Path) -> None:
    _HELD.enter_context(exclusive_lock(run / RUN_LOCK, "the test's run"))


def _other_base_weights(run: Path) -> None:
    """The run's model spec now finds a copy of its model with one tensor changed (finite),
    the run resealed: only the recorded digest of the base weights can tell."""
    from safetensors.numpy import load_file, save_file

    config = yaml.safe_load((run / "config.yaml").read_text())
    other = run.parent / "other-model"
    shutil.copytree(config["model"], other)
    state = load_file(str(other / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = state[name] * np.float32(1.5)
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    (run / "config.yaml").write_text(yaml.safe_dump({**config, "model": str(other)}))
    seal_run(run)


def _user_encodings(run: Path) -> None:
    """A user's own AIMET encodings where `--format aimet --out mine` writes the run's."""
    (run.parent / "mine").mkdir()
    doc = {"version": "1.0.0", "activation_encodings": [], "param_encodings": []}
    (run.parent / "mine" / f"{run.name}.encodings").write_text(json.dumps(doc))


def _dangling_out(run: Path) -> None:
    (run.parent / "dangling").symlink_to(run.parent / "nowhere")


# -------------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class Row:
    name: str
    target: str  # "artifact" | "run" | "none": what is copied and corrupted first
    corrupt: Callable[[Path], None] | None
    args: Callable[[dict[str, Path], Path], list[str]]  # (inputs, out) -> qnpu arguments
    message: str  # a regular expression the error must match


def _emulate(p: dict[str, Path], out: Path) -> list[str]:
    return ["emulate", "--artifact", str(p["target"]), "--prompt", "hi", "--max-new-tokens", "2"]


def _export(p: dict[str, Path], out: Path) -> list[str]:
    return ["export", "--run", str(p["target"]), "--out", str(out), "--prefill-chunk", "16",
            "--max-context", "64"]  # fmt: skip


def _quantize(p: dict[str, Path], out: Path) -> list[str]:
    return ["quantize", "--config", str(p["config"]), "--out", str(out), "--no-progress"]


def _quantize_set(*overrides: str) -> Callable[[dict[str, Path], Path], list[str]]:
    """quantize with the pristine config and `--set` each override."""
    return lambda p, out: [*_quantize(p, out), *(a for o in overrides for a in ("--set", o))]


def _eval_data(spec: Callable[[dict[str, Path]], str]) -> Callable[[dict[str, Path], Path], list]:
    """eval of the 2-layer model on the data spec `spec(inputs)`."""
    return lambda p, out: ["eval", "--model", str(p["model"]), "--data", spec(p), "--seq-len", "8"]


ROWS = [
    # the artifact: files, manifest numbers, paths, .npy headers
    Row("artifact: flipped tensor byte", "artifact",
        _tensor_file("layers.q_proj.weight", _flip_byte), _emulate,
        r"layers\.q_proj\.weight\.npy: hash mismatch"),
    Row("artifact: truncated tensor", "artifact",
        _tensor_file("lm_head.weight", _truncate), _emulate,
        r"lm_head\.weight\.npy: size mismatch \(truncated\)"),
    Row("artifact: logits_scale doubled", "artifact",
        _artifact_manifest(False, lambda m: m["graph"].update(logits_scale=2.0**-15)), _emulate,
        r"manifest\.json: digest mismatch"),
    Row("artifact: norm_fraction_bits 8 -> 9, resealed", "artifact",
        _artifact_manifest(True, lambda m: m["graph"].update(norm_fraction_bits=9)), _emulate,
        r"norm_fraction_bits is 9; graph .* fixes it at 8"),
    Row("artifact: rope_fraction_bits, resealed", "artifact",
        _artifact_manifest(True, lambda m: m["graph"].update(rope_fraction_bits=12)), _emulate,
        r"rope_fraction_bits is 12"),
    Row("artifact: prefix token changed", "artifact",
        _artifact_manifest(False, lambda m: m["graph"].update(prefix_tokens=[2])), _emulate,
        r"digest mismatch"),
    Row("artifact: an encoding's scale changed", "artifact",
        _artifact_manifest(False, lambda m: m["encodings"]["layers.0.attn_in"].update(scale=[1.0])),
        _emulate, r"digest mismatch"),
    Row("artifact: eos_token_id outside the vocabulary, resealed", "artifact",
        _artifact_manifest(True, lambda m: m["tokenizer"].update(eos_token_id=10**6)), _emulate,
        r"eos_token_id 1000000 is not a token id"),
    Row("artifact: eos_token_id changed", "artifact",
        _artifact_manifest(False, lambda m: m["tokenizer"].update(eos_token_id=0)), _emulate,
        r"digest mismatch"),
    Row("artifact: max_context past the model's, resealed", "artifact",
        _artifact_manifest(True, lambda m: m["graph"].update(max_context=100000)), _emulate,
        r"max_context 100000 is not in 1\.\.8192"),
    Row("artifact: '..' path, resealed", "artifact",
        _artifact_manifest(True, lambda m: m["tensors"]["layers.pv.M"].update(file="../x.npy")),
        _emulate, r"contains '\.\.'"),
    Row("artifact: symlink out of the directory", "artifact", _symlink_out, _emulate,
        r"outside the artifact directory"),
    Row("artifact: pickled .npy", "artifact",
        _retensor("layers.pv.M", np.array([{"evil": 1}], dtype=object)), _emulate,
        r"holds Python objects \(pickled"),
    Row("artifact: big-endian .npy", "artifact",
        _retensor("layers.pv.M", np.ones(2, ">i4")), _emulate, r"stored big-endian"),
    Row("artifact: wrong dtype", "artifact",
        _retensor("layers.pv.M", np.ones(2, np.int16)), _emulate,
        r"layers\.pv\.M\.npy: dtype mismatch"),
    Row("artifact: wrong shape", "artifact",
        _retensor("layers.pv.M", np.ones(3, np.int32)), _emulate,
        r"layers\.pv\.M\.npy: shape mismatch"),
    Row("artifact: written by format version 1", "artifact",
        _artifact_manifest(False, lambda m: (m.update(version=1), m.pop("digest"))), _emulate,
        r"unsupported version 1 .*export the run again"),
    Row("emulate: more new tokens than the context holds", "artifact", None,
        lambda p, out: ["emulate", "--artifact", str(p["target"]), "--prompt", "hello world",
                        "--max-new-tokens", "100"],
        r"2-token prompt \(after the 1-token sink prefix\) and 100 new tokens need 102 "
        r"positions; the artifact's maximum context is 64 \(at most 62 new tokens fit\)"),
    Row("emulate --engine jax: more new tokens than the context holds", "artifact", None,
        lambda p, out: ["emulate", "--artifact", str(p["target"]), "--prompt", "hello world",
                        "--max-new-tokens", "63", "--engine", "jax"],
        r"and 63 new tokens need 65 positions; .* \(at most 62 new tokens fit\)"),
    Row("emulate --samples: a top-p outside (0, 1]", "artifact", None,
        lambda p, out: ["emulate", "--artifact", str(p["target"]), "--prompt", "hello world",
                        "--samples", "3", "--top-p", "1.5"],
        r"top_p must be in \(0, 1\], got 1.5"),
    Row("emulate --select beam: more new tokens than the context holds", "artifact", None,
        lambda p, out: ["emulate", "--artifact", str(p["target"]), "--prompt", "hello world",
                        "--samples", "2", "--select", "beam", "--max-new-tokens", "100"],
        r"and 100 new tokens need 102 positions"),
    Row("emulate: a prompt longer than the context", "artifact", None,
        lambda p, out: ["emulate", "--artifact", str(p["target"]), "--prompt", "hello " * 100,
                        "--max-new-tokens", "1"],
        r"101-token prompt .* need 102 positions; .* 64 \(the prompt alone does not fit\)"),
    # the run directory
    Row("run: flipped byte in learned/", "run",
        _run_file(_learned_data_file, _flip_byte, reseal=False), _export,
        r"learned/.*: hash mismatch"),
    Row("run: truncated learned/ file", "run",
        _run_file(_learned_data_file, _truncate, reseal=False), _export,
        r"learned/.*: size mismatch \(truncated\)"),
    Row("run: truncated learned/ file, resealed", "run",
        _run_file(_learned_data_file, _truncate, reseal=True), _export,
        r"learned: cannot restore the learned checkpoint"),
    Row("run: R1 not orthogonal, resealed", "run", _scaled_rotation, _export,
        r"rotation r1 is not orthogonal"),
    Row("run: plan.json edited", "run",
        _run_file(lambda r: r / "plan.json", _flip_byte, reseal=False), _export,
        r"plan\.json: hash mismatch"),
    Row("run: file added in learned/", "run", _extra_learned_file, _export,
        r"files the manifest does not list: learned/d/extra"),
    Row("run: no manifest (killed, or an older qnpu)", "run",
        lambda r: (r / "manifest.json").unlink(), _export,
        r"is not a finished run: manifest\.json is missing"),
    Row("run: manifest edited", "run",
        lambda r: _edit_json(r / "manifest.json", lambda d: d["files"].pop("plan.json"),
                             reseal=False), _export, r"manifest\.json: digest mismatch"),
    Row("run: '..' path in the manifest, resealed", "run", _unsafe_run_path, _export,
        r"contains '\.\.'"),
    Row("run: symlink out of the run", "run",
        lambda r: (shutil.move(r / "plan.json", r.parent / "plan.json"),
                   (r / "plan.json").symlink_to(r.parent / "plan.json")),
        _export, r"outside the run directory"),
    # command arguments and configs
    Row("export: --out a user folder holding manifest.json", "run",
        None, lambda p, out: _export(p, p["user"]), r"not a qnpu artifact"),
    Row("export: --max-context past the model's", "run", None,
        lambda p, out: [*_export(p, out)[:-1], "100000"],
        r"max context 100000 exceeds the model's 8192 positions"),
    Row("export: --out names a file", "run", None,
        lambda p, out: _export(p, p["file"]), r"exists and is not a directory"),
    Row("quantize: empty config file", "none", None,
        lambda p, out: _quantize({**p, "config": p["empty"]}, out), r"config file is empty"),
    Row("quantize: eval_data path that does not exist", "none", None,
        lambda p, out: _quantize({**p, "config": p["bad_eval"]}, out),
        r"eval_data 'wikitext:/nonexistent/wiki\.test\.raw': .*does not exist"),
    Row("quantize: calib_windows without bound", "none", None,
        lambda p, out: _quantize({**p, "config": p["many_windows"]}, out),
        r"calib_windows must be at most 4096"),
    Row("quantize: unknown config key", "none", None,
        lambda p, out: _quantize({**p, "config": p["unknown_key"]}, out),
        r"unknown config key\(s\) \['stage_1'\]"),
    Row("quantize: --out names a file", "none", None,
        lambda p, out: _quantize(p, p["file"]), r"exists and is not a directory"),
    Row("generate: more tokens than the model's context", "none", None,
        lambda p, out: ["generate", "--model", str(p["model"]), "--prompt", "hi",
                        "--max-new-tokens", "100000000"],
        r"100000000 new tokens need \d+ positions; the model's context is 8192"),
    Row("eval: truncated GGUF", "none", None,
        lambda p, out: ["eval", "--model", str(p["gguf"]), "--data", "wiki", "--seq-len", "8"],
        r"GGUF file .*trunc\.gguf: truncated or corrupt"),
    # bounds and types (issue 42)
    Row("eval: --data wikitext:/dev/zero", "none", None,
        _eval_data(lambda p: "wikitext:/dev/zero"),
        r"cannot read data file /dev/zero: it is a character device, not a regular file"),
    Row("eval: --data wikitext:FIFO (no writer: would block)", "none", None,
        _eval_data(lambda p: f"wikitext:{p['fifo']}"), r"data file .*fifo: it is a FIFO"),
    Row("eval: --data FIFO", "none", None,
        _eval_data(lambda p: str(p["fifo"])), r"data file .*fifo: it is a FIFO"),
    Row("eval: --data a sparse file past the text cap", "none", None,
        _eval_data(lambda p: f"wikitext:{p['sparse']}"),
        r"sparse\.raw: it is larger than the 512 MiB that qnpu reads \(536870913 bytes"),
    Row("eval: --data a file of NUL bytes", "none", None,
        _eval_data(lambda p: str(p["nul"])), r"nul\.txt: it holds NUL bytes, so it is not text"),
    Row("eval: --batch-size 10^6", "none", None,
        lambda p, out: [*_eval_data(lambda p: "wiki")(p, out), "--batch-size", "1000000"],
        r"--batch-size must be at most 256, got 1000000"),
    Row("eval: --seed 10^23", "none", None,
        lambda p, out: [*_eval_data(lambda p: "wiki")(p, out), "--seed", str(10**23)],
        r"--seed must be an integer in 0\.\.4294967295"),
    Row("emulate: --samples 10^8", "artifact", None,
        lambda p, out: [*_emulate(p, out), "--samples", "100000000"],
        r"--samples must be at most 64, got 100000000"),
    Row("plan-memory: --devices 10^6", "none", None,
        lambda p, out: ["plan-memory", "--model", "smollm2-135m", "--devices", "1000000"],
        r"--devices must be at most 4096, got 1000000"),
    Row("quantize: stage1.batch_size=10^8", "none", None,
        _quantize_set("stage1.batch_size=100000000"),
        r"stage 1 batch_size x grad_accum must be at most 4096, got 100000000"),
    Row("quantize: YAML alias bomb in eval_data", "none", None,
        lambda p, out: _quantize({**p, "config": p["bomb_eval_data"]}, out),
        r"bomb_eval_data\.yaml: more than 1048576 bytes of values once YAML aliases"),
    Row("quantize: YAML alias bomb in rules", "none", None,
        lambda p, out: _quantize({**p, "config": p["bomb_rules"]}, out),
        r"bomb_rules\.yaml: more than 1048576 bytes of values once YAML aliases"),
    Row("quantize: YAML alias bomb in --set", "none", None,
        lambda p, out: [*_quantize(p, out), "--set", "eval_data=" + _ALIAS_BOMB],
        r"--set 'eval_data=.*: more than 1048576 bytes of values once YAML aliases"),
    Row("quantize: --config a FIFO", "none", None,
        lambda p, out: _quantize({**p, "config": p["fifo"]}, out),
        r"config file .*fifo: it is a FIFO"),
    Row("quantize: --set model=123", "none", None, _quantize_set("model=123"),
        r"model must be a string, got 123$"),
    Row("quantize: --set model=[a,b]", "none", None, _quantize_set("model=[a,b]"),
        r"model must be a string, got \['a', 'b'\]$"),
    Row("quantize: --set calib_data=5 (refused before the model loads)", "none", None,
        _quantize_set("calib_data=5"), r"calib_data must be a string, got 5$"),
    Row("quantize: --set seed=10^23", "none", None, _quantize_set(f"seed={10**23}"),
        r"seed must be an integer in 0\.\.4294967295 \(32 bits\), got 1(0{23})$"),
    Row("quantize: --set stage1.remat=maybe", "none", None, _quantize_set("stage1.remat=maybe"),
        r"stage 1 remat must be true or false, got 'maybe'$"),
    Row("generate: a --prompt that is not UTF-8", "none", None,
        lambda p, out: ["generate", "--model", str(p["model"]), "--prompt", "hi \udcff"],
        r"--prompt is not valid UTF-8 text"),
    Row("emulate: a --prompt that is not UTF-8", "artifact", None,
        lambda p, out: ["emulate", "--artifact", str(p["target"]), "--prompt", "\udcff"],
        r"--prompt is not valid UTF-8 text"),
    # run integrity and outputs (issue 42)
    Row("run: quantize --resume while another qnpu holds the run", "run", _hold_run_lock,
        lambda p, out: [*_quantize(p, p["target"]), "--resume"],
        r"run directory .*/run is in use by another qnpu process \(pid \d+\)"),
    Row("run: quantize --out a run another qnpu is writing", "run", _hold_run_lock,
        lambda p, out: _quantize(p, p["target"]),
        r"run directory .*/run is in use by another qnpu process \(pid \d+\)"),
    Row("run: other weights at the run's model path, resealed", "run", _other_base_weights,
        _export, r"made from the base weights .*model\.safetensors sha256 [0-9a-f]{64}\), not "
                 r"from .*/other-model \(model\.safetensors sha256 [0-9a-f]{64}\): other weights"),
    Row("onnx: flipped byte in model.data", "onnx", lambda d: _flip_byte(d / "model.data"),
        lambda p, out: ["eval", "--onnx", str(p["target"]), "--data", "wiki", "--seq-len", "8"],
        r"model\.data: hash mismatch"),
    Row("eval: --json inside the artifact it reads", "artifact", None,
        lambda p, out: ["eval", "--artifact", str(p["target"]), "--data", "wiki", "--seq-len",
                        "8", "--json", str(p["target"] / "manifest.json")],
        r"--json .*/manifest\.json is inside --artifact"),
    Row("export: --out inside the run", "run", None,
        lambda p, out: _export(p, p["target"] / "learned" / "art"),
        r"--out .*/learned/art is inside --run"),
    Row("export --format aimet: --out the run itself", "run", None,
        lambda p, out: ["export", "--run", str(p["target"]), "--format", "aimet", "--out",
                        str(p["target"])], r"--out .*/run is inside --run"),
    Row("export --format aimet: a user's RUN.encodings in --out", "run", _user_encodings,
        lambda p, out: ["export", "--run", str(p["target"]), "--format", "aimet", "--out",
                        str(p["target"].parent / "mine")],
        r"mine/run\.encodings exists and is not an encodings file that qnpu wrote"),
    Row("quantize: --out a dangling symlink", "run", _dangling_out,
        lambda p, out: _quantize(p, p["target"].parent / "dangling"),
        r"--out .*/dangling is a symlink to .*/nowhere, which does not exist"),
]  # fmt: skip


@pytest.fixture(scope="module")
def inputs(pristine: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("inputs")
    configs = {
        "empty": "",
        "bad_eval": yaml.safe_dump(
            _config(pristine["model"], eval_data=["wiki", "wikitext:/nonexistent/wiki.test.raw"])
        ),
        "many_windows": yaml.safe_dump(_config(pristine["model"], calib_windows=10**6)),
        "unknown_key": yaml.safe_dump(_config(pristine["model"], stage_1={"steps": 1})),
    }
    paths: dict[str, Path] = {}
    for name, text in configs.items():
        paths[name] = root / f"{name}.yaml"
        paths[name].write_text(text)
    from qnpu_jax.models.load import builtin_model_path

    gguf = builtin_model_path("smollm2-135m")
    with gguf.open("rb") as f:
        (root / "trunc.gguf").write_bytes(f.read(gguf.stat().st_size // 3))
    return {**pristine, **paths, "gguf": root / "trunc.gguf", **_bounds_inputs(root, pristine)}


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_fault_matrix(row: Row, inputs: dict, tmp_path: Path, capsys) -> None:
    work = tmp_path / "work"
    work.mkdir()
    p = dict(inputs)
    if row.target != "none":
        p["target"] = work / row.target
        shutil.copytree(inputs[row.target], p["target"], symlinks=True)
        if row.corrupt is not None:
            row.corrupt(p["target"])
    p["user"] = work / "user"  # a user's folder that merely holds a manifest.json
    p["user"].mkdir()
    (p["user"] / "manifest.json").write_text('{"project": "mine"}')
    (p["user"] / "important.txt").write_text("precious")
    p["file"] = work / "a-file"
    p["file"].write_text("not a directory")
    out = work / "out"
    before = _snapshot(work)
    capsys.readouterr()
    assert main(row.args(p, out)) == 2, row.name
    err = capsys.readouterr().err  # phase announcements may come first
    errors = [line for line in err.splitlines() if line.startswith("qnpu: error: ")]
    assert len(errors) == 1 and re.search(row.message, errors[0]), err
    assert not out.exists()
    assert _snapshot(work) == before  # nothing else changed (no temp dirs, no partial files)


def test_fault_matrix_size() -> None:
    """The closing note quotes this count; at least the issue's items and the cases that
    already passed before it."""
    assert len(ROWS) >= 72  # 42 before issue 42; its bounds and types rows: 21; run integrity
    # and outputs: 9


# ---------------------------------------------------------------------------- kill -9 rows


def _spawn_qnpu(args: list[str], cwd: Path, prelude: str = "") -> subprocess.Popen:
    code = f"import sys\n{prelude}\nfrom qnpu_jax.cli import main\nsys.exit(main({args!r}))\n"
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the process ended first: {proc.stderr.read()}")  # type: ignore[union-attr]
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the process")
        time.sleep(0.02)


def test_kill_during_stage1_then_resume_equals_the_uninterrupted_run(
    inputs: dict, tmp_path: Path, capsys
) -> None:
    from qnpu_jax.pipeline.quantized_model import restore_learned

    run = tmp_path / "run"
    proc = _spawn_qnpu(_quantize(inputs, run), tmp_path)
    metrics = run / "stage1" / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 1, proc, 300)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "manifest.json").exists()  # killed: not a finished run
    capsys.readouterr()
    assert main(_export({"target": run}, tmp_path / "art")) == 2
    assert "not a finished run" in capsys.readouterr().err
    assert not (tmp_path / "art").exists()
    # The evaluation may change on resume (here: one more window); nothing else may.
    changed = tmp_path / "c.yaml"
    changed.write_text(yaml.safe_dump(_config(inputs["model"], eval_windows=2)))
    assert main(["quantize", "--config", str(changed), "--out", str(run), "--resume",
                 "--no-progress"]) == 0  # fmt: skip
    report = json.loads((run / "report.json").read_text())
    assert report["resumed"] is True and report["stage1_step_seconds"] > 0
    assert report["perplexity"]["wiki"]["windows"] == 2
    resumed, reference = restore_learned(run), restore_learned(inputs["run"])
    flat_a = dict(_leaves(resumed))
    flat_b = dict(_leaves(reference))
    assert flat_a.keys() == flat_b.keys()
    for key, value in flat_a.items():
        np.testing.assert_array_equal(value, flat_b[key], err_msg=str(key))


def _leaves(tree: object, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _leaves(v, f"{prefix}/{k}")
    else:
        yield prefix, np.asarray(tree)


def test_kill_during_export_leaves_the_previous_artifact_and_the_next_export_cleans_up(
    inputs: dict, tmp_path: Path
) -> None:
    art = tmp_path / "art"
    shutil.copytree(inputs["artifact"], art)
    before = _snapshot(art)
    # Slow every file write of the export down, so the kill lands while it writes.
    prelude = (
        "import time\nimport qnpu_jax.export.artifact as a\n_w = a.write_bytes_atomic\n"
        "a.write_bytes_atomic = lambda *x: (time.sleep(0.2), _w(*x))[1]"
    )
    args = _export({"target": inputs["run"]}, art)
    proc = _spawn_qnpu(args, tmp_path, prelude)
    temp = lambda: [p for p in tmp_path.iterdir() if p.name.startswith(".art.tmp-")]  # noqa: E731
    _wait_for(lambda: any((t / "tensors").is_dir() and any((t / "tensors").iterdir())
                          for t in temp()), proc, 300)  # fmt: skip
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert temp(), "the kill should leave the half-written temp dir"
    assert _snapshot(art) == before  # the previous artifact is untouched
    assert main(args) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # leftovers removed
    assert _snapshot(art) == before  # the same run exported again: byte-identical


# ------------------------------------------------------------ bounds and types (issue 42)


def _alias_bomb(leaf: str = "x", levels: int = 10, fan: int = 9) -> str:
    """A YAML flow list of a few hundred bytes whose aliases expand it to fan**levels leaves
    (3.5 billion): repr() of it, or any walk over it, never ends."""
    text = "[" + ", ".join([leaf] * fan) + "]"
    for i in range(levels - 1):
        text = f"[&a{i} {text}" + f", *a{i}" * (fan - 1) + "]"
    return text


_ALIAS_BOMB = _alias_bomb()


def _bounds_inputs(root: Path, pristine: dict[str, Path]) -> dict[str, Path]:
    """The odd files of the issue-42 rows: a FIFO nobody writes, a sparse file one byte past
    the text cap (no disk space used), a text file with NUL bytes, and configs holding an
    alias bomb in eval_data and in rules."""
    out = {"fifo": root / "fifo", "sparse": root / "sparse.raw", "nul": root / "nul.txt"}
    os.mkfifo(out["fifo"])
    with out["sparse"].open("wb") as f:
        f.truncate(MAX_TEXT_BYTES + 1)
    out["nul"].write_bytes(b"some text\0" * 100)
    base = yaml.safe_dump(_config(pristine["model"]))
    for name, text in {
        "bomb_eval_data": f"eval_data: {_ALIAS_BOMB}\n",
        "bomb_rules": f"rules: {_alias_bomb(leaf='{pattern: x}')}\n",
    }.items():
        out[name] = root / f"{name}.yaml"
        out[name].write_text(base + text)
    return out


def _one_error(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("qnpu: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_export_onnx_without_the_export_extra(
    inputs: dict, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without onnx installed: one error naming the extra, before the run is even read."""
    monkeypatch.setitem(sys.modules, "onnx", None)  # `import onnx` raises ImportError
    out = tmp_path / "onnx"
    before = _snapshot(inputs["run"])
    capsys.readouterr()
    assert main([*_export({"target": inputs["run"]}, out), "--format", "onnx"]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "need onnx, which is not installed: pip install 'qnpu_jax[export]'" in line, line
    assert not out.exists() and _snapshot(inputs["run"]) == before


def test_a_full_disk_while_writing_is_one_error(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOSPC from a write (the deterministic hook: the atomic writer fails as a full disk
    would) is one `qnpu: error:` line that says so; nothing is left behind."""
    import errno

    import qnpu_jax.files

    def full(path: Path, data: bytes) -> Path:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(qnpu_jax.files, "write_bytes_atomic", full)
    capsys.readouterr()
    assert main(["cost", "--json", str(tmp_path / "cost.json")]) == 2
    line = _one_error(capsys.readouterr().err)
    assert re.search(r"writing failed: no space left on the device \(.*cost\.json\)", line), line
    assert list(tmp_path.iterdir()) == []


def test_quantize_under_a_file_size_limit_is_one_error_and_leaves_the_run_unsealed(
    inputs: dict, tmp_path: Path
) -> None:
    """`ulimit -f`: orbax's checkpoint write fails with EFBIG in its own threads, which log a
    traceback each (468 lines before); now one `qnpu: error:` line, and the run unsealed.
    Run as the `qnpu` command runs (`cli.command`): orbax's other failed writes would
    otherwise print tracebacks at interpreter shutdown, in some runs and not others."""
    run = tmp_path / "run"
    prelude = (  # 256 KiB: the JSON files fit, the first orbax checkpoint does not
        "import resource\nresource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, 1 << 18))"
    )
    before = _snapshot(inputs["model"].parent)
    args = [*_quantize(inputs, run), "--set", "mixed_precision=0"]  # no sensitivity scan
    code = f"import sys\n{prelude}\nfrom qnpu_jax.cli import command\n"
    code += f"sys.argv = ['qnpu', *{args!r}]\ncommand()\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err
    line = _one_error(err)
    assert "writing failed: a file would exceed the file size limit (ulimit -f)" in line, line
    assert str(run.resolve()) in line  # where it failed
    assert "ERROR" not in err and len(err.splitlines()) < 20, err  # phase lines, settings
    assert (run / "config.yaml").is_file() and not (run / "manifest.json").exists()
    assert _snapshot(inputs["model"].parent) == before
