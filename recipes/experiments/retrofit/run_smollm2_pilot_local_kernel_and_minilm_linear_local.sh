#!/usr/bin/env bash
# Which exact-block kernel: the SmolLM2 pilot A/B/C (40 transfer steps, no fine-tuning: polynomial blocks + qk
# LayerNorm, softmax blocks without, softmax blocks with), then MiniLM/SST-2 elu+1 linear with exact 16-token
# softmax blocks (the fourth row of the MiniLM table). Was scripts/pilot.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
LM="--model smollm2 --data demo --transfer_steps 40 --transfer_lr 1e-2 --batch_size 4 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 2048 --threads 2 --progress false --eval_before false --save_model false --kind polysketch --set sketch=learned --set sketch_size=32 --set local_exact=true --set block_size=64"
$P -m hf_polyattn.retrofit $LM --set qk_norm=true --output_dir runs/r2/pilot-A
$P -m hf_polyattn.retrofit $LM --set local_kernel=softmax --set qk_norm=false --output_dir runs/r2/pilot-B
$P -m hf_polyattn.retrofit $LM --set local_kernel=softmax --set qk_norm=true --output_dir runs/r2/pilot-C
SST2=${HF_POLYATTN_SST2:?SST-2 is not bundled: set HF_POLYATTN_SST2 to GLUE SST-2 train.tsv (sentence<TAB>label)}
CLS="--model minilm --task classification --data $SST2 --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress true"
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3"
$P -m hf_polyattn.retrofit $CLS $T --kind linear --set local_exact=true --set block_size=16 --set qk_norm=true --output_dir runs/r2/minilm-linear-local
