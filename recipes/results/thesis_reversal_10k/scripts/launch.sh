#!/usr/bin/env bash
# What ran (2026-11-22 09:28 UTC, idle 2-core CPU, nothing else running): the full thesis grid, 17 attentions
# x 3 seeds x 10,000 iterations, split over two single-threaded processes (one per core), then merged.
set -euo pipefail
cd "$(dirname "$0")/.."   # recipes/results/thesis_reversal_10k
PY=../../../.venv/bin/python
OMP_NUM_THREADS=1 nohup $PY ../../thesis_reversal.py --iterations 10000 --seeds 0 1 2 --threads 1 --compile \
    --kinds softmax elu x2 x4 x8 sq1 sq2 sq3 sq4 --tag _a --out . > run_a.log 2>&1 &
OMP_NUM_THREADS=1 nohup $PY ../../thesis_reversal.py --iterations 10000 --seeds 0 1 2 --threads 1 --compile \
    --kinds sq5 sq6 learned1 learned2 learned3 learned4 learned5 learned6 --tag _b --out . > run_b.log 2>&1 &
wait
$PY ../../thesis_reversal.py --merge results_a.json results_b.json --out .
# eager against compiled time per iteration, run after the grid (one paper_tables run on the other core)
for mode in eager compile; do
    OMP_NUM_THREADS=1 $PY ../../thesis_reversal.py --iterations 300 --seeds 0 --threads 1 \
        $([ $mode = compile ] && echo --compile) --kinds softmax x8 sq6 learned6 --out compile_check/$mode
done
