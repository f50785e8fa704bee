"""qnpu_jax: fully static, integer-only quantization of small LLMs for mobile NPUs.

The public API, `import qnpu_jax as qj`:

    model = qj.load_model("smollm2-135m")                 # float model, tokenizer
    config = qj.load_config("quick", ["seq_len=32"])      # a shipped config, with overrides
    qj.quantize(config, "runs/quick")                     # `qnpu quantize`
    run = qj.load_run("runs/quick")                       # its QuantizedModel, no step re-run
    qj.export_run("runs/quick", "artifacts/quick")        # the integer artifact
    engine = qj.open_engine("emulator", qj.load_int_model("artifacts/quick"))
    qj.perplexity(engine.token_nll, windows)

Recipes of steps over a `QuantizedModel`: `qj.recipes`, `qj.steps`, `qj.chain`,
`qj.Calibration`. Names are imported on first use, so `import qnpu_jax` stays light (the
emulator's users never load JAX).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.version import __version__

if TYPE_CHECKING:
    from qnpu_jax.data import eval_windows, load_documents, tokenize_documents
    from qnpu_jax.eval.perplexity import perplexity
    from qnpu_jax.export.exporter import export_quantized, export_run
    from qnpu_jax.export.int_model import IntModel, artifact_tokenizer, load_int_model
    from qnpu_jax.models.llama import generate
    from qnpu_jax.models.load import LoadedModel, load_model
    from qnpu_jax.pipeline import recipes, steps
    from qnpu_jax.pipeline.config import QuantizeConfig, load_config
    from qnpu_jax.pipeline.quantized_model import QuantizedModel
    from qnpu_jax.pipeline.recipes import Recipe, chain
    from qnpu_jax.pipeline.run import Run, load_run, quantize
    from qnpu_jax.pipeline.steps import Calibration
    from qnpu_jax.runtime.engines import ENGINES, open_engine
    from qnpu_jax.runtime.interface import IntegerEngine

# public name -> the module that defines it (a module itself where the name is a module)
_WHERE = {
    "load_model": "qnpu_jax.models.load",
    "LoadedModel": "qnpu_jax.models.load",
    "generate": "qnpu_jax.models.llama",
    "load_config": "qnpu_jax.pipeline.config",
    "QuantizeConfig": "qnpu_jax.pipeline.config",
    "quantize": "qnpu_jax.pipeline.run",
    "load_run": "qnpu_jax.pipeline.run",
    "Run": "qnpu_jax.pipeline.run",
    "QuantizedModel": "qnpu_jax.pipeline.quantized_model",
    "recipes": "qnpu_jax.pipeline.recipes",
    "steps": "qnpu_jax.pipeline.steps",
    "Recipe": "qnpu_jax.pipeline.recipes",
    "chain": "qnpu_jax.pipeline.recipes",
    "Calibration": "qnpu_jax.pipeline.steps",
    "export_run": "qnpu_jax.export.exporter",
    "export_quantized": "qnpu_jax.export.exporter",
    "load_int_model": "qnpu_jax.export.int_model",
    "IntModel": "qnpu_jax.export.int_model",
    "artifact_tokenizer": "qnpu_jax.export.int_model",
    "open_engine": "qnpu_jax.runtime.engines",
    "ENGINES": "qnpu_jax.runtime.engines",
    "IntegerEngine": "qnpu_jax.runtime.interface",
    "perplexity": "qnpu_jax.eval.perplexity",
    "load_documents": "qnpu_jax.data",
    "tokenize_documents": "qnpu_jax.data",
    "eval_windows": "qnpu_jax.data",
}
_MODULES = ("recipes", "steps")

__all__ = [
    "ENGINES",
    "Calibration",
    "IntModel",
    "IntegerEngine",
    "LoadedModel",
    "QnpuError",
    "QuantizeConfig",
    "QuantizedModel",
    "Recipe",
    "Run",
    "__version__",
    "artifact_tokenizer",
    "chain",
    "eval_windows",
    "export_quantized",
    "export_run",
    "generate",
    "load_config",
    "load_documents",
    "load_int_model",
    "load_model",
    "load_run",
    "open_engine",
    "perplexity",
    "quantize",
    "recipes",
    "steps",
    "tokenize_documents",
]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'qnpu_jax' has no attribute {name!r}")
    module = importlib.import_module(where)
    return module if name in _MODULES else getattr(module, name)


def __dir__() -> list[str]:  # __all__ and _WHERE: tests/test_public_api.py checks they agree
    return sorted(__all__)
