#!/usr/bin/env bash
# The beam table of another tree's package against the working tree's, in alternating runs of one device call:
# a change's end-to-end A/B where the two differ by more than an environment switch. The other tree is a copy of
# the package (e.g. `git archive main metrale | tar -x -C bench/variants/main-tree`; carry bench/variants), put
# first on PYTHONPATH for its runs; the benches come from the working tree. Kernels are cached by their source's
# hash, so the two trees' builds do not mix. Python runs with -P: `-m` would otherwise put the working directory,
# and with it the working tree's package, ahead of PYTHONPATH.
# Usage: bash bench/ab_trees.sh OTHER_TREE [ROUNDS] [beam_generate args...]
#   (default: 2 rounds of --batches 16,64 --reps 7). Prints each run's metrale p50s, then the medians per tree.
set -uo pipefail
other=$(cd "$1" && pwd); shift
rounds=${1:-2}; [ $# -gt 0 ] && shift
args=("$@"); [ ${#args[@]} -eq 0 ] && args=(--batches 16,64 --reps 7)
source scripts/device_env.sh || exit 1
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
for round in $(seq "$rounds"); do
  for tree in other work; do
    path=$PYTHONPATH; [ $tree = other ] && path=/tmp/site:$other:$PWD
    PYTHONPATH=$path python3 -P -c "import metrale; print('# $tree: package', metrale.__file__)" >> "$OUT/ab_trees.txt"
    PYTHONPATH=$path python3 -P -m bench.beam_generate --shape nllb-600m --device cuda "${args[@]}" \
      --json "$OUT/ab_${tree}_$round.json" > "$OUT/ab_${tree}_$round.txt" 2>&1 || echo "$tree round $round: FAILED"
  done
done
sort -u "$OUT/ab_trees.txt"
python3 - "$OUT" <<'PY'
import glob, json, statistics, sys
runs = {}
for path in sorted(glob.glob(f"{sys.argv[1]}/ab_*_*.json")):
    tree = path.rsplit("/", 1)[1].split("_")[1]
    for row in json.load(open(path))["rows"]:
        if row["impl"] == "metrale":
            runs.setdefault((row["batch"], tree), []).append(statistics.median(row["step_ms"]))
print("batch  tree   p50 ms of each run          median")
for (batch, tree), p50s in sorted(runs.items()):
    print(f"{batch:5d}  {tree:<5}  {' '.join(f'{p:7.2f}' for p in p50s):<26}  {statistics.median(p50s):7.2f}")
PY
