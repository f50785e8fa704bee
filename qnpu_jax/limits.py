"""Every size bound of `qnpu` in one place, each checked before anything is allocated.

A number past its bound is a `QnpuError` naming the bound, never an allocation that runs
the machine out of memory (or a wrapped-around value). The bounds are far above what the
shipped configs and the paper use; each says why it is where it is.
"""

from __future__ import annotations

from qnpu_jax.errors import QnpuError

MIB = 1 << 20

# A text file read whole (data specs, zero-shot task files): its size on disk, checked before
# it is read. WikiText-103's raw training text (~516 MiB) is the largest corpus a
# quantization paper calibrates on; tokenization holds several times the text in memory.
MAX_TEXT_BYTES = 512 * MIB
# A YAML/JSON config or architecture file, and a YAML document's size once its aliases
# are expanded (each value counts 1, a string its length too): an alias "bomb" of a few
# hundred bytes that expands to gigabytes is refused when it is loaded.
MAX_CONFIG_BYTES = 1 * MIB
# Calibration windows of a run (2M tokens at seq_len 512; the paper calibrates on 128), and
# the windows of one stage-1 step (batch_size x grad_accum), drawn from the calibration text
# at once: every window runs through every calibration pass.
MAX_CALIB_WINDOWS = 4096
# Seeds: jax.random.key keeps 32 bits of a seed here, so 2**32 would silently equal seed 0.
MAX_SEED = 2**32 - 1
# Windows (or zero-shot requests) scored as one batch by `qnpu eval`: the batch is padded to
# this size, and 256 windows of 2048 tokens already hold 100 GB of float32 logits.
MAX_EVAL_BATCH = 256
# Samples (or beams) that `qnpu emulate` decodes as one batch, each with its own KV cache.
MAX_SAMPLES = 64
# Devices of a mesh that `qnpu plan-memory` plans for (a TPU v4 pod); on a CPU host each is a
# stand-in CPU device, and far more of them exhaust the host.
MAX_PLAN_DEVICES = 4096


def check_at_most(value: int, bound: int, name: str, why: str = "") -> int:
    """`value`, or a QnpuError naming `name`, the bound and (optionally) why it exists."""
    if value > bound:
        raise QnpuError(f"{name} must be at most {bound}, got {value}{f' ({why})' if why else ''}")
    return value


def check_seed(value: object, name: str = "seed") -> int:
    """A seed: an integer in 0..MAX_SEED."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SEED:
        raise QnpuError(f"{name} must be an integer in 0..{MAX_SEED} (32 bits), got {value!r}")
    return value
