#!/usr/bin/env bash
# A plain (non-editable) `pip install .` into a fresh venv, used from another directory: a
# shipped config named without a path, and a config-free run. The venv sees the system
# packages (jax, the model and corpus wheels), so nothing is downloaded; the check asserts
# that qnpu_jax itself is imported from the venv's copy, not from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
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
"$work/venv/bin/qnpu" quantize --config quick --out "$work/run-quick" --no-progress
"$work/venv/bin/qnpu" quantize --model smollm2-135m --method rtn --bits w8a8 --set seq_len=32 \
  --set calib_windows=1 --set eval_windows=1 --out "$work/run-free" --no-progress
test -f "$work/run-quick/manifest.json" && test -f "$work/run-free/manifest.json"
echo "check_install: non-editable install lists the studies and runs a shipped config by name and a config-free run"
