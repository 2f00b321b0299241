#!/bin/bash
# The GPU checklist (../shared/GPU.md) on a GPU host that has PyTorch but no network:
#   here:  bash scripts/gpu_check.sh wheels .whl   # the engine's pure-Python needs, cp312
#   there: bash scripts/gpu_check.sh run .whl      # environment, bench, Triton tests, tests
# `run` is one command of at most 8 minutes, each part under its own deadline, leaving a
# 10-minute device call room to start: the environment, bench/gpu_decode.py (CUDA graphs
# on, and off at 1 and 64 sequences), the Triton kernels' tests on CUDA, then
# tests/models and tests/engine. It writes env.txt, bench.log, triton.log and tests.log
# under $OUT (or ./gpu-check). Tests that need the default model's package (98 MB, more
# than a device call carries) are reported skipped there (scripts/gpu_missing_model.py).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
mode=${1:-}
wheels=${2:-.whl}
case $mode in
wheels)
  mkdir -p "$wheels"
  py=$(command -v .venv/bin/python || command -v python3)
  for spec in pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection==0.4.5 \
    typing-extensions gguf==0.19.0 llguidance==1.9.1 pytest-timeout==2.4.0 jsonschema \
    jsonschema-specifications referencing rpds-py; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d "$wheels" "$spec" ||
      exit 1
  done
  ls "$wheels"
  ;;
run)
  out=${OUT:-gpu-check}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-check-site:$PWD PYTHONUNBUFFERED=1
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    lscpu | grep "Model name"
  } 2>&1 | tee "$out/env.txt"
  # the deadlines add up to 8 minutes: most valuable first
  timeout "${BENCH_S:-240}" python3 bench/gpu_decode.py 2>&1 | tee "$out/bench.log"
  bench=$?
  # SIGINT at a deadline: pytest still prints its summary of what ran (-n: the image
  # has pytest-xdist)
  timeout -s INT -k 10 "${TRITON_S:-60}" python3 -m pytest tests/models/test_triton_attention.py \
    tests/engine/test_decode_graphs.py tests/engine/test_decode_graphs_cuda.py -q -p no:cacheprovider -p scripts.gpu_missing_model --timeout 50 -rfEs --tb=short \
    >"$out/triton.log" 2>&1
  triton=$?
  tail -n 25 "$out/triton.log" | cut -c1-240
  timeout -s INT -k 10 "${TEST_S:-160}" python3 -m pytest tests/models tests/engine -q \
    -p no:cacheprovider -p scripts.gpu_missing_model -n 8 --continue-on-collection-errors --timeout 120 -rfE --tb=line \
    --ignore=tests/models/test_triton_attention.py --ignore=tests/engine/test_decode_graphs.py --ignore=tests/engine/test_decode_graphs_cuda.py \
    >"$out/tests.log" 2>&1
  tests=$?
  grep -E "^(FAILED|ERROR) |passed|failed" "$out/tests.log" | cut -c1-240
  echo "bench exit $bench, triton exit $triton, tests exit $tests"
  [ "$bench" = 0 ] && [ "$triton" = 0 ] && [ "$tests" = 0 ]
  ;;
*) echo "usage: $0 wheels|run [DIR]" >&2; exit 2 ;;
esac
