#!/usr/bin/env bash
# Issue 13's two-stage recipe on SmolLM2-135M-Instruct / Tiny Shakespeare: attention transfer (60 steps, only the
# polyattn parameters) then LoRA r=8 on q/k/v/o plus the polyattn parameters (60 steps of 4 x 256 tokens); the
# softmax baseline gets the same 60 LoRA steps. 8192 held-out tokens. One run after another on the 2-core CPU.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_window_two_stage}
C="--model smollm2 --data demo --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false --resume false --save_model false --batch_size 4 --transfer_batch_size 4"
F="--finetune_steps 60 --lora true --lora_r 8 --lora_alpha 16 --finetune_lr 1e-3 --polyattn_lr 1e-3 --warmup_steps 5"
T="--kind polysketch --set sketch=learned --set sketch_size=16 --set qk_norm=true --set block_size=64 --transfer_steps 60 --transfer_lr 1e-2 --eval_before false"
$P -m hf_polyattn.retrofit $C $F --kind softmax --output_dir $OUT/softmax
$P -m hf_polyattn.retrofit $C $F $T --set window=128 --set feature_proj=64 --output_dir $OUT/polysketch_window128_proj
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
j, md = write_table(compare_runs([out / 'softmax', out / 'polysketch_window128_proj']),
                    Path('recipes/results/retrofit_window/two_stage'))
print(md.read_text())
"
