#!/usr/bin/env bash
# Issue 13's "report every kind": the two-stage recipe of run_smollm2_two_stage.sh (60 attention-transfer steps, then
# 60 LoRA r=8 steps on q/k/v/o plus the polyattn parameters, 4 x 256 tokens a step, 8192 held-out tokens) for the
# kinds that run lacked: linear (elu + 1) and Performer with the 128-token window + projection (as polysketch there),
# and the exact polynomial kernel (degree 4, quadratic, projection; no window: it is exact everywhere). softmax is
# rerun with the same 60 LoRA steps (compare_runs takes the baseline from the runs it is given). One run after
# another on the 2-core CPU; a failed row is reported and left out. The table is written by compare_runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_window_two_stage_kinds}
C="--model smollm2 --data demo --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 8192 --threads 2 --progress false --resume false --save_model false --batch_size 4 --transfer_batch_size 4"
F="--finetune_steps 60 --lora true --lora_r 8 --lora_alpha 16 --finetune_lr 1e-3 --polyattn_lr 1e-3 --warmup_steps 5"
T="--set qk_norm=true --set block_size=64 --set feature_proj=64 --transfer_steps 60 --transfer_lr 1e-2 --eval_before false"
row() {  # row NAME ARGS...: one run; a failure is reported, not fatal
  local name=$1
  shift
  $P -m hf_polyattn.retrofit $C $F "$@" --output_dir "$OUT/$name" || echo "FAILED $name (exit $?)" >&2
}
row softmax --kind softmax
row linear_window128_proj --kind linear --set feature_map=elu $T --set window=128
row polynomial4_proj --kind polynomial --set degree=4 $T
row performer_window128_proj --kind performer --set num_features=256 $T --set window=128
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
names = ('softmax', 'linear_window128_proj', 'polynomial4_proj', 'performer_window128_proj')
done = [out / n for n in names if (out / n / 'results.json').exists()]
print('missing (failed):', [n for n in names if out / n not in done])
j, md = write_table(compare_runs(done), Path('recipes/results/retrofit_window/two_stage_kinds'))
print(md.read_text())
"
