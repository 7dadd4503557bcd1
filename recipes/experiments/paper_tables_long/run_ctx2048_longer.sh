#!/usr/bin/env bash
# After run_grid.sh: at context 2048 every kind was still on the unigram/bigram plateau after 600 steps
# (perplexity 12.2-12.4, softmax included), so softmax and the two learned polysketch kinds train 4x longer there
# (2400 steps, their own cosine schedule), one seed per single-threaded process, both seeds side by side
# (`run_ctx2048_longer.sh 0 &`, `run_ctx2048_longer.sh 1 &`, each started when that seed's run_grid.sh ended).
# One paper_tables.py call per kind so that every finished run leaves its results.json. Then the section:
#     .venv/bin/python -m recipes.experiments.paper_tables_long.fill_section
# (At that time this script was recipes/results/paper_tables_long/scripts/launch_long2048.sh.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
seed=$1
STEPS=${STEPS:-2400}
mkdir -p runs
for kind in softmax polysketch_learned polysketch_local; do
    OMP_NUM_THREADS=1 .venv/bin/python recipes/paper_tables.py --contexts 2048 --steps "$STEPS" --seed "$seed" \
        --kinds "$kind" --threads 1 --runs_dir runs/paper_tables_long2048/seed$seed \
        --out recipes/results/paper_tables_long/long2048/seed$seed/$kind \
        > runs/paper_tables_long2048_seed${seed}_$kind.log 2>&1
done
