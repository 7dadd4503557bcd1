#!/usr/bin/env bash
# MiniLM (all-MiniLM-L6-v2) on SST-2 with the bidirectional sliding window (|i - j| < 16 exact, softmax), the same
# budget as recipes/experiments/retrofit/run_minilm_sst2.sh (100 transfer + 400 fine-tuning steps x 16 sentences),
# against softmax in the same session; one run after another on the 2-core CPU. The table (with the paired
# McNemar test on the per-example hits) is written by compare_runs (no number typed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_window_minilm}
DATA=../shared/data/sst2_train.tsv
CLS="--model minilm --task classification --data $DATA --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress false --resume false"
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3 --qk_norm true"
$P recipes/retrofit.py $CLS --attention softmax --eval_before false --output_dir $OUT/softmax
$P recipes/retrofit.py $CLS $T --attention linear --feature_map elu --window 16 --feature_proj 0 --output_dir $OUT/linear_window16
$P recipes/retrofit.py $CLS $T --attention polysketch --sketch learned --sketch_size 32 --window 16 --block_size 16 --feature_proj 0 --output_dir $OUT/polysketch_window16
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
j, md = write_table(compare_runs([out / n for n in ('softmax', 'linear_window16', 'polysketch_window16')]),
                    Path('recipes/results/retrofit_window/minilm_sst2_window'))
print(md.read_text())
"
