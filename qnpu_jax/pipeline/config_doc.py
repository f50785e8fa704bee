"""What every config key means: `qnpu config show` prints a resolved config with it, and
docs/config.md is generated from it (`python3 -m qnpu_jax.pipeline.config_doc docs/config.md`;
tests/test_config.py checks that the file is current and that every key has a meaning)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from qnpu_jax.ir.graph import MUXQ_MAX_EXP
from qnpu_jax.mesh import MeshConfig
from qnpu_jax.models.taps import SINK_PREFIXES
from qnpu_jax.pipeline.config import (
    BASE_KEY,
    INIT_SCHEMES,
    KEYS,
    MAX_BASE_DEPTH,
    MAX_CALIB_WINDOWS,
    SCOPES,
    SOURCE_SEEDS,
    WEIGHT_ROUNDINGS,
    QuantizeConfig,
    key_defaults,
)
from qnpu_jax.pipeline.methods import (
    METHOD_OFF,
    METHODS,
    SCALE_LEARNING_METHODS,
    STAGE1_METHODS,
)
from qnpu_jax.pipeline.stage1 import ACTIVATION_MODES, OBJECTIVES, SCALE_PARAMS, Stage1Config
from qnpu_jax.quant.plan import BLOCK_SIZES, INIT_METHODS, QuantRule

_OR = " | "


def _word(value: Any) -> str:
    """An option's value as a config reads: true, false, off (null), 0.5."""
    if value is None:
        return "off"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _by_method(option: str) -> str:
    """ "mobilequant 0.5, others off": each method whose spec turns `option` on, with its
    value, then what the others take (`methods.METHOD_OFF`)."""
    own = [
        f"{name} {_word(spec.defaults[option])}"
        for name, spec in METHODS.items()
        if spec.defaults[option] != METHOD_OFF[option]
    ]
    return ", ".join([*own, f"others {_word(METHOD_OFF[option])}"])


# QuantizeConfig's keys, in `KEYS` order
CONFIG_KEYS: dict[str, str] = {
    "model": "the base model: smollm2-135m, a .gguf file, an HF directory or a hub id org/name",
    "method": f"the recipe: {_OR.join(METHODS)} (docs/cli.md `qnpu quantize`)",
    "w_bits": "bits of the decoder linears' weights (2..16)",
    "a_bits": "bits of the activations (2..16)",
    "kv_bits": "bits of the K/V cache (2..16)",
    "down_in_bits": "base bits of the unrotated down_proj input (8 or 16; 16 is the paper's "
    "Table 1)",
    "mixed_precision": "share of layers whose down_proj input is promoted to 16 bits by eq. "
    "(4)'s sensitivity scan (0: none; applies when down_in_bits is 8)",
    "down_out_mixed_precision": "share of layers whose down_proj output is promoted to 16 bits "
    "by a scan of the final model (0: none; not in the paper; needs selective: true)",
    "mlp_in_mixed_precision": "share of layers whose gate/up input is promoted to 16 bits by "
    "eq. (4)'s scan at its planned bits, before stage 1 (0: none; not in the paper)",
    "attn_out_mixed_precision": "share of layers whose o_proj input is promoted to 16 bits by "
    "eq. (4)'s scan at its planned bits, before stage 1 (0: none; not in the paper)",
    "learn_down_in": "stage 1 learns the down_proj input's scale too (§4.3.1's literal text)",
    "init_scheme": f"quantnpu's initialization: {_OR.join(INIT_SCHEMES)} (aware: mean ± 3σ "
    "for rotated 4-bit tensors, Max-Min elsewhere, by each tensor's bits after the rules; "
    "max_min: Max-Min everywhere)",
    "selective": "stage 1 learns only the linears' inputs and weights (false: the linear "
    f"outputs and K/V too); null: the method's default ({_by_method('selective')})",
    "scope": f"what is quantized: {_OR.join(SCOPES)} (linears: only the linears' weights, "
    "inputs and outputs, Table 2)",
    "weight_rounding": f"how weights are rounded after stage 2: {_OR.join(WEIGHT_ROUNDINGS)} "
    "(gptq: GPTQ's codes on the same grid)",
    "gptq_damp": "GPTQ's dampening, a share of the Hessian's mean diagonal, in (0, 1)",
    "gptq_act_order": "GPTQ rounds the columns by decreasing H_ii (its act-order; needs "
    "weight_rounding gptq); false: in input order",
    "gptq_windows": "GPTQ's Hessians from this many windows of the calibration text: the "
    "calibration windows, then more drawn from the text (needs weight_rounding gptq); null: "
    "the calibration windows alone",
    "gptq_passes": "GPTQ's passes, 1..4: each after the first takes its Hessians with the last "
    "pass's codes in place, so a linear's Hessian sees the inputs the rounded layers before it "
    "feed it (needs weight_rounding gptq)",
    "smooth_mlp": "α of up→down channel smoothing (MobileQuant's SmoothQuant-Edge), in (0, 1); "
    "null: off",
    "weight_block": "the linear weights' scales per block of B inputs "
    f"({', '.join(map(str, BLOCK_SIZES))}); null: one scale per output channel",
    "weight_block_scale_bits": "with weight_block: integer block scales of k bits times a float "
    "per row (AIMET's LPBQ); null: float block scales",
    "shadow_outliers": "mllm-NPU: clip percentile (0, 100] of the down_proj input, its "
    "overflowing channels on a shadow path; null: off",
    "shadow_keep": "share of layers that keep a shadow path (with shadow_outliers)",
    "muxq_exp": "MUXQ: bits the down_proj input's outlier channels are shifted right by "
    f"(1..{MUXQ_MAX_EXP}); null: off",
    "muxq_threshold": "MUXQ: |x| above which a channel is an outlier",
    "residual_split": "D > 1: each residual add's output on two grids, per layer the channels "
    "above 1/D of the largest |x| shifted right by one exp per tensor (after stage 2); null: off",
    "equalize": "SmoothQuant α initializing every linear pair's equivalent scales, in (0, 1); "
    f"null: the method's default ({_by_method('equalize')})",
    "weight_clipping": "learnable weight clipping in stage 1 (OmniQuant's LWC; methods "
    f"{', '.join(SCALE_LEARNING_METHODS)}); null: the method's default",
    "asymmetric_activations": "a zero point on every activation but the softmax output; null: "
    f"the method's default ({_by_method('asymmetric_activations')})",
    "asymmetric_weights": "a zero point per linear weight row; null: the method's default "
    f"({_by_method('asymmetric_weights')})",
    "prefix": f"sink prefix computed offline before every sequence: {_OR.join(SINK_PREFIXES)} "
    "(none: the paper's setting; bos_newline: BOS then a newline, so that no first token "
    "after BOS becomes a second sink)",
    "simulation": "what the fake-quant forward computes between quantizers: device (the "
    "integer contract's softmax and RoPE tables) | fake (plain float32)",
    "seed": "seeds the calibration windows, the Hadamard rotations and stage 1's batches",
    "rotation_seed": "seeds the Hadamard signs alone (null: seed); for crossing the sources",
    "rotation_candidates": "R1/R2 from the best of this many randomized Hadamard rotations, "
    "judged by the perplexity of the calibrated model before stage 1 on 4 calibration windows "
    "(1: the seed's rotation alone)",
    "calib_seed": "seeds the calibration windows alone (null: seed)",
    "data_seed": "seeds stage 1's batches alone (null: seed)",
    "calib_data": "calibration text: wiki (its calib split) or any data spec (docs/cli.md `Data`)",
    "seq_len": "window length in tokens, for calibration, stage 1 and evaluation",
    "calib_windows": f"calibration windows (stage 2 and the scans), 1..{MAX_CALIB_WINDOWS}",
    "eval_data": "evaluation sets, a list of data specs (wiki: its eval split; wikitext2: "
    "$QNPU_DATA_DIR's WikiText-2 test)",
    "eval_windows": "at most this many windows per evaluation set; null: every window",
    "stage1": f"stage 1's schedule (the stage1.* keys); used by {', '.join(STAGE1_METHODS)}",
    "rules": "plan rules applied after the method's defaults, in order (the rules.* keys)",
    "mesh": "the device mesh {data, fsdp}, DATAxFSDP or auto (the mesh.* keys)",
}

STAGE1_KEYS: dict[str, str] = {
    "steps": "optimizer steps",
    "batch_size": "windows per micro-batch (a multiple of the mesh's data axis)",
    "grad_accum": "micro-batches accumulated per step",
    "lr_rotation": "Cayley SGD's learning rate for R1/R2 (cosine decay)",
    "lr_scale": "SGD's learning rate for the learned scales (cosine decay)",
    "momentum": "SGD momentum, in [0, 1) (the paper: 0)",
    "local_loss_fraction": "share of the first steps trained with eq. (3)'s local loss too",
    "local_loss_weight": "weight of the local loss in those steps",
    "lsq_grad_scaling": "LSQ's gradient scale on the learned scales",
    "learn_rotations": "learn R1/R2 (false: they stay as initialized)",
    "activation_mode": f"activation quantization while training: {_OR.join(ACTIVATION_MODES)} "
    "(dynamic: per token, SpinQuant)",
    "scale_param": f"how a learned scale is parameterized: {_OR.join(SCALE_PARAMS)}",
    "remat": "recompute each layer's activations in the backward pass (less memory)",
    "checkpoint_every": "steps between checkpoints (what --resume continues from)",
    "compute_dtype": "the linears' matmul operands: float32 | bfloat16 (float32 accumulation)",
    "lr_equalization": "Adam's learning rate for equivalent scales and clip factors",
    "objective": f"what stage 1 minimizes: {_OR.join(OBJECTIVES)} (block: each layer's output "
    "error against the float layer; kl: distillation from the float model's next-token "
    "distributions)",
    "select_every": "checkpoint selection: score the model every N steps on held-out windows "
    "and keep the best (0: keep the last step)",
    "select_windows": "held-out windows of checkpoint selection (the calibration text's tail, "
    "not trained on)",
}

MESH_KEYS: dict[str, str] = {
    "data": "devices that split each batch; null: automatic",
    "fsdp": "devices that split the weights and learned parameters; null: automatic",
}

RULE_KEYS: dict[str, str] = {
    "pattern": "a regex matched in full against tensor paths (e.g. layers/down_in)",
    "bits": "the tensor's bits",
    "symmetric": "symmetric (true) or with a zero point (false)",
    "axis": "the scale's channel axis; null: per tensor; -1: leave it unchanged",
    "init": f"the initializer: {_OR.join(INIT_METHODS)}",
    "learnable": "stage 1 learns its scale",
    "layer_bits": "bits per layer, a list of one entry per decoder layer",
    "block": "weights: a scale per block of B inputs (0: per channel again)",
    "block_scale_bits": "weights: LPBQ integer block scales of k bits (0: float again)",
    "quantize": "false: keep the tensor in float",
    "headroom": "symmetric activations: the calibrated range times this, in [1, 256] (2: one "
    "bit of the grid for values beyond the calibration's)",
}

SECTIONS: tuple[tuple[str, tuple[str, ...], Mapping[str, str]], ...] = (
    ("", tuple(KEYS), CONFIG_KEYS),
    ("stage1", tuple(f.name for f in dataclasses.fields(Stage1Config)), STAGE1_KEYS),
    ("mesh", tuple(f.name for f in dataclasses.fields(MeshConfig)), MESH_KEYS),
    ("rules", tuple(f.name for f in dataclasses.fields(QuantRule)), RULE_KEYS),
)


def undocumented() -> list[str]:
    """Keys without a meaning here, and meanings of keys that do not exist (empty: in step)."""
    out = []
    for prefix, names, meanings in SECTIONS:
        dotted = f"{prefix}." if prefix else ""
        out += [f"{dotted}{n} (no meaning)" for n in names if n not in meanings]
        out += [f"{dotted}{n} (not a key)" for n in meanings if n not in names]
    return out


def _value(value: Any) -> str:
    """A value as YAML flow text (JSON is YAML): strings bare where YAML reads them back."""
    if isinstance(value, str):
        return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
    return json.dumps(value, ensure_ascii=False)


def _line(key: str, value: Any, meaning: str, indent: str = "") -> str:
    left = f"{indent}{key}: {_value(value)}"
    return f"{left:40s} # {meaning}"


def show_config(config: QuantizeConfig, where: str) -> str:
    """`config` as YAML that `qnpu quantize --config FILE` reads back, every key with its
    resolved value and a comment saying what it means."""
    data = config.to_dict()
    lines = [f"# {where}, resolved: every key (`qnpu quantize --config FILE` reads this back)"]
    for key, meaning in CONFIG_KEYS.items():
        value = data[key]
        if key == "stage1":
            lines.append(f"{'stage1:':40s} # {meaning}")
            lines += [_line(k, value[k], m, "  ") for k, m in STAGE1_KEYS.items()]
        elif key == "mesh":
            lines.append(f"{'mesh:':40s} # {meaning}")
            lines += [_line(k, value[k], m, "  ") for k, m in MESH_KEYS.items()]
        else:
            lines.append(_line(key, value, meaning))
    return "\n".join(lines) + "\n"


def settings_summary(config: QuantizeConfig, where: str, recipe: Iterable[Any]) -> list[str]:
    """The settings `qnpu quantize` prints before it starts: where they came from and the
    ones that decide the result and its cost (`recipe`: the steps it will run)."""
    names = [s.name for s in recipe]
    s1, data, evaluation = config.stage1, config.data, config.eval
    stage1 = (
        f"stage 1 {s1.steps} steps of {s1.batch_size} x {s1.grad_accum} windows"
        if "stage1" in names
        else f"no stage 1 ({config.method} learns nothing)"
    )
    share = config.promotions.down_in
    promoted = (
        f"mixed precision {share:g} (that share of down_proj inputs at 16 "
        "bits, by the sensitivity scan)"
        if "promote" in names and share > 0
        else "mixed precision 0 (no down_proj input promoted to 16 bits)"
    )
    cap = "every window" if evaluation.windows is None else f"at most {evaluation.windows} windows"
    return [
        f"settings from {where} (`qnpu config show` explains every key):",
        f"  model {config.model}, method {config.method}, bits {config.bits.name}, {stage1}",
        f"  calibration {data.calib}: {data.windows} windows of {data.seq_len} "
        f"tokens; evaluation {', '.join(evaluation.data)}: {cap} per set",
        f"  {promoted}, prefix {config.prefix}, seed {config.seed}"
        + "".join(
            f", {name} {getattr(config, name)}"
            for name in SOURCE_SEEDS
            if getattr(config, name) is not None
        ),
    ]


def _defaults(cls: type) -> dict[str, Any]:
    """{field: its default as written in the class} (MISSING where it has none)."""
    return {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(cls)
    }


def _table(
    rows: Mapping[str, str],
    defaults: Mapping[str, Any],
    prefix: str = "",
    fields: Mapping[str, str] | None = None,
) -> list[str]:
    """A markdown table of `rows`' keys, defaults and meanings (with `fields`: each key's
    place in the Python object too)."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    if fields is not None:
        lines = ["| key | in Python | default | meaning |", "|---|---|---|---|"]
    for key, meaning in rows.items():
        default = defaults[key]
        if default is dataclasses.MISSING:
            shown = "(required)"
        elif dataclasses.is_dataclass(default):
            shown = "(below)"
        else:
            shown = f"`{_value(default)}`"
        place = f" `config.{fields[key]}` |" if fields is not None else ""
        lines.append(f"| `{prefix}{key}` |{place} {shown} | {meaning.replace('|', '&#124;')} |")
    return lines


def reference_markdown() -> str:
    """docs/config.md: every config key, its default and its meaning."""
    lines = [
        "# Config keys",
        "",
        "<!-- generated by `python3 -m qnpu_jax.pipeline.config_doc docs/config.md` from",
        "qnpu_jax/pipeline/config_doc.py; tests/test_config.py checks it is current -->",
        "",
        "A `qnpu quantize` config is a YAML mapping of these keys (`qnpu configs` lists the",
        "shipped ones; `--set KEY=VALUE` overrides one, dotted for `stage1.KEY` and",
        "`mesh.KEY`). Unknown keys are errors, and so is a key given twice. Numbers are read",
        "as Python reads them (`1e-3` and `5E-4` are numbers; `inf`, `nan` and YAML's `.inf`",
        "are refused). `qnpu config show NAME|FILE` prints a config resolved, every key with",
        "its value and meaning; `qnpu quantize` prints the settings it chose before it starts.",
        "",
        f"`{BASE_KEY}: NAME|FILE` makes a config the named one (a shipped config, or a YAML",
        "file relative to the file that names it) with its own keys over it: `stage1` and",
        "`mesh` key by key, any other value (`rules` too) whole. A base may name its own base,",
        f"up to {MAX_BASE_DEPTH} configs deep; a cycle is an error. Gemma 3's shipped",
        "configs are SmolLM2's with a few keys changed so",
        "(`configs/gemma3-270m-quantnpu-w4a8.yaml`).",
        "",
        "## Top level",
        "",
        "In Python a `QuantizeConfig` groups these keys (`config.bits.w` is `w_bits`);",
        "`QuantizeConfig.of(w_bits=4, ...)` and `config.replace(w_bits=8)` take the keys.",
        "",
        *_table(CONFIG_KEYS, key_defaults(), fields=KEYS),
        "",
        "## `stage1` (methods with a stage 1)",
        "",
        *_table(STAGE1_KEYS, _defaults(Stage1Config), "stage1."),
        "",
        "## `mesh`",
        "",
        *_table(MESH_KEYS, _defaults(MeshConfig), "mesh."),
        "",
        "## `rules` (a list; each rule a mapping)",
        "",
        "A rule changes the plan entries whose path `pattern` matches in full; a key left out",
        "(null) leaves that field of them as it was.",
        "",
        *_table(RULE_KEYS, _defaults(QuantRule)),
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Write docs/config.md (the path given) or print it."""
    args = list(sys.argv[1:] if argv is None else argv)
    text = reference_markdown()
    if args:
        Path(args[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
