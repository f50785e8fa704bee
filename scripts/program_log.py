"""What the test suite compiles, from the log that `QNPU_TESTS_PROGRAM_LOG=FILE` makes
(tests/conftest.py: one line per program XLA compiled in a test process). Prints, per jitted
function, the programs and seconds, and the two kinds of compile a suite could avoid:

- the same program compiled more than once (another process compiled it too, or the cache
  entry was not there yet);
- programs of one function with the same argument types (other constants or static
  arguments: a plan's bits, a learning rate): with those traced, one program;
- programs of one function whose argument types differ only in their sizes (the same
  structure at another shape): one shape shared by the tests would compile once.

A log may be gzipped (FILE.gz).

    QNPU_TESTS_PROGRAM_LOG=/tmp/programs.jsonl python3 -m pytest -q -n 2
    python3 scripts/program_log.py /tmp/programs.jsonl [--json reports/programs.json]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

from qnpu_jax.files import write_json_atomic

_SIZE = re.compile(r"\d+x")


def summarize(lines: list[dict]) -> dict:
    by_fun: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        by_fun[line["fun"]].append(line)
    functions = []
    for fun, rows in by_fun.items():
        programs: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            programs[row["program"]].append(row)
        again = [r for rs in programs.values() for r in rs[1:]]
        # programs beside the first of their exact signature (other constants or static
        # arguments: a plan's bits, a learning rate), and the seconds of every signature of a
        # structure beside its costliest one (the same program at other sizes)
        signatures: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            signatures[row["signature"]].append(row)
        same_signature = [r for rs in signatures.values() for r in rs[1:]]
        structures: dict[str, dict[str, float]] = defaultdict(dict)
        for sig, rs in signatures.items():
            structures[_SIZE.sub("Nx", sig)][sig] = sum(r["seconds"] for r in rs)
        shape_variants = sum(len(s) - 1 for s in structures.values())
        variant_seconds = sum(sum(s.values()) - max(s.values()) for s in structures.values())
        functions.append({
            "fun": fun,
            "compiles": len(rows),
            "seconds": round(sum(r["seconds"] for r in rows), 1),
            "programs": len(programs),
            "compiled_again": len(again),
            "compiled_again_seconds": round(sum(r["seconds"] for r in again), 1),
            "signatures": len(signatures),
            "same_signature_other_programs": len(same_signature),
            "same_signature_other_seconds": round(sum(r["seconds"] for r in same_signature), 1),
            "structures": len(structures),
            "shape_variants": shape_variants,
            "shape_variant_seconds": round(variant_seconds, 1),
            "tests": len({r["test"] for r in rows}),
        })  # fmt: skip
    functions.sort(key=lambda f: -f["seconds"])
    return {
        "compiles": len(lines),
        "seconds": round(sum(r["seconds"] for r in lines), 1),
        "same_signature_other_seconds": round(
            sum(f["same_signature_other_seconds"] for f in functions), 1
        ),
        "shape_variant_seconds": round(sum(f["shape_variant_seconds"] for f in functions), 1),
        "functions": functions,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if not args.log.is_file():
        print(f"program_log: no log at {args.log}", file=sys.stderr)
        return 2
    opener = gzip.open if args.log.suffix == ".gz" else open
    with opener(args.log, "rt") as f:
        lines = [json.loads(t) for t in f.read().splitlines() if t.strip()]
    doc = summarize(lines)
    print(
        f"{doc['compiles']} programs compiled, {doc['seconds']:.0f} s; beside the first of "
        f"their signature {doc['same_signature_other_seconds']:.0f} s; shape variants "
        f"{doc['shape_variant_seconds']:.0f} s"
    )
    print("     s  compiles programs again(s) same-sig(s) variants(s) tests  function")
    for f in doc["functions"][: args.top]:
        print(
            f"{f['seconds']:6.0f} {f['compiles']:9d} {f['programs']:8d} "
            f"{f['compiled_again']:4d}({f['compiled_again_seconds']:4.0f}) "
            f"{f['same_signature_other_programs']:4d}({f['same_signature_other_seconds']:4.0f}) "
            f"{f['shape_variants']:4d}({f['shape_variant_seconds']:4.0f}) {f['tests']:5d}  "
            f"{f['fun']}"
        )
    if args.json is not None:
        write_json_atomic(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
