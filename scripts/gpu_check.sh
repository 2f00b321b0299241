#!/bin/bash
# The GPU checklist (../shared/GPU.md) on a GPU host that has PyTorch but no network:
#   here:  bash scripts/gpu_check.sh wheels .whl   # the engine's pure-Python needs, cp312
#   there: bash scripts/gpu_check.sh run .whl      # environment, bench/gpu_decode.py, tests
# `run` writes env.txt, bench.log and tests.log under $OUT (or ./gpu-check). The tests
# that need the default model's package (98 MB) fail there unless it was installed.
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
  # the two deadlines fit one 10-minute device command
  timeout "${BENCH_S:-240}" python3 bench/gpu_decode.py 2>&1 | tee "$out/bench.log"
  bench=$?
  # SIGINT at the deadline: pytest still prints its summary of what ran (-n: the
  # image has pytest-xdist)
  timeout -s INT -k 15 "${TEST_S:-270}" python3 -m pytest tests/models tests/engine -q \
    -p no:cacheprovider -n 8 --continue-on-collection-errors --timeout 120 -rfE --tb=line \
    >"$out/tests.log" 2>&1
  tests=$?
  grep -E "^(FAILED|ERROR) |passed|failed" "$out/tests.log" | cut -c1-240
  echo "bench exit $bench, tests exit $tests"
  [ "$bench" = 0 ] && [ "$tests" = 0 ]
  ;;
*) echo "usage: $0 wheels|run [DIR]" >&2; exit 2 ;;
esac
