"""Inputs of the retrofit_window study (issue 13): SmolLM2 at the demo's budget (60 transfer steps of 4 x 256
tokens, no fine-tuning), block-diagonal exact blocks against a sliding window and the ablation around it; the
two-stage runs (transfer, then 60 LoRA steps); MiniLM on SST-2 with a bidirectional window.

    python recipes/experiments/run.py retrofit_window [ROW ...]

Each row is one ``recipes/retrofit.py`` run (the flags it ran with); a table of ``TABLES`` compares its rows
(``recipes/results/retrofit_window/<table>.{md,json}``), then ``fill_section`` writes ``SECTION_retrofit_window.md``
and ``ablation.png``. The ``ablation`` rows shared the 2 cores with another session's jobs for part of the time (the
section says so).
"""

RETROFIT = "recipes/retrofit.py"
# the demo's budget: SmolLM2 on Tiny Shakespeare (the recipe's default data), context 256, 2,048 held-out tokens
DEMO = ["--model", "smollm2", "--context", "256", "--eval_context", "256", "--eval_stride", "256",
        "--max_eval_tokens", "2048", "--threads", "2", "--progress", "false", "--resume", "false",
        "--transfer_batch_size", "4", "--save_model", "false"]
TRANSFER = ["--qk_norm", "true", "--transfer_steps", "60", "--transfer_lr", "1e-2"]
SKETCH16 = ["--attention", "polysketch", "--sketch", "learned", "--sketch_size", "16", *TRANSFER]
SKETCH32 = ["--attention", "polysketch", "--sketch", "learned", "--sketch_size", "32", *TRANSFER]
PROJ = ["--polyattn_json", '{"feature_proj": 64}']
# two stages: 8,192 held-out tokens, 60 LoRA r=8 steps on q/k/v/o plus the polyattn parameters
TWO = ["--model", "smollm2", "--context", "256", "--eval_context", "256", "--eval_stride", "256",
       "--max_eval_tokens", "8192", "--threads", "2", "--progress", "false", "--resume", "false",
       "--save_model", "false", "--batch_size", "4", "--transfer_batch_size", "4",
       "--finetune_steps", "60", "--lora", "true", "--lora_r", "8", "--lora_alpha", "16", "--finetune_lr", "1e-3",
       "--polyattn_lr", "1e-3", "--warmup_steps", "5"]
TWO_TRANSFER = ["--qk_norm", "true", "--transfer_steps", "60", "--transfer_lr", "1e-2", "--eval_before", "false"]
# MiniLM on SST-2: 100 transfer + 400 fine-tuning steps x 16 sentences, 1,000 held-out sentences
CLS = ["--model", "minilm", "--task", "classification", "--data", "{sst2}", "--finetune_steps", "400",
       "--finetune_lr", "1e-4", "--warmup_steps", "20", "--batch_size", "16", "--max_length", "64",
       "--num_eval", "1000", "--eval_batch_size", "100", "--threads", "2", "--progress", "false", "--resume", "false"]
CLS_TRANSFER = ["--transfer_steps", "100", "--transfer_batch_size", "16", "--transfer_lr", "1e-2",
                "--polyattn_lr", "1e-3", "--qk_norm", "true"]
OUT = ["--output_dir", "{out}"]

ROWS = {
    # the demo's budget, block-diagonal blocks against a window (run_demo_budget.sh, then run_demo_budget_more.sh)
    "demo_budget/softmax": [RETROFIT, *DEMO, "--attention", "softmax", *OUT],
    "demo_budget/polysketch_blocks64": [RETROFIT, *DEMO, *SKETCH16, "--local_exact", "true", "--block_size", "64",
                                        "--window", "0", "--feature_proj", "0", *OUT],
    "demo_budget/polysketch_window64": [RETROFIT, *DEMO, *SKETCH16, "--window", "64", "--block_size", "64",
                                        "--feature_proj", "0", *OUT],
    "demo_budget/polysketch_window64_proj": [RETROFIT, *DEMO, *SKETCH16, "--window", "64", "--block_size", "64",
                                             *PROJ, *OUT],
    "demo_budget/polysketch_window64_proj_mix": [RETROFIT, *DEMO, *SKETCH16, "--window", "64", "--block_size", "64",
                                                 "--polyattn_json", '{"feature_proj": 64, "window_mix": true}', *OUT],
    "demo_budget/polysketch_window128_proj": [RETROFIT, *DEMO, *SKETCH16, "--window", "128", "--block_size", "64",
                                              *PROJ, *OUT],
    # the ablation rows the demo_budget table lacks, softmax rerun in the same session
    "ablation/softmax": [RETROFIT, *DEMO, "--attention", "softmax", *OUT],
    "ablation/polysketch_r32_window128_proj": [RETROFIT, *DEMO, *SKETCH32, "--window", "128", "--block_size", "64",
                                               *PROJ, *OUT],
    "ablation/polysketch_window0_proj": [RETROFIT, *DEMO, *SKETCH16, "--local_exact", "false", "--window", "0",
                                         "--block_size", "64", *PROJ, *OUT],
    "ablation/polysketch_window128": [RETROFIT, *DEMO, *SKETCH16, "--window", "128", "--block_size", "64",
                                      "--feature_proj", "0", *OUT],
    "ablation/linear_window128_proj": [RETROFIT, *DEMO, "--attention", "linear", "--feature_map", "elu", *TRANSFER,
                                       "--window", "128", "--block_size", "64", *PROJ, *OUT],
    "ablation/polysketch_window16_proj": [RETROFIT, *DEMO, *SKETCH16, "--window", "16", "--block_size", "64", *PROJ,
                                          *OUT],
    "ablation/polynomial4_proj": [RETROFIT, *DEMO, "--attention", "polynomial", "--degree", "4", *TRANSFER, *PROJ,
                                  *OUT],
    # transfer, then LoRA
    "two_stage/softmax": [RETROFIT, *TWO, "--attention", "softmax", *OUT],
    "two_stage/polysketch_window128_proj": [RETROFIT, *TWO, "--attention", "polysketch", "--sketch", "learned",
                                            "--sketch_size", "16", *TWO_TRANSFER, "--window", "128", "--block_size",
                                            "64", *PROJ, *OUT],
    "two_stage_kinds/softmax": [RETROFIT, *TWO, "--attention", "softmax", *OUT],
    "two_stage_kinds/linear_window128_proj": [RETROFIT, *TWO, "--attention", "linear", "--feature_map", "elu",
                                              *TWO_TRANSFER, "--feature_proj", "64", "--window", "128",
                                              "--block_size", "64", *OUT],
    "two_stage_kinds/polynomial4_proj": [RETROFIT, *TWO, "--attention", "polynomial", "--degree", "4", *TWO_TRANSFER,
                                         "--feature_proj", "64", *OUT],
    "two_stage_kinds/performer_window128_proj": [RETROFIT, *TWO, "--attention", "performer", "--num_features", "256",
                                                 *TWO_TRANSFER, "--feature_proj", "64", "--window", "128",
                                                 "--block_size", "64", *OUT],
    # MiniLM / SST-2 with a 16-token bidirectional window
    "minilm_sst2_window/softmax": [RETROFIT, *CLS, "--attention", "softmax", "--eval_before", "false", *OUT],
    "minilm_sst2_window/linear_window16": [RETROFIT, *CLS, *CLS_TRANSFER, "--attention", "linear", "--feature_map",
                                           "elu", "--window", "16", "--feature_proj", "0", *OUT],
    "minilm_sst2_window/polysketch_window16": [RETROFIT, *CLS, *CLS_TRANSFER, "--attention", "polysketch", "--sketch",
                                               "learned", "--sketch_size", "32", "--window", "16", "--block_size",
                                               "16", "--feature_proj", "0", *OUT],
}
TABLES = {table: tuple(r for r in ROWS if r.startswith(table + "/"))
          for table in ("demo_budget", "ablation", "two_stage", "two_stage_kinds", "minilm_sst2_window")}
AFTER = [["-m", "recipes.experiments.retrofit_window.fill_section"]]

