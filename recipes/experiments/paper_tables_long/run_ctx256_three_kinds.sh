#!/usr/bin/env bash
# PolySketchFormer Table 1 at context 256, 600 steps, softmax and the two learned polysketch kinds only
# (usage: run_ctx256_three_kinds.sh SEED). Ran after the thesis grid on the idle 2-core CPU: the 150-step Table 1
# (recipes/results/paper_tables/) sits at the unigram/bigram plateau (every kind ~12.5 ppl), so these kinds train
# longer, one seed per single-threaded process: seed 0 started when the thesis grid's second process finished,
# seed 1 when the first one did (one process per core). Its results folder (recipes/results/paper_tables_long/seed$SEED)
# was later replaced by run_grid.sh's seed$SEED/ctx256, which reused these trained runs from runs/ (same runs_dir,
# same fingerprint) and only evaluated them again. Then the section:
#     .venv/bin/python -m recipes.experiments.paper_tables_long.fill_section
# (At that time this script was recipes/results/paper_tables_long/scripts/launch.sh.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
seed=$1
STEPS=${STEPS:-600}
mkdir -p runs
OMP_NUM_THREADS=1 .venv/bin/python recipes/paper_tables.py --contexts 256 --steps "$STEPS" --seed "$seed" \
    --kinds softmax polysketch_learned polysketch_local --threads 1 \
    --runs_dir runs/paper_tables_long/seed$seed --out recipes/results/paper_tables_long/seed$seed \
    > runs/paper_tables_long_seed$seed.log 2>&1
