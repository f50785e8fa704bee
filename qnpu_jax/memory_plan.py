"""Stage 1's memory per device for a model config on a mesh, from XLA's compiled memory
analysis of the real train step built on abstract shapes (`jax.ShapeDtypeStruct`): nothing is
allocated and no weights are needed, so paper-size models are planned on any machine.

The step is `stage1.make_train_step` with the mesh's explicit shardings, lowered for the
quantnpu stage-1 plan (linear weights and inputs fake-quantized, R1/R2 and their scales
learned) and compiled for the devices at hand: on a CPU host, 8 platform devices stand in for
8 accelerators (`--xla_force_host_platform_device_count`); XLA's buffer assignment is then the
CPU backend's, so figures for a GPU or TPU are an estimate of the same program's footprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import read_text
from qnpu_jax.ir.graph import ROTATION_WEIGHTS, Graph, layer_widths
from qnpu_jax.limits import MAX_CONFIG_BYTES
from qnpu_jax.mesh import MeshConfig, check_batch, describe, make_mesh
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import (
    MATMUL_DTYPES,
    init_random_params,
    layer_param_shapes,
)
from qnpu_jax.models.taps import state_entry
from qnpu_jax.pipeline.config import QuantizeConfig
from qnpu_jax.pipeline.quantized_model import Transforms
from qnpu_jax.pipeline.recipes import config_stage1_plan
from qnpu_jax.pipeline.stage1 import Stage1Config, init_train_state, make_train_step
from qnpu_jax.quant import default_plan
from qnpu_jax.quant.plan import QuantPlan, is_weight
from qnpu_jax.quant.spec import check_block
from qnpu_jax.quant.state import is_layer_path, state_key

SHIPPED_ARCHITECTURES = "architectures"  # package data: HF config.json files, by name
BASE_DTYPES = ("float32", "bfloat16")
GIB = 1 << 30


def shipped_architectures() -> dict[str, Any]:
    """{name: resource} of the model configs shipped with the package (config.json only)."""
    root = resources.files("qnpu_jax").joinpath(SHIPPED_ARCHITECTURES)
    return {e.name.removesuffix(".json"): e for e in root.iterdir() if e.name.endswith(".json")}


def _read_json_text(path: Path) -> str:
    return read_text(path, what="model config", limit=MAX_CONFIG_BYTES)


def model_architecture(spec: str) -> ModelConfig:
    """A ModelConfig from a shipped name (`qnpu plan-memory --list`), a config.json file or an
    HF checkpoint directory holding one; no weights are read."""
    shipped = shipped_architectures()
    path = Path(spec)
    if spec in shipped:
        where, text = f"shipped architecture {spec}", shipped[spec].read_text()
    elif path.is_dir() and (path / "config.json").exists():
        where, text = str(path / "config.json"), _read_json_text(path / "config.json")
    elif path.exists() and not path.is_dir():  # a FIFO or a device is refused, never read
        where, text = str(path), _read_json_text(path)
    else:
        raise QnpuError(
            f"unknown model {spec!r}: not a shipped architecture ({', '.join(sorted(shipped))}), "
            "a config.json file nor a directory holding one"
        )
    try:
        return ModelConfig.from_hf(json.loads(text))
    except json.JSONDecodeError as e:
        raise QnpuError(f"{where}: not valid JSON ({e})") from e
    except QnpuError as e:
        raise QnpuError(f"{where}: {e}") from e


def stage1_transforms(cfg: ModelConfig) -> Transforms:
    """The transforms stage 1 starts from: norms fused and an R1 (its value is the run's; a
    plan needs only that there is one). Their `apply(rotate=False)` is the base stage 1 rotates
    on the fly and their `graph` the one it trains (Gemma 3's with its rotation linears)."""
    return Transforms(fused_norms=True, r1=jnp.eye(cfg.hidden_size, dtype=jnp.float32))


def abstract_params(cfg: ModelConfig, dtype: str = "float32") -> Any:
    """ShapeDtypeStructs of the float params stage 1 starts from (`stage1_transforms`: fused
    norms with an explicit lm_head, and the rotation linears of a model whose R1 is online),
    in `dtype`."""
    start = stage1_transforms(cfg)
    shapes = jax.eval_shape(
        lambda: start.apply(init_random_params(cfg, jax.random.key(0)), cfg, rotate=False)
    )
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.dtype(dtype)), shapes)


def _weight_shape(path: str, cfg: ModelConfig, graph: Graph) -> tuple[int, ...]:

    group, name = state_key(path)
    if group == "layers":
        return layer_param_shapes(cfg, graph)[name]
    return (cfg.vocab_size, cfg.hidden_size)


def abstract_state(plan: QuantPlan, cfg: ModelConfig) -> Any:
    """The quantizer state `calibrate` gives for `plan`, as ShapeDtypeStructs: a weight's
    scale keeps its channel axis (the others become 1), a per-tensor activation's is a scalar,
    both with a leading layer axis under `layers/` (tests compare with `calibrate`)."""

    state: dict[str, Any] = {"layers": {}, "outer": {}}
    for path, tq in plan.entries:
        layers = cfg.num_layers if is_layer_path(path) else None
        lead = (layers,) if layers is not None else ()
        if is_weight(path) and tq.axis is not None:
            shape = _weight_shape(path, cfg, plan.graph)
            axis = tq.axis % len(shape)
            scale_shape = (*lead, *(n if a == axis else 1 for a, n in enumerate(shape)))
            if tq.block is not None:  # one scale per row and block of inputs
                blocks = check_block(tq.block, shape[-1], path)
                scale_shape = (*scale_shape[:-1], blocks)
        elif is_weight(path) or tq.axis is None:
            scale_shape = lead
        else:
            raise QnpuError(f"{path}: the memory plan models per-tensor activation scales only")
        zeros = np.zeros(scale_shape, np.float32)
        group, name = state_key(path)
        width = layer_widths(cfg.dims, plan.graph).get(name)
        state[group][name] = state_entry(tq, zeros, zeros, layers=layers, width=width)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), state)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemorySetting:
    """What one plan entry measures: the stage-1 batch shape, the precision of the frozen base
    and of the linears' matmul operands (`Stage1Config.compute_dtype`); learned parameters and
    optimizer state are float32 throughout."""

    seq_len: int = 2048
    batch_size: int = 2
    grad_accum: int = 2
    base_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: bool = True
    w_bits: int = 4
    a_bits: int = 8

    def __post_init__(self) -> None:
        if self.base_dtype not in BASE_DTYPES:
            raise QnpuError(f"base_dtype must be one of {BASE_DTYPES}, got {self.base_dtype!r}")
        if self.compute_dtype not in MATMUL_DTYPES:
            raise QnpuError(
                f"compute_dtype must be one of {MATMUL_DTYPES}, got {self.compute_dtype!r}"
            )
        for name in ("seq_len", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise QnpuError(f"{name} must be positive")


def stage1_memory(cfg: ModelConfig, mesh: Any, setting: MemorySetting) -> dict[str, Any]:
    """XLA's memory analysis of the stage-1 train step of `cfg` on `mesh`, per device, on the
    graph Quant.npu trains (`stage1_transforms`: Gemma 3's with its rotation linears)."""

    check_batch(mesh, setting.batch_size, "batch_size")
    config = Stage1Config(
        steps=100,
        batch_size=setting.batch_size,
        grad_accum=setting.grad_accum,
        remat=setting.remat,
        compute_dtype=setting.compute_dtype,
    )
    plan = config_stage1_plan(
        default_plan(
            cfg.num_layers,
            w_bits=setting.w_bits,
            a_bits=setting.a_bits,
            graph=stage1_transforms(cfg).graph(cfg),
        ),
        QuantizeConfig.of(w_bits=setting.w_bits, a_bits=setting.a_bits),
    )
    params = abstract_params(cfg, setting.base_dtype)
    frozen = abstract_state(plan, cfg)
    f32 = jnp.float32
    r1 = jax.ShapeDtypeStruct((cfg.hidden_size, cfg.hidden_size), f32)
    r2 = jax.ShapeDtypeStruct((cfg.num_layers, cfg.head_dim, cfg.head_dim), f32)
    train_state = jax.eval_shape(
        lambda a, b, s: init_train_state(a, b, s, plan, config), r1, r2, frozen
    )
    batch = jax.ShapeDtypeStruct(
        (setting.grad_accum, setting.batch_size, setting.seq_len), jnp.int32
    )
    step = make_train_step(cfg, plan, config, mesh=mesh, like=(train_state, params, frozen))
    compiled = step.lower(train_state, batch, params, frozen).compile()
    stats = compiled.memory_analysis()
    if stats is None:
        raise QnpuError("this backend gives no memory analysis")
    fields = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "aliased": int(stats.alias_size_in_bytes),
        "temporaries": int(stats.temp_size_in_bytes),
        "code": int(stats.generated_code_size_in_bytes),
    }
    total = fields["arguments"] + fields["outputs"] - fields["aliased"] + fields["temporaries"]
    base_bytes = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(params))
    return {
        "bytes_per_device": fields,
        "total_bytes_per_device": total,
        "total_gib_per_device": total / GIB,
        "base_params_gib_whole_model": base_bytes / GIB,
        # the model's own: less a tied table's second copy and the rotation linears stage 1 adds
        "parameters": sum(int(np.prod(s.shape)) for s in jax.tree.leaves(params))
        - (cfg.vocab_size * cfg.hidden_size if cfg.tie_word_embeddings else 0)
        - sum(
            int(np.prod(params["layers"][n].shape))
            for n in ROTATION_WEIGHTS.get(cfg.architecture, ())
        ),
    }


def memory_settings(
    *,
    seq_len: int,
    batch_size: int,
    grad_accum: int,
    base_dtypes: Sequence[str],
    compute_dtypes: Sequence[str],
    remat: bool = True,
) -> list[MemorySetting]:
    """One MemorySetting of this batch shape per base dtype and compute dtype, the base
    dtypes outermost; each checked as it is made (a bad dtype fails before any compile)."""
    return [
        MemorySetting(
            seq_len=seq_len,
            batch_size=batch_size,
            grad_accum=grad_accum,
            base_dtype=dtype,
            compute_dtype=compute,
            remat=remat,
        )
        for dtype in base_dtypes
        for compute in compute_dtypes
    ]


def planning_devices(count: int) -> list[Any]:
    """`count` devices to plan on: the default backend's when it has that many, else CPU
    platform devices standing in for accelerators (their number is set here while JAX's
    backend has not started; in a program that started it, the ones it has)."""
    if count > 1:
        # RuntimeError: a backend already started (a program embedding the CLI): as it is
        with contextlib.suppress(RuntimeError):
            jax.config.update("jax_num_cpu_devices", count)
    devices = jax.devices() if jax.device_count() >= count else jax.devices("cpu")
    if len(devices) < count:
        raise QnpuError(f"{count} devices asked, {len(devices)} present")
    return devices


def memory_rows(
    models: Mapping[str, ModelConfig],
    settings: Sequence[MemorySetting],
    device_counts: Sequence[int],
    devices: Sequence[Any],
    budget_gib: float,
) -> Iterator[dict[str, Any]]:
    """The rows of a memory plan, model by model, setting by setting, then device count by
    device count, each on an automatic (1, n) mesh of `devices` and compiled when it is
    asked for: the model's name (a key of `models`), the mesh (`mesh.describe`), the setting,
    `stage1_memory`'s figures and whether the total fits `budget_gib` per device."""
    for spec, cfg in models.items():
        for setting in settings:
            for n in device_counts:
                mesh = make_mesh(MeshConfig(data=1, fsdp=n), devices)
                row = {
                    "model": spec,
                    "mesh": describe(mesh),
                    **dataclasses.asdict(setting),
                    **stage1_memory(cfg, mesh, setting),
                }
                row["fits_budget"] = row["total_gib_per_device"] <= budget_gib
                yield row
