"""The long-context study's inputs: one budget, one entry per row, in the flags of `hf-polyattn retrofit`.

Every row is SmolLM2-135M-Instruct on Tiny Shakespeare (``--data demo``: the copy bundled with the package, the bytes
the rows were measured on), evaluated the same way (``EVAL``): perplexity at 256 ... 8,192 tokens on the first
12,288 held-out tokens and passkey retrieval at 1k / 2k / 4k (10 depths, seed 0), through the pipeline's
long-context stage. A row is its ``attention`` (PolyAttnConfig fields with ``kind``: ``--kind`` and ``--set``) and its
training fields (``--transfer_steps`` ...); ``run_rows.py`` turns it into the command line (``--dry_run`` prints it).
The baseline rows ('softmax', 'streaming') train nothing. A row's ``softmax_heads`` may name a count ("top:22": the
22 best kv heads of ``HEAD_SCORES`` by retrieval score; "per_layer:1": the best kv head of every layer) that
``run_rows.py`` turns into pairs; the scores file comes from ``hf-polyattn score-heads`` (seed 1, so the scoring
prompts' keys are not the evaluation's).
"""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "results"
HEAD_SCORES = RESULTS / "long_context" / "head_scores_smollm2.json"

EVAL = dict(eval_contexts="256,1024,2048,4096,8192", passkey_lengths="1024,2048,4096", passkey_depths=10,
            long_eval_tokens=12288, long_eval_baselines="none", eval_before=False, eval_context=256, eval_stride=256,
            max_eval_tokens=2048)
COMMON = dict(model="smollm2", data="demo", threads=2, progress=False, resume=False, save_model=False, **EVAL)

# the kernel part of the demo before this study: learned polysketch r = 16 after a learnable projection + qk LayerNorm
POLYSKETCH = dict(kind="polysketch", sketch="learned", sketch_size=16, block_size=64, qk_norm=True, feature_proj=64)
# sinks scored at their own positions: the rows run before sink_position existed (its default is "window" now)
OWN = dict(sinks=4, sink_position="own")
STREAMING = dict(kind="sliding_window", window=128, sinks=4)

ROWS: dict[str, dict] = {
    # baselines (no training)
    "softmax": dict(attention="softmax"),
    "streaming": dict(attention={**STREAMING, "sink_position": "own"}),
    "streaming_top22": dict(attention={**STREAMING, "sink_position": "own"}, softmax_heads="top:22"),
}

# one transfer budget for every trained row: 60 steps of 2,048 tokens (the length varies, the tokens do not)
TRANSFER = {256: "256:60:8", 1024: "1024:60:2", 2048: "2048:60:1"}


def transfer(length: int = 1024, **extra) -> dict:
    return dict(transfer_steps=60, transfer_lr=1e-2, transfer_schedule=TRANSFER[length], **extra)


def row(base: dict, softmax_heads: str | None = None, train: dict | None = None, **attention) -> dict:
    """A row: the attention ``base`` + ``attention`` fields, its softmax heads, its training (default: transfer at
    1k)."""
    out = dict(attention={**base, **attention}, **(transfer(1024) if train is None else train))
    if softmax_heads:
        out["softmax_heads"] = softmax_heads
    return out


ROWS.update({
    # the demo's attention as it was (window 128, no sinks), transferred at 1k
    "ps_w128_t1k": row(POLYSKETCH, window=128),
    # + 4 sink tokens
    "ps_w128_s4_t1k": row(POLYSKETCH, window=128, **OWN),
    # + the 22 best retrieval heads as softmax
    "ps_w128_s4_top22_t1k": row(POLYSKETCH, "top:22", window=128, **OWN),
})

ROWS.update({
    # decay of the kernel state: a learnable scalar per kv head, or a gate per token read from the value vector
    "ps_w128_s4_top22_dscalar_t1k": row(POLYSKETCH, "top:22", window=128, **OWN, decay="scalar"),
    "ps_w128_s4_top22_dgate_t1k": row(POLYSKETCH, "top:22", window=128, **OWN, decay="gate"),
    "ps_w128_s4_dgate_t1k": row(POLYSKETCH, window=128, **OWN, decay="gate"),
})

# the kernel part starts nearly off (window_mix_init 0.01): from 1 the transfer never got back to the window alone
GATED_MIX = {"sinks": 4, "decay": "gate", "window_mix": True, "window_mix_init": 0.01}
LORA = dict(lora=True, lora_r=8, finetune_lr=1e-4, finetune_steps=40, finetune_schedule="1024:40:1")
ROWS.update({
    "ps_w128_s4_top22_dgate_mix_t1k": row(POLYSKETCH, "top:22", window=128, **GATED_MIX, sink_position="own"),
    "ps_w128_s4_top22_dgate_mix_t1k_lora1k": row(POLYSKETCH, "top:22", {**transfer(1024), **LORA}, window=128,
                                                 **GATED_MIX, sink_position="own"),
    "ps_w128_s4_dgate_mix_t1k": row(POLYSKETCH, window=128, **GATED_MIX, sink_position="own"),
})
# (rows above this line that have sinks ran before sink_position existed: their sinks sat at their own positions,
# sink_position="own"; rows since score them at positions within the window, the default)

# LoRA over a length curriculum (1k then 2k); the folder is kept for the held-out check (heldout_licenses.py)
LORA_CURRICULUM = dict(lora=True, lora_r=8, finetune_lr=1e-4, finetune_steps=40,
                       finetune_schedule="1024:20:1,2048:20:1", save_model=True)
ROWS.update({
    # StreamingLLM as published: sinks at positions within the cache (sink_position="window", the default now)
    "streaming_cachepos": dict(attention=STREAMING),
    "streaming_cachepos_top22": dict(attention=STREAMING, softmax_heads="top:22"),
    "ps_w128_s4w_top22_dgate_mix_t1k": row(POLYSKETCH, "top:22", window=128, **GATED_MIX),
    "ps_w128_s4w_top22_dgate_mix_t1k_lora1k2k": row(POLYSKETCH, "top:22", {**transfer(1024), **LORA_CURRICULUM},
                                                    window=128, **GATED_MIX),
    # the same LoRA budget on the softmax checkpoint: how much of a LoRA row's gain is adaptation to the corpus
    "softmax_lora1k2k": dict(attention="softmax", **LORA_CURRICULUM),
})

ROWS.update({
    # the default without softmax heads: the figure the issue asks for as measured (every kv head linear-time)
    "ps_w128_s4w_dgate_mix_t1k": row(POLYSKETCH, window=128, **GATED_MIX),
})

# the kernel kind, everything else the default's (no softmax heads: where the kernel part carries the far context)
LINEAR = dict(kind="linear", feature_map="elu", block_size=64, qk_norm=True, feature_proj=64)
ROWS.update({
    "lin_w128_s4w_dgate_mix_t1k": row(LINEAR, window=128, **GATED_MIX),
})
ROWS.update({
    # a shorter decay horizon (256 tokens): the gated state's mass saturates within the 1k training length, so a
    # longer context should add no more kernel mass than training saw (the horizon-1024 row rose from 2k on)
    "ps_w128_s4w_dgate_h256_mix_t1k": row(POLYSKETCH, window=128, **GATED_MIX, decay_horizon=256.0),
})
ROWS.update({
    # the recommended row with the 256-token horizon (every head linear-time, it cut the 8k perplexity 46.1 -> 39.6)
    "ps_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k": row(POLYSKETCH, "top:22", {**transfer(1024), **LORA_CURRICULUM},
                                                         window=128, **GATED_MIX, decay_horizon=256.0),
})
ROWS.update({
    # the recommended row's recipe with the elu kernel: every head linear-time, elu stayed flat from 2k to 8k
    # (36.54 -> 36.38) where polysketch rose (34.99 -> 46.09), both at horizon 1,024
    "lin_w128_s4w_top22_dgate_mix_t1k_lora1k2k": row(LINEAR, "top:22", {**transfer(1024), **LORA_CURRICULUM},
                                                     window=128, **GATED_MIX),
})

# the ablation grid around the every-head-linear-time elu row (lin_w128_s4w_dgate_mix_t1k): one factor changed per
# row, the same transfer budget, no LoRA
ROWS.update({
    # learned sinks: 4 learnable key/value slots per kv head (Lizard's meta-memory) instead of the 4 first tokens
    "lin_w128_l4_dgate_mix_t1k": row(LINEAR, window=128, **{**GATED_MIX, "sinks": 0}, learned_sinks=4),
    # sinks 0
    "lin_w128_dgate_mix_t1k": row(LINEAR, window=128, **{**GATED_MIX, "sinks": 0}),
    # decay: a learnable scalar per kv head, or none
    "lin_w128_s4w_dscalar_mix_t1k": row(LINEAR, window=128, **{**GATED_MIX, "decay": "scalar"}),
    "lin_w128_s4w_mix_t1k": row(LINEAR, window=128, **{**GATED_MIX, "decay": "none"}),
    # the transfer length (the same 122,880 tokens)
    "lin_w128_s4w_dgate_mix_t256": row(LINEAR, None, transfer(256), window=128, **GATED_MIX),
    "lin_w128_s4w_dgate_mix_t2k": row(LINEAR, None, transfer(2048), window=128, **GATED_MIX),
    # softmax heads: the best kv head of every layer (30 of 90), or the best two (60 of 90)
    "lin_w128_s4w_pl1_dgate_mix_t1k": row(LINEAR, "per_layer:1", window=128, **GATED_MIX),
    "lin_w128_s4w_pl2_dgate_mix_t1k": row(LINEAR, "per_layer:2", window=128, **GATED_MIX),
    # window 64
    "lin_w64_s4w_dgate_mix_t1k": row(LINEAR, window=64, **GATED_MIX),
    # the kernel: hedgehog (learned softmax-mimicking features, 2 x 64) and the first-order Taylor kernel
    "hh_w128_s4w_dgate_mix_t1k": row(LINEAR, window=128, **GATED_MIX, feature_map="hedgehog"),
    "taylor_w128_s4w_dgate_mix_t1k": row({k: v for k, v in LINEAR.items() if k != "feature_map"}, window=128,
                                         **GATED_MIX, kind="taylor"),
})

ROWS.update({
    # the recommended recipe with the hedgehog kernel: with every head linear-time it was the first row below
    # StreamingLLM at every length (35.43 / 35.22 at 4k / 8k against 36.07 / 35.96), elu 36.20 / 36.38
    "hh_w128_s4w_top22_dgate_mix_t1k_lora1k2k": row(LINEAR, "top:22", {**transfer(1024), **LORA_CURRICULUM},
                                                    window=128, **GATED_MIX, feature_map="hedgehog"),
})

# the ablation grid as fill_section.py tabulates and plots it: factor -> setting -> row (BASE: the setting's default)
ABLATION_BASE = "lin_w128_s4w_dgate_mix_t1k"
ABLATION = {
    "sink tokens": {"0": "lin_w128_dgate_mix_t1k", "4": ABLATION_BASE, "4 learned slots": "lin_w128_l4_dgate_mix_t1k"},
    "decay": {"none": "lin_w128_s4w_mix_t1k", "scalar": "lin_w128_s4w_dscalar_mix_t1k", "gate": ABLATION_BASE},
    "transfer length": {"256": "lin_w128_s4w_dgate_mix_t256", "1,024": ABLATION_BASE,
                        "2,048": "lin_w128_s4w_dgate_mix_t2k"},
    "softmax kv heads per layer": {"0": ABLATION_BASE, "1": "lin_w128_s4w_pl1_dgate_mix_t1k",
                                   "2": "lin_w128_s4w_pl2_dgate_mix_t1k"},
    "window": {"64": "lin_w64_s4w_dgate_mix_t1k", "128": ABLATION_BASE},
    "kernel": {"polysketch (learned r=16)": "ps_w128_s4w_dgate_mix_t1k", "linear (elu + 1)": ABLATION_BASE,
               "hedgehog": "hh_w128_s4w_dgate_mix_t1k", "taylor": "taylor_w128_s4w_dgate_mix_t1k"},
}

ROWS.update({
    # the recommended elu recipe with the gate's horizon at 256 (polysketch's default): does a shorter memory of the
    # kernel part hold up better on held-out text at 4k / 8k (elu at 1,024: 1.12 / 1.17x on the license texts)?
    "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k": row(LINEAR, "top:22", {**transfer(1024), **LORA_CURRICULUM},
                                                          window=128, **GATED_MIX, decay_horizon=256.0),
})
