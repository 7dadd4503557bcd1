#!/usr/bin/env bash
# MiniLM (all-MiniLM-L6-v2) on SST-2: the softmax baseline, 400 fine-tuning steps (was scripts/minilm.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
SST2=${HF_POLYATTN_SST2:?SST-2 is not bundled: set HF_POLYATTN_SST2 to GLUE SST-2 train.tsv (sentence<TAB>label)}
CLS="--model minilm --task classification --data $SST2 --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress true"
P=.venv/bin/python
$P -m hf_polyattn.retrofit $CLS --kind softmax --eval_before false --output_dir runs/r2/minilm-softmax
