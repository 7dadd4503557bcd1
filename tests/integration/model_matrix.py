"""The model-type matrix: one row per transformers model type, a tiny config built in code, and what hf_polyattn
does with it (``test_model_matrix.py`` checks every row; ``docs/supported_models.md`` is written from the same rows).

Run ``python tests/integration/model_matrix.py`` to rewrite docs/supported_models.md after changing a row (the test
``test_supported_models_doc_is_up_to_date`` fails until then).

Each decoder is built with 2 layers, hidden 64, 4 heads of 16 dims (2 kv heads where the type has grouped-query
attention), vocabulary 100 and 256 positions; each encoder likewise. A model family with sliding-window layers gets
one sliding layer (window 8, shorter than every prompt of the test) and one full-attention layer, so that both roles
run. A row is either supported (every check of the test passes) or refused with the message the row names: a new
silent acceptance and a new refusal both fail.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

VOCAB = 100
DOC = Path(__file__).resolve().parents[2] / "docs" / "supported_models.md"

# what every tiny config gets (types ignore what they do not know)
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
_GQA = dict(num_key_value_heads=2, head_dim=16)
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=0,
            n_group=1, topk_group=1)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                pad_token_id=1, embedding_size=64)

# the window of the tiny sliding-window layers: below the 24-token prompts (and 12-token encoder inputs), so that it
# decides which keys a query sees
SW = 8
# one sliding-window layer, then one full-attention layer (Gemma 3 has five sliding layers per global one)
MIXED = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=SW)

NOT_ROUTED = r"does not route its attention through transformers' AttentionInterface"
# the transformers releases every row was checked on (test_model_matrix.py passing on each); the doc says so
CHECKED_ON = ("5.19.0", "5.23.0", "5.24.0", "5.25.0")


@dataclass(frozen=True)
class Row:
    """``model_type`` (``AutoConfig.for_model``), ``family``: example checkpoints; ``config``: the tiny config's
    settings beyond the defaults above; ``polyattn``: PolyAttnConfig fields the row sets on top of the test's recipe
    (``sliding_layers='kind'``); ``refusal``: None for a supported row, else a regex of the ValueError ``convert``
    raises, and ``reason`` says it in words.

    ``rope``: what the RoPE reading finds in each attention layer of the tiny model, sliding layers included: (layout,
    rotated dims of the 16-dim head[, rope_theta]) or None for a layer without RoPE. ``layout``: each attention
    layer's (layer index, role, window) in ``hf_polyattn.layer_layout`` of the converted model (role 'kind' or
    'sliding'; window: the sliding window the layer kept or had); None: every layer converted, none had a window.
    ``refused_also``: PolyAttnConfig overrides refused with the same message (no setting converts the model);
    ``converts_with``: overrides with which ``convert`` accepts the model (what the reason offers)."""

    model_type: str
    family: str
    config: dict = field(default_factory=dict)
    encoder: bool = False
    polyattn: dict = field(default_factory=dict)
    refusal: str | None = None
    reason: str = ""
    refused_also: tuple = ()
    converts_with: dict | None = None
    # the first transformers release whose modeling code routes this type's attention through AttentionInterface
    # (GPT-J and CodeGen: 5.24, Falcon: 5.25); before it the row is refused as computing its attention itself
    since: tuple[int, int] | None = None
    rope: tuple = ()
    layout: tuple | None = None
    name: str = ""  # the row's id where one model type has several rows

    @property
    def id(self) -> str:
        return self.name or self.model_type

    @property
    def supported(self) -> bool:
        return self.refusal is None

    @property
    def status(self) -> str:
        return "refused" if self.refusal is not None else "supported"

    def make_config(self):
        from transformers import AutoConfig

        base = dict(_ENCODER if self.encoder else _DECODER)
        return AutoConfig.for_model(self.model_type, **{**base, **self.config})


def _rope(layout: str | None, dims: int = 16, layers: int = 2) -> tuple:
    """The same RoPE entry for each of ``layers`` attention layers."""
    return tuple(None if layout is None else (layout, dims) for _ in range(layers))


HALF, PAIRS = "rotate_half", "interleaved"
SLIDING_FULL = ((0, "sliding", SW), (1, "kind", None))

DECODERS = [
    Row("llama", "Llama 2/3, SmolLM2, TinyLlama", _GQA, rope=_rope(HALF)),
    Row("qwen2", "Qwen2, Qwen2.5", _GQA, rope=_rope(HALF)),
    # builds a sliding-window mask on every forward, also with no sliding layer: its full-attention layers never read
    # it (the layer layout decides, layout.py)
    Row("qwen2_moe", "Qwen1.5-MoE", {**_GQA, **_MOE}, rope=_rope(HALF)),
    Row("qwen3", "Qwen3 (q/k norm before RoPE)", _GQA, rope=_rope(HALF)),
    Row("qwen3_moe", "Qwen3 MoE", {**_GQA, **_MOE}, rope=_rope(HALF)),
    Row("gemma", "Gemma 1", _GQA, rope=_rope(HALF)),
    Row("phi3", "Phi-3, Phi-3.5, Phi-4-mini", _GQA, rope=_rope(HALF)),
    Row("smollm3", "SmolLM3 (every 4th layer without RoPE; here layer 1)", {**_GQA, "no_rope_layers": [1, 0]},
        rope=(("rotate_half", 16), None)),
    Row("glm", "GLM-4 9B (half the head rotated, interleaved pairs)", _GQA, rope=_rope(PAIRS, 8)),
    Row("glm4", "GLM-4-0414", _GQA, rope=_rope(PAIRS, 8)),
    Row("glm4_moe", "GLM-4.5", {**_GQA, **_MOE}, rope=_rope(HALF, 8)),
    Row("olmo", "OLMo", _GQA, rope=_rope(HALF)),
    Row("olmo2", "OLMo 2 (q/k norm before RoPE)", _GQA, rope=_rope(HALF)),
    Row("olmoe", "OLMoE", {**_GQA, **_MOE}, rope=_rope(HALF)),
    Row("granite", "Granite 3", _GQA, rope=_rope(HALF)),
    Row("granitemoe", "Granite 3 MoE", {**_GQA, **_MOE}, rope=_rope(HALF)),
    Row("starcoder2", "StarCoder2", _GQA, rope=_rope(HALF)),
    Row("mixtral", "Mixtral", {**_GQA, **_MOE}, rope=_rope(HALF)),
    Row("phi", "Phi-1, Phi-1.5, Phi-2 (partial rotary)", {}, rope=_rope(HALF, 8)),
    Row("stablelm", "StableLM 2 (partial rotary)", _GQA, rope=_rope(HALF, 4)),
    Row("persimmon", "Persimmon, Fuyu (partial rotary)", {}, rope=_rope(HALF, 8)),
    Row("nemotron", "Nemotron-4, Minitron (partial rotary)", _GQA, rope=_rope(HALF, 8)),
    Row("gpt_neox", "Pythia, GPT-NeoX-20B (partial rotary)", {}, rope=_rope(HALF, 4)),
    Row("cohere", "Command R (interleaved pairs)", _GQA, rope=_rope(PAIRS)),
    Row("gptj", "GPT-J 6B (interleaved pairs, partial rotary)", dict(rotary_dim=8), rope=_rope(PAIRS, 8),
        since=(5, 24)),
    Row("codegen", "CodeGen (interleaved pairs, partial rotary)", dict(rotary_dim=8), rope=_rope(PAIRS, 8),
        since=(5, 24)),
    # multi-query attention (one kv head) by default
    Row("falcon", "Falcon 7B / 40B (rotary)", {}, rope=_rope(HALF), since=(5, 25)),
    Row("helium", "Helium 1 (interleaved pairs)", _GQA, rope=_rope(PAIRS)),
    Row("seed_oss", "Seed-OSS", _GQA, rope=_rope(HALF)),
    Row("ernie4_5", "ERNIE 4.5 (interleaved pairs)", _GQA, rope=_rope(PAIRS)),
    Row("arcee", "Arcee AFM", _GQA, rope=_rope(HALF)),
    Row("apertus", "Apertus", _GQA, rope=_rope(HALF)),
    # mixture of attention heads: num_key_value_heads x num_experts_per_tok query heads (JetMoeConfig sets
    # num_attention_heads to that product: 2 x 2 here), keys tiled to them before the attention function
    Row("jetmoe", "JetMoE (mixture of attention heads)", {**_GQA, **_MOE, "kv_channels": 16}, rope=_rope(HALF)),
    # the convolution layers keep their conv state in transformers' own cache layer inside the PolyAttnCache
    Row("lfm2", "LFM2 (short-convolution layers beside attention; here conv, then attention)",
        {**_GQA, "layer_types": ["conv", "full_attention"]}, rope=_rope(HALF, layers=1),
        layout=((1, "kind", None),)),
    # gated DeltaNet layers keep their conv and recurrent states in transformers' own cache layers too; the attention
    # layer first here, where one token repeated reaches it as one hidden state (the RoPE check)
    Row("qwen3_next", "Qwen3-Next (gated DeltaNet layers beside gated attention; here attention, then DeltaNet)",
        {**_GQA, **_MOE, "layer_types": ["full_attention", "linear_attention"], "linear_num_key_heads": 2,
         "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16},
        rope=_rope(HALF, 4, layers=1), layout=((0, "kind", None),)),
    Row("llama", "Llama 3.1 (llama3 scaled RoPE)", {**_GQA, "rope_parameters": dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)}, rope=_rope(HALF), name="llama-llama3"),
    Row("qwen2", "Qwen2.5 with YaRN", {**_GQA, "rope_parameters": dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)}, rope=_rope(HALF),
        name="qwen2-yarn"),
    # sliding-window layers kept exact (softmax over their window), full-attention layers converted
    Row("gemma3_text", "Gemma 3 (five sliding layers per global one)", {**_GQA, **MIXED},
        rope=((HALF, 16, 1e4), (HALF, 16, 1e6)), layout=SLIDING_FULL),
    Row("gemma2", "Gemma 2, with `softcap_mode='exact_parts'` (attn_logit_softcapping=50 on every layer)",
        {**_GQA, **MIXED}, polyattn={"softcap_mode": "exact_parts"}, rope=_rope(HALF), layout=SLIDING_FULL,
        name="gemma2-exact-parts",
        reason="the cap c tanh(s / c) is applied to every score a layer forms: the sliding layer's window, the "
               "converted layer's window, sinks and softmax heads; its kernel part beyond the window forms none and "
               "approximates the capped softmax (attention transfer trains it against the capped model)"),
    Row("ministral", "Ministral 8B", {**_GQA, **MIXED}, rope=_rope(HALF), layout=SLIDING_FULL),
    Row("olmo3", "OLMo 3 (q/k norm before RoPE)", {**_GQA, **MIXED}, rope=_rope(HALF), layout=SLIDING_FULL),
    Row("exaone4", "EXAONE 4 (global layers without RoPE)", {**_GQA, **MIXED}, rope=((HALF, 16), None),
        layout=SLIDING_FULL),
    Row("qwen2", "Qwen2 with use_sliding_window (layers from max_window_layers on)",
        {**_GQA, "use_sliding_window": True, "sliding_window": SW, "max_window_layers": 1}, rope=_rope(HALF),
        layout=((0, "kind", None), (1, "sliding", SW)), name="qwen2-sliding"),
    Row("mistral", "Mistral 7B v0.1, with `sliding_layers='kind'` (every layer converted)",
        {**_GQA, "sliding_window": SW}, polyattn={"sliding_layers": "kind"}, rope=_rope(HALF),
        layout=((0, "kind", SW), (1, "kind", SW)), name="mistral-kind"),
    Row("gpt2", "GPT-2, DistilGPT2 (learned positions)", {}, rope=_rope(None)),
    Row("opt", "OPT (learned positions)", dict(ffn_dim=128, word_embed_proj_dim=64), rope=_rope(None)),
    # refused
    Row("llama", "Llama with dynamic NTK scaling", {**_GQA, "rope_parameters": dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0)}, name="llama-dynamic",
        converts_with={"sink_position": "own"},
        refusal=r"changes its frequencies with the length of the call.*sink_position='own'",
        reason="'dynamic' RoPE scaling recomputes the frequencies from the length of each call (the model rotates "
               "one position differently in short and long calls): sinks at positions within the window cannot "
               "be re-rotated; converts with `sink_position='own'`"),
    Row("phi3", "Phi-3 128k (longrope)", {**_GQA, "rope_parameters": dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
        original_max_position_embeddings=64)}, name="phi3-longrope", converts_with={"sink_position": "own"},
        refusal=r"changes its frequencies with the length of the call.*sink_position='own'",
        reason="'longrope' switches to its long factors when a call reaches beyond the original context: as "
               "'dynamic'; converts with `sink_position='own'`"),
    Row("deepseek_v3", "DeepSeek-V3, Kimi K2 (multi-head latent attention)",
        {**_MOE, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
         "q_lora_rank": 32, "num_key_value_heads": 4},
        refusal=r"are not those rotations of each other.*sink_position='own'",
        reason="MLA rotates the trailing dims of each head (64 of 192) after unrotated ones: the RoPE reading finds "
               "the module's queries are not the rotation read from apply_rotary_pos_emb and refuses; converts "
               "with `sink_position='own'`", converts_with={"sink_position": "own"}),
    Row("mistral", "Mistral 7B v0.1 (sliding_window 4096 on every layer)", {**_GQA, "sliding_window": SW},
        refusal=r"every attention layer of MistralForCausalLM is a sliding-window layer \(window 8\).*"
                r"StreamingLLM-like.*Pass sliding_layers='kind'",
        reason="a sliding window on every layer: already linear time with a decode cache bounded by the window "
               "(StreamingLLM-like), so the default `sliding_layers='exact'` leaves nothing to convert; converts "
               "with `sliding_layers='kind'` (the next row)",
        converts_with={"sliding_layers": "kind"}),
    Row("gemma2", "Gemma 2 (attention soft-capping, attn_logit_softcapping=50, on every layer)", {**_GQA, **MIXED},
        refusal=r"passes softcap=self\.attn_logit_softcapping \(50\.0\).*cannot apply it.*kernel part "
                r"phi\(q\)\.phi\(k\).*Pass softcap_mode='exact_parts'",
        reason="soft-capping tanh(s / 50) * 50 of every attention score, in every layer: the exact sliding layers "
               "apply it, and so do a converted layer's window, sinks and softmax heads, but the recipe's kernel part "
               "beyond the window forms no score to cap, so by default (`softcap_mode='refuse'`) convert refuses; "
               "`sliding_layers='kind'` alike. Converts with `softcap_mode='exact_parts'` (its own row), or with "
               "every kv head of the global layers softmax",
        refused_also=({"sliding_layers": "kind"},), converts_with={"softcap_mode": "exact_parts"}),
    Row("minimax", "MiniMax-Text-01, MiniMax-M1 (lightning-attention layers beside softmax layers)",
        {**_GQA, **_MOE},
        refusal=r"model_type 'minimax' \(MiniMaxForCausalLM\) keeps its generation cache in a class of its own "
                r"\(MiniMaxCache.*cannot use a MiniMaxCache",
        reason="its forward creates a MiniMaxCache (the lightning-attention layers' states) in place of a "
               "DynamicCache and refuses any other cache, and hf_polyattn attention cannot use a MiniMaxCache: "
               "refused at convert rather than failing at the first cached forward"),
    Row("doge", "Doge (dynamic mask attention)", _GQA,
        refusal=r"DogeAttention\.forward\) \(model_type='doge'\) passes attention_mask=attn_mask to its attention "
                r"function: a mask the module computes itself",
        reason="each attention module computes a per-head 4-D mask from its value states (dynamic mask attention: a "
               "bias on the scores and the top-k keys kept) and hands it to the attention function, which uses the "
               "model's mask for padding only: refused at convert rather than failing at the first forward"),
    Row("bloom", "BLOOM", {}, refusal=NOT_ROUTED, reason="computes softmax (with ALiBi) itself"),
    Row("falcon", "Falcon-RW (ALiBi)", dict(alibi=True), name="falcon-alibi", since=(5, 25),
        refusal=r"config\.alibi=True.*ALiBi position bias.*added to the attention mask",
        reason="from transformers 5.25 Falcon routes its attention through AttentionInterface and adds the ALiBi "
               "bias to the attention mask it hands it (a 4-D float mask), which hf_polyattn attention uses for "
               "padding only: refused at convert rather than failing at the first forward; before 5.25 it computed "
               "its attention itself"),
    Row("mpt", "MPT", dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2), refusal=NOT_ROUTED,
        reason="computes softmax (with ALiBi) itself"),
    Row("falcon_h1", "Falcon-H1 (attention and Mamba-2 side by side in every layer)",
        dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16, **_GQA),
        refusal=r"layer 0 of model_type 'falcon_h1' is a 'hybrid' layer.*share one cache layer.*generation with "
                r"hf_polyattn "
                r"attention is not supported",
        reason="each layer's attention and Mamba-2 mixer keep their states in one transformers cache layer, and "
               "the PolyAttnCache layer holds the attention's recurrent state only: refused at convert rather "
               "than failing in generate()"),
]

ENCODERS = [
    Row("bert", "BERT, MiniLM", encoder=True),
    Row("roberta", "RoBERTa", encoder=True),
    Row("distilbert", "DistilBERT", dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                                         attention_dropout=0.0), encoder=True),
    Row("electra", "ELECTRA", encoder=True),
    Row("xlm-roberta", "XLM-RoBERTa", encoder=True),
    Row("albert", "ALBERT (one attention module shared by every layer)", encoder=True, layout=((0, "kind", None),)),
    Row("camembert", "CamemBERT", encoder=True),
    Row("data2vec-text", "data2vec-text", encoder=True),
    Row("roberta-prelayernorm", "RoBERTa-PreLayerNorm", encoder=True),
    Row("ernie", "ERNIE 1/2/3 (Baidu)", encoder=True),
    Row("esm", "ESM-2 (protein, RoPE)", dict(position_embedding_type="rotary", mask_token_id=4), encoder=True),
    Row("nomic_bert", "nomic-embed-text (RoPE)", encoder=True),
    Row("eurobert", "EuroBERT (RoPE)", encoder=True),
    # local layers kept exact: |i - j| < local_attention / 2 + 1 = 5; ModernBERT's global layers are every third
    Row("modernbert", "ModernBERT (a global layer every 2nd here; local window 8)",
        dict(global_attn_every_n_layers=2, local_attention=SW, bos_token_id=2, cls_token_id=2, eos_token_id=3,
             sep_token_id=3), encoder=True, layout=((0, "kind", None), (1, "sliding", SW // 2 + 1))),
    Row("deberta-v2", "DeBERTa-v2/v3", encoder=True, refusal=NOT_ROUTED,
        reason="disentangled attention computed by the model itself"),
    Row("mpnet", "MPNet, all-mpnet-base-v2", encoder=True, refusal=NOT_ROUTED,
        reason="relative position bias computed by the model itself"),
]

ROWS = DECODERS + ENCODERS


def installed(row: Row) -> Row:
    """The row as the installed transformers has it: before its ``since`` release, refused as not routed."""
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if row.since is None or version >= row.since:
        return row
    return dataclasses.replace(row, refusal=NOT_ROUTED, rope=(), layout=None,
                               reason=f"transformers {transformers.__version__} computes its attention itself")


def _rope_text(entry) -> str:
    if entry is None:
        return "no RoPE: nothing to re-rotate"
    layout, dims, *theta = entry
    text = "rotate_half pairs (t, t + d/2)" if layout == HALF else "interleaved pairs (2t, 2t + 1)"
    return text + ("" if dims == 16 else f" on {dims} of 16 dims") + (f", rope_theta {theta[0]:,.0f}" if theta else "")


def _layout_text(row: Row) -> str:
    parts = []
    for layer, role, window in row.layout:
        # bidirectional: keys at distance < window either side (no '|' in a table cell)
        span = f"keys at distance < {window} either side" if row.encoder else f"window {window}"
        if role == "sliding":
            parts.append(f"layer {layer} sliding ({span}) kept exact")
        else:
            parts.append(f"layer {layer} converted" + (f" (was sliding, {span})" if window is not None else ""))
    return ", ".join(parts)


def _note(row: Row) -> str:
    if row.refusal is not None:
        return row.reason
    notes = [_layout_text(row)] if row.layout is not None else []
    if row.polyattn:
        notes.insert(0, "with " + ", ".join(f"`{k}={v!r}`" for k, v in row.polyattn.items()))
    if row.encoder:
        notes.insert(0, "polysketch (bidirectional)")
    elif not any(row.rope):
        notes.append("no RoPE: nothing to re-rotate")
    elif len(set(row.rope)) == 1:
        notes.append("RoPE read from the model: " + _rope_text(row.rope[0]))
    else:
        layers = [e[0] for e in row.layout] if row.layout is not None else range(len(row.rope))
        notes.append("RoPE read from the model: " + "; ".join(f"layer {i}: {_rope_text(e)}"
                                                              for i, e in zip(layers, row.rope)))
    if row.since is not None:
        notes.append(f"transformers >= {row.since[0]}.{row.since[1]}; refused before: it computed its attention "
                     "itself")
    if row.reason:  # what the row's option does
        notes.append(row.reason)
    return "; ".join(notes)


def counts(rows: list[Row] = ROWS) -> dict[str, int]:
    """Model types supported with the test's recipe as it is (decoders: the long-context recipe, encoders:
    polysketch), model types supported only with a row's own option (Mistral: sliding_layers='kind'), refused rows."""
    plain = {r.model_type for r in rows if r.supported and not r.polyattn}
    return dict(decoders=len({r.model_type for r in rows if r.supported and not r.polyattn and not r.encoder}),
                encoders=len({r.model_type for r in rows if r.supported and not r.polyattn and r.encoder}),
                with_option=len({r.model_type for r in rows if r.supported and r.polyattn} - plain),
                refused=len([r for r in rows if not r.supported]))


def render() -> str:
    """docs/supported_models.md from :data:`ROWS`."""
    lines = [
        "# Supported model types",
        "",
        "Generated by `python tests/integration/model_matrix.py` from the rows that "
        "`tests/integration/test_model_matrix.py` checks; do not edit by hand.",
        "",
        f"Checked on transformers {', '.join(CHECKED_ON[:-1])} and {CHECKED_ON[-1]}: the test passes on each. A "
        "row with a first release (GPT-J and CodeGen: 5.24, Falcon: 5.25) is refused before it, as computing its "
        "attention itself. CI runs the test on the pinned minimum, on the newest release `pyproject.toml` allows "
        "and on the newest release on the package index (`make test-canary`).",
        "",
        "Every row is a transformers model type built in code with a tiny config (2 layers, hidden 64). "
        "**Supported** decoders pass, with the long-context recipe "
        '(`PolyAttnConfig(kind="linear", window=16, sinks=2, decay="gate")`, and the same with one kv head '
        "softmax): generate() with the recurrent cache equals the uncached forward over 150 generated tokens "
        "after a 24-token prompt, a left-padded batch equals each prompt alone, save -> reload gives identical "
        "logits, and `trust_remote_code=True` loads the saved folder without `import hf_polyattn`. "
        "Supported encoders pass the same with `polysketch` (a right-padded batch instead of generation). "
        "For a RoPE model the rotation that places the attention sinks within the window "
        "(`sink_position='window'`) is read from the model's own rotary embedding and `apply_rotary_pos_emb`, "
        "and checked against the model's own queries at other positions. "
        "Where a model has sliding-window layers (here one sliding layer of window 8, then one full-attention "
        "layer), the sliding layers stay the model's exact softmax over their window and the full-attention "
        "layers get the recipe (`sliding_layers='exact'`, the default); the note names each layer's role. "
        "**Refused** rows raise a `ValueError` naming the reason at `convert` / `from_pretrained`, never a "
        "silently different model.",
        "",
        "| model type | | example checkpoints | status | reason / note |",
        "|---|---|---|---|---|",
    ]
    for title, rows in (("decoder", DECODERS), ("encoder", ENCODERS)):
        for row in rows:
            lines.append(f"| `{row.model_type}` | {title} | {row.family} | {row.status} | {_note(row)} |")
    n = counts()
    lines += ["", f"{n['decoders']} decoder and {n['encoders']} encoder model types supported as they are, "
                  f"{n['with_option']} more with a row's option; {n['refused']} rows refused.", ""]
    return "\n".join(lines)


def write() -> Path:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render())
    return DOC


if __name__ == "__main__":
    print(f"wrote {write()}")
