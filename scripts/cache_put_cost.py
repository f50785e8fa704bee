"""The cost of one write to JAX's persistent compilation cache with a size cap, by how many
entries the cache holds: JAX's LRUCache lists, stats and reads the access time of every entry
on each write (under its file lock), so a suite that caches every program pays O(entries) per
compile. Writes a JSON report.

    python3 scripts/cache_put_cost.py [--entries 100,1000,3000] [--json reports/cache_put_cost.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from jax._src.lru_cache import LRUCache  # the cache JAX uses for its persistent cache


def put_seconds(entries: int, size: int = 200_000) -> float:
    """Seconds of one write into a capped cache that already holds `entries` entries."""
    with tempfile.TemporaryDirectory() as root:
        cache = LRUCache(root, max_size=16 * 2**30)
        value = os.urandom(size)
        for i in range(entries):
            cache.put(f"k{i}", value)
        start = time.perf_counter()
        cache.put("new", value)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", default="100,1000,3000", help="comma list of cache sizes")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    rows = [
        {"entries": n, "put_seconds": round(put_seconds(n), 4)}
        for n in (int(x) for x in args.entries.split(","))
    ]
    for row in rows:
        print(f"{row['entries']:6d} entries: one write {row['put_seconds'] * 1000:.1f} ms")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
