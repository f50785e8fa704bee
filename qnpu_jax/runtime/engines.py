"""The integer engines by name: `open_engine("emulator" | "jax", model)`."""

from __future__ import annotations

from typing import Any

from qnpu_jax.errors import QnpuError
from qnpu_jax.export.int_model import IntModel
from qnpu_jax.runtime.emulator import EmulatorEngine
from qnpu_jax.runtime.interface import IntegerEngine
from qnpu_jax.runtime.jax_engine import JaxIntEngine

ENGINES = ("emulator", "jax")


def open_engine(name: str, model: IntModel) -> IntegerEngine[Any]:
    """The integer engine `name` (one of ENGINES) over a loaded artifact."""
    if name == "emulator":
        return EmulatorEngine(model)
    if name == "jax":
        return JaxIntEngine(model)
    raise QnpuError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
