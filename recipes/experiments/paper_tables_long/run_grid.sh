#!/usr/bin/env bash
# PolySketchFormer Tables 1-2 at small scale, 600 steps: all six kinds at contexts 2048, 1024 and 256, one seed per
# single-threaded process, both seeds side by side (`run_grid.sh 0 &`, `run_grid.sh 1 &`; fourth session, idle
# 2-core CPU). One paper_tables.py call per context so that every finished context leaves its results.json even if
# the session ends first; the longest context runs first because nothing at 2048 existed. The context-256 runs of
# softmax and the two learned polysketch kinds are the ones run_ctx256_three_kinds.sh trained (same runs_dir, same
# fingerprint): they are reused and only evaluated again. Then the section:
#     .venv/bin/python -m recipes.experiments.paper_tables_long.fill_section
# (At that time this script was recipes/results/paper_tables_long/scripts/launch_grid.sh.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
seed=$1
STEPS=${STEPS:-600}
mkdir -p runs
for ctx in 2048 1024 256; do
    OMP_NUM_THREADS=1 .venv/bin/python recipes/paper_tables.py --contexts "$ctx" --steps "$STEPS" --seed "$seed" \
        --threads 1 --runs_dir runs/paper_tables_long/seed$seed \
        --out recipes/results/paper_tables_long/seed$seed/ctx$ctx \
        > runs/paper_tables_long_seed${seed}_ctx$ctx.log 2>&1
done
