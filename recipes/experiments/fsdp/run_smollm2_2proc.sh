#!/usr/bin/env bash
# A sharded retrofit smoke run: SmolLM2-135M-Instruct on 2 CPU processes (torchrun, FSDP2 over gloo), attention
# transfer then LoRA, global batch 4 x 256 tokens; then the saved folder is reloaded and scored again, and
# lm-eval's own CLI scores it (trust_remote_code=True: through the folder's loader) beside the softmax checkpoint.
# Wrote recipes/results/fsdp/smollm2-2proc.json (the run's results.json); smollm2-2proc.md quotes it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/fsdp-smollm2}
OMP_NUM_THREADS=1 $P -m torch.distributed.run --nproc_per_node 2 -m hf_polyattn.retrofit --model smollm2 --data demo \
    --kind polysketch --set sketch=learned --set sketch_size=32 --set window=128 --set feature_proj=64 \
    --set block_size=64 --set qk_norm=true --transfer_steps 10 --transfer_batch_size 2 --lora --finetune_steps 5 --batch_size 2 \
    --context 256 --max_eval_tokens 2048 --eval_batch_size 4 --threads 1 --progress false --fsdp --no_resume \
    --output_dir $OUT
cp $OUT/results.json recipes/results/fsdp/smollm2-2proc.json
$P -m hf_polyattn.cli eval $OUT/model --data demo --max-eval-tokens 2048 \
    --context 256 --batch-size 4 --threads 1
for M in "$($P -c 'from hf_polyattn.checkpoints import resolve_checkpoint; print(resolve_checkpoint("smollm2"))')" $OUT/model; do
    OMP_NUM_THREADS=2 $P -m lm_eval --model hf --model_args pretrained=$M,trust_remote_code=True,dtype=float32,max_length=256 \
        --tasks polyattn_tinyshakespeare --include_path hf_polyattn/eval/lm_eval_tasks --limit 10 --device cpu
done
