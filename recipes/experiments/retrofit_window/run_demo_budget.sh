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
C="--model smollm2 --data demo --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 2048 --threads 2 --progress false --resume false --transfer_batch_size 4 --save_model false"
T="--kind polysketch --set sketch=learned --set sketch_size=16 --set qk_norm=true --set block_size=64 --transfer_steps 60 --transfer_lr 1e-2"
$P -m hf_polyattn.retrofit $C --kind softmax --output_dir $OUT/softmax
$P -m hf_polyattn.retrofit $C $T --set local_exact=true --output_dir $OUT/polysketch_blocks64
$P -m hf_polyattn.retrofit $C $T --set window=64 --output_dir $OUT/polysketch_window64
$P -m hf_polyattn.retrofit $C $T --set window=64 --set feature_proj=64 --output_dir $OUT/polysketch_window64_proj
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
runs = [out / n for n in ('softmax', 'polysketch_blocks64', 'polysketch_window64', 'polysketch_window64_proj')]
j, md = write_table(compare_runs(runs), Path('recipes/results/retrofit_window/demo_budget'))
print(md.read_text())
"
