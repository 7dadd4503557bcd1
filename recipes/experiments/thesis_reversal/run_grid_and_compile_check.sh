#!/usr/bin/env bash
# Thesis Chapter 5, full protocol: 17 attentions x 3 seeds x 10,000 iterations, split over two single-threaded
# processes (one per core), merged; then eager against compiled time per iteration (300 iterations of seed 0);
# then the RESULTS.md section. Ran 2026-11-22 09:28 UTC on the idle 2-core CPU (nothing else running); the
# eager/compiled check ran after the grid while one paper_tables.py run used the other core.
# At that time this script lived in the results folder (recipes/results/thesis_reversal_10k/scripts/launch.sh),
# ran from there (`--out .`, `../../thesis_reversal.py`) and wrote to recipes/results/thesis_reversal_10k, since
# renamed recipes/results/thesis_reversal; the commands are the same, with paths from the repository root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
PY=.venv/bin/python
OUT=recipes/results/thesis_reversal
mkdir -p "$OUT"
OMP_NUM_THREADS=1 nohup $PY recipes/thesis_reversal.py --iterations 10000 --seeds 0 1 2 --threads 1 --compile \
    --kinds softmax elu x2 x4 x8 sq1 sq2 sq3 sq4 --tag _a --out "$OUT" > "$OUT/run_a.log" 2>&1 &
OMP_NUM_THREADS=1 nohup $PY recipes/thesis_reversal.py --iterations 10000 --seeds 0 1 2 --threads 1 --compile \
    --kinds sq5 sq6 learned1 learned2 learned3 learned4 learned5 learned6 --tag _b --out "$OUT" > "$OUT/run_b.log" 2>&1 &
wait
$PY recipes/thesis_reversal.py --merge results_a.json results_b.json --out "$OUT"
# eager against compiled time per iteration, run after the grid (one paper_tables run on the other core)
for mode in eager compile; do
    OMP_NUM_THREADS=1 $PY recipes/thesis_reversal.py --iterations 300 --seeds 0 --threads 1 \
        $([ $mode = compile ] && echo --compile) --kinds softmax x8 sq6 learned6 --out "$OUT/compile_check/$mode"
done
$PY -m recipes.experiments.thesis_reversal.fill_section   # writes recipes/results/SECTION_thesis.md
