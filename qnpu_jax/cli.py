"""The `qnpu` command."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import select
import shlex
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from qnpu_jax import cost
from qnpu_jax.argtypes import positive_int, use_help_formatter
from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
from qnpu_jax.data.locations import DATA_DIR_FLAG, data_dir_override
from qnpu_jax.errors import QnpuError, StorageFullError
from qnpu_jax.eval import TASKS, perplexity
from qnpu_jax.eval.zeroshot import task_source
from qnpu_jax.export.exporter import export_run, export_run_aimet
from qnpu_jax.export.int_model import artifact_tokenizer, load_int_model
from qnpu_jax.export.onnx_export import FLOAT_WEIGHTS, export_run_onnx, require_export_extra
from qnpu_jax.files import check_outside, check_writable, storage_full_is_an_error
from qnpu_jax.limits import (
    MAX_EVAL_BATCH,
    MAX_PLAN_DEVICES,
    MAX_SAMPLES,
    check_at_most,
    check_seed,
)
from qnpu_jax.memory_plan import (
    memory_rows,
    memory_settings,
    model_architecture,
    planning_devices,
    shipped_architectures,
)
from qnpu_jax.mesh import initialize_distributed
from qnpu_jax.models.llama import generate
from qnpu_jax.models.load import load_model
from qnpu_jax.models.taps import SINK_PREFIXES, prefix_name
from qnpu_jax.pipeline.config import (
    load_config,
    parse_bits,
    read_run_config,
    shipped_configs,
    shipped_variants,
)
from qnpu_jax.pipeline.config_doc import settings_summary, show_config
from qnpu_jax.pipeline.recipes import for_config
from qnpu_jax.pipeline.run import quantize
from qnpu_jax.pipeline.run_dir import RunDir
from qnpu_jax.report import build_report, write_report
from qnpu_jax.runtime.decode import (
    SELECTIONS,
    Sampler,
    beam_search,
    sample_parallel,
    select_best,
    select_vote,
)
from qnpu_jax.runtime.engines import ENGINES, open_engine
from qnpu_jax.runtime.onnx_run import OnnxModel
from qnpu_jax.scoring import Scored, finish_eval_report, scored_model, zero_shot_report
from qnpu_jax.studies import STUDIES, describe, run_study
from qnpu_jax.studies.harness import write_study_json
from qnpu_jax.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qnpu", description="Static integer-only quantization of small LLMs for mobile NPUs."
    )
    parser.add_argument("--version", action="version", version=f"qnpu {__version__}")
    parser.add_argument(
        DATA_DIR_FLAG,
        metavar="DIR|hf",
        default=None,
        help="where the `wikitext2` data and the zero-shot task data are read from: a directory "
        "(docs/cli.md 'Data' gives its layout), or hf for the Hugging Face `datasets` cache "
        "(default: $QNPU_DATA_DIR; `qnpu eval --task-data` still wins for the tasks)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    add_quantize_parser(sub)
    add_export_parser(sub)
    add_emulate_parser(sub)
    add_configs_parser(sub)
    add_config_parser(sub)
    add_study_parser(sub)
    add_report_parser(sub)
    add_plan_memory_parser(sub)
    add_cost_parser(sub)
    add_generate_parser(sub)
    return use_help_formatter(parser)


def _scored_model(args: argparse.Namespace) -> Scored:
    return scored_model(model=args.model, run=args.run, prefix=args.prefix)


def _scored_artifact(args: argparse.Namespace) -> Scored:

    if args.prefix is not None:
        raise QnpuError("--prefix does not apply to an artifact: its sink prefix is built in")
    model = load_int_model(args.artifact)
    engine = open_engine(args.engine, model)
    prefix = model.graph["prefix_tokens"]
    tokenizer = artifact_tokenizer(model)
    return Scored(
        label=f"artifact {args.artifact} ({args.engine})",
        nll_fn=engine.token_nll,
        nll_argmax_fn=engine.token_nll_argmax,
        tokenizer=tokenizer,
        max_length=int(model.graph["max_context"]) - len(prefix),
        report={
            "artifact": str(args.artifact),
            "path": f"integer ({args.engine})",
            "prefix": prefix_name(prefix, tokenizer),
            "source": model.source,
        },
    )


def _scored_onnx(args: argparse.Namespace) -> Scored:

    require_export_extra("onnx", "onnxruntime")

    if args.prefix is not None:
        raise QnpuError("--prefix does not apply to an ONNX export: its sink prefix is built in")
    model = OnnxModel(args.onnx, qdq=args.qdq)
    kind = "QDQ" if args.qdq else f"float graph: {FLOAT_WEIGHTS[model.float_weights]}"
    tokenizer = model.tokenizer()
    return Scored(
        label=f"ONNX {args.onnx} ({kind}, onnxruntime CPU)",
        nll_fn=model.token_nll,
        nll_argmax_fn=model.token_nll_argmax,
        tokenizer=tokenizer,
        max_length=model.max_context - len(model.prefix),
        report={
            "onnx": str(args.onnx),
            "path": f"onnxruntime ({kind})",
            "prefix": prefix_name(model.prefix, tokenizer),
            "source": model.manifest.get("source", {}),
        },
    )


def _perplexity_report(
    args: argparse.Namespace, scored: Scored, docs: list[str], split: str | None
) -> dict[str, Any]:
    """`qnpu eval`'s task ppl: `docs` in windows of --seq-len tokens scored by `scored`, the
    result printed; its entries of the report."""
    if args.seq_len > scored.max_length:
        raise QnpuError(
            f"--seq-len {args.seq_len} exceeds the model's context "
            f"({scored.max_length} positions after the sink prefix)"
        )
    ids = tokenize_documents(docs, scored.tokenizer)
    windows = eval_windows(ids, args.seq_len, args.max_windows)
    print(
        f"{scored.label} on {args.data}{f' ({split})' if split else ''}: {len(docs)} "
        f"documents, {len(ids)} tokens, {len(windows)} windows of {args.seq_len}",
        file=sys.stderr,
    )
    result = perplexity(
        scored.nll_fn, windows, batch_size=args.batch_size or 1, progress=not args.no_progress
    )
    entries: dict[str, Any] = {
        "data": args.data,
        "split": split,
        "seq_len": args.seq_len,
        "windows": result.windows,
        "max_windows": args.max_windows,
        "batch_size": args.batch_size or 1,
        "text_tokens": len(ids),
        "tokens": result.predicted_tokens,
        "nll_mean": result.nll_sum / result.predicted_tokens,
        "ppl": result.ppl,
        "seconds": result.seconds,
    }
    print(
        f"ppl {result.ppl:.4f} over {result.predicted_tokens} predicted tokens "
        f"({result.seconds:.1f} s)"
    )
    return entries


def add_eval_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ev = sub.add_parser("eval", help="perplexity of a model on a text corpus")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="smollm2-135m, a .gguf file, an HF dir or org/name")
    source.add_argument("--run", type=Path, help="a `qnpu quantize` run: its fake-quant model")
    source.add_argument("--artifact", type=Path, help="an integer artifact (`qnpu export`)")
    source.add_argument(
        "--onnx", type=Path, help="an ONNX export (`qnpu export --format onnx`), in onnxruntime"
    )
    ev.add_argument(
        "--engine",
        choices=ENGINES,
        default="emulator",
        help="with --artifact: the numpy NPU emulator or the JAX integer forward",
    )
    ev.add_argument(
        "--qdq", action="store_true", help="with --onnx: the QDQ graphs (default: float)"
    )
    ev.add_argument(
        "--data",
        help="perplexity text: wiki | wikitext2 | wikitext:PATH | hf:NAME[:CONFIG]:SPLIT | a file "
        "(with --run: the run's first eval_data)",
    )
    ev.add_argument(
        "--tasks",
        default="ppl",
        help="comma list of ppl (perplexity on --data) and zero-shot tasks: piqa, hellaswag, "
        "arc_easy, arc_challenge, winogrande, lambada",
    )
    ev.add_argument(
        "--task-data",
        metavar="DIR|hf",
        default=None,
        help="zero-shot task data: a directory (docs/cli.md 'Data' gives its layout), or hf for "
        "the Hugging Face `datasets` cache (default: $QNPU_DATA_DIR)",
    )
    ev.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        metavar="N",
        help="zero-shot: a seeded subset of N items per task (default: every item)",
    )
    ev.add_argument("--seed", type=int, default=0, help="zero-shot subset seed")
    ev.add_argument("--split", default=None, help="wiki split: calib, eval (default) or all")
    ev.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="perplexity window length in tokens: the text is cut into non-overlapping windows "
        "of N tokens (with --run: the run's seq_len)",
    )
    ev.add_argument(
        "--max-windows",
        type=positive_int,
        default=None,
        metavar="K",
        help="perplexity on the first K windows only (default: every window; with --run: "
        "the run's eval_windows, so that its report's perplexity comes out again)",
    )
    ev.add_argument(
        "--batch-size", type=positive_int, default=None, help="default: 1 (ppl), 8 (tasks)"
    )
    ev.add_argument("--json", type=Path, default=None, help="write the report here")
    ev.add_argument("--no-progress", action="store_true", help="no progress bars")
    ev.add_argument(
        "--prefix",
        choices=SINK_PREFIXES,
        default=None,
        help="sink prefix before every window (default: none; a run's own prefix with --run)",
    )


def cmd_eval(args: argparse.Namespace) -> int:

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - {"ppl", *TASKS})
    if unknown or not tasks:
        raise QnpuError(f"unknown task(s) {unknown}; known: ppl, {', '.join(TASKS)}")
    want_ppl = "ppl" in tasks
    zero_shot = [t for t in tasks if t != "ppl"]
    if args.batch_size is not None:
        check_at_most(args.batch_size, MAX_EVAL_BATCH, "--batch-size", "qnpu_jax.limits")
    check_seed(args.seed, "--seed")
    if want_ppl and args.run is not None and None in (args.data, args.seq_len, args.max_windows):
        # the run's own evaluation text, window length and window count: its report again
        run_config = _run_config(args.run)
        run_values = {
            "data": run_config.eval.data[0],
            "seq_len": run_config.data.seq_len,
            "max_windows": run_config.eval.windows,
        }
        taken = {k: v for k, v in run_values.items() if getattr(args, k) is None}
        for name, value in taken.items():
            setattr(args, name, value)
        said = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in taken.items() if v is not None)
        if said:
            print(f"{said} (the run's)", file=sys.stderr)
    missing = [f for f, v in (("--data", args.data), ("--seq-len", args.seq_len)) if v is None]
    if want_ppl and missing:
        example = {"--data": "--data wiki", "--seq-len": "--seq-len 512"}
        raise QnpuError(
            f"perplexity (task ppl) needs {' and '.join(missing)}, e.g. "
            f"{' '.join(example[f] for f in missing)} (a --run gives its own)"
        )
    if zero_shot:  # missing task data fails now, not after the model loads
        task_source(zero_shot, args.task_data)
    split = args.split
    if args.data == "wiki" and split is None:
        split = "eval"
    started = time.perf_counter()
    if args.json is not None:
        check_writable(args.json)  # fail before the run, not after it
        inputs = {"--artifact": args.artifact, "--onnx": args.onnx, "--run": args.run}
        check_outside(args.json, {**inputs, "--model": args.model}, "--json")
    docs = load_documents(args.data, split) if want_ppl else []  # cheap checks first
    if args.qdq and args.onnx is None:
        raise QnpuError("--qdq applies to --onnx only")
    if args.artifact is not None:
        scored = _scored_artifact(args)
    elif args.onnx is not None:
        scored = _scored_onnx(args)
    else:
        scored = _scored_model(args)
    report: dict[str, Any] = dict(scored.report)
    if want_ppl:
        report |= _perplexity_report(args, scored, docs, split)
    if zero_shot:
        report |= zero_shot_report(
            scored,
            zero_shot,
            limit=args.limit,
            seed=args.seed,
            batch_size=args.batch_size or 8,
            progress=not args.no_progress,
            data_dir=args.task_data,
        )
    finish_eval_report(
        report, command="qnpu " + shlex.join(args.argv), started=started, path=args.json
    )
    return 0


def _run_config(run: Path) -> Any:
    """The config of the run in `run` (its config.yaml), read without loading the run."""

    return read_run_config(RunDir(run))


def quantize_config(args: argparse.Namespace) -> Any:
    """The QuantizeConfig of `qnpu quantize`: --config (a name or a file) or the defaults, then
    --model/--method/--bits, then every --set, validated as one config."""

    if args.config is None and (args.method is None or args.bits is None):
        raise QnpuError("give --config NAME (see `qnpu configs`), or --method and --bits")
    return load_config(args.config, args.overrides, config_updates(args))


def variant_notes(spec: str | None, model: str) -> list[str]:
    """A line for each shipped config that changes the shipped config --config `spec` names
    for `model` (a shipped recipe run with --model on another model than its own)."""
    return [
        f"note: shipped config {other} is this recipe with {model}'s own choices (its "
        f"comment says which and why; `qnpu config show {other}`)"
        for other in ([] if spec is None else shipped_variants(spec, model))
    ]


def config_updates(args: argparse.Namespace) -> dict[str, Any]:
    """The plain values --model, --method, --bits (and --mesh) put over a config."""

    pairs = (("model", args.model), ("method", args.method), ("mesh", getattr(args, "mesh", None)))
    updates = {k: v for k, v in pairs if v is not None}
    if args.bits is not None:
        updates |= parse_bits(args.bits)
    return updates


def config_source(args: argparse.Namespace) -> str:
    """Where a command's config came from, in words (--config, the flags over it, --set)."""
    if args.config is None:
        where = "the defaults"
    elif Path(args.config).is_file():
        where = f"config file {args.config}"
    else:
        where = f"shipped config {args.config}"
    flags = [f"--{k}" for k in ("model", "method", "bits", "mesh") if getattr(args, k, None)]
    flags += ["--set"] if args.overrides else []
    return where + (f" with {', '.join(flags)}" if flags else "")


def announcer(started: float) -> Callable[[str], None]:
    """Print a phase line to stderr with the seconds since `started` (`time.perf_counter()`)."""

    def announce(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f} s] {message}", file=sys.stderr, flush=True)

    return announce


def add_quantize_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    qz = sub.add_parser(
        "quantize",
        help="quantize a model into a run dir (a config by name or file, or --method/--bits)",
    )
    qz.add_argument(
        "--config", default=None, help="a shipped config NAME (`qnpu configs`) or a YAML file"
    )
    qz.add_argument("--model", default=None, help="overrides the config's model")
    qz.add_argument(
        "--method",
        default=None,
        help="rtn, quarot, spinquant, quantnpu or mobilequant (overrides the config's)",
    )
    qz.add_argument("--bits", default=None, help="w4a8, w8a8, w4a4kv8, ... (overrides)")
    qz.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (YAML value; stage1.KEY for stage 1), repeatable",
    )
    qz.add_argument(
        "--mesh",
        default=None,
        metavar="DATAxFSDP",
        help="device mesh, e.g. 1x8 or 2x4 (overrides the config's; default auto: all on fsdp)",
    )
    qz.add_argument(
        "--distributed",
        action="store_true",
        help="join a multi-host job first (jax.distributed.initialize; or QNPU_DISTRIBUTED=1)",
    )
    qz.add_argument("--out", required=True, type=Path, help="the run directory")
    qz.add_argument("--resume", action="store_true", help="continue the run in --out")
    qz.add_argument("--no-progress", action="store_true", help="no progress bars")


def cmd_quantize(args: argparse.Namespace) -> int:

    initialize_distributed(True if args.distributed else None)
    config = quantize_config(args)
    for line in settings_summary(config, config_source(args), for_config(config)):
        print(line, file=sys.stderr, flush=True)
    for line in variant_notes(args.config, config.model):
        print(line, file=sys.stderr, flush=True)
    started = time.perf_counter()
    announce = announcer(started)

    report = quantize(
        config,
        args.out,
        resume=args.resume,
        progress=not args.no_progress,
        command="qnpu " + shlex.join(args.argv),
        announce=announce,
    )
    for spec, r in report["perplexity"].items():
        print(
            f"{spec}: float ppl {r['float_ppl']:.3f}, {report['method']} {report['bits']} "
            f"ppl {r['quantized_ppl']:.3f} ({r['ratio']:.3f}x) over {r['windows']} windows"
        )
    print(f"run written to {args.out}")
    return 0


def add_configs_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("configs", help="list the shipped configs (`qnpu quantize --config NAME`)")


def cmd_configs(args: argparse.Namespace) -> int:

    for name, resource in sorted(shipped_configs().items()):
        text = config_about(resource.read_text())
        about = textwrap.wrap(text, 55, break_on_hyphens=False, break_long_words=False) or [""]
        print(f"{name:44s} {about[0]}")
        for line in about[1:]:
            print(f"{'':44s} {line}")
    return 0


_SENTENCE_END = re.compile(r"[.!?](?=\s|$)")


def config_about(text: str) -> str:
    """The first sentence of a config file's leading comment block (`qnpu configs`)."""
    comment = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        comment.append(line.lstrip("#").strip())
    joined = " ".join(c for c in comment if c)
    end = _SENTENCE_END.search(joined)
    return joined[: end.end()] if end else joined


def add_config_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cf = sub.add_parser("config", help="show a config resolved: every key, its value, its meaning")
    cf_sub = cf.add_subparsers(dest="config_command", required=True)
    show = cf_sub.add_parser(
        "show",
        help="print a config as `qnpu quantize` would run it: every key with its meaning "
        "(docs/config.md), as YAML that --config reads back",
    )
    show.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a shipped config NAME (`qnpu configs`) or a YAML file (default: the defaults)",
    )
    show.add_argument("--model", default=None, help="overrides the config's model")
    show.add_argument("--method", default=None, help="overrides the config's method")
    show.add_argument("--bits", default=None, help="w4a8, w8a8, w4a4kv8, ... (overrides)")
    show.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key (as `qnpu quantize --set`), repeatable",
    )


def cmd_config(args: argparse.Namespace) -> int:

    config = load_config(args.config, args.overrides, config_updates(args))
    print(show_config(config, config_source(args)), end="")
    return 0


def add_study_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    st = sub.add_parser(
        "study",
        help="run a study (the measurements of docs/results.md); without NAME, list them",
        description="Run a study (the measurements of docs/results.md), or list them.",
        add_help=False,
    )
    st.add_argument(
        "-h", "--help", dest="study_help", action="store_true", help="this help and the studies"
    )
    st.add_argument("name", nargs="?", help="the study; `qnpu study NAME --help` for its options")
    st.add_argument("study_args", nargs=argparse.REMAINDER, help="the study's own arguments")
    st.set_defaults(study_usage=st.format_help)


def cmd_study(args: argparse.Namespace) -> int:

    if args.study_help:
        print(args.study_usage())
        print("studies:")
    if args.name is None or args.study_help:
        for name in STUDIES:
            print(f"{'  ' if args.study_help else ''}{name:24s} {describe(name)}")
        return 0
    return run_study(args.name, args.study_args)


def add_report_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    rp = sub.add_parser(
        "report", help="results table (paper Table 1 shape) and plots from runs and evals"
    )
    rp.add_argument(
        "--runs", required=True, nargs="+", type=Path, help="finished `qnpu quantize` runs"
    )
    rp.add_argument(
        "--evals",
        nargs="+",
        type=Path,
        default=[],
        help="`qnpu eval --json` files: the float model (--model), runs, artifacts",
    )
    rp.add_argument(
        "--sweep", type=Path, default=None, help="JSON of `qnpu study mixed_precision_sweep`"
    )
    rp.add_argument(
        "--out",
        required=True,
        type=Path,
        help="reports/NAME: writes NAME.md, NAME.html, NAME.json and NAME/*.png",
    )


def cmd_report(args: argparse.Namespace) -> int:

    out = Path(args.out)
    if not out.name or out.suffix in (".md", ".html", ".json"):
        raise QnpuError(f"--out {out}: give reports/NAME, without an extension")
    for suffix in (".md", ".html", ".json"):  # fail before reading anything, not after
        check_writable(out.with_name(out.name + suffix))
    if out.exists() and not out.is_dir():
        raise QnpuError(f"{out} exists and is not a directory (the plots go there)")
    report = build_report(
        args.runs, args.evals, args.sweep, name=out.name, command="qnpu " + shlex.join(args.argv)
    )
    for path in write_report(out, report):
        print(f"wrote {path}")
    if report.skipped_stage1:
        print(f"no stage 1 (skipped in the loss plot): {', '.join(report.skipped_stage1)}")
    for flag in report.table.flags:
        print(f"flag: {flag}", file=sys.stderr)
    return 0


def utf8_argument(text: str, flag: str) -> str:
    """`text` (a command-line argument), or a QnpuError when it is not valid UTF-8: bytes that
    do not decode reach Python as lone surrogates, which no tokenizer or terminal takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise QnpuError(
            f"{flag} is not valid UTF-8 text (undecodable bytes at character {e.start})"
        ) from None
    return text


def add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    gen = sub.add_parser("generate", help="greedy continuation of a prompt")
    gen.add_argument(
        "--model", required=True, help="smollm2-135m, a .gguf file, an HF dir or org/name"
    )
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="tokens generated at most"
    )


def cmd_generate(args: argparse.Namespace) -> int:

    utf8_argument(args.prompt, "--prompt")
    model = load_model(args.model)
    prompt = model.tokenizer.encode(args.prompt, add_bos=model.tokenizer.add_bos)
    if not prompt:
        raise QnpuError("the prompt is empty")
    new = generate(
        model.params,
        prompt,
        cfg=model.config,
        max_new_tokens=args.max_new_tokens,
        eos_token_id=model.tokenizer.eos_token_id,
    )
    print(args.prompt + model.tokenizer.decode(new))
    return 0


def add_plan_memory_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    pm = sub.add_parser(
        "plan-memory",
        help="stage 1's memory per device for model configs on meshes (XLA's analysis, no weights)",
    )
    pm.add_argument(
        "--model",
        nargs="+",
        default=None,
        help="shipped architectures (--list), config.json files or HF directories",
    )
    pm.add_argument("--list", action="store_true", help="list the shipped architectures")
    pm.add_argument(
        "--devices",
        nargs="+",
        type=positive_int,
        default=[1],
        help="device counts, each an automatic (1, n) mesh; on a CPU host, n platform devices",
    )
    pm.add_argument(
        "--base-dtype", nargs="+", default=["float32"], help="frozen base: float32, bfloat16"
    )
    pm.add_argument(
        "--compute-dtype",
        nargs="+",
        default=["float32"],
        help="the linears' matmul operands in stage 1: float32, bfloat16",
    )
    pm.add_argument(
        "--seq-len", type=positive_int, default=2048, help="stage 1's window length in tokens"
    )
    pm.add_argument(
        "--batch-size", type=positive_int, default=2, help="stage 1's windows per micro-batch"
    )
    pm.add_argument(
        "--grad-accum", type=positive_int, default=2, help="micro-batches per stage-1 step"
    )
    pm.add_argument("--no-remat", action="store_true", help="keep every layer's activations")
    pm.add_argument("--budget-gib", type=float, default=80.0, help="a device's memory")
    pm.add_argument("--json", type=Path, default=None, help="write the report here")


def cmd_plan_memory(args: argparse.Namespace) -> int:

    if args.list:
        print("\n".join(sorted(shipped_architectures())))
        return 0
    if not args.model:
        raise QnpuError("give --model NAME... (or --list)")
    # every input checked before the first compile
    models = {spec: model_architecture(spec) for spec in args.model}
    settings = memory_settings(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        base_dtypes=args.base_dtype,
        compute_dtypes=args.compute_dtype,
        remat=not args.no_remat,
    )
    if not args.budget_gib > 0:
        raise QnpuError(f"--budget-gib must be positive, got {args.budget_gib}")
    most = check_at_most(max(args.devices), MAX_PLAN_DEVICES, "--devices", "qnpu_jax.limits")
    devices = planning_devices(most)
    started = time.perf_counter()
    first = settings[0]
    print(
        f"stage 1's train step (quantnpu W{first.w_bits}A{first.a_bits}'s stage-1 plan): "
        f"windows of {first.seq_len} tokens, batch {first.batch_size} x accumulation "
        f"{first.grad_accum}, remat {'on' if first.remat else 'off'}; on a (1, n) mesh of "
        f"{jax.default_backend()} devices; XLA's memory analysis per device: arguments + "
        f"outputs - aliased + temporaries (GiB), against a budget of {args.budget_gib:g} GiB"
    )
    rows = []
    for row in memory_rows(models, settings, args.devices, devices, args.budget_gib):
        rows.append(row)
        parts = {k: v / 2**30 for k, v in row["bytes_per_device"].items()}
        print(
            f"{row['model']:14s} base {row['base_dtype']:8s} compute {row['compute_dtype']:8s} "
            f"{row['mesh']['devices']} device(s): "
            f"{row['total_gib_per_device']:7.2f} GiB per device = arguments "
            f"{parts['arguments']:.2f} + outputs {parts['outputs']:.2f} - aliased "
            f"{parts['aliased']:.2f} + temporaries {parts['temporaries']:.2f}"
            f"{'' if row['fits_budget'] else f'  (over {args.budget_gib:g} GiB)'}"
        )
    if args.json is not None:
        write_study_json(
            args.json,
            {"budget_gib": args.budget_gib, "backend": jax.default_backend(), "rows": rows},
            command="qnpu " + shlex.join(args.argv),
            started=started,
        )
    return 0


def add_cost_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    co = sub.add_parser(
        "cost",
        help="a plan's MACs by precision pair, bytes, LUT lookups and modelled NPU latency",
    )
    co_src = co.add_mutually_exclusive_group()
    co_src.add_argument(
        "--config", default=None, help="a shipped config NAME or a YAML file (default: defaults)"
    )
    co_src.add_argument("--run", type=Path, default=None, help="a finished run's plan instead")
    co.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, repeatable",
    )
    co.add_argument("--model", default=None, help="shipped architecture or config.json (overrides)")
    co.add_argument("--prefill", type=positive_int, default=512, help="prompt tokens")
    co.add_argument("--chunk", type=positive_int, default=64, help="prefill chunk (the artifact's)")
    co.add_argument("--decode", type=positive_int, default=128, help="generated tokens")
    co.add_argument("--json", type=Path, default=None, help="write the report here")


def cmd_cost(args: argparse.Namespace) -> int:

    if args.run is not None:
        if args.overrides:
            raise QnpuError("--set changes a config; a run's plan is fixed")
        priced = cost.run_plan(args.run, model_architecture, args.model)
    else:
        priced = cost.config_plan(args.config, args.overrides, model_architecture, args.model)
    plan, cfg, source = priced.plan, priced.cfg, priced.source
    phases = [cost.prefill(args.prefill, args.chunk), cost.decode(args.prefill, args.decode)]
    anchor = model_architecture(cost.ANCHOR_MODEL)
    readings = cost.devices(anchor)
    print(
        f"model {priced.model_name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}"
    )
    print(f"plan of {source}: {cost.plan_summary(plan, cfg.num_layers)}")
    print(
        "counts are exact (GMACs per operand pair: A16W4 is a 16-bit activation times a 4-bit "
        "weight; bytes of weights, activations and KV cache moved); latencies are modelled, not "
        "measured (docs/cost.md): a roofline fitted to the seed papers' device figures, under "
        "two readings of a 16-bit activation:"
    )
    for name, device in readings.items():
        print(f"  {name}: {READINGS.get(name, '').format(a16=device.a16, block=device.per_block)}")
    report: dict[str, Any] = {
        "source": source,
        "model": cfg.to_json(),
        "note": "counts are exact; latencies are a model fitted to the seeds' device figures "
        "(qnpu_jax.cost), not measurements",
        "devices": {k: dataclasses.asdict(v) for k, v in readings.items()},
        "phases": {},
    }
    for phase in phases:
        sums = report["phases"][phase.name] = cost.phase_report(plan, cfg, phase, readings)
        lat = sums["latency"]
        pairs = ", ".join(f"{p} {n / 1e9:.2f}" for p, n in sums["macs"].items())
        moved = sums["weight_bytes"] + sums["act_bytes"] + sums["kv_bytes"]
        print(f"{phase.name} ({phase.tokens} tokens): GMACs {pairs}")
        print(
            f"  bytes moved {moved / 1e6:.1f} MB (weights {sums['weight_bytes'] / 1e6:.1f}), "
            f"LUT lookups {sums['lut_lookups'] / 1e6:.2f} M, requantizations "
            f"{sums['requants'] / 1e6:.2f} M"
        )
        if sums["cpu_macs"]:  # the deployment's split: the shadow paths run on the CPU
            print(
                f"  on the CPU (shadow paths: Gather, Mul, Sub, overflow QDQ, MatMul, Add): "
                f"{sums['cpu_macs'] / 1e9:.2f} GMACs in {sums['syncs']} linears, "
                f"{sums['cross_bytes'] / 1e6:.1f} MB moved between NPU and CPU; every other op "
                "on the NPU"
            )
        else:
            print("  every op on the NPU")
        for k, v in lat.items():
            print(f"  modelled latency ({k}): {v['total_s'] * 1e3:.1f} ms")
    if args.json is not None:
        write_study_json(args.json, report, command="qnpu " + shlex.join(args.argv))
        print(f"-> {args.json}")
    return 0


# what each reading of `cost.devices` assumes, for `qnpu cost`
READINGS = {
    "mobilequant-table6": "a MAC with one 16-bit operand takes {a16:.2f} 8-bit MACs (fitted to "
    "MobileQuant Table 6, W8A16 against W8A8 prompt encoding); per-block weights {block:g}x",
    "quantnpu-table3": "a MAC with one 16-bit operand takes {a16:.2f} 8-bit MACs (Quant.npu "
    "Table 3, A16 against A8 per-channel W4); per-block weights {block:g}x",
}


def add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ex = sub.add_parser(
        "export", help="export a run to an integer artifact, ONNX graphs or AIMET encodings"
    )
    ex.add_argument("--run", required=True, type=Path, help="a finished `qnpu quantize` run")
    ex.add_argument("--out", required=True, type=Path, help="the artifact directory")
    ex.add_argument(
        "--format",
        choices=("qnpu", "onnx", "aimet"),
        default="qnpu",
        help="qnpu: the integer artifact; onnx: float + QDQ ONNX graphs with AIMET encodings "
        "(docs/deploy.md); aimet: the encodings alone",
    )
    ex.add_argument(
        "--aimet-version", choices=("1.0.0", "0.6.1"), default="1.0.0", help="AIMET schema"
    )
    ex.add_argument(
        "--max-context", type=positive_int, default=None, help="positions (default 2048+prefix)"
    )
    ex.add_argument(
        "--prefill-chunk", type=positive_int, default=64, help="tokens per prefill step (graph)"
    )
    ex.add_argument("--no-progress", action="store_true", help="no phase lines on stderr")


def cmd_export(args: argparse.Namespace) -> int:

    if args.format == "aimet":
        path = export_run_aimet(args.run, args.out, version=args.aimet_version)
        print(f"AIMET encodings (schema {args.aimet_version}) written to {path}")
        return 0
    if args.format == "onnx":
        require_export_extra("onnx")  # before the run is read, not after minutes of export
        out = export_run_onnx(
            args.run,
            args.out,
            chunk=args.prefill_chunk,
            max_context=args.max_context,
            version=args.aimet_version,
            announce=None if args.no_progress else announcer(time.perf_counter()),
        )
        print(f"ONNX graphs (prefill chunk {args.prefill_chunk}, decode) written to {out}")
        return 0
    out = export_run(
        args.run, args.out, max_context=args.max_context, prefill_chunk=args.prefill_chunk
    )
    print(f"integer artifact written to {out}")
    return 0


def add_emulate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    em = sub.add_parser(
        "emulate",
        help="generation with an integer artifact: greedy, or N parallel samples and a selection",
    )
    em.add_argument(
        "--artifact", required=True, type=Path, help="an integer artifact (`qnpu export`)"
    )
    em.add_argument("--prompt", required=True, help="the text to continue")
    em.add_argument(
        "--max-new-tokens", type=positive_int, default=32, help="tokens generated at most"
    )
    em.add_argument(
        "--engine",
        choices=ENGINES,
        default="emulator",
        help="the numpy NPU emulator or the JAX integer forward (bit for bit alike)",
    )
    em.add_argument(
        "--samples", type=positive_int, default=1, help="N samples decoded as one batch"
    )
    em.add_argument(
        "--select",
        choices=SELECTIONS,
        default="best",
        help="best: highest likelihood; vote: most frequent continuation; beam: beam search "
        "of width N",
    )
    em.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default 0 (greedy) for one sample, 1 for several; beam search ignores it",
    )
    em.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens whose probability reaches P",
    )
    em.add_argument("--seed", type=int, default=0, help="sample i draws from (seed, i)")


def cmd_emulate(args: argparse.Namespace) -> int:

    utf8_argument(args.prompt, "--prompt")
    check_at_most(args.samples, MAX_SAMPLES, "--samples", "decoded as one batch; qnpu_jax.limits")
    check_seed(args.seed, "--seed")
    model = load_int_model(args.artifact)
    tokenizer = artifact_tokenizer(model)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise QnpuError("the prompt is empty")
    engine = open_engine(args.engine, model)
    eos = tokenizer.eos_token_id
    n = args.samples
    temperature = args.temperature if args.temperature is not None else (0.0 if n == 1 else 1.0)
    sampler = Sampler(temperature=temperature, top_p=args.top_p)
    if args.select == "beam":
        new = list(beam_search(engine, prompt, n, args.max_new_tokens, eos)[0].tokens)
        note = f"best of {n} beams"
    elif n == 1 and temperature == 0:
        new = engine.generate(prompt, args.max_new_tokens, eos)
        note = ""
    else:
        samples = sample_parallel(engine, prompt, n, args.max_new_tokens, sampler, args.seed, eos)
        if args.select == "vote":
            texts = {s.tokens: tokenizer.decode(list(s.tokens)).strip() for s in samples}
            text = select_vote(samples, lambda s: texts[s.tokens])
            voted = [s for s in samples if texts[s.tokens] == text] or samples
            new = list(select_best(voted).tokens)
            note = f"most frequent of {n} samples"
        else:
            new = list(select_best(samples).tokens)
            note = f"likeliest of {n} samples"
    print(args.prompt + tokenizer.decode(new))
    if note:
        how = "" if args.select == "beam" else f", temperature {temperature}, top-p {args.top_p}"
        print(f"({note}{how})", file=sys.stderr)
    return 0


# the exit status when stdout's reader went away: 128 + SIGPIPE, a shell's status for a
# command that signal ended
READER_LEFT = 141


def stdout_reader_left() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll reports an error on it), so
    that a broken pipe elsewhere (a FIFO given as a path) is still reported as an error."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # replaced by an object without a descriptor, or closed
        return False
    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poller.poll(0))


def main(argv: Sequence[str] | None = None, *, exit_on_failed_write: bool = False) -> int:
    """Run `qnpu ARGV`; 0, or 2 after printing one `qnpu: error:` line (READER_LEFT, quietly,
    when stdout's reader went away). `exit_on_failed_write` (the `qnpu` command): after a
    write that failed for want of space, end the process at once, since orbax's writer
    threads still hold the other failed writes and would print their tracebacks at
    interpreter shutdown, after the error line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    commands = {
        "config": cmd_config,
        "configs": cmd_configs,
        "eval": cmd_eval,
        "emulate": cmd_emulate,
        "export": cmd_export,
        "generate": cmd_generate,
        "plan-memory": cmd_plan_memory,
        "cost": cmd_cost,
        "quantize": cmd_quantize,
        "report": cmd_report,
        "study": cmd_study,
    }
    try:
        # a full disk: one line, not orbax's thread dumps; --data-dir: $QNPU_DATA_DIR meanwhile
        with storage_full_is_an_error(), data_dir_override(args.data_dir):
            return commands[args.command](args)
    except (QnpuError, OSError) as e:  # OSError: an unwritable or vanished path
        if isinstance(e, BrokenPipeError) and stdout_reader_left():
            return READER_LEFT  # `qnpu configs | head -1`: nothing to report
        print(f"qnpu: error: {e}", file=sys.stderr)
        if exit_on_failed_write and isinstance(e, StorageFullError):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        return 2


def command() -> None:
    """The `qnpu` console command. Output piped into a reader that stops early (`| head`)
    ends it quietly with READER_LEFT, as a command killed by SIGPIPE ends in a shell."""
    rc = main(exit_on_failed_write=True)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        rc = READER_LEFT
    if rc == READER_LEFT:  # the interpreter's own flush at exit would fail again, loudly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(rc)


if __name__ == "__main__":
    command()
