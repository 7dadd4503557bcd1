#!/usr/bin/env bash
# Issue 14's causal retrofit rows: the registry's new causal kinds on SmolLM2-135M / Tiny Shakespeare with the
# two-stage budget of recipes/experiments/retrofit_window/run_smollm2_two_stage_kinds.sh (60 LoRA r=8 steps on
# q/k/v/o plus the polyattn parameters, 4 x 256 tokens a step, 8192 held-out tokens; kinds with parameters first
# get 60 attention-transfer steps): bigbird (blocks of 16: 3-block window, 1 global, 3 random of the 16 blocks of a
# 256-token context) and reformer (8 buckets, 2 rounds, 32 keys per bucket window, hashing the model's own q and k)
# have no parameters and get the LoRA steps only; taylor (seed 002's Taylor kernel) takes the kernel kinds' recipe
# (128-token window + projection, transfer + LoRA). softmax is rerun with the same LoRA steps. One run after
# another on the 2-core CPU; a failed row is reported and left out. The table is written by compare_runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_kinds_smollm2}
C="--model smollm2 --data demo --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false --resume false --save_model false --batch_size 4 --transfer_batch_size 4"
F="--finetune_steps 60 --lora true --lora_r 8 --lora_alpha 16 --finetune_lr 1e-3 --polyattn_lr 1e-3 --warmup_steps 5"
T="--set qk_norm=true --set block_size=64 --set feature_proj=64 --transfer_steps 60 --transfer_lr 1e-2 --eval_before false"
row() {  # row NAME ARGS...: one run; a failure is reported, not fatal
  local name=$1
  shift
  $P -m hf_polyattn.retrofit $C $F "$@" --output_dir "$OUT/$name" || echo "FAILED $name (exit $?)" >&2
}
row softmax --kind softmax
row bigbird16 --kind bigbird --set block=16
row reformer8x32 --kind reformer --set num_buckets=8 --set bucket_window=32 --set shared_qk=false
row taylor_window128_proj --kind taylor $T --set window=128
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
names = ('softmax', 'bigbird16', 'reformer8x32', 'taylor_window128_proj')
done = [out / n for n in names if (out / n / 'results.json').exists()]
j, md = write_table(compare_runs(done), Path('recipes/results/retrofit_kinds/smollm2_kinds'))
print(md.read_text())
"
