#!/usr/bin/env bash
# After the SmolLM2 and MiniLM runs: GPT-2 trained from scratch and retrofitted (softmax / polysketch / linear),
# four MiniLM models with a learned sketch r = 8, 16, 32, 64 after transfer only and their sketch accuracy
# (recipes/results/sketch_accuracy, after-transfer table), and the paired re-evaluation of the four MiniLM
# models (recipes/results/retrofit/minilm_sst2_paired). Was scripts/after.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
$P recipes/train_gpt2_scratch.py --steps 600 --threads 2 --progress false --output_dir runs/r2/gpt2-scratch
G="--model runs/r2/gpt2-scratch/model --data demo --finetune_steps 100 --finetune_lr 3e-4 --warmup_steps 5 --batch_size 16 --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false --transfer_lr 1e-2 --polyattn_lr 1e-3"
$P -m hf_polyattn.retrofit $G --kind softmax --output_dir runs/r2/gpt2-softmax
$P -m hf_polyattn.retrofit $G --kind polysketch --set sketch=learned --set sketch_size=32 --set local_exact=true --set block_size=64 --set qk_norm=true --transfer_steps 100 --output_dir runs/r2/gpt2-polysketch
$P -m hf_polyattn.retrofit $G --kind linear --set block_size=64 --set qk_norm=true --transfer_steps 100 --output_dir runs/r2/gpt2-linear
SST2=${HF_POLYATTN_SST2:?SST-2 is not bundled: set HF_POLYATTN_SST2 to GLUE SST-2 train.tsv (sentence<TAB>label)}
for r in 8 16 32 64; do
$P -m hf_polyattn.retrofit --model minilm --task classification --data $SST2 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress false --kind polysketch --set sketch=learned --set sketch_size=$r --set degree=4 --set block_size=64 --set qk_norm=true --transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --eval_before false --output_dir runs/r2/minilm-transfer-r$r
done
$P recipes/sketch_accuracy.py --transferred-only --transferred runs/r2/minilm-transfer-r8/model runs/r2/minilm-transfer-r16/model runs/r2/minilm-transfer-r32/model runs/r2/minilm-transfer-r64/model --threads 2
for r in softmax polysketch linear linear-local; do
  att=${r%-local}
  $P recipes/evaluate.py --model runs/r2/minilm-$r/model --kind $att --task classification --data $SST2 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress false --save_model false --output_dir runs/r2/eval-minilm-$r
done
$P recipes/evaluate.py --runs runs/r2/eval-minilm-softmax runs/r2/eval-minilm-polysketch runs/r2/eval-minilm-linear runs/r2/eval-minilm-linear-local --output recipes/results/retrofit/minilm_sst2_paired
