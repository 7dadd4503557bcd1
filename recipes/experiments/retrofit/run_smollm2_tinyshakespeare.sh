#!/usr/bin/env bash
# SmolLM2-135M-Instruct on Tiny Shakespeare: softmax fine-tuning baseline, then polysketch (150 transfer steps),
# exact polynomial and elu+1 linear (40 transfer steps each), each followed by the same 60 fine-tuning steps.
# Idle-machine session of 2026-11-22, one run after another (was scripts/smol.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
LM="--model smollm2 --finetune_steps 60 --finetune_lr 1e-4 --warmup_steps 5 --batch_size 4 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false"
R="--transfer_lr 1e-2 --polyattn_lr 1e-3 --eval_before false"
$P recipes/retrofit.py $LM --attention softmax --output_dir runs/r2/smollm2-softmax
$P recipes/retrofit.py $LM $R --attention polysketch --sketch learned --sketch_size 32 --local_exact true --block_size 64 --qk_norm true --transfer_steps 150 --window 0 --feature_proj 0 --output_dir runs/r2/smollm2-polysketch
$P recipes/retrofit.py $LM $R --attention polynomial --degree 4 --qk_norm true --transfer_steps 40 --output_dir runs/r2/smollm2-polynomial
$P recipes/retrofit.py $LM $R --attention linear --feature_map elu --local_exact false --qk_norm true --transfer_steps 40 --window 0 --feature_proj 0 --output_dir runs/r2/smollm2-linear
