#!/usr/bin/env bash
# What a session with a lent GPU runs, in stages that each fit one call of the device tool (10 minutes a
# command, 30 minutes of device time a session): run them in this order, one call each, and commit what lands
# in $OUT (see recipes/results/PENDING.md for where each file goes).
#
#   bash recipes/gpu_checks.sh tests     # the Triton kernels and the bf16 model contract compiled for CUDA
#   bash recipes/gpu_checks.sh kernels   # SDPA, the causal product and the local part alone (with their before/after
#                                        # switches), a profile of the product
#   bash recipes/gpu_checks.sh layers    # whole PolyAttention layers per backend, a layer profile at 32k, and
#                                        # each bf16 layer's peak memory against SDPA's (memory_layers.py)
#   bash recipes/gpu_checks.sh bench     # the official table against SDPA: hf-polyattn bench --device cuda
#   bash recipes/gpu_checks.sh e2e       # GPT-2-small-shaped training step and decoding, SDPA vs the kinds
#   bash recipes/gpu_checks.sh fla       # linear elu+1 against fla-core's chunk_linear_attn (its wheel in .whl/)
#   bash recipes/gpu_checks.sh flex      # backend 'fla' (FlexAttention window + fla-core's gated state): its CUDA
#                                        # tests, its rows beside SDPA's and fla-core's, the same rows on 'triton'
#   bash recipes/gpu_checks.sh model     # the whole-model bench of a retrofit against its base (MODEL, BASE)
#
# Runs from the repository root with the machine's own torch / triton / transformers (the lent machines have no
# package index: the repository goes on PYTHONPATH, nothing is installed). Each stage stops itself before the
# tool's limit (timeout) so that what it printed and wrote under $OUT comes back.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
case "${1:-}" in
  tests|kernels|layers|bench|e2e|fla|flex|model) ;;
  *) echo "usage: bash recipes/gpu_checks.sh tests|kernels|layers|bench|e2e|fla|flex|model" >&2; exit 2 ;;
esac
# fla-core (the rows against fla's chunk_linear_attn): the lent machines reach no package index, so its wheel travels
# in .whl/ (git-ignored; made here with `pip download --no-deps --only-binary=:all: -d .whl fla-core==0.6.0` and named
# in the device tool's carry); it needs einops, which those machines have
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla_site .whl/fla_core-*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/fla_site"
fi
OUT="${OUT:-recipes/results/gpu_run}"
mkdir -p "$OUT"
python - <<'EOF' | tee "$OUT/machine.txt"
import importlib.util, torch, triton, transformers
print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__,
      "fla", "yes" if importlib.util.find_spec("fla") else "no",
      torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device")
EOF

case "${1:-}" in
  tests)
    # 8 workers: each compiles its kernels in parallel (one process compiled test_triton.py for over 110 s)
    timeout 540 python -m pytest -q -n 8 -p no:cacheprovider tests/ops/test_triton.py tests/ops/test_triton_local.py \
      tests/ops/test_triton_window.py tests/ops/test_fla_backend.py tests/integration/test_cuda_models.py \
      2>&1 | tee "$OUT/cuda_tests.txt" | tail -40 ;;
  kernels)
    timeout 540 python recipes/profile_gpu_kernels.py sdpa_rows lt_rows local_rows profile_lt --out "$OUT" \
      2>&1 | tee "$OUT/kernels.log" | grep -v '^{' | tail -60 ;;
  layers)
    timeout 440 python recipes/profile_gpu_kernels.py layer_rows profile_layer --out "$OUT" \
      2>&1 | tee "$OUT/layers.log" | grep -v '^{' | tail -60
    # counted storages and the allocator's peak of each bf16 layer against SDPA's (seconds per row on a GPU)
    timeout 100 python recipes/memory_layers.py --device cuda --heads 16 --lengths 8192 32768 --out "$OUT/memory_layers" \
      2>&1 | tail -20 ;;
  bench)
    timeout 560 python recipes/benchmark_attention.py --device cuda --kinds sdpa polysketch-local polysketch \
      linear-elu performer polysketch-window128 --lengths 2048 8192 32768 65536 --repeats 3 --timeout 60 \
      --out "$OUT" 2>&1 | tail -40 ;;
  e2e)
    timeout 560 python recipes/e2e_speed.py --device cuda --dtype bfloat16 --out "$OUT" 2>&1 | tail -40 ;;
  fla)
    # fla's autotuning takes minutes per shape on a first run: its own stage, a longer timeout per cell
    timeout 560 python recipes/benchmark_attention.py --device cuda --kinds sdpa linear-elu fla-linear-elu \
      --lengths 8192 32768 65536 --repeats 3 --timeout 240 --out "$OUT" 2>&1 | tail -40 ;;

  # ---------------------------------------------------------------------------------------------------------------
  # backend 'fla' for whole layers (hf_polyattn/ops/flex.py): a softmax window (+ sinks) on FlexAttention, the
  # kernel state (gated or not) on fla-core's chunk kernels, one normaliser; 'auto' takes it on CUDA when fla-core
  # imports. Targets (issue 33): the long-context default (linear-elu-window128-gate) >= 3x SDPA at 32k
  # forward+backward; linear-elu (now on fla-core) at least as fast as fla-linear-elu. Needs fla-core (.whl/ above).
  flex)
    timeout 200 python -m pytest -q -p no:cacheprovider tests/ops/test_flex_fla.py tests/ops/test_fla_backend.py \
      2>&1 | tee "$OUT/flex_tests.txt" | tail -20
    # one run: SDPA, fla-core's own kernel and the rows 'auto' now sends to backend 'fla' (compiles FlexAttention
    # and autotunes fla-core on first use: a long timeout per cell)
    timeout 220 python recipes/benchmark_attention.py --device cuda --kinds sdpa fla-linear-elu linear-elu \
      linear-elu-window128-gate --lengths 8192 32768 --repeats 5 --timeout 100 --out "$OUT/flex_auto" \
      2>&1 | tail -20
    # the same rows on the project's Triton kernels (the path before), SDPA again in that run
    HF_POLYATTN_BACKEND=triton timeout 140 python recipes/benchmark_attention.py --device cuda --kinds sdpa \
      linear-elu linear-elu-window128-gate --lengths 8192 32768 --repeats 5 --timeout 60 \
      --out "$OUT/flex_triton" 2>&1 | tail -20 ;;
  model)
    # prefill and decode of a retrofitted model against its base in one process (decode at 32k against SDPA with
    # DynamicCache): MODEL = the retrofit's folder (e.g. make demo's runs/demo/linear/model, carried to the machine),
    # BASE = its checkpoint's folder
    if [ -z "${MODEL:-}" ] || [ ! -d "$MODEL" ]; then
      echo "model: set MODEL to a retrofitted model's folder (and BASE to its base checkpoint's)" >&2; exit 2
    fi
    timeout 560 python -m hf_polyattn.cli bench --model "$MODEL" ${BASE:+--base "$BASE"} --device cuda \
      --out "$OUT/bench_model" 2>&1 | tail -40 ;;
esac
