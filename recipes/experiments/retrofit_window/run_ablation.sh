#!/usr/bin/env bash
# Issue 13's ablation at the demo's budget, the rows that run_demo_budget*.sh did not run: the same options and
# budget as those (SmolLM2-135M-Instruct, Tiny Shakespeare, 60 attention-transfer steps of 4 x 256 tokens, no
# fine-tuning, 2048 held-out tokens, 2 threads), one run after another, most informative first:
#   polysketch r=32, 128-token window + projection; polysketch r=16 without any exact local part (window 0, no
#   blocks) + projection; r=16, 128-token window without the projection; linear (elu), 128-token window +
#   projection; r=16, 16-token window + projection.
# The exact polynomial kind (degree 4, quadratic time) runs without a window: it is exact everywhere already
# (PolyAttnConfig and the pipeline refuse --window for it), so its row is the exact kernel itself with the
# projection and the q/k LayerNorm. softmax is rerun: compare_runs takes the baseline from
# the runs it is given. A row that fails is reported and left out of the table; with STOP_AT (epoch seconds) set,
# rows not started by then are skipped (the time box). The table is written by compare_runs (no number typed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_window}
STOP_AT=${STOP_AT:-}
C="--model smollm2 --data demo --context 256 --eval_context 256 --eval_stride 256 --max_eval_tokens 2048 --threads 2 --progress false --resume false --transfer_batch_size 4 --save_model false"
B="--set qk_norm=true --set block_size=64 --transfer_steps 60 --transfer_lr 1e-2"
S16="--kind polysketch --set sketch=learned --set sketch_size=16 $B"
S32="--kind polysketch --set sketch=learned --set sketch_size=32 $B"
LIN="--kind linear --set feature_map=elu $B"
PROJ="--set feature_proj=64"
row() {  # row NAME ARGS...: one run; a failure is reported, not fatal (the table lists the runs that finished)
  local name=$1
  shift
  if [[ -n "$STOP_AT" && $(date +%s) -ge $STOP_AT ]]; then
    echo "SKIPPED $name: time box (STOP_AT=$STOP_AT) reached before it started" >&2
    return 0
  fi
  $P -m hf_polyattn.retrofit $C "$@" --output_dir "$OUT/$name" || echo "FAILED $name (exit $?)" >&2
}
row softmax --kind softmax
row polysketch_r32_window128_proj $S32 --set window=128 $PROJ
row polysketch_window0_proj $S16 $PROJ
row polysketch_window128 $S16 --set window=128
row linear_window128_proj $LIN --set window=128 $PROJ
row polysketch_window16_proj $S16 --set window=16 $PROJ
row polynomial4_proj --kind polynomial --set degree=4 $B $PROJ
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
names = ('softmax', 'polysketch_r32_window128_proj', 'polysketch_window0_proj', 'polysketch_window128',
         'linear_window128_proj', 'polysketch_window16_proj', 'polynomial4_proj')
done = [out / n for n in names if (out / n / 'results.json').exists()]
print('missing (failed or not run):', [n for n in names if out / n not in done])
j, md = write_table(compare_runs(done), Path('recipes/results/retrofit_window/ablation'))
print(md.read_text())
"
