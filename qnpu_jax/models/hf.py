"""Hugging Face checkpoints: state-dict <-> params, directory loader/saver, hub download."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import current_umask, read_text
from qnpu_jax.ir.graph import ARCHITECTURE_GRAPHS, EMBED_TABLE, FINAL_NORM, GRAPH, LM_HEAD, Graph
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import graph_of, layer_param_shapes
from qnpu_jax.models.tokenizer import Tokenizer, tokenizer_from_file


def hf_layer_names(graph: Graph) -> dict[str, str]:
    """params key inside "layers" -> HF name inside "model.layers.{i}.", from `graph`."""
    names = {}
    for op in graph.layer:
        if op.gain:
            names[op.gain] = f"{op.gain}.weight"
        if op.head_norm:  # inside the attention module (Qwen3)
            names[op.head_norm] = f"self_attn.{op.head_norm}.weight"
        if op.weight is not None:
            names[op.weight.name] = op.weight.hf
            if op.bias:
                names[op.bias] = op.weight.hf.removesuffix(".weight") + ".bias"
    return names


HF_LAYER_NAMES = hf_layer_names(GRAPH)
_FAMILY_LAYER_NAMES = {arch: hf_layer_names(g) for arch, g in ARCHITECTURE_GRAPHS.items()}
# the global params' HF names: the embedding table's and lm_head's from the graph, the norm's
HF_GLOBAL_NAMES = {t.name: t.hf for t in GRAPH.global_tensors if t.hf.endswith(".weight")} | {
    FINAL_NORM: f"model.{FINAL_NORM}.weight"
}
# Buffers some exporters write that carry no parameters.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _layer_names(cfg: ModelConfig) -> dict[str, str]:
    return _FAMILY_LAYER_NAMES.get(cfg.architecture, HF_LAYER_NAMES)


def layer_tensor_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(params key, HF name) of every per-layer tensor this config has."""
    names = _layer_names(cfg)
    return [(key, names[key]) for key in layer_param_shapes(cfg)]


def _gain_keys(cfg: ModelConfig) -> set[str]:
    """The params keys in "layers" that are RMSNorm gains (the layer's and the per-head ones)."""
    graph = graph_of(cfg)
    return {op.gain for op in graph.layer if op.gain} | {
        op.head_norm for op in graph.layer if op.head_norm
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the checkpoint must hold."""
    d = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    names = _layer_names(cfg)
    for i in range(cfg.num_layers):
        shapes |= {
            f"model.layers.{i}.{names[key]}": shape
            for key, shape in layer_param_shapes(cfg).items()
        }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes


def params_from_state_dict(
    state: Mapping[str, np.ndarray], cfg: ModelConfig, *, gains: bool = False
) -> dict[str, Any]:
    """HF-named float tensors -> stacked float32 params; every name and shape is checked.

    Gemma (`cfg.norm_unit_offset`): HF checkpoints store each RMSNorm weight w of gain 1 + w,
    which is added here in float32 (as HF's forward does); `gains=True` says `state` already
    holds the gains (GGUF files do)."""
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise QnpuError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    extra = sorted(
        k
        for k in set(state) - set(shapes)
        if not _IGNORED.fullmatch(k) and not (k == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    if extra:
        raise QnpuError(f"checkpoint has {len(extra)} unexpected tensors, e.g. {extra[:3]}")
    for name, shape in shapes.items():
        if tuple(state[name].shape) != shape:
            raise QnpuError(
                f"tensor {name} has shape {tuple(state[name].shape)}, config expects {shape}"
            )

    def f32(name: str) -> np.ndarray:
        return np.asarray(state[name], dtype=np.float32)

    layers = {
        key: np.stack([f32(f"model.layers.{i}.{hf}") for i in range(cfg.num_layers)])
        for key, hf in layer_tensor_names(cfg)
    }
    params: dict[str, Any] = {
        EMBED_TABLE: f32(HF_GLOBAL_NAMES[EMBED_TABLE]),
        "layers": layers,
        FINAL_NORM: f32(HF_GLOBAL_NAMES[FINAL_NORM]),
    }
    if not cfg.tie_word_embeddings:
        params[LM_HEAD] = f32(HF_GLOBAL_NAMES[LM_HEAD])
    if cfg.norm_unit_offset and not gains:
        params = _shift_gains(params, cfg, np.float32(1.0))
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not np.isfinite(value).all():
            name = "/".join(str(k.key) for k in path)  # type: ignore[attr-defined]
            raise QnpuError(f"checkpoint tensor {name} contains NaN or Inf")
    return params


def _shift_gains(params: Mapping[str, Any], cfg: ModelConfig, by: np.float32) -> dict[str, Any]:
    """`params` with `by` added (float32) to every RMSNorm gain: Gemma's w <-> 1 + w."""
    keys = _gain_keys(cfg)
    layers = {
        k: np.asarray(v, np.float32) + by if k in keys else v for k, v in params["layers"].items()
    }
    return {**params, "layers": layers, FINAL_NORM: np.asarray(params[FINAL_NORM], np.float32) + by}


def state_dict_from_params(params: Mapping[str, Any], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Stacked params -> HF-named tensors (Gemma: gains written as w = gain − 1)."""
    if cfg.norm_unit_offset:
        params = _shift_gains(params, cfg, np.float32(-1.0))
    state = {HF_GLOBAL_NAMES[k]: np.asarray(params[k]) for k in (EMBED_TABLE, FINAL_NORM)}
    for key, hf in layer_tensor_names(cfg):
        stacked = np.asarray(params["layers"][key])
        for i in range(cfg.num_layers):
            state[f"model.layers.{i}.{hf}"] = np.ascontiguousarray(stacked[i])
    if not cfg.tie_word_embeddings:
        state[HF_GLOBAL_NAMES[LM_HEAD]] = np.asarray(params[LM_HEAD])
    return state


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise QnpuError(f"missing {path}")
    try:  # a regular file of at most MAX_TEXT_BYTES (a FIFO or a device is refused)
        data = json.loads(read_text(path, what="model file"))
    except json.JSONDecodeError as e:
        raise QnpuError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise QnpuError(f"{path} must hold a JSON object")
    return data


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:

    try:
        with safe_open(str(path), framework="numpy") as f:
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    except FileNotFoundError as e:
        raise QnpuError(f"missing weight file {path}") from e
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise QnpuError(f"cannot read weight file {path}: {e}") from e


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index lists, or model.safetensors."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise QnpuError(f"{index} has no weight_map")
        shards = []
        for shard in sorted(set(weight_map.values())):
            shard_path = (directory / shard).resolve()
            if directory.resolve() not in shard_path.parents:
                raise QnpuError(f"{index} names a shard outside the checkpoint: {shard!r}")
            shards.append(shard_path)
        return shards
    single = directory / "model.safetensors"
    if not single.exists():
        raise QnpuError(
            f"{directory} has neither model.safetensors nor model.safetensors.index.json "
            "(only safetensors checkpoints are supported)"
        )
    return [single]


def load_state_dict(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or of the shards its index lists."""
    state: dict[str, np.ndarray] = {}
    for path in weight_files(directory):
        state |= _read_safetensors(path)
    index = directory / "model.safetensors.index.json"
    if index.exists():
        missing = sorted(set(_read_json(index)["weight_map"]) - set(state))
        if missing:
            raise QnpuError(f"shards listed in {index} lack tensors, e.g. {missing[:3]}")
    return state


def hf_dir_config(directory: Path) -> ModelConfig:
    """The model's config from the directory's config.json alone (no weight is read)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise QnpuError(f"model directory {directory} does not exist")
    return ModelConfig.from_hf(_read_json(directory / "config.json"))


def load_hf_dir(directory: Path) -> tuple[ModelConfig, dict[str, Any], Tokenizer]:
    """Load a `save_pretrained` dir: config.json, safetensors (sharded too), tokenizer.json."""
    directory = Path(directory)
    cfg = hf_dir_config(directory)
    tokenizer = _load_tokenizer(directory, cfg)  # before the weights: fail fast
    return cfg, params_from_state_dict(load_state_dict(directory), cfg), tokenizer


def _load_tokenizer(directory: Path, cfg: ModelConfig) -> Tokenizer:
    tok_file = directory / "tokenizer.json"
    if not tok_file.exists():
        raise QnpuError(f"{directory} has no tokenizer.json (a fast tokenizer is required)")
    tokenizer = tokenizer_from_file(tok_file, cfg.bos_token_id, cfg.eos_token_id)
    tok_config_path = directory / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path) if tok_config_path.exists() else {}
    # The tokenizer's own special tokens win over config.json's ids when both are present.
    ids = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id}
    for name in ids:
        token = tok_config.get(name)
        if isinstance(token, dict):
            token = token.get("content")
        idx = tokenizer.token_to_id(token) if isinstance(token, str) else None
        if idx is not None:
            ids[name] = idx
    add_bos = tok_config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        # LLaMA 3 style: the post-processor template prepends BOS.
        probe = tokenizer.backend.encode("a", add_special_tokens=True).ids
        add_bos = bool(probe) and ids["bos_token"] is not None and probe[0] == ids["bos_token"]
    return Tokenizer(tokenizer.backend, ids["bos_token"], ids["eos_token"], add_bos)


def save_hf_dir(
    directory: Path,
    cfg: ModelConfig,
    params: Mapping[str, Any],
    tokenizer: Tokenizer,
    *,
    max_shard_bytes: int | None = None,
    dtype: Any = np.float32,
) -> Path:
    """Write config.json, safetensors (sharded when `max_shard_bytes` is set) and tokenizer files.

    The directory appears whole or not at all: everything is written to a sibling temporary
    directory that is renamed into place last. An existing directory is refused.
    """

    directory = Path(directory)
    if directory.exists():
        raise QnpuError(f"{directory} already exists; refusing to overwrite it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        hf_config = cfg.to_hf() | {"torch_dtype": np.dtype(dtype).name}
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        state = {
            k: np.ascontiguousarray(v, dtype=dtype)
            for k, v in state_dict_from_params(params, cfg).items()
        }
        shards = _shard(state, max_shard_bytes)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map: dict[str, str] = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map |= dict.fromkeys(shard, name)
            total = sum(v.nbytes for v in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        tokenizer.save(tmp)
        mask = current_umask()
        for f in tmp.iterdir():  # safetensors writes its files private (0600)
            f.chmod(0o666 & ~mask)
        tmp.chmod(0o777 & ~mask)  # mkdtemp makes it private (0700)
        os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _shard(state: dict[str, np.ndarray], max_bytes: int | None) -> list[dict[str, np.ndarray]]:
    if max_bytes is None:
        return [state]
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in state.items():
        if shards[-1] and size + value.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    return shards


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.fullmatch(spec))


def download_from_hub(repo_id: str) -> Path:
    """Snapshot the files the directory loader needs; never hangs when offline."""

    patterns = ["config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=10))
    except LocalEntryNotFoundError as e:
        raise QnpuError(
            f"cannot download {repo_id!r} from the Hugging Face hub (offline or unreachable) and "
            "it is not in the local cache; pass a local checkpoint directory instead"
        ) from e
    except HFValidationError as e:
        raise QnpuError(f"{repo_id!r} is not a valid hub id: {e}") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise QnpuError(f"cannot download {repo_id!r} from the Hugging Face hub: {e}") from e
