#!/usr/bin/env bash
# Issue 30, item 5: a second family end to end. A Gemma 3 text model (6 layers, 5 sliding-window layers of window 64
# per global one, as Gemma 3's 5:1; hidden 128, 4 heads / 2 kv heads, a 2,048-token byte-level BPE) trained from
# scratch on Tiny Shakespeare with the project's scratch trainer, then:
#   1. `hf-polyattn convert` with the long-context recipe on the converted layers (linear elu + a 128-token softmax
#      window + 4 sinks + gated decay, horizon 256): the global layer gets it, the sliding layers stay exact
#      (sliding_layers='exact'); sinks at their own positions (sink_position=own: integration/rope.py does not read
#      Gemma's RoPE yet);
#   2. generate() with and without the cache, cache bytes at two lengths, save -> reload (generate_and_reload.py);
#   3. `hf-polyattn eval --contexts --passkey` of the converted model beside the softmax checkpoint, and the
#      StreamingLLM row (kind sliding_window, 4 sinks + 128 window, on the same converted layers, own positions).
# No training of the converted layers (no attention transfer): training-free conversion. One run, 2 threads.
# DATA: the text file (default: the recipes' Tiny Shakespeare path, recipes/_defaults.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."   # the repository root
set -x
P=.venv/bin/python
DATA=${DATA:-$($P -c "import sys; sys.path.insert(0, 'recipes'); from _defaults import TINY_SHAKESPEARE as T; print(T)")}
RUN=${RUN:-runs/second_family}
OUT=recipes/results/second_family
EVAL="--data $DATA --contexts 256,1024,2048,4096 --passkey 1024,2048 --passkey-depths 5 --max-eval-tokens 4096 --threads 2"
RECIPE="--kind linear --set window=128 --set sinks=4 --set sink_position=own --set decay=gate --set decay_horizon=256"
mkdir -p "$OUT"

$P recipes/train_gpt2_scratch.py --family gemma3 --data "$DATA" --n_layer 6 --n_embd 128 --n_head 4 --context 256 \
    --sliding_window 64 --global_every 6 --steps 150 --batch_size 8 --lr 2e-3 --threads 2 --progress false \
    --save_every 50 --output_dir "$RUN/gemma3-scratch"
cp "$RUN/gemma3-scratch/results.json" "$OUT/train.json"

$P -m hf_polyattn.cli convert "$RUN/gemma3-scratch/model" $RECIPE --out "$RUN/gemma3-linear" --overwrite \
    | tee "$OUT/convert.txt"

$P recipes/experiments/second_family/generate_and_reload.py --base "$RUN/gemma3-scratch/model" \
    --converted "$RUN/gemma3-linear" --data "$DATA" --out "$OUT/generate.json"

$P -m hf_polyattn.cli eval "$RUN/gemma3-linear" $EVAL --base "$RUN/gemma3-scratch/model" --baselines softmax \
    --out "$RUN/eval-linear"
$P -m hf_polyattn.cli eval "$RUN/gemma3-scratch/model" $EVAL --kind sliding_window --set window=128 --set sinks=4 \
    --set sink_position=own --baselines none --out "$RUN/eval-streaming"
for row in linear streaming; do
    cp "$RUN/eval-$row/long_context.json" "$OUT/long_context_$row.json"
    cp "$RUN/eval-$row/long_context.md" "$OUT/long_context_$row.md"
done
