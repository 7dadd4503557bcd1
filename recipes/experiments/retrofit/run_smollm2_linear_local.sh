#!/usr/bin/env bash
# SmolLM2: elu+1 linear attention with exact 64-token softmax blocks (40 transfer + 60 fine-tuning steps), the
# fifth row of the SmolLM2 table (was scripts/late.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
LM="--model smollm2 --data demo --finetune_steps 60 --finetune_lr 1e-4 --warmup_steps 5 --batch_size 4 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false"
R="--transfer_lr 1e-2 --polyattn_lr 1e-3 --eval_before false"
$P -m hf_polyattn.retrofit $LM $R --kind linear --set local_exact=true --set block_size=64 --set qk_norm=true --transfer_steps 40 --output_dir runs/r2/smollm2-linear-local
