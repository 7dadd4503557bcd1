#!/usr/bin/env bash
# What ran after the thesis grid (idle 2-core CPU): the 150-step Table 1 sits at the unigram/bigram plateau
# (every kind ~12.5 ppl), so softmax and the two learned polysketch variants train longer, one seed per
# single-threaded process: `launch.sh 0` started when the grid's second process finished, `launch.sh 1` when the
# first one did (one process per core). Then:
#     .venv/bin/python recipes/results/paper_tables_long/scripts/fill_section.py
set -euo pipefail
cd "$(dirname "$0")/../../../.."   # repository root
seed=$1
STEPS=${STEPS:-600}
mkdir -p runs
OMP_NUM_THREADS=1 .venv/bin/python recipes/paper_tables.py --contexts 256 --steps "$STEPS" --seed "$seed" \
    --kinds softmax polysketch_learned polysketch_local --threads 1 \
    --runs_dir runs/paper_tables_long/seed$seed --out recipes/results/paper_tables_long/seed$seed \
    > runs/paper_tables_long_seed$seed.log 2>&1
