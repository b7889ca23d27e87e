#!/usr/bin/env bash
# Everything GPU in one call on the lent H200: the gpu-marked tests (kernels against torch references,
# models against transformers, the API on the CUDA backend), then the GPU benchmarks; a short table last.
# Usage (from the repository root, with .whl carried): bash bench/gpu_check.sh [pytest args...]
set -uo pipefail
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --tb=short "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" \
  | grep -vE '^(\.|s)+ *\[' | tail -60
echo "== summary"
grep -E '^(FAILED|ERROR)' "$OUT/pytest.log" | cut -c1-160 | head -30
tail -1 "$OUT/pytest.log"
