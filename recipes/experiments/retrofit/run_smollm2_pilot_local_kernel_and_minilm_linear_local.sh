#!/usr/bin/env bash
# Which exact-block kernel: the SmolLM2 pilot A/B/C (40 transfer steps, no fine-tuning: polynomial blocks + qk
# LayerNorm, softmax blocks without, softmax blocks with), then MiniLM/SST-2 elu+1 linear with exact 16-token
# softmax blocks (the fourth row of the MiniLM table). Was scripts/pilot.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
LM="--model smollm2 --transfer_steps 40 --transfer_lr 1e-2 --batch_size 4 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 2048 --threads 2 --progress false --eval_before false --save_model false --attention polysketch --sketch learned --sketch_size 32 --local_exact true --block_size 64"
$P recipes/retrofit.py $LM --qk_norm true --window 0 --feature_proj 0 --output_dir runs/r2/pilot-A
$P recipes/retrofit.py $LM --local_kernel softmax --no_qk_norm --window 0 --feature_proj 0 --output_dir runs/r2/pilot-B
$P recipes/retrofit.py $LM --local_kernel softmax --qk_norm true --window 0 --feature_proj 0 --output_dir runs/r2/pilot-C
CLS="--model minilm --task classification --data ../shared/data/sst2_train.tsv --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress true"
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3 --qk_norm true"
$P recipes/retrofit.py $CLS $T --attention linear --feature_map elu --local_exact true --block_size 16 --window 0 --feature_proj 0 --output_dir runs/r2/minilm-linear-local
