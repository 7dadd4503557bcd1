"""Inputs of the retrofit_kinds study (issue 14): the registry's other kinds retrofitted at one budget each.

    python recipes/experiments/run.py retrofit_kinds [ROW ...]

Each row is one ``hf-polyattn retrofit`` run (``python -m hf_polyattn.retrofit``), the kind's settings given with
``--set``.

* ``minilm_sst2_kinds/*``: all-MiniLM-L6-v2 on SST-2 (``$HF_POLYATTN_SST2``), 200 fine-tuning steps x 16 sentences
  for every row (100 transfer steps first for linformer's E, F; the parameter-free kinds cannot be transferred),
  softmax in the same session;
* ``smollm2_kinds/*``: SmolLM2-135M on Tiny Shakespeare (``--data demo``, the bundled copy) with the two-stage
  budget of retrofit_window's ``two_stage_kinds`` rows: 60 LoRA r=8 steps on q/k/v/o plus the polyattn parameters,
  4 x 256 tokens a step, 8,192 held-out tokens; kinds with parameters first get 60 attention-transfer steps:
  bigbird (blocks of 16: 3-block window, 1 global, 3 random of the 16 blocks of a 256-token context) and reformer
  (8 buckets, 2 rounds, 32 keys per bucket window, hashing the model's own q and k) have none and get the LoRA
  steps only; taylor (seed 002's Taylor kernel) takes the kernel kinds' recipe (128-token window + projection).

The CPU speed tables of the section come from ``hf-polyattn bench`` (their commands are in
``recipes/results/benchmark_attention_kinds/*.json``).
"""

RETROFIT = ["-m", "hf_polyattn.retrofit"]
CLS = ["--model", "minilm", "--task", "classification", "--data", "{sst2}", "--finetune_steps", "200",
       "--finetune_lr", "1e-4", "--warmup_steps", "20", "--batch_size", "16", "--max_length", "64",
       "--num_eval", "1000", "--eval_batch_size", "100", "--threads", "2", "--progress", "false", "--resume", "false"]
CLS_TRANSFER = ["--transfer_steps", "100", "--transfer_batch_size", "16", "--transfer_lr", "1e-2",
                "--polyattn_lr", "1e-3"]
LM = ["--model", "smollm2", "--data", "demo", "--context", "256", "--eval_context", "256", "--eval_stride", "256",
      "--max_eval_tokens", "8192", "--threads", "2", "--progress", "false", "--resume", "false", "--save_model",
      "false", "--batch_size", "4", "--transfer_batch_size", "4",
      "--finetune_steps", "60", "--lora", "true", "--lora_r", "8", "--lora_alpha", "16", "--finetune_lr", "1e-3",
      "--polyattn_lr", "1e-3", "--warmup_steps", "5"]
LM_TRANSFER = ["--set", "qk_norm=true", "--set", "block_size=64", "--set", "feature_proj=64", "--transfer_steps", "60",
               "--transfer_lr", "1e-2", "--eval_before", "false"]
OUT = ["--output_dir", "{out}"]

ROWS = {
    "minilm_sst2_kinds/softmax": [*RETROFIT, *CLS, "--kind", "softmax", "--eval_before", "false", *OUT],
    # MiniLM reads 64 tokens here: E, F for 64 positions, projected to 16 rows (segments of 4 tokens)
    "minilm_sst2_kinds/linformer": [*RETROFIT, *CLS, *CLS_TRANSFER, "--kind", "linformer", "--set",
                                    "projection_length=16", "--set", "max_length=64", *OUT],
    "minilm_sst2_kinds/nystrom": [*RETROFIT, *CLS, "--kind", "nystrom", "--set", "num_landmarks=16", *OUT],
    "minilm_sst2_kinds/fnet": [*RETROFIT, *CLS, "--kind", "fnet", *OUT],
    # blocks of 8 tokens: window of 3 blocks, 1 global block, 1 random block
    "minilm_sst2_kinds/bigbird": [*RETROFIT, *CLS, "--kind", "bigbird", "--set", "block=8", "--set", "random_blocks=1",
                                  *OUT],
    # LSH on the model's own q and k (a stock checkpoint has trained W_k): shared_qk off
    "minilm_sst2_kinds/reformer": [*RETROFIT, *CLS, "--kind", "reformer", "--set", "num_buckets=4", "--set",
                                   "shared_qk=false", "--set", "bucket_window=16", *OUT],
    "smollm2_kinds/softmax": [*RETROFIT, *LM, "--kind", "softmax", *OUT],
    "smollm2_kinds/bigbird16": [*RETROFIT, *LM, "--kind", "bigbird", "--set", "block=16", *OUT],
    "smollm2_kinds/reformer8x32": [*RETROFIT, *LM, "--kind", "reformer", "--set", "num_buckets=8", "--set",
                                   "bucket_window=32", "--set", "shared_qk=false", *OUT],
    "smollm2_kinds/taylor_window128_proj": [*RETROFIT, *LM, "--kind", "taylor", *LM_TRANSFER, "--set", "window=128",
                                            *OUT],
}
TABLES = {table: tuple(r for r in ROWS if r.startswith(table + "/"))
          for table in ("minilm_sst2_kinds", "smollm2_kinds")}
AFTER = [["-m", "recipes.experiments.retrofit_kinds.fill_section"]]

