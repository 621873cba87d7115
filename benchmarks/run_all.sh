#!/usr/bin/env bash
# Every CPU benchmark, one after another (about 30 minutes on 2 cores), each against the competitor
# or floor its issue names, then one table of every goal line they printed: measured, goal, met.
# The full output of each stays in $VITFORGE_BENCH_OUT (default bench-out/). `make bench` runs this.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${VITFORGE_BENCH_OUT:-bench-out}"
PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$OUT"
status=0
for bench in shard_bench loader_bench train_bench ckpt_bench egress_bench scale_bench fewshot_bench tracking_bench; do
    echo "== benchmarks/$bench.py"
    "$PY" "benchmarks/$bench.py" 2>&1 | tee "$OUT/$bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "benchmarks/$bench.py failed"; status=1; }
done
echo
echo "== summary (goals from each benchmark's issue; details above and in $OUT/)"
"$PY" benchmarks/summarise.py "$OUT"/{shard_bench,loader_bench,train_bench,ckpt_bench,egress_bench,scale_bench,fewshot_bench,tracking_bench}.log || status=1
exit $status
