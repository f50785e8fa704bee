"""Shared fixtures: the real model is loaded once per session (compilation dominates on CI)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# One XLA compilation cache for the session and every process it starts (before JAX is
# imported, so the CLI subprocesses inherit it). The suite is bound by compiling the same
# programs again: after each module's `jax.clear_caches`, in each `qnpu` subprocess, for each
# new jit of the same function. The cache keys on the program and the compiler, so a hit runs
# the very executable a miss would have built.
# Under pytest-xdist the controller runs this first and its workers inherit the directory,
# so they share it too. Uncapped: a size cap makes JAX's LRUCache list, stat and read the
# access time of every entry under a file lock on each write, O(entries): 409 ms a write at
# 3,000 entries (`python3 scripts/cache_put_cost.py`; the suite held about 950 half-way, so
# it gained little: docs/results.md, session 39). Without
# the lock a process may read an entry another is still writing: its decompression fails, JAX
# warns ("Error reading persistent compilation cache entry") and compiles the program itself.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="qnpu-tests-xla-cache-")
    atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"
# The same for the data layer's cache (the parsed Wikipedia dump, token ids): the session's
# own, shared by its workers and subprocesses, and not the user's ~/.cache.
if "QNPU_CACHE_DIR" not in os.environ:
    _DATA_CACHE = tempfile.mkdtemp(prefix="qnpu-tests-data-cache-")
    atexit.register(shutil.rmtree, _DATA_CACHE, ignore_errors=True)
    os.environ["QNPU_CACHE_DIR"] = _DATA_CACHE

import jax
import numpy as np
import pytest

from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import init_random_params
from qnpu_jax.models.load import LoadedModel, load_model

# in case a plugin imported JAX before this file set the environment
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
if "JAX_COMPILATION_CACHE_MAX_SIZE" in os.environ:
    _max_size = int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"])
    jax.config.update("jax_compilation_cache_max_size", _max_size)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


# JAX's events for tracing, lowering and XLA's compile: each test's report carries what its
# process spent in them per phase (`compile_trace_setup`, `compile_xla_call`, ...; a
# persistent-cache hit's XLA figure is its read) and the cache's hits and misses (JAX counts a
# miss when it writes the entry: every one here, the threshold is 0; `qnpu` subprocesses are not
# counted); the session's summary adds them up. It is the figure to cut when CI's budget is
# tight.
_COMPILE_PARTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "xla",
}
_CACHE_COUNTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
}


class _CompileClock:
    """Seconds spent compiling since the last `take` (fed by jax.monitoring listeners), split
    into tracing, lowering and XLA (a persistent-cache hit's XLA figure is its read), and the
    cache's hits and misses; and XLA's seconds per jitted function, misses and hits apart
    (JAX counts a hit inside the XLA event that it belongs to)."""

    def __init__(self) -> None:
        self.figures: dict[str, float] = {}
        self.functions: dict[str, list[float]] = {}  # name -> [misses, s, hits, s]
        self._hit = False

    def record(self, event: str, duration: float, **kwargs: Any) -> None:
        if event in _COMPILE_PARTS:
            part = _COMPILE_PARTS[event]
            self.figures[part] = self.figures.get(part, 0.0) + duration
            if part == "xla":
                row = self.functions.setdefault(str(kwargs.get("fun_name")), [0, 0.0, 0, 0.0])
                at = 2 if self._hit else 0
                row[at] += 1
                row[at + 1] += duration
                self._hit = False

    def count(self, event: str, **_: Any) -> None:
        if event in _CACHE_COUNTS:
            name = _CACHE_COUNTS[event]
            self.figures[name] = self.figures.get(name, 0.0) + 1
            self._hit = self._hit or name == "hits"

    def take(self) -> tuple[dict[str, float], dict[str, list[float]]]:
        taken = self.figures, self.functions
        self.figures, self.functions = {}, {}
        return taken


_compile_clock = pytest.StashKey[_CompileClock]()


def pytest_configure(config: pytest.Config) -> None:
    clock = _CompileClock()
    jax.monitoring.register_event_duration_secs_listener(clock.record)
    jax.monitoring.register_event_listener(clock.count)
    config.stash[_compile_clock] = clock
    if os.environ.get(PROGRAM_LOG_ENV):
        _log_compiled_programs(Path(os.environ[PROGRAM_LOG_ENV]))


# QNPU_TESTS_PROGRAM_LOG=FILE: every program XLA compiles in the test processes (a persistent
# cache miss) appends a line to FILE: the jitted function, its arguments' types, a hash of the
# program without locations, the test and the seconds. `python3 scripts/program_log.py FILE`
# tells which programs differ only in a shape, and which compiled twice.
PROGRAM_LOG_ENV = "QNPU_TESTS_PROGRAM_LOG"


def _log_compiled_programs(path: Path) -> None:
    import hashlib
    import json
    import time

    from jax._src import compiler  # private: a diagnostic, off unless asked for

    compile_and_write = compiler._compile_and_write_cache

    def logged(backend: Any, computation: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        executable = compile_and_write(backend, computation, *args, **kwargs)
        seconds = time.monotonic() - start
        text = computation.operation.get_asm(enable_debug_info=False)
        main = next(
            (op for op in computation.body.operations if "main" in str(op.attributes["sym_name"])),
            None,
        )
        line = {
            "fun": str(computation.operation.attributes["sym_name"]).strip('"'),
            "signature": str(main.attributes["function_type"]) if main is not None else "",
            "program": hashlib.sha1(text.encode()).hexdigest()[:16],
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0],
            "seconds": round(seconds, 3),
        }
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
        return executable

    compiler._compile_and_write_cache = logged


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    # before the report is made, so that it carries the figure (xdist sends it to the controller)
    figures, functions = item.config.stash[_compile_clock].take()
    for name, value in figures.items():
        item.user_properties.append((f"compile_{name}_{call.when}", round(value, 3)))
    if functions:
        item.user_properties.append(("xla_by_function", functions))
    yield


def pytest_terminal_summary(terminalreporter: Any) -> None:
    seconds: dict[str, float] = {}  # nodeid -> setup + call + teardown
    figures: dict[str, dict[str, float]] = {}  # nodeid -> trace, lower, xla, hits, misses
    functions: dict[str, list[float]] = {}  # jitted function -> [misses, s, hits, s]
    for reports in terminalreporter.stats.values():
        for report in reports:
            if not isinstance(report, pytest.TestReport):
                continue
            seconds[report.nodeid] = seconds.get(report.nodeid, 0.0) + report.duration
            if report.when == "teardown":  # it carries the three phases' figures
                row = figures.setdefault(report.nodeid, {})
                for key, value in report.user_properties:
                    if key.startswith("compile_"):
                        name = key.split("_")[1]
                        row[name] = row.get(name, 0.0) + float(value)
                    elif key == "xla_by_function":
                        for fn, counts in value.items():
                            have = functions.setdefault(fn, [0, 0.0, 0, 0.0])
                            functions[fn] = [a + b for a, b in zip(have, counts, strict=True)]
    if not seconds:
        return
    parts = ("trace", "lower", "xla")
    compiling = {n: sum(f.get(p, 0.0) for p in parts) for n, f in figures.items()}
    part = {p: sum(f.get(p, 0.0) for f in figures.values()) for p in (*parts, "hits", "misses")}
    total, spent = sum(seconds.values()), sum(compiling.values())
    terminalreporter.write_line(
        f"compiling (trace, lower, XLA) in the test processes: {spent:.0f} s of the "
        f"tests' {total:.0f} s ({spent / max(total, 1e-9):.0%}): trace {part['trace']:.0f} s, "
        f"lower {part['lower']:.0f} s, XLA or cache read {part['xla']:.0f} s; persistent "
        f"cache {part['hits']:.0f} hits, {part['misses']:.0f} misses written"
    )
    top = sorted(compiling.items(), key=lambda kv: -kv[1])[:15]
    for nodeid, c in top:
        terminalreporter.write_line(f"  {c:7.1f} s compiling of {seconds[nodeid]:7.1f} s  {nodeid}")
    terminalreporter.write_line(
        "XLA by jitted function (the test processes): compiled n, s | read from the cache n, s"
    )
    for fn, (n, s, hn, hs) in sorted(functions.items(), key=lambda kv: -kv[1][1] - kv[1][3])[:20]:
        terminalreporter.write_line(f"  {n:5.0f} {s:7.1f} s | {hn:5.0f} {hs:7.1f} s  {fn}")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs() -> Any:
    """Drop JAX's compiled programs after each test module. One process running the whole
    suite otherwise keeps every program the engines compiled (a key window × batch × chunk
    shape each) and XLA later crashed while compiling (test_stage1, twice, after 570 tests);
    the programs' code mappings are the suspect."""
    yield
    jax.clear_caches()


def load_script(name: str) -> Any:
    """Study NAME (`qnpu_jax.studies.NAME`), or scripts/NAME.py as a module (once per session)."""
    import importlib
    import importlib.util
    import sys

    from qnpu_jax.studies import STUDIES

    if name in STUDIES:
        return importlib.import_module(f"qnpu_jax.studies.{name}")
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while built
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def run_artifact_ppl(run: Path, out: Path, *, seq_len: int = 32, windows: int = 2) -> dict:
    """`qnpu export` of a run into `out`, then `qnpu eval --artifact` on the emulator and on
    the JAX integer engine (wiki, the first `windows` windows): {engine: perplexity}."""
    import json

    from qnpu_jax.cli import main

    art = out / "artifact"
    export = ["export", "--run", str(run), "--out", str(art), "--max-context", "64"]
    assert main([*export, "--prefill-chunk", "16"]) == 0
    ppl = {}
    for engine in ("emulator", "jax"):
        ev = ["eval", "--artifact", str(art), "--engine", engine, "--data", "wiki"]
        ev += ["--seq-len", str(seq_len), "--max-windows", str(windows), "--no-progress"]
        assert main([*ev, "--json", str(out / f"{engine}.json")]) == 0
        ppl[engine] = json.loads((out / f"{engine}.json").read_text())["ppl"]
    return ppl


def engines_agree_with_fake_quant(
    int_model: Any, model: Any, ids: np.ndarray, rel: float = 0.02
) -> None:
    """The emulator and the JAX integer engine prefill `ids` [1, T] to the same logits and
    K/V cache, bit for bit, and the integer NLL is within `rel` of the fake-quant `model`'s."""
    from qnpu_jax.runtime.engines import open_engine

    emulator, jax_engine = open_engine("emulator", int_model), open_engine("jax", int_model)
    le, ce = emulator.prefill(ids)
    lj, cj = jax_engine.prefill(ids)
    np.testing.assert_array_equal(np.asarray(le), np.asarray(lj))
    np.testing.assert_array_equal(np.asarray(ce.k), np.asarray(cj.k))
    np.testing.assert_array_equal(np.asarray(ce.v), np.asarray(cj.v))
    nll_int = float(np.mean(emulator.token_nll(ids)))
    assert abs(nll_int / np.log(model.perplexity(ids)["ppl"]) - 1) < rel


@pytest.fixture(scope="session")
def smollm() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg: ModelConfig) -> dict:
    return init_random_params(tiny_cfg, jax.random.key(0))


@pytest.fixture(scope="session")
def two_layer_dir(smollm: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's real weights, first two decoder layers, as an HF directory."""
    import dataclasses

    from qnpu_jax.models.hf import save_hf_dir

    cfg = dataclasses.replace(smollm.config, num_layers=2)
    params = dict(smollm.params)
    params["layers"] = {k: v[:2] for k, v in smollm.params["layers"].items()}
    return save_hf_dir(tmp_path_factory.mktemp("m") / "smollm2-2l", cfg, params, smollm.tokenizer)


@pytest.fixture(scope="session")
def wikitext_test_path() -> Path:
    path = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if not path.is_file():
        pytest.fail(f"shared evaluation data missing: {path}")
    return path


def build_int_source(
    smollm: LoadedModel, *, w_bits: int, layers: int = 2, rules: tuple = ()
) -> dict:
    """A fake-quant model of the real weights cut to `layers` layers: R1/R2 Hadamard, the
    default plan at W`w_bits`A8KV8 with down_proj inputs at 8 and 16 bits (per-layer bits),
    then `rules`, BOS sink prefix, calibrated on two 64-token windows of the calib split."""
    import dataclasses

    from qnpu_jax.data import load_documents, tokenize_documents
    from qnpu_jax.data.sources import sample_windows
    from qnpu_jax.models.taps import sink_prefix
    from qnpu_jax.pipeline.calibrate import calibrate
    from qnpu_jax.quant.plan import QuantRule, default_plan
    from qnpu_jax.transforms import apply_rotations, fuse_norms, randomized_hadamard_rotations

    cfg = dataclasses.replace(smollm.config, num_layers=layers)
    params = dict(smollm.params)
    params["layers"] = jax.tree.map(lambda a: a[:layers], smollm.params["layers"])
    rotated = apply_rotations(
        fuse_norms(params, cfg), cfg, *randomized_hadamard_rotations(cfg, jax.random.key(1))
    )
    down_bits = tuple(16 if i % 2 else 8 for i in range(layers))
    plan = default_plan(
        layers,
        w_bits=w_bits,
        rules=[QuantRule(pattern="layers/down_in", layer_bits=down_bits), *rules],
    )
    tok = smollm.tokenizer
    windows = sample_windows(
        tokenize_documents(load_documents("wiki", "calib"), tok), 64, 2, jax.random.key(0)
    )
    prefix = sink_prefix("bos", tok)
    state = calibrate(rotated, cfg, plan, windows, prefix=prefix)
    return {"cfg": cfg, "params": rotated, "plan": plan, "state": state, "prefix": prefix}


def export_int_source(smollm: LoadedModel, source: dict, out: Path) -> Path:
    from qnpu_jax.export.exporter import export_model, tokenizer_info, write_exported

    exported = export_model(
        source["params"],
        source["cfg"],
        source["plan"],
        source["state"],
        prefix=source["prefix"],
        max_context=256,
        prefill_chunk=32,
        tokenizer_info=tokenizer_info(smollm.tokenizer),
        source={"test": f"smollm2-135m cut to {source['cfg'].num_layers} layers"},
    )
    return write_exported(exported, out, smollm.tokenizer)


def build_int_artifact(smollm: LoadedModel, out: Path, *, w_bits: int, layers: int = 2) -> Path:
    """The integer artifact of `build_int_source` (max_context 256, prefill chunk 32)."""
    return export_int_source(smollm, build_int_source(smollm, w_bits=w_bits, layers=layers), out)


@pytest.fixture(scope="session")
def int_sources(smollm: LoadedModel) -> dict:
    """{"w8a8": source, "w4a8": source}: 2-layer fake-quant models of the real weights."""
    return {name: build_int_source(smollm, w_bits=w) for name, w in (("w8a8", 8), ("w4a8", 4))}


@pytest.fixture(scope="session")
def int_artifacts(
    smollm: LoadedModel, int_sources: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    """{"w8a8": DIR, "w4a8": DIR}: the integer artifacts of `int_sources`."""
    root = tmp_path_factory.mktemp("artifacts")
    return {
        name: export_int_source(smollm, source, root / name) for name, source in int_sources.items()
    }
