#!/usr/bin/env bash
# A plain (non-editable) `pip install .` into a fresh venv, used from another directory: a
# shipped config named without a path (`config show`, and the quick start's `quick` run), a
# config-free run and README's quick start.
#     bash scripts/check_install.sh [QUICK_START_OUTPUT]
# QUICK_START_OUTPUT: where to write what the quick start printed (tests/test_readme.py runs
# this script and compares that with README, so the quick start runs once in CI).
# The venv sees the system packages (jax, the model and corpus wheels), so nothing is downloaded; the check asserts
# that qnpu_jax itself is imported from the venv's copy, not from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
quick_start_output=${1:-}
src=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m venv --system-site-packages "$work/venv"
"$work/venv/bin/python" -m pip install --disable-pip-version-check -q "$src"
cd "$work"
"$work/venv/bin/python" - "$work/venv" <<'PY'
import sys
from pathlib import Path

import qnpu_jax

where = Path(qnpu_jax.__file__).resolve()
assert Path(sys.argv[1]).resolve() in where.parents, f"qnpu_jax imported from {where}"
print(f"qnpu_jax from {where.parent}")
PY
"$work/venv/bin/qnpu" configs | grep '^quick ' >/dev/null
"$work/venv/bin/qnpu" study | grep '^table_cost ' >/dev/null
"$work/venv/bin/qnpu" study table_cost --help | grep '^usage: qnpu study table_cost' >/dev/null
"$work/venv/bin/qnpu" config show quick | grep '^method: quantnpu' >/dev/null
"$work/venv/bin/qnpu" quantize --model smollm2-135m --method rtn --bits w8a8 --set seq_len=32 \
  --set calib_windows=1 --set eval_windows=1 --out "$work/run-free" --no-progress
# README's quick start, as written, from an empty directory, on the installed copy
mkdir "$work/empty"
"$work/venv/bin/python" - "$src/README.md" "$work/quick_start.py" <<'PY'
import re
import sys
from pathlib import Path

text = Path(sys.argv[1]).read_text()
block = re.search(r"<!-- example: quick-start.*?-->\n```python\n(.*?)```", text, re.S)
assert block is not None, "README has no quick-start example"
Path(sys.argv[2]).write_text(block.group(1))
PY
(cd "$work/empty" && "$work/venv/bin/python" "$work/quick_start.py") | tee "$work/quick_start.out"
if [[ -n "$quick_start_output" ]]; then
  cp "$work/quick_start.out" "$quick_start_output.tmp" && mv "$quick_start_output.tmp" "$quick_start_output"
fi
# both runs (the quick start's names the shipped `quick` config) finished: their manifests
# are sealed (RunDir names the run directory's files)
"$work/venv/bin/python" -c 'import sys; from qnpu_jax.pipeline.run_dir import RunDir
assert all(RunDir(p).is_sealed for p in sys.argv[1:]), sys.argv[1:]' "$work/run-free" \
  "$work/empty/runs/quick"
echo "check_install: non-editable install lists the studies, shows a shipped config by name, runs a config-free run and README's quick start (the shipped quick config)"
