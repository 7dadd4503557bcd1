#!/usr/bin/env bash
# Copy each runs/r2/<run>/results.json and loss plots into recipes/results/retrofit and write the comparison
# tables with recipes/evaluate.py --runs; then the section (was scripts/collect.sh; the last line is new).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
D=recipes/results/retrofit
for r in smollm2-softmax smollm2-polysketch smollm2-polynomial smollm2-linear smollm2-linear-local minilm-softmax minilm-polysketch minilm-linear minilm-linear-local gpt2-softmax gpt2-polysketch gpt2-linear; do
  [ -f runs/r2/$r/results.json ] || { echo "missing $r"; continue; }
  cp runs/r2/$r/results.json $D/${r}_results.json
  for png in runs/r2/$r/*_loss.png; do [ -f "$png" ] && cp "$png" $D/${r}_$(basename $png); done
done
[ -f runs/r2/gpt2-scratch/results.json ] && cp runs/r2/gpt2-scratch/results.json $D/gpt2-scratch_results.json
$P recipes/evaluate.py --runs runs/r2/smollm2-softmax runs/r2/smollm2-polysketch runs/r2/smollm2-polynomial runs/r2/smollm2-linear $([ -f runs/r2/smollm2-linear-local/results.json ] && echo runs/r2/smollm2-linear-local) --output $D/smollm2_tinyshakespeare
$P recipes/evaluate.py --runs runs/r2/minilm-softmax runs/r2/minilm-polysketch runs/r2/minilm-linear runs/r2/minilm-linear-local --output $D/minilm_sst2
if [ -f runs/r2/gpt2-linear/results.json ]; then
$P recipes/evaluate.py --runs runs/r2/gpt2-softmax runs/r2/gpt2-polysketch runs/r2/gpt2-linear --output $D/gpt2_scratch
fi
.venv/bin/python -m recipes.experiments.retrofit.fill_section   # writes recipes/results/SECTION_retrofit.md
