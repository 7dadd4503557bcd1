"""Named, measured retrofit recipes: ``hf-polyattn retrofit --preset NAME``, ``hf-polyattn presets``.

A preset is an attention (the fields of a :class:`~hf_polyattn.PolyAttnConfig`), a training budget, the data it
reads by default, and the figure it was measured at with the command that measured it. Every figure is copied from
a result file of the repository (``source``, and ``speed_source`` for the whole-model benchmark;
``tests/test_presets.py`` reads the files and checks each number and setting, and ``recipes/performance.py`` writes
docs/performance.md and the README's table from the same files), never typed from memory; the summaries and notes
hold settings, not measurements. Every user-facing default of a retrofit lives here: the pipeline applies none.

Two attention values depend on the model and are resolved when it is loaded:

* ``feature_proj="head_dim"``: a learnable projection of q and k to the model's own head size;
* ``softmax_heads="auto"`` (or ``"auto:K"``): the checkpoint's best quarter (K) of the converted layers' kv heads by
  retrieval score, measured before conversion (``hf_polyattn.eval.heads.score_heads``), kept as exact softmax;
  ``"auto"`` keeps more when a quarter holds less than 80% of their retrieval score (the fewest that hold it: 2 of
  Gemma 3 270M's 3 global kv heads, ``training.pipeline.AUTO_SHARE``).

Precedence (``RetrofitArgs.build`` and the command line): a field given explicitly wins over the preset's value,
which wins over the field's default. The attention is built in order preset -> ``--config`` -> ``--kind`` ->
``--set`` (later wins). A training stage whose step count is given without its schedule keeps the preset's lengths
and batch sizes with the steps scaled to the new count (``scale_schedule``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PRESETS", "Preset", "attention_spec", "get_preset", "preset_names", "scale_schedule"]

# the general web-text corpus a causal-LM preset reads by default (hf_polyattn.data: 'web'; offline the bundled
# Tiny Shakespeare, and the run says how narrow that is)
WEB = {"data": "web"}

# SmolLM2-135M-Instruct's long-context evaluation (recipes/experiments/long_context/rows.py EVAL): perplexity over the
# first 12,288 held-out Tiny Shakespeare tokens, passkey retrieval at 1k / 2k / 4k with 10 needle depths
LONG_CONTEXT_EVAL = ("SmolLM2-135M-Instruct, held-out Tiny Shakespeare (first 12,288 tokens), perplexity at "
                     "256 / 1k / 2k / 4k / 8k tokens, passkey at 1k / 2k / 4k (10 depths), 2-core CPU")
ROWS = "recipes/results/long_context"
# the softmax checkpoint's row of that evaluation (recipes/results/long_context/softmax.json)
SOFTMAX_ROW = {"perplexity": {256: 43.66, 1024: 31.02, 2048: 29.00, 4096: 27.75, 8192: 26.65}}
RUN_ROW = ".venv/bin/python recipes/experiments/long_context/run_rows.py "

# the long-context study's recipe (rows.py LINEAR / POLYSKETCH, GATED_MIX): an exact softmax 128-token window with 4
# sinks scored at positions within it, the kernel part beside it behind a gated decay and a per-head weight that
# starts at 0.01, after a learnable projection to head_dim and a per-head q/k LayerNorm
WINDOW_RECIPE = {"window": 128, "sinks": 4, "decay": "gate", "window_mix": True, "window_mix_init": 0.01,
                 "block_size": 64, "qk_norm": True, "feature_proj": "head_dim"}
TRANSFER_1K = {"transfer_steps": 60, "transfer_lr": 1e-2, "transfer_schedule": "1024:60:2"}
LORA_1K_2K = {"finetune_steps": 40, "finetune_lr": 1e-4, "lora": True, "lora_r": 8, "lora_alpha": 16,
              "finetune_schedule": "1024:20:1,2048:20:1"}
# the whole-model benchmark of the demo's model (the long-context preset's attention, 22 softmax kv heads, with the
# demo's shorter training: speed and decode memory depend on the attention, not on the weights) against SmolLM2,
# and the linear-only preset's (its trained model with the reconfigure written in, hf-polyattn convert --set), one
# after the other on one 2-core machine with nothing else running, so that the README's speed column compares like
# with like: the same command on another 2-core machine gave the demo 3.33x decode at 16k (bench_model/
# demo_xeon_repeats2), and the ratio moves with the machine
DEMO_SPEED_SOURCE = "recipes/results/bench_model/demo_epyc/cpu-fp32.json"
LINEAR_ONLY_SPEED_SOURCE = "recipes/results/bench_model/linear_only_epyc/cpu-fp32.json"
DEMO_SPEED = {"decode_speedup": {4096: 0.85, 16384: 1.72}, "prefill_speedup": {4096: 1.13, 16384: 1.68},
              "decode_state": {32768: 420963440}, "base_state": {32768: 1509949440}}
AUTO_HEADS_NOTE = ("measured with the 22 kv heads that `hf-polyattn score-heads` ranked best on 8 passkey prompts of "
                   "2,048 tokens (recipes/results/long_context/head_scores_smollm2.json); softmax_heads='auto' "
                   "scores 4 prompts of 1,024 when the run starts and chose nearly the same heads on SmolLM2")


@dataclass(frozen=True)
class Preset:
    """One measured recipe. ``attention`` None = the checkpoint's own softmax attention."""

    name: str
    summary: str
    attention: dict[str, Any] | None
    train: dict[str, Any] = field(default_factory=dict)
    # settings that add no tensor, applied to the trained attention after training (hf_polyattn.reconfigure)
    reconfigure: dict[str, Any] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    task: str = "causal_lm"
    model: str = "smollm2"
    # what it was measured at: "perplexity" {context: value} (causal LM) or "accuracy" (classification), "passkey"
    # {length: "hits/depths"} (and "passkey_vault", the second template), the softmax reference in the same form,
    # "train_cpu_s"; from ``speed_source``: "decode_speedup" and "prefill_speedup" {length: base time / this
    # model's time, batch 1} and "decode_state" / "base_state" {length: bytes one sequence's cache holds}
    figures: dict[str, Any] = field(default_factory=dict)
    setting: str = ""  # how the figures were measured (model, data, machine)
    source: str = ""  # the repository's result file the figures come from
    # the whole-model benchmark (hf-polyattn bench --model) of this attention against its base, the file its speed
    # and decode-memory figures come from ("" when none was run)
    speed_source: str = ""
    command: str = ""  # the command that measured them
    note: str = ""

    def describe(self) -> str:
        """The figure in one line, from ``figures``."""
        f = self.figures
        if "perplexity" in f:
            ppl = " / ".join(f"{v:.2f}" for v in f["perplexity"].values())
            at = " / ".join(_tokens(c) for c in f["perplexity"])
            soft = " / ".join(f"{v:.2f}" for v in f["softmax"]["perplexity"].values())
            text = f"perplexity {ppl} at {at} tokens (softmax {soft})"
            if f.get("passkey"):
                keys = ", ".join(f"{v} at {_tokens(n)}" for n, v in f["passkey"].items())
                text += f"; passkey {keys}"
            if f.get("passkey_vault"):
                keys = ", ".join(f"{v} at {_tokens(n)}" for n, v in f["passkey_vault"].items())
                text += f"; passkey 'vault' {keys}"
        else:
            text = f"accuracy {f['accuracy']:.4f} (softmax {f['softmax']['accuracy']:.4f})"
        if f.get("train_cpu_s"):
            text += f"; training {f['train_cpu_s']:,} CPU-s"
        if f.get("decode_speedup"):
            from .bench_model import size

            at = " / ".join(_tokens(n) for n in f["decode_speedup"])
            text += (f"; against the base at {at} tokens: decode "
                     f"{' / '.join(f'{v:.2f}x' for v in f['decode_speedup'].values())}, prefill "
                     f"{' / '.join(f'{v:.2f}x' for v in f['prefill_speedup'].values())}")
            text += "; decode state " + ", ".join(f"{size(b)} at {_tokens(n)} (base {size(f['base_state'][n])})"
                                                  for n, b in f["decode_state"].items())
            text += f" ({self.speed_source})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "measured": self.describe()}


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


_PRESETS = [
    Preset(
        name="long-context",
        summary="the best measured long-context retrofit: a quarter of the kv heads softmax, the rest linear (elu) "
                "+ 128 window + 4 sinks + gated decay (horizon 256); attention transfer at 1k, LoRA at 1k and 2k",
        attention={"kind": "linear", "feature_map": "elu", **WINDOW_RECIPE, "decay_horizon": 256.0,
                   "softmax_heads": "auto"},
        train={**TRANSFER_1K, **LORA_1K_2K}, data=WEB,
        figures={"perplexity": {256: 40.79, 1024: 30.44, 2048: 28.77, 4096: 27.74, 8192: 26.97},
                 "passkey": {1024: "10/10", 2048: "10/10", 4096: "10/10"},
                 "softmax": SOFTMAX_ROW,
                 "train_cpu_s": 1056, **DEMO_SPEED},
        setting=LONG_CONTEXT_EVAL, source=f"{ROWS}/lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k.json",
        speed_source=DEMO_SPEED_SOURCE,
        command=RUN_ROW + "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k", note=AUTO_HEADS_NOTE),
    Preset(
        name="linear-only",
        summary="every kv head linear-time (no softmax heads, no full KV cache): linear with hedgehog features + "
                "128 window + 4 sinks + gated decay, attention transfer at 1k; then, without training, a bounded "
                "sparse cache of 2,048 keys per kv head ranked by the attention the last 64 queries give them "
                "(sparse_score='attention') and chosen again by a prompt's last 16 queries (sparse_observe), the "
                "decayed state's memory bounded to 256 tokens and the sinks scored at their own positions, and 1,536 "
                "of the 2,048 keys those of largest |v| pooled over 5 neighbours (sparse_value_keys), kept whatever "
                "the queries read, so that a document read in an earlier call keeps what a question in a later "
                "turn asks for: a decode state of constant size at any length. Retrieves passkeys beyond its window "
                "without any softmax head, with the question in the prompt or in a later turn up to 4k; few far "
                "needles at 8k. On these passkeys and on a RULER-style suite at 4k / 8k it scores what the same "
                "cache scores on the untrained model, not more; StreamingLLM keeping as many keys (a 2,176-token "
                "window) scores more at 4k, less at 8k; asked in a later turn, the RULER suite's needles at 4k "
                "are almost all lost (by the same cache untrained too), where the demo's hybrid finds what it finds "
                "with the question in the prompt. A document read with hf_polyattn.read_document (eval --read copy: "
                "the cache chosen by KVzip's copy score) keeps the 1k-4k passkeys and most 8k ones for a later "
                "question and more of RULER's needles, not all, as the same cache read that way on the untrained "
                "model does, and training on recall tasks (--retrieval_mix) changes neither: for documents "
                "questioned later, read them that way or use a preset with "
                "softmax heads (docs/integration.md, docs/long_context.md); prefills slower than softmax on a CPU "
                "(the figures below)",
        attention={"kind": "linear", "feature_map": "hedgehog", **WINDOW_RECIPE, "decay_horizon": 1024.0},
        train=dict(TRANSFER_1K), data=WEB,
        reconfigure={"decay_max_horizon": 256.0, "sparse_cache": 2048, "sparse_observe": 16, "sink_position": "own",
                     "sparse_score": "attention", "sparse_value_keys": 1536},
        figures={"perplexity": {256: 43.66, 1024: 31.02, 2048: 29.00, 4096: 27.84, 8192: 27.25},
                 "passkey": {1024: "10/10", 2048: "10/10", 4096: "10/10", 8182: "7/10"},
                 "passkey_vault": {1024: "10/10", 2048: "10/10", 4096: "10/10", 8182: "4/10"},
                 "softmax": SOFTMAX_ROW,
                 "train_cpu_s": 830.3,
                 "decode_speedup": {4096: 0.88, 16384: 2.2}, "prefill_speedup": {4096: 0.29, 16384: 0.62},
                 "decode_state": {32768: 159623400}, "base_state": {32768: 1509949440}},
        setting="SmolLM2-135M-Instruct, held-out Tiny Shakespeare (first 12,288 tokens), perplexity at 256 / 1k / "
                "2k / 4k / 8k tokens, passkey 'classic' and 'vault' at 1k / 2k / 4k / 8,182 tokens (10 depths), "
                "2-core CPU (recipes/results/SECTION_retrieval.md)",
        source="recipes/results/retrieval/hh_max256+sparse2048+observe16+own+attention+value1536.json",
        speed_source=LINEAR_ONLY_SPEED_SOURCE,
        command="python recipes/experiments/run.py retrieval hh hh_max256+sparse2048+observe16+own+attention+value1536",
        note="the study trained with --data demo (the bundled Tiny Shakespeare: what 'web' reads offline); the rows "
             "'hh' (trained, then evaluated as trained) and 'hh_max256+sparse2048+observe16+own+attention+value1536' "
             "(its saved model with the preset's reconfigure as --set). Without the |v| reserve (--reconfigure "
             "sparse_value_keys=0, row hh_max256+sparse2048+observe16+own+attention) more 8k 'vault' needles asked in "
             "the prompt are found and the perplexity at 8k is lower, but a question in a later turn loses the 4k "
             "needles (docs/kinds.md, sparse_value_keys; recipes/results/ruler_matched). "
             "Ranking the cache by LoLA's recall error with the "
             "sinks scored as if at most 1,024 positions back (--reconfigure sparse_score=recall sink_position=window "
             "sink_span=1024 sparse_value_keys=0, row hh_max256+sparse2048+observe16+span1024) prefills faster and "
             "retrieves fewer 8k needles; with 512 keys (--reconfigure sparse_cache=512 sparse_value_keys=0; a "
             "reserve larger than the cache is refused) the state is smaller and the 8k needles fewer "
             "(docs/performance.md, SECTION_retrieval.md)"),
    Preset(
        name="demo",
        summary="`make demo`: the long-context preset's attention with attention transfer only (30 steps of "
                "1 x 1,024 tokens), judged at 256-4k tokens and on passkey beside softmax and StreamingLLM",
        attention={"kind": "linear", "feature_map": "elu", **WINDOW_RECIPE, "decay_horizon": 256.0,
                   "softmax_heads": "auto"},
        train={"transfer_steps": 30, "transfer_lr": 1e-2, "transfer_schedule": "1024:30:1"},
        eval={"eval_before": False, "max_eval_tokens": 2048, "eval_contexts": "256,1024,2048,4096",
              "passkey_lengths": "1024,2048", "passkey_depths": 5, "long_eval_tokens": 4096,
              "long_eval_baselines": "softmax,streaming", "speed_lengths": "4096"},
        data={"data": "demo"},
        figures={"perplexity": {256: 44.41, 1024: 33.49, 2048: 31.45, 4096: 30.12},
                 "passkey": {1024: "5/5", 2048: "5/5"},
                 "softmax": {"perplexity": {256: 44.09, 1024: 32.03, 2048: 29.84, 4096: 28.36}}, **DEMO_SPEED},
        setting="SmolLM2-135M-Instruct, held-out Tiny Shakespeare (first 4,096 tokens), perplexity at 256 / 1k / "
                "2k / 4k tokens, passkey at 1k / 2k (5 depths), 2-core CPU (recipes/results/SECTION_demo.md)",
        source="recipes/results/demo/long_context.json", speed_source=DEMO_SPEED_SOURCE, command="make demo"),
    Preset(
        name="polysketch",
        summary="the long-context recipe with a learned polysketch (r=16, degree 4) kernel: closer to softmax up to "
                "2k, further from it from 4k",
        attention={"kind": "polysketch", "sketch": "learned", "sketch_size": 16, **WINDOW_RECIPE,
                   "decay_horizon": 256.0, "softmax_heads": "auto"},
        train={**TRANSFER_1K, **LORA_1K_2K}, data=WEB,
        figures={"perplexity": {256: 40.85, 1024: 30.06, 2048: 28.51, 4096: 28.98, 8192: 29.65},
                 "passkey": {1024: "10/10", 2048: "9/10", 4096: "9/10"},
                 "softmax": SOFTMAX_ROW,
                 "train_cpu_s": 1411},
        setting=LONG_CONTEXT_EVAL, source=f"{ROWS}/ps_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k.json",
        command=RUN_ROW + "ps_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k", note=AUTO_HEADS_NOTE),
    Preset(
        name="taylor",
        summary="every kv head the first-order Taylor kernel (1 + q.k) + 128 window + 4 sinks + gated decay "
                "(horizon 1,024), attention transfer at 1k",
        attention={"kind": "taylor", **WINDOW_RECIPE, "decay_horizon": 1024.0},
        train=dict(TRANSFER_1K), data=WEB,
        figures={"perplexity": {256: 45.03, 1024: 37.00, 2048: 36.14, 4096: 36.46, 8192: 38.51},
                 "passkey": {1024: "1/10", 2048: "1/10", 4096: "0/10"},
                 "softmax": SOFTMAX_ROW,
                 "train_cpu_s": 562},
        setting=LONG_CONTEXT_EVAL, source=f"{ROWS}/taylor_w128_s4w_dgate_mix_t1k.json",
        command=RUN_ROW + "taylor_w128_s4w_dgate_mix_t1k"),
    Preset(
        name="streaming",
        summary="StreamingLLM, training-free: exact softmax on 4 sink tokens + a 128-token window (sliding_window); "
                "the baseline a trained retrofit has to beat",
        attention={"kind": "sliding_window", "window": 128, "sinks": 4}, data=WEB,
        figures={"perplexity": {256: 45.17, 1024: 37.69, 2048: 36.63, 4096: 36.07, 8192: 35.96},
                 "passkey": {1024: "1/10", 2048: "1/10", 4096: "0/10"},
                 "softmax": SOFTMAX_ROW},
        setting=LONG_CONTEXT_EVAL, source=f"{ROWS}/streaming_cachepos.json", command=RUN_ROW + "streaming_cachepos"),
]

# all-MiniLM-L6-v2 on GLUE SST-2 (recipes/experiments/retrofit_kinds/run_minilm_sst2_kinds.sh): 200 fine-tuning steps
# x 16 sentences, 1,000 held-out sentences of a seeded split of the training file
MINILM_SST2 = {"finetune_steps": 200, "finetune_lr": 1e-4, "warmup_steps": 20, "batch_size": 16}
MINILM_DATA = {"max_length": 64, "num_eval": 1000}
MINILM_SETTING = ("all-MiniLM-L6-v2 on GLUE SST-2: accuracy on 1,000 sentences held out of the training split "
                  "(seed 0), 2-core CPU")
MINILM_SOURCE = "recipes/results/retrofit_kinds/minilm_sst2_kinds.json"
MINILM_COMMAND = "KINDS={} bash recipes/experiments/retrofit_kinds/run_minilm_sst2_kinds.sh"
# the MiniLM budget with attention transfer first (recipes/experiments/retrofit_window/run_minilm_sst2_window.sh)
MINILM_WINDOW_TRAIN = {"transfer_steps": 100, "transfer_batch_size": 16, "transfer_lr": 1e-2, "polyattn_lr": 1e-3,
                       "finetune_steps": 400, "finetune_lr": 1e-4, "warmup_steps": 20, "batch_size": 16}
MINILM_WINDOW_SOURCE = "recipes/results/retrofit_window/minilm_sst2_window.json"
MINILM_WINDOW_COMMAND = "bash recipes/experiments/retrofit_window/run_minilm_sst2_window.sh"
SST2_NOTE = ("SST-2 is not bundled (67,349 rows): pass --data, a local sentence<TAB>label file or a Hub id (e.g. "
             "stanfordnlp/sst2)")
_PRESETS += [
    Preset(
        name="linear-encoder",
        summary="an encoder's attention -> linear (elu) beside an exact softmax window of 16 tokens each side; "
                "attention transfer, then full fine-tuning for classification",
        attention={"kind": "linear", "feature_map": "elu", "window": 16, "qk_norm": True, "block_size": 64},
        task="classification", model="minilm", train=MINILM_WINDOW_TRAIN, data=MINILM_DATA,
        figures={"accuracy": 0.869, "softmax": {"accuracy": 0.871}}, setting=MINILM_SETTING,
        source=MINILM_WINDOW_SOURCE, command=MINILM_WINDOW_COMMAND, note=SST2_NOTE),
    Preset(
        name="polysketch-encoder",
        summary="an encoder's attention -> polysketch (learned r=32, degree 4) beside an exact softmax window of 16 "
                "tokens each side; attention transfer, then full fine-tuning for classification",
        attention={"kind": "polysketch", "sketch": "learned", "sketch_size": 32, "window": 16, "qk_norm": True,
                   "block_size": 16},
        task="classification", model="minilm", train=MINILM_WINDOW_TRAIN, data=MINILM_DATA,
        figures={"accuracy": 0.882, "softmax": {"accuracy": 0.871}}, setting=MINILM_SETTING,
        source=MINILM_WINDOW_SOURCE, command=MINILM_WINDOW_COMMAND, note=SST2_NOTE),
    Preset(
        name="bigbird-encoder",
        summary="an encoder's attention -> BigBird (blocks of 8: a 3-block window, 1 global and 1 random block), "
                "then full fine-tuning for classification",
        attention={"kind": "bigbird", "options": {"block": 8, "random_blocks": 1}}, task="classification",
        model="minilm", train=MINILM_SST2, data=MINILM_DATA,
        figures={"accuracy": 0.852, "softmax": {"accuracy": 0.856}}, setting=MINILM_SETTING, source=MINILM_SOURCE,
        command=MINILM_COMMAND.format("bigbird"), note=SST2_NOTE),
    Preset(
        name="nystrom-encoder",
        summary="an encoder's attention -> Nystromformer (16 landmarks), then full fine-tuning for classification",
        attention={"kind": "nystrom", "options": {"num_landmarks": 16}}, task="classification", model="minilm",
        train=MINILM_SST2, data=MINILM_DATA,
        figures={"accuracy": 0.843, "softmax": {"accuracy": 0.856}}, setting=MINILM_SETTING, source=MINILM_SOURCE,
        command=MINILM_COMMAND.format("nystrom"), note=SST2_NOTE),
]

PRESETS: dict[str, Preset] = {p.name: p for p in _PRESETS}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)} (`hf-polyattn presets` lists "
                         "them)") from None


def attention_spec(preset: str | Preset | None = None, *, config: dict[str, Any] | None = None,
                   kind: str | None = None, overrides: dict[str, Any] | None = None,
                   notes: list[str] | None = None) -> dict[str, Any] | str | None:
    """The attention of a run: the preset's fields, then ``config``'s, then ``kind``, then ``overrides`` (later
    wins). 'softmax' (``kind='softmax'``) for the checkpoint's own attention; None when nothing names one.

    A ``kind`` other than the one named so far keeps only the fields the new kind reads (``KindSpec.fields``, its
    options, seed and softmax_heads); what it leaves out is said in ``notes`` (a list the caller prints).
    """
    from .registry import get_kind

    p = get_preset(preset) if isinstance(preset, str) else preset
    spec: dict[str, Any] | None = dict(p.attention) if p is not None else None
    if config is not None:
        if not isinstance(config, dict):
            raise ValueError(f"an attention config is a JSON object of PolyAttnConfig fields, got {config!r}")
        spec = {**(spec or {}), **config}
    if kind == "softmax":
        if overrides:
            raise ValueError(f"kind 'softmax' is the checkpoint's own attention: it takes no settings, got "
                             f"{sorted(overrides)}")
        return "softmax"
    if kind is not None:
        old = (spec or {}).get("kind")
        if spec and old not in (None, kind):
            k = get_kind(kind)
            reads = {*k.fields, "seed", "softmax_heads"}
            kept = {name: v for name, v in spec.items() if name in reads}
            options = {name: v for name, v in (spec.get("options") or {}).items() if name in k.options}
            if options:
                kept["options"] = options
            dropped = sorted({*spec, *(spec.get("options") or {})} - {*kept, *options, "kind", "options"})
            if dropped and notes is not None:
                notes.append(f"kind {kind!r} instead of {old!r}: kept {sorted(kept) or 'no fields'}, left out "
                             f"{dropped} (kind {kind!r} does not read them)")
            spec = kept
        spec = {**(spec or {}), "kind": kind}
    if overrides:
        if spec is None:
            raise ValueError("attention settings need a kind: give --kind KIND, a preset or a config that names one")
        spec = {**spec, **overrides}
    if spec is not None and "kind" not in spec:
        raise ValueError(f"the attention config names no kind (fields {sorted(spec)}): add \"kind\" or --kind")
    return spec


def scale_schedule(schedule: str | None, steps: int) -> str | None:
    """A 'LEN:STEPS[:BATCH],...' schedule with its steps scaled to ``steps`` in total (the largest remainders get
    the rounding; phases left with 0 steps go). None for 0 steps or no schedule."""
    if not schedule or steps <= 0:
        return None
    phases = [part.split(":") for part in schedule.replace(" ", "").split(",")]
    old = [int(p[1]) for p in phases]
    total = sum(old)
    exact = [steps * s / total for s in old]
    new = [int(x) for x in exact]
    for i in sorted(range(len(new)), key=lambda i: (new[i] - exact[i], i))[: steps - sum(new)]:
        new[i] += 1
    return ",".join(":".join([p[0], str(n), *p[2:]]) for p, n in zip(phases, new) if n > 0)
