#!/usr/bin/env bash
# The demo's budget (SmolLM2-135M-Instruct, Tiny Shakespeare, 60 attention-transfer steps of 4 x 256 tokens,
# no fine-tuning, 2048 held-out tokens) for the exact local part: block-diagonal local_exact (the demo until
# now) vs a sliding window (PolyAttnConfig.window), with and without the learnable projection feature_proj.
# One run after another on the 2-core CPU; the table is written by compare_runs (no number typed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_window}
C="--model smollm2 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 2048 --threads 2 --progress false --resume false --transfer_batch_size 4 --save_model false"
T="--attention polysketch --sketch learned --sketch_size 16 --qk_norm true --transfer_steps 60 --transfer_lr 1e-2"
$P recipes/retrofit.py $C --attention softmax --output_dir $OUT/softmax
$P recipes/retrofit.py $C $T --local_exact true --block_size 64 --window 0 --feature_proj 0 --output_dir $OUT/polysketch_blocks64
$P recipes/retrofit.py $C $T --window 64 --block_size 64 --feature_proj 0 --output_dir $OUT/polysketch_window64
$P recipes/retrofit.py $C $T --window 64 --block_size 64 --polyattn_json '{"feature_proj": 64}' --output_dir $OUT/polysketch_window64_proj
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
runs = [out / n for n in ('softmax', 'polysketch_blocks64', 'polysketch_window64', 'polysketch_window64_proj')]
j, md = write_table(compare_runs(runs), Path('recipes/results/retrofit_window/demo_budget'))
print(md.read_text())
"
