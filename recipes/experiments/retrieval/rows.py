"""Issue 32's study: retrieval with a constant-size decode state (no softmax heads) on SmolLM2-135M-Instruct.

Every trained row has the ``linear-only`` preset's budget (attention transfer, 60 steps of 2 x 1,024 tokens of the
bundled Tiny Shakespeare, ``--data demo``) and is judged the same way: perplexity at 256 ... 8,192 tokens on the first
12,288 held-out tokens, passkey retrieval at 1k / 2k / 4k / 8k (8,182 tokens) with 10 needle depths on two
templates ('classic' and 'vault': another filler, phrasing and 4-7 digit keys; ``hf_polyattn/eval/passkey.py``).
The rows named ``+sparseN`` train nothing: they evaluate a trained row's saved model with a bounded sparse cache of
N keys per kv head (``--set sparse_cache=N``: LoLA's mechanism, training-free). ``baselines`` evaluates the softmax
checkpoint and StreamingLLM (4 sinks + 128 window) on the same tokens.

    python recipes/experiments/run.py retrieval [ROW ...]

``collect.py`` (AFTER) copies each row's long-context record into ``recipes/results/retrieval/`` with the decode state's
bytes at 8k (``hf_polyattn.decode_memory``); ``fill_section.py`` writes ``SECTION_retrieval.md`` and the plot.
"""

RETROFIT = ["-m", "hf_polyattn.retrofit", "--model", "smollm2", "--data", "demo", "--threads", "2",
            "--progress", "false", "--no_resume", "--output_dir", "{out}"]
# the 8k passkey prompt is 8,182 tokens: SmolLM2 has 8,192 positions and the 'vault' answer takes up to 7 digits + 3
CONTEXTS, PASSKEY, TEMPLATES = "256,1024,2048,4096,8192", "1024,2048,4096,8182", "classic,vault"
# the retrofit's own long-context stage: this study's evaluation after training
EVAL_STAGE = ["--eval_contexts", CONTEXTS, "--passkey_lengths", PASSKEY, "--passkey_templates", TEMPLATES,
              "--passkey_depths", "10", "--long_eval_tokens", "12288", "--long_eval_baselines", "none",
              "--eval_before", "false"]


def flags(flag: str, *settings: str) -> list[str]:
    """``flag`` before each of ``settings`` (FIELD=VALUE): the command-line form of --set / --reconfigure items."""
    return [x for s in settings for x in (flag, s)]


def evaluate(model: str, *settings: str, kind: str | None = None, baselines: str = "none",
             threads: int = 2) -> list[str]:
    """``hf-polyattn eval`` of a saved model (another row's ``runs/retrieval/<row>/model``) with ``settings``."""
    sets = flags("--set", *settings)
    return ["-m", "hf_polyattn.cli", "eval", model, "--data", "demo", "--contexts", CONTEXTS, "--passkey", PASSKEY,
            "--passkey-templates", TEMPLATES, "--passkey-depths", "10", "--max-eval-tokens", "12288",
            "--baselines", baselines, "--threads", str(threads), *(["--kind", kind] if kind else []), *sets,
            "--out", "{out}"]


TRAINED = "runs/retrieval/{}/model"
# the linear-only preset's attention as it trains, without the settings the preset applies after training
# (``Preset.reconfigure``: the sparse cache and its re-choice, the bounded decay): the rows below evaluate those
# themselves, on the saved model, with --set; sparse_score, sink_position and sparse_value_keys back to their
# defaults too, since the preset's 'attention' score and |v| reserve refuse a model without a sparse cache
AS_TRAINED = flags("--reconfigure", "sparse_observe=0", "sparse_cache=0", "decay_max_horizon=0",
                   "sparse_score=recall", "sink_position=window", "sparse_value_keys=0")

# the linear-only preset's reconfigure until 2026-11-28 (512 keys, the sinks at 'window'), as --set on the trained
# row's model: the settings the diagnostic rows below vary one at a time
SETS512 = flags("--set", "decay_max_horizon=256", "sparse_cache=512", "sparse_observe=16")
VAULT_4K = ("hh_max256+sparse512+observe16_vault_4k", "softmax_vault_4k",
            "hh_max256+sparse512+observe16_read_all_vault_4k", "hh_max256+sparse1024+observe16_vault_4k",
            "hh_loop_vault_4k", "hh_loop_classic_1k4k", "hh_max256+sparse512+observe16_nofar_vault_4k",
            "hh_loop_lora_vault_4k")

# probe_selection.py's variants run on the 4k prompts (the kernel part off: _nofar)
PROBED = ("h2o", "h2o_window", "h2o_max", "err_knorm", "err_mass", "oracle_key", "oracle_needle", "plumbing",
          "h2o_nofar", "h2o_window_nofar", "h2o_max_nofar", "oracle_needle_nofar", "plumbing_nofar")

# inference-time settings of the bounded cache on the trained row 'hh' (nothing trained), whether one lifts the
# 'vault' misses at 4k / 8k: the then preset's settings (SETS512) with one changed, each a passkey cell
# (template, length, settings)
SELECT = {
    "hh_max256+sparse512+observe64_vault_4k": ("vault", "4096", ("decay_max_horizon=256", "sparse_cache=512",
                                                                 "sparse_observe=64")),
    "hh_max256+sparse512+observe8_vault_4k": ("vault", "4096", ("decay_max_horizon=256", "sparse_cache=512",
                                                                "sparse_observe=8")),
    # the 8k prompts alone (keys drawn first, as at 4k above: not the table's 8k keys), a cache twice the preset's
    # and the preset's own on the same prompts
    "hh_max256+sparse1024+observe16_vault_8k": ("vault", "8182", ("decay_max_horizon=256", "sparse_cache=1024",
                                                                  "sparse_observe=16")),
    "hh_max256+sparse512+observe16_vault_8k": ("vault", "8182", ("decay_max_horizon=256", "sparse_cache=512",
                                                                 "sparse_observe=16")),
    # every key of a 4k prompt exact (a cache of 4,096 keys: nothing evicted, nothing in the state): whether the
    # trained row's own q, k find the far 'vault' needles that the preset's 512 keys miss
    "hh_max256+all_keys_vault_4k": ("vault", "4096", ("decay_max_horizon=256", "sparse_cache=4096")),
    # SETS512 with the streaming selection ranking by the recall error over |v| (sparse_score)
    "hh_max256+sparse512+observe16+relative_vault_4k": ("vault", "4096", (*SETS512[1::2], "sparse_score=relative")),
    "hh_max256+sparse512+observe16+relative_vault_8k": ("vault", "8182", (*SETS512[1::2], "sparse_score=relative")),
    # the sinks scored at their own positions (sink_position='own') instead of StreamingLLM's, beside the window: with
    # a cache that holds far keys at their true positions, the re-rotated sinks draw attention they never drew in the
    # checkpoint (every key exact, 'window': wrong at 8k depth 0.25, where 'own' matches softmax's logits:
    # probe_against_softmax.py); caches of 1,024 and 2,048 keys on the same 8k prompts, with and without it
    "hh_max256+sparse512+observe16+own_vault_4k": ("vault", "4096", (*SETS512[1::2], "sink_position=own")),
    "hh_max256+sparse512+observe16+own_vault_8k": ("vault", "8182", (*SETS512[1::2], "sink_position=own")),
    "hh_max256+sparse1024+observe16+own_vault_8k": ("vault", "8182", ("decay_max_horizon=256", "sparse_cache=1024",
                                                                      "sparse_observe=16", "sink_position=own")),
    "hh_max256+sparse2048+observe16_vault_8k": ("vault", "8182", ("decay_max_horizon=256", "sparse_cache=2048",
                                                                  "sparse_observe=16")),
    "hh_max256+sparse2048+observe16+own_vault_8k": ("vault", "8182", ("decay_max_horizon=256", "sparse_cache=2048",
                                                                      "sparse_observe=16", "sink_position=own")),
    # an intermediate sink distance (sink_span: the query scores the re-rotated sinks as if at min(p, span), 'window'
    # being span 131 and 'own' the sinks' true positions): whether one keeps 'window''s 'classic' answers (where the
    # far sinks of 'own' absorb the dropped keys' weight) and 'own''s 'vault' ones; the 8k 'classic' prompts alone
    # (keys drawn first, as the 'vault' cells: not the table's 8k keys) with the preset's 'window' and 'own' beside.
    # Measured (of 10, 'window' / span 1024 / span 4096 / 'own'): 512 keys 'classic' 7 / 8 / 5 / 1, 'vault' 3 / 3 / 3 /
    # 4; 2,048 keys 'classic' 7 / 8 / 6 / not run, 'vault' 3 / 5 / 5 / 8: span 1024 keeps (and adds one to)
    # 'window''s 'classic' answers and takes 2 of the 5 'vault' answers 'own' adds at 2,048 keys; no span gets both
    **{f"hh_max256+sparse{cache}+observe16{sinks}_{template}_8k": (
        template, "8182", ("decay_max_horizon=256", f"sparse_cache={cache}", "sparse_observe=16", *extra))
       for cache, sinks, extra in [(512, "+span1024", ("sink_span=1024",)), (512, "+span4096", ("sink_span=4096",)),
                                   (2048, "+span1024", ("sink_span=1024",)), (2048, "+span4096", ("sink_span=4096",))]
       for template in ("vault", "classic")},
    **{f"hh_max256+sparse{cache}+observe16{sinks}_classic_8k": (
        "classic", "8182", ("decay_max_horizon=256", f"sparse_cache={cache}", "sparse_observe=16", *extra))
       for cache in (512, 2048) for sinks, extra in [("", ()), ("+own", ("sink_position=own",))]},
    # the selection ranked by attention (sparse_score='attention': 'vault' 4 of 10 at 8k in the table with span 1024)
    # with the sinks at their own positions, which found 8 of 10 of these 'vault' prompts with the recall error but
    # lost the 'classic' ones: whether ranking by attention keeps both. Measured: 'vault' 6, 'classic' 7 of 10
    **{f"hh_max256+sparse2048+observe16+own+attention_{template}_8k": (
        template, "8182", ("decay_max_horizon=256", "sparse_cache=2048", "sparse_observe=16", "sink_position=own",
                           "sparse_score=attention"))
       for template in ("vault", "classic")},
}

ROWS = {
    # every head linear-time: the linear-only preset (hedgehog features + 128 window + 4 sinks + gated decay)
    "hh": [*RETROFIT, "--preset", "linear-only", *AS_TRAINED, *EVAL_STAGE],
    "hh+sparse64": evaluate(TRAINED.format("hh"), "sparse_cache=64"),
    # the same with a quarter of the training windows carrying recall tasks (training/retrieval_data.py)
    "hh_retr": [*RETROFIT, "--preset", "linear-only", *AS_TRAINED, "--retrieval_mix", "0.25", *EVAL_STAGE],
    "hh_retr+sparse64": evaluate(TRAINED.format("hh_retr"), "sparse_cache=64"),
    # softmax and StreamingLLM on the same tokens (no training)
    "baselines": evaluate("smollm2", "window=128", "sinks=4", kind="sliding_window", baselines="softmax"),
    "hh_retr+sparse128": evaluate(TRAINED.format("hh_retr"), "sparse_cache=128"),
    "hh+sparse128": evaluate(TRAINED.format("hh"), "sparse_cache=128"),
    # how large a bounded cache retrieval needs: 512 keys per kv head (+ 63 waiting), a sixteenth of 8k
    "hh+sparse512": evaluate(TRAINED.format("hh"), "sparse_cache=512"),
    # diagnostic, not constant memory: a cache that holds every key of a 4k prompt (nothing is ever evicted), 'classic'
    # passkey at 4k only: whether the failures of the bounded caches are the keys they drop or the model's use of them
    "hh+all_keys_4k": ["-m", "hf_polyattn.cli", "eval", TRAINED.format("hh"), "--data", "demo", "--contexts", "256",
                       "--max-eval-tokens", "1024", "--passkey", "4096", "--passkey-templates", "classic",
                       "--passkey-depths", "10", "--baselines", "none", "--threads", "1", "--set", "sparse_cache=4096",
                       "--out", "{out}"],
    # diagnostics: two other selection rules for the 128-key cache, 'classic' passkey at 4k only (probe_selection.py)
    **{f"hh+sparse128_{variant}_4k": ["-m", "recipes.experiments.retrieval.probe_selection", variant,
                                      TRAINED.format("hh"), "--data", "demo", "--contexts", "256", "--max-eval-tokens",
                                      "512", "--passkey", "4096", "--passkey-templates", "classic", "--passkey-depths",
                                      "10", "--baselines", "none", "--threads", "1", "--set", "sparse_cache=128",
                                      "--out", "{out}"]
       for variant in ("frozen", "relative")},
    # diagnostics: attention-informed selection (H2O-style masses), recall error mixed with them, oracles that keep
    # the needle, and the kernel part switched off (_nofar), on the same 4k prompts (probe_selection.py's docstring)
    **{f"hh+sparse{budget}_{variant}_4k": ["-m", "recipes.experiments.retrieval.probe_selection", variant,
                                           TRAINED.format("hh"), "--data", "demo", "--contexts", "256",
                                           "--max-eval-tokens", "512", "--baselines", "none", "--threads", "1",
                                           "--passkey", "4096", "--passkey-templates", "classic", "--passkey-depths",
                                           "10", "--set", f"sparse_cache={budget}", "--out", "{out}"]
       for budget, variant in [*((128, v) for v in PROBED), (512, "oracle_needle")]},
    # the library's own rule on those prompts (the table's hh+sparse128 row read other prompts at 4k), and the h2o
    # probe with every key kept (its bookkeeping's check: the library's all-keys answers)
    **{f"hh+sparse{budget}_library_4k": ["-m", "hf_polyattn.cli", "eval", TRAINED.format("hh"), "--data", "demo",
                                         "--contexts", "256", "--max-eval-tokens", "512", "--baselines", "none",
                                         "--threads", "1", "--passkey", "4096", "--passkey-templates", "classic",
                                         "--passkey-depths", "10", "--set", f"sparse_cache={budget}", "--out", "{out}"]
       for budget in (128, 512)},
    "hh+all_keys_h2o_4k": ["-m", "recipes.experiments.retrieval.probe_selection", "h2o", TRAINED.format("hh"),
                           "--data", "demo", "--contexts", "256", "--max-eval-tokens", "512", "--baselines", "none",
                           "--threads", "1", "--passkey", "4096", "--passkey-templates", "classic", "--passkey-depths",
                           "10", "--set", "sparse_cache=4096", "--out", "{out}"],
    # the trained row with its kernel state's memory bounded to 256 tokens (decay_max_horizon: its learned gates
    # drifted to horizons of 1k-70k tokens on 1k-token windows), alone and with the 512-key cache
    "hh_max256": evaluate(TRAINED.format("hh"), "decay_max_horizon=256"),
    "hh_max256+sparse512": evaluate(TRAINED.format("hh"), "decay_max_horizon=256", "sparse_cache=512"),
    # the same cache chosen again by the prompt's last 16 queries (sparse_observe: each of them reads the keys the
    # question's queries up to it attend most, pooled over 15 neighbours; the rest folded into the bounded state)
    "hh_max256+sparse512+observe16": evaluate(TRAINED.format("hh"), "decay_max_horizon=256", "sparse_cache=512",
                                              "sparse_observe=16"),
    # the same with the sinks scored at their own positions (SELECT's '+own' cells): a trade, not a gain ('vault'
    # 4k / 8k 8 and 4 of 10 against 6 and 3, 'classic' 8k 1 against 7, perplexity at 8k 34.24 against 31.24: the
    # re-rotated sinks take the weight of the keys a bounded cache drops)
    "hh_max256+sparse512+observe16+own": evaluate(TRAINED.format("hh"), "decay_max_horizon=256", "sparse_cache=512",
                                                  "sparse_observe=16", "sink_position=own"),
    # a cache of 2,048 keys per kv head with the sinks at their own positions (a quarter of softmax's cache at 8k;
    # 'vault' 8k: 8 of 10 with 'own', 3 with 'window', SELECT's cells): softmax's perplexity to 2k and 1.05x at 4k,
    # 'vault' 10 / 10 / 10 / 7, but 'classic' at 8k 0 of 10 and 1.27x at 8k, as with 512 keys and 'own'
    "hh_max256+sparse2048+observe16+own": evaluate(TRAINED.format("hh"), "decay_max_horizon=256",
                                                   "sparse_cache=2048", "sparse_observe=16", "sink_position=own"),
    # the sinks at the intermediate distance that kept 'classic' at 8k (SELECT's span cells: span 1024 with 2,048 keys
    # 'classic' 8 and 'vault' 5 of 10 on the 8k prompts alone), the full grid, with 512 keys and with 2,048; two
    # single-threaded rows side by side. Measured: 2,048 keys perplexity 1.00-1.10x softmax's to 8k, 'classic'
    # 10 / 10 / 10 / 9, 'vault' 10 / 10 / 10 / 5 (the linear-only preset's until the attention ranking); 512 keys
    # 'vault' 7 / 3 at 4k / 8k and 1.17x at 8k
    **{f"hh_max256+sparse{cache}+observe16+span1024": evaluate(
        TRAINED.format("hh"), "decay_max_horizon=256", f"sparse_cache={cache}", "sparse_observe=16",
        "sink_span=1024", threads=1) for cache in (512, 2048)},
    # the same with the streaming selection ranked by the attention the last sparse_chunk queries give each candidate
    # (sparse_score='attention'; probe_position_loss on the first 8,192 held-out tokens: 1.074x -> 1.008x softmax's
    # loss with 2,048 keys, diag/attention_score_8k.json)
    "hh_max256+sparse2048+observe16+span1024+attention": evaluate(
        TRAINED.format("hh"), "decay_max_horizon=256", "sparse_cache=2048", "sparse_observe=16", "sink_span=1024",
        "sparse_score=attention"),
    # the sinks at their own positions with the selection ranked by attention: SELECT's 8k cells gave 'classic' 7 and
    # 'vault' 6 of 10 (recall error with 'own': 'vault' 8, 'classic' 0 in the table), probe_position_loss on the first
    # 8,192 held-out tokens 1.010x softmax's loss (1.168x with the recall error, diag/own_attention_8k.json).
    # Measured: 1.00-1.01x softmax's perplexity to 8k, 'classic' and 'vault' 10 / 10 / 10 / 7: the linear-only
    # preset's settings since
    "hh_max256+sparse2048+observe16+own+attention": evaluate(
        TRAINED.format("hh"), "decay_max_horizon=256", "sparse_cache=2048", "sparse_observe=16", "sink_position=own",
        "sparse_score=attention"),
    # the same with 1,536 of the 2,048 keys reserved for the largest |v| (sparse_value_keys): in a later turn on the
    # same trained model (recipes/results/ruler_matched, 5 depths) 'classic' 5/5/5/2 and 'vault' 5/5/5/1 at
    # 1k/2k/4k/8k where the row above gives 5/5/1/0 and 5/5/0/0
    "hh_max256+sparse2048+observe16+own+attention+value1536": evaluate(
        TRAINED.format("hh"), "decay_max_horizon=256", "sparse_cache=2048", "sparse_observe=16", "sink_position=own",
        "sparse_score=attention", "sparse_value_keys=1536"),
    # diagnostics of the 'vault' misses at 4k (the far needles), on the 4k prompts alone (another draw of keys than
    # the table's 4k cell): the preset's settings; softmax on the same prompts; the observed queries reading every
    # key exactly (probe_observe_wide.py); a cache twice as large
    **{f"{name}_vault_4k": [*module, *model_, "--data", "demo", "--contexts", "256", "--max-eval-tokens", "512",
                            "--passkey", "4096", "--passkey-templates", "vault", "--passkey-depths", "10",
                            "--baselines", "none", "--threads", "2", *sets, "--out", "{out}"]
       for name, module, model_, sets in [
           ("hh_max256+sparse512+observe16", ["-m", "hf_polyattn.cli", "eval"], [TRAINED.format("hh")], SETS512),
           ("softmax", ["-m", "hf_polyattn.cli", "eval"], ["smollm2"], []),
           ("hh_max256+sparse512+observe16_read_all", ["-m", "recipes.experiments.retrieval.probe_observe_wide"],
            [TRAINED.format("hh"), "--keys", "4096"], SETS512),
           ("hh_max256+sparse1024+observe16", ["-m", "hf_polyattn.cli", "eval"], [TRAINED.format("hh")],
            flags("--set", "decay_max_horizon=256", "sparse_cache=1024", "sparse_observe=16")),
           # the row hh trained further with those settings in the loop (hh_loop below)
           ("hh_loop", ["-m", "hf_polyattn.cli", "eval"], [TRAINED.format("hh_loop")], SETS512),
           ("hh_loop_lora", ["-m", "hf_polyattn.cli", "eval"], [TRAINED.format("hh_loop_lora")], SETS512),
           # the preset's settings with the kernel part off (probe_nofar.py: window_mix 0), the only part whose
           # parameters attention transfer trains
           ("hh_max256+sparse512+observe16_nofar", ["-m", "recipes.experiments.retrieval.probe_nofar"],
            [TRAINED.format("hh")], SETS512),
       ]},
    # the trained row 'hh' trained further with the preset's inference settings in the loop (train_in_loop.py): the
    # transfer's forward runs the 512-key cache (re-chosen by the last 16 queries) and the 256-token decay bound at
    # 2k-4k tokens, where the cache evicts; 17 steps (14 of 1 x 2,048, 3 of 1 x 4,096) at lr 3e-3. Judged with the
    # preset's settings on the table's held-out tokens (perplexity 256-8k) and its 'classic' prompts at 1k-4k (the
    # same draws as the table's cells: the keys are drawn length after length), and on the 'vault' 4k prompts of the
    # diagnostic rows above (hh_loop_vault_4k)
    "hh_loop": ["-m", "recipes.experiments.retrieval.train_in_loop", TRAINED.format("hh"), *SETS512, "--out",
                "{out}", "--data", "demo", "--threads", "2", "--progress", "false", "--no_resume", "--transfer_steps",
                "17", "--transfer_lr", "3e-3", "--transfer_schedule", "2048:14:1,4096:3:1", "--eval_before", "false",
                "--max_eval_tokens", "512"],
    # the same settings in the loop of a LoRA fine-tuning instead (the model's own hidden states, so its keys and
    # values, train; the LM loss end to end through the cache), half the windows carrying recall tasks: 6 steps of
    # 1 x 2,048 tokens at lr 1e-3, what the session's time left allowed
    "hh_loop_lora": ["-m", "recipes.experiments.retrieval.train_in_loop", TRAINED.format("hh"), *SETS512,
                     "--out", "{out}", "--data", "demo", "--threads", "2", "--progress", "false", "--no_resume",
                     "--finetune_steps", "6", "--finetune_lr", "1e-3", "--finetune_schedule", "2048:6:1", "--lora",
                     "true", "--retrieval_mix", "0.5", "--eval_before", "false", "--max_eval_tokens", "512"],
    "hh_loop_classic_1k4k": ["-m", "hf_polyattn.cli", "eval", TRAINED.format("hh_loop"), "--data", "demo",
                             "--contexts", CONTEXTS, "--passkey", "1024,2048,4096", "--passkey-templates", "classic",
                             "--passkey-depths", "10", "--max-eval-tokens", "12288", "--baselines", "none",
                             "--threads", "2", *SETS512, "--out", "{out}"],
    # the relative ranking's perplexity on the study's held-out tokens, a table row without passkey cells (its
    # 'vault' cells are SELECT's diagnostics)
    "hh_max256+sparse512+observe16+relative_ppl": ["-m", "hf_polyattn.cli", "eval", TRAINED.format("hh"), "--data",
                                                   "demo", "--contexts", CONTEXTS, "--max-eval-tokens", "12288",
                                                   "--baselines", "none", "--threads", "1", *SETS512, "--set",
                                                   "sparse_score=relative", "--out", "{out}"],
    # SELECT's cells, one thread each
    **{name: ["-m", "hf_polyattn.cli", "eval", TRAINED.format("hh"), "--data", "demo", "--contexts", "256",
              "--max-eval-tokens", "512", "--passkey", length, "--passkey-templates", template, "--passkey-depths",
              "10", "--baselines", "none", "--threads", "1", *flags("--set", *sets), "--out", "{out}"]
       for name, (template, length, sets) in SELECT.items()},
    # softmax SmolLM2 on the 8k 'vault' prompts of SELECT's 8k cells (drawn for that length alone): which of them the
    # checkpoint itself answers
    "softmax_vault_8k": ["-m", "hf_polyattn.cli", "eval", "smollm2", "--data", "demo", "--contexts", "256",
                         "--max-eval-tokens", "512", "--passkey", "8182", "--passkey-templates", "vault",
                         "--passkey-depths", "10", "--baselines", "none", "--threads", "1", "--out", "{out}"],
    # the elu kernel of the hybrid recipe, without its softmax heads
    "elu_retr": [*RETROFIT, "--preset", "linear-only", *AS_TRAINED, "--set", "feature_map=elu", "--retrieval_mix",
                 "0.25", *EVAL_STAGE],
    "elu_retr+sparse64": evaluate(TRAINED.format("elu_retr"), "sparse_cache=64"),
    # a short causal convolution on q / k (LAWCAT), identity at the start
    "hh_conv_retr": [*RETROFIT, "--preset", "linear-only", *AS_TRAINED, "--set", "short_conv=4", "--retrieval_mix",
                     "0.25", *EVAL_STAGE],
    # the gated delta rule (overwrites what a key holds) with the window and sinks, conv and recall tasks
    "delta_conv_retr": [*RETROFIT, "--kind", "delta", "--set", "window=128", "--set", "sinks=4", "--set",
                        "decay=gate", "--set", "short_conv=4", "--transfer_steps", "60", "--transfer_schedule",
                        "1024:60:2", "--retrieval_mix", "0.25", *EVAL_STAGE],
}

# rows outside the table (another grid of lengths): fill_section states them under it
DIAGNOSTICS = ("hh+all_keys_4k", "hh+sparse128_frozen_4k", "hh+sparse128_relative_4k",
               *(f"hh+sparse128_{v}_4k" for v in PROBED), "hh+sparse512_oracle_needle_4k", "hh+sparse128_library_4k",
               "hh+sparse512_library_4k", "hh+all_keys_h2o_4k", *VAULT_4K, *SELECT, "softmax_vault_8k")

# the rows run in this order: every '+sparse' row after the row whose model it reads
ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
AFTER = [["-m", "recipes.experiments.retrieval.collect"], ["-m", "recipes.experiments.retrieval.fill_section"]]
