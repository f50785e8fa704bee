"""What a report records about where it was measured."""

from __future__ import annotations

import os
import platform
from typing import Any


def environment_info() -> dict[str, Any]:
    import jax

    import qnpu_jax

    device = jax.devices()[0]
    return {
        "qnpu_jax": qnpu_jax.__version__,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
