#!/usr/bin/env bash
# MiniLM on SST-2: polysketch (16-token exact blocks) and plain elu+1 linear attention, 100 transfer + 400
# fine-tuning steps each (was scripts/minilm2.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
CLS="--model minilm --task classification --data ../shared/data/sst2_train.tsv --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress true"
P=.venv/bin/python
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3 --qk_norm true"
$P recipes/retrofit.py $CLS $T --attention polysketch --sketch learned --sketch_size 32 --local_exact true --block_size 16 --window 0 --feature_proj 0 --output_dir runs/r2/minilm-polysketch
$P recipes/retrofit.py $CLS $T --attention linear --feature_map elu --local_exact false --window 0 --feature_proj 0 --output_dir runs/r2/minilm-linear
