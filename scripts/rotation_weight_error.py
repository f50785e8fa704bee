"""How far a run's learned R1 is from its own per-row integer grid -> JSON (issue 54).

On a model whose R1 is online (Gemma 3: a rotation linear after each pre-norm holds R1, so R1
is a weight the NPU stores), the rotation linear's weight is R1ᵀ [out, in]. A randomized
Hadamard R1 has ±1/√n in every entry and sits exactly on any symmetric per-row grid; once
stage 1 moved it, it does not. This reports ‖Q(W) − W‖_F / ‖W‖_F (symmetric, per row, max |w|
at the top code, not the run's learned scales) at each of `--bits` for the run's R1 and for a
Hadamard of the same size: for an orthogonal W, the RMS relative error of the rotated output
over isotropic inputs (a given input's error lies between E's extreme singular values).

    python scripts/rotation_weight_error.py --run runs/gemma3-w4a8 \
        --json reports/rotation_weight_error_gemma3.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qnpu_jax.environment import environment_info, script_command
from qnpu_jax.errors import QnpuError
from qnpu_jax.files import write_json_atomic
from qnpu_jax.pipeline.quantized_model import restore_learned
from qnpu_jax.quant.fake_quant import dynamic_fake_quant
from qnpu_jax.rotation import orthogonality_error, random_hadamard


def row_grid_error(w: np.ndarray, bits: int) -> float:
    """‖Q(w) − w‖ / ‖w‖ with w's rows on symmetric `bits`-bit grids (max |row| at the top:
    `quant.fake_quant.dynamic_fake_quant` per row, in float32)."""
    w32 = np.asarray(w, np.float32)
    q = np.asarray(dynamic_fake_quant(w32, bits, axis=-1), np.float64)
    return float(np.linalg.norm(q - w32) / np.linalg.norm(w32))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", type=Path, required=True, help="a finished run with a learned R1")
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        r1 = restore_learned(args.run).get("r1")
        if r1 is None:
            raise QnpuError(f"{args.run}: the run has no R1")
    except QnpuError as e:
        print(f"rotation_weight_error: error: {e}", file=sys.stderr)
        return 2
    weight = np.asarray(r1, np.float64).T  # the rotation linear's weight, [out, in]
    n = weight.shape[0]
    hadamard = np.asarray(random_hadamard(n, jax.random.key(0)), np.float64)
    report = {
        "run": str(args.run),
        "size": n,
        "orthogonality_error": float(orthogonality_error(jnp.asarray(r1))),
        "largest_entry_from_hadamard": float(np.abs(np.abs(weight) - n**-0.5).max()),
        "learned": {str(b): row_grid_error(weight, b) for b in args.bits},
        "hadamard": {str(b): row_grid_error(hadamard, b) for b in args.bits},
        "environment": environment_info(),
        "command": script_command(__file__),
    }
    for b in args.bits:
        print(
            f"{b}-bit rows: learned R1 {report['learned'][str(b)]:.4f}, "
            f"Hadamard {report['hadamard'][str(b)]:.4f} (relative error)"
        )
    write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
