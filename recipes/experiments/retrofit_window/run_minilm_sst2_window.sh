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
SST2=${HF_POLYATTN_SST2:?SST-2 is not bundled: set HF_POLYATTN_SST2 to GLUE SST-2 train.tsv (sentence<TAB>label)}
CLS="--model minilm --task classification --data $SST2 --finetune_steps 400 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress false --resume false"
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3"
$P -m hf_polyattn.retrofit $CLS --kind softmax --eval_before false --output_dir $OUT/softmax
$P -m hf_polyattn.retrofit $CLS $T --kind linear --set window=16 --set block_size=64 --set qk_norm=true --output_dir $OUT/linear_window16
$P -m hf_polyattn.retrofit $CLS $T --kind polysketch --set sketch=learned --set sketch_size=32 --set window=16 --set block_size=16 --set qk_norm=true --output_dir $OUT/polysketch_window16
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
j, md = write_table(compare_runs([out / n for n in ('softmax', 'linear_window16', 'polysketch_window16')]),
                    Path('recipes/results/retrofit_window/minilm_sst2_window'))
print(md.read_text())
"
