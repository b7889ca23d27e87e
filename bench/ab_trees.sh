#!/usr/bin/env bash
# One benchmark of another tree against the working tree, in alternating runs of one device call: a change's
# end-to-end A/B where the two differ by more than an environment switch. The other tree is a copy of the package
# and its benches (e.g. `mkdir -p bench/variants/before && git archive REV metrale bench | tar -x -C
# bench/variants/before`; carry bench/variants), run from its own directory, so each tree runs the benchmark
# written for its own API. Kernels are cached by their source's hash, so the two trees' builds do not mix. Python
# runs with -P: `-m` would otherwise put the working directory ahead of PYTHONPATH.
# Usage: bash bench/ab_trees.sh OTHER_TREE ROUNDS MODULE [args...]
#   e.g. bash bench/ab_trees.sh bench/variants/before 2 bench.beam_generate --shape nllb-600m --device cuda
#        bash bench/ab_trees.sh bench/variants/before 2 bench.gpu_decode --shape llama3-8b --prefill ''
# Prints each run's p50 per (impl, batch) row of the benchmark's JSON, then the median per tree and their ratio.
set -uo pipefail
other=$(cd "$1" && pwd); rounds=$2; module=$3; shift 3
source scripts/device_env.sh || exit 1
work=$PWD
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
for round in $(seq "$rounds"); do
  for tree in before after; do
    dir=$work; [ $tree = before ] && dir=$other
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 -P -m "$module" "$@" --json "$OUT/ab_${tree}_$round.json" \
      > "$OUT/ab_${tree}_$round.txt" 2>&1) || echo "$tree round $round: FAILED (see $OUT/ab_${tree}_$round.txt)"
  done
done
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
runs = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/ab_*_*.json")):
    tree = path.rsplit("/", 1)[1].split("_")[1]
    data = json.load(open(path))
    for row in data.get("rows") or data.get("decode") or []:
        times = row.get("step_ms") or []
        p50 = row.get("p50_ms") or (statistics.median(times) if times else None)
        if p50:
            runs.setdefault((row["impl"], row["batch"]), {}).setdefault(tree, []).append(p50)
print("impl       batch  before p50s (ms)          after p50s (ms)           after/before")
for (impl, batch), trees in sorted(runs.items()):
    before, after = trees.get("before", []), trees.get("after", [])
    ratio = statistics.median(after) / statistics.median(before) if before and after else float("nan")
    print(f"{impl:<10} {batch:5d}  {' '.join(f'{p:7.3f}' for p in before):<24}  "
          f"{' '.join(f'{p:7.3f}' for p in after):<24}  {ratio:6.3f}")
PY
