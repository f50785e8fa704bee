"""This machine's float32 matmul peak (a jitted 2048×2048 matmul), so that every CI log and
timing report says which kind of machine it measured (CI's machines differ by about 3×).

    python scripts/matmul_peak.py [--json reports/matmul_peak.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qnpu_jax.environment import environment_info, matmul_peak, script_command
from qnpu_jax.files import write_json_atomic


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=2048, help="matrix side (default 2048)")
    parser.add_argument("--json", type=Path, default=None, help="also write a JSON report here")
    args = parser.parse_args(argv)
    if args.size < 1:
        parser.error(f"--size must be positive, got {args.size}")
    peak = matmul_peak(args.size)
    print(f"matmul peak: {peak / 1e9:.1f} GFLOP/s (float32 {args.size}x{args.size}, jitted)")
    if args.json is not None:
        report = {
            "matmul_peak_flops_per_second": peak,
            "size": args.size,
            "environment": environment_info(),
            "command": script_command(__file__, argv),
        }
        write_json_atomic(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
