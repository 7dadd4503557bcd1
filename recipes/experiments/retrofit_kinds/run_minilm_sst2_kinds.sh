#!/usr/bin/env bash
# Issue 14's retrofit rows: every bidirectional kind of the registry's new systems on MiniLM (all-MiniLM-L6-v2) /
# SST-2, one budget for all: 200 fine-tuning steps x 16 sentences (lr 1e-4, 20 warm-up), 1000 held-out sentences;
# kinds with parameters (linformer's E, F) first get 100 attention-transfer steps, the parameter-free ones (nystrom,
# fnet) cannot be transferred; softmax runs in the same session as the baseline. KINDS="..." picks a subset (the
# causal-and-bidirectional bigbird and reformer are run by the same script). One run after another on the 2-core
# CPU. The table, with the paired McNemar test on the per-example hits, is written by compare_runs (no number typed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
OUT=${OUT:-runs/retrofit_kinds_minilm}
KINDS=${KINDS:-"softmax linformer nystrom fnet bigbird reformer"}
SST2=${HF_POLYATTN_SST2:?SST-2 is not bundled: set HF_POLYATTN_SST2 to GLUE SST-2 train.tsv (sentence<TAB>label)}
CLS="--model minilm --task classification --data $SST2 --finetune_steps 200 --finetune_lr 1e-4 --warmup_steps 20 --batch_size 16 --max_length 64 --num_eval 1000 --eval_batch_size 100 --threads 2 --progress false --resume false"
T="--transfer_steps 100 --transfer_batch_size 16 --transfer_lr 1e-2 --polyattn_lr 1e-3"
for kind in $KINDS; do
  case $kind in
    softmax) $P -m hf_polyattn.retrofit $CLS --kind softmax --eval_before false --output_dir $OUT/softmax ;;
    # MiniLM reads 64 tokens here: E, F for 64 positions, projected to 16 rows (segments of 4 tokens)
    linformer) $P -m hf_polyattn.retrofit $CLS $T --kind linformer --set projection_length=16 --set max_length=64 --output_dir $OUT/linformer ;;
    nystrom) $P -m hf_polyattn.retrofit $CLS --kind nystrom --set num_landmarks=16 --output_dir $OUT/nystrom ;;
    fnet) $P -m hf_polyattn.retrofit $CLS --kind fnet --output_dir $OUT/fnet ;;
    # blocks of 8 tokens: window of 3 blocks, 1 global block, 1 random block
    bigbird) $P -m hf_polyattn.retrofit $CLS --kind bigbird --set block=8 --set random_blocks=1 --output_dir $OUT/bigbird ;;
    # LSH on the model's own q and k (a stock checkpoint has trained W_k): shared_qk off
    reformer) $P -m hf_polyattn.retrofit $CLS --kind reformer --set num_buckets=4 --set shared_qk=false --set bucket_window=16 --output_dir $OUT/reformer ;;
  esac
done
$P -c "
from pathlib import Path
from hf_polyattn.eval.compare import compare_runs, write_table
out = Path('$OUT')
runs = [out / n for n in ('softmax', 'linformer', 'nystrom', 'fnet', 'bigbird', 'reformer') if (out / n / 'results.json').exists()]
j, md = write_table(compare_runs(runs), Path('recipes/results/retrofit_kinds/minilm_sst2_kinds'))
print(md.read_text())
"
