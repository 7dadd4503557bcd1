#!/usr/bin/env bash
# Follow-up of run_demo_budget.sh at the same budget (60 transfer steps, no fine-tuning): the learnable
# per-head mixing factor of the window (window_mix) and a 128-token window, both with feature_proj=64.
# Reuses the softmax run of run_demo_budget.sh; the table covers both scripts' runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_window}
C="--model smollm2 --data demo --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 2048 --threads 2 --progress false --resume false --transfer_batch_size 4 --save_model false"
T="--kind polysketch --set sketch=learned --set sketch_size=16 --set qk_norm=true --set block_size=64 --transfer_steps 60 --transfer_lr 1e-2"
$P -m hf_polyattn.retrofit $C $T --set window=64 --set feature_proj=64 --set window_mix=true --output_dir $OUT/polysketch_window64_proj_mix
$P -m hf_polyattn.retrofit $C $T --set window=128 --set feature_proj=64 --output_dir $OUT/polysketch_window128_proj
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
names = ('softmax', 'polysketch_blocks64', 'polysketch_window64', 'polysketch_window64_proj',
         'polysketch_window64_proj_mix', 'polysketch_window128_proj')
j, md = write_table(compare_runs([out / n for n in names]), Path('recipes/results/retrofit_window/demo_budget'))
print(md.read_text())
"
