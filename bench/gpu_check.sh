#!/usr/bin/env bash
# Everything GPU in one call on the lent H200: the gpu-marked tests (kernels against torch references,
# models against transformers), the API tests with their workers on the CUDA backend, then the GPU
# benchmarks (none yet); a short summary last.
# Usage (from the repository root, with .whl carried): bash bench/gpu_check.sh
set -uo pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
run_pytest() {  # name, pytest args...
  local name=$1; shift
  python3 -m pytest -q -p no:cacheprovider -o addopts="" --tb=short "$@" > "$OUT/$name.log" 2>&1
  echo "$name: $(grep -E '[0-9]+ (passed|failed)' "$OUT/$name.log" | tail -1)"
  grep -E '^(FAILED|ERROR)' "$OUT/$name.log" | cut -c1-160 | head -20
}
echo "== summary"
run_pytest kernels-and-models -m gpu tests/runtime
run_pytest api-on-cuda --worker-device cuda tests/service/test_forward_api.py tests/service/test_errors.py \
  tests/service/test_concurrency.py tests/service/test_generate.py tests/service/test_faults.py \
  tests/service/test_metrics.py
