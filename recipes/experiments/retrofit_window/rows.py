"""Inputs of the retrofit_window study (issue 13): SmolLM2 at the demo's budget (60 transfer steps of 4 x 256
tokens, no fine-tuning), block-diagonal exact blocks against a sliding window and the ablation around it; the
two-stage runs (transfer, then 60 LoRA steps); MiniLM on SST-2 with a bidirectional window.

    python recipes/experiments/run.py retrofit_window [ROW ...]

Each row is one ``hf-polyattn retrofit`` run (``python -m hf_polyattn.retrofit``), its attention spelled out with
``--kind`` and ``--set`` as the recorded run used it (the retrofit's old flags set a learned sketch, the q/k
LayerNorm and 64-token blocks without being asked: here they are named); Tiny Shakespeare is ``--data demo`` (the
bundled copy), SST-2 ``$HF_POLYATTN_SST2``. A table of ``TABLES`` compares its rows
(``recipes/results/retrofit_window/<table>.{md,json}``), then ``fill_section`` writes ``SECTION_retrofit_window.md``
and ``ablation.png``. The ``ablation`` rows shared the 2 cores with another session's jobs for part of the time (the
section says so).
"""

RETROFIT = ["-m", "hf_polyattn.retrofit"]
# the demo's budget: SmolLM2 on Tiny Shakespeare, context 256, 2,048 held-out tokens
DEMO = ["--model", "smollm2", "--data", "demo", "--context", "256", "--eval_context", "256", "--eval_stride", "256",
        "--max_eval_tokens", "2048", "--threads", "2", "--progress", "false", "--resume", "false",
        "--transfer_batch_size", "4", "--save_model", "false"]
TRANSFER = ["--set", "qk_norm=true", "--set", "block_size=64", "--transfer_steps", "60", "--transfer_lr", "1e-2"]
SKETCH16 = ["--kind", "polysketch", "--set", "sketch=learned", "--set", "sketch_size=16", *TRANSFER]
SKETCH32 = ["--kind", "polysketch", "--set", "sketch=learned", "--set", "sketch_size=32", *TRANSFER]
PROJ = ["--set", "feature_proj=64"]
# two stages: 8,192 held-out tokens, 60 LoRA r=8 steps on q/k/v/o plus the polyattn parameters
TWO = ["--model", "smollm2", "--data", "demo", "--context", "256", "--eval_context", "256", "--eval_stride", "256",
       "--max_eval_tokens", "8192", "--threads", "2", "--progress", "false", "--resume", "false",
       "--save_model", "false", "--batch_size", "4", "--transfer_batch_size", "4",
       "--finetune_steps", "60", "--lora", "true", "--lora_r", "8", "--lora_alpha", "16", "--finetune_lr", "1e-3",
       "--polyattn_lr", "1e-3", "--warmup_steps", "5"]
TWO_TRANSFER = ["--set", "qk_norm=true", "--set", "block_size=64", "--transfer_steps", "60", "--transfer_lr", "1e-2",
                "--eval_before", "false"]
# MiniLM on SST-2: 100 transfer + 400 fine-tuning steps x 16 sentences, 1,000 held-out sentences
CLS = ["--model", "minilm", "--task", "classification", "--data", "{sst2}", "--finetune_steps", "400",
       "--finetune_lr", "1e-4", "--warmup_steps", "20", "--batch_size", "16", "--max_length", "64",
       "--num_eval", "1000", "--eval_batch_size", "100", "--threads", "2", "--progress", "false", "--resume", "false"]
CLS_TRANSFER = ["--transfer_steps", "100", "--transfer_batch_size", "16", "--transfer_lr", "1e-2",
                "--polyattn_lr", "1e-3", "--set", "qk_norm=true"]
OUT = ["--output_dir", "{out}"]

ROWS = {
    # the demo's budget, block-diagonal blocks against a window (first the four rows, then the two after them)
    "demo_budget/softmax": [*RETROFIT, *DEMO, "--kind", "softmax", *OUT],
    "demo_budget/polysketch_blocks64": [*RETROFIT, *DEMO, *SKETCH16, "--set", "local_exact=true", *OUT],
    "demo_budget/polysketch_window64": [*RETROFIT, *DEMO, *SKETCH16, "--set", "window=64", *OUT],
    "demo_budget/polysketch_window64_proj": [*RETROFIT, *DEMO, *SKETCH16, "--set", "window=64", *PROJ, *OUT],
    "demo_budget/polysketch_window64_proj_mix": [*RETROFIT, *DEMO, *SKETCH16, "--set", "window=64", *PROJ,
                                                 "--set", "window_mix=true", *OUT],
    "demo_budget/polysketch_window128_proj": [*RETROFIT, *DEMO, *SKETCH16, "--set", "window=128", *PROJ, *OUT],
    # the ablation rows the demo_budget table lacks, softmax rerun in the same session
    "ablation/softmax": [*RETROFIT, *DEMO, "--kind", "softmax", *OUT],
    "ablation/polysketch_r32_window128_proj": [*RETROFIT, *DEMO, *SKETCH32, "--set", "window=128", *PROJ, *OUT],
    "ablation/polysketch_window0_proj": [*RETROFIT, *DEMO, *SKETCH16, *PROJ, *OUT],
    "ablation/polysketch_window128": [*RETROFIT, *DEMO, *SKETCH16, "--set", "window=128", *OUT],
    "ablation/linear_window128_proj": [*RETROFIT, *DEMO, "--kind", "linear", "--set", "feature_map=elu", *TRANSFER,
                                       "--set", "window=128", *PROJ, *OUT],
    "ablation/polysketch_window16_proj": [*RETROFIT, *DEMO, *SKETCH16, "--set", "window=16", *PROJ, *OUT],
    # exact everywhere already: no window (the kind refuses one)
    "ablation/polynomial4_proj": [*RETROFIT, *DEMO, "--kind", "polynomial", "--set", "degree=4", *TRANSFER, *PROJ,
                                  *OUT],
    # transfer, then LoRA
    "two_stage/softmax": [*RETROFIT, *TWO, "--kind", "softmax", *OUT],
    "two_stage/polysketch_window128_proj": [*RETROFIT, *TWO, "--kind", "polysketch", "--set", "sketch=learned",
                                            "--set", "sketch_size=16", *TWO_TRANSFER, "--set", "window=128", *PROJ,
                                            *OUT],
    "two_stage_kinds/softmax": [*RETROFIT, *TWO, "--kind", "softmax", *OUT],
    "two_stage_kinds/linear_window128_proj": [*RETROFIT, *TWO, "--kind", "linear", "--set", "feature_map=elu",
                                              *TWO_TRANSFER, *PROJ, "--set", "window=128", *OUT],
    "two_stage_kinds/polynomial4_proj": [*RETROFIT, *TWO, "--kind", "polynomial", "--set", "degree=4",
                                         *TWO_TRANSFER, *PROJ, *OUT],
    "two_stage_kinds/performer_window128_proj": [*RETROFIT, *TWO, "--kind", "performer", "--set", "num_features=256",
                                                 *TWO_TRANSFER, *PROJ, "--set", "window=128", *OUT],
    # MiniLM / SST-2 with a 16-token bidirectional window
    "minilm_sst2_window/softmax": [*RETROFIT, *CLS, "--kind", "softmax", "--eval_before", "false", *OUT],
    "minilm_sst2_window/linear_window16": [*RETROFIT, *CLS, *CLS_TRANSFER, "--kind", "linear", "--set",
                                           "feature_map=elu", "--set", "window=16", "--set", "block_size=64", *OUT],
    "minilm_sst2_window/polysketch_window16": [*RETROFIT, *CLS, *CLS_TRANSFER, "--kind", "polysketch", "--set",
                                               "sketch=learned", "--set", "sketch_size=32", "--set", "window=16",
                                               "--set", "block_size=16", *OUT],
}
TABLES = {table: tuple(r for r in ROWS if r.startswith(table + "/"))
          for table in ("demo_budget", "ablation", "two_stage", "two_stage_kinds", "minilm_sst2_window")}
AFTER = [["-m", "recipes.experiments.retrofit_window.fill_section"]]
