#!/usr/bin/env bash
# MiniLM on SST-2: polysketch (16-token exact blocks) and plain elu+1 linear attention, 100 transfer + 400
# fine-tuning steps each (was scripts/minilm2.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
SST2=${HF_POLYATTN_SST2:?SST-2 is not bundled: set HF_POLYATTN_SST2 to GLUE SST-2 train.tsv (sentence<TAB>label)}
CLS="--model minilm --task classification --data $SST2 --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress true"
P=.venv/bin/python
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3"
$P -m hf_polyattn.retrofit $CLS $T --kind polysketch --set sketch=learned --set sketch_size=32 --set local_exact=true --set block_size=16 --set qk_norm=true --output_dir runs/r2/minilm-polysketch
$P -m hf_polyattn.retrofit $CLS $T --kind linear --set block_size=64 --set qk_norm=true --output_dir runs/r2/minilm-linear
