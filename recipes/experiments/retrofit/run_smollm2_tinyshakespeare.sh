#!/usr/bin/env bash
# SmolLM2-135M-Instruct on Tiny Shakespeare: softmax fine-tuning baseline, then polysketch (150 transfer steps),
# exact polynomial and elu+1 linear (40 transfer steps each), each followed by the same 60 fine-tuning steps.
# Idle-machine session of 2026-11-22, one run after another (was scripts/smol.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
LM="--model smollm2 --data demo --finetune_steps 60 --finetune_lr 1e-4 --warmup_steps 5 --batch_size 4 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false"
R="--transfer_lr 1e-2 --polyattn_lr 1e-3 --eval_before false"
$P -m hf_polyattn.retrofit $LM --kind softmax --output_dir runs/r2/smollm2-softmax
$P -m hf_polyattn.retrofit $LM $R --kind polysketch --set sketch=learned --set sketch_size=32 --set local_exact=true --set block_size=64 --set qk_norm=true --transfer_steps 150 --output_dir runs/r2/smollm2-polysketch
$P -m hf_polyattn.retrofit $LM $R --kind polynomial --set degree=4 --set block_size=64 --set qk_norm=true --transfer_steps 40 --output_dir runs/r2/smollm2-polynomial
$P -m hf_polyattn.retrofit $LM $R --kind linear --set block_size=64 --set qk_norm=true --transfer_steps 40 --output_dir runs/r2/smollm2-linear
