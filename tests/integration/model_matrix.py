"""The model-type matrix: one row per transformers model type, a tiny config built in code, and what hf_polyattn
does with it (``test_model_matrix.py`` checks every row; ``docs/supported_models.md`` is written from the same rows).

Run ``python tests/integration/model_matrix.py`` to rewrite docs/supported_models.md after changing a row (the test
``test_supported_models_doc_is_up_to_date`` fails until then).

Each decoder is built with 2 layers, hidden 64, 4 heads of 16 dims (2 kv heads where the type has grouped-query
attention), vocabulary 100 and 256 positions; each encoder likewise. A row is either supported (every check of the
test passes) or refused with the message the row names: a new silent acceptance and a new refusal both fail.
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

NOT_ROUTED = r"does not route its attention through transformers' AttentionInterface"
SLIDING_LAYERS = r"hf_polyattn does not implement \['sliding_attention'\] layers"
SLIDING_WINDOW = r"config.sliding_window=\d+: hf_polyattn does not implement sliding-window attention"


@dataclass(frozen=True)
class Row:
    """``model_type`` (``AutoConfig.for_model``), ``family``: example checkpoints; ``config``: the tiny config's
    settings beyond the defaults above; ``refusal``: None for a supported row, else a regex of the ValueError
    ``convert`` raises, and ``reason`` says it in words; ``rope``: what the RoPE reading finds in the tiny config's
    layers ((layout, rotated dims of the 16-dim head) per layer, None for a layer without RoPE)."""

    model_type: str
    family: str
    config: dict = field(default_factory=dict)
    encoder: bool = False
    refusal: str | None = None
    reason: str = ""
    # a regex of the ValueError that generate() on the converted model raises (convert accepts it): a known gap
    known_error: str | None = None
    # the first transformers release whose modeling code routes this type's attention through AttentionInterface
    # (GPT-J and CodeGen: 5.24); before it the row is refused as computing its attention itself
    since: tuple[int, int] | None = None
    rope: tuple = ()
    name: str = ""  # the row's id where one model type has several rows

    @property
    def id(self) -> str:
        return self.name or self.model_type

    @property
    def supported(self) -> bool:
        return self.refusal is None and self.known_error is None

    @property
    def status(self) -> str:
        if self.refusal is not None:
            return "refused"
        return "converts, then fails (known gap)" if self.known_error is not None else "supported"

    def make_config(self):
        from transformers import AutoConfig

        base = dict(_ENCODER if self.encoder else _DECODER)
        return AutoConfig.for_model(self.model_type, **{**base, **self.config})


def _rope(layout: str | None, dims: int = 16, layers: int = 2) -> tuple:
    return tuple(None if layout is None else (layout, dims) for _ in range(layers))


HALF, PAIRS = "rotate_half", "interleaved"

DECODERS = [
    Row("llama", "Llama 2/3, SmolLM2, TinyLlama", _GQA, rope=_rope(HALF)),
    Row("qwen2", "Qwen2, Qwen2.5", _GQA, rope=_rope(HALF)),
    Row("qwen2_moe", "Qwen1.5-MoE", {**_GQA, **_MOE},
        known_error=r"hf_polyattn attention cannot apply a sliding-window mask",
        reason="the model builds a sliding-window mask on every forward, also when no layer is a sliding one "
               "(use_sliding_window=False), and hf_polyattn's mask function refuses it"),
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
    Row("helium", "Helium 1 (interleaved pairs)", _GQA, rope=_rope(PAIRS)),
    Row("seed_oss", "Seed-OSS", _GQA, rope=_rope(HALF)),
    Row("ernie4_5", "ERNIE 4.5 (interleaved pairs)", _GQA, rope=_rope(PAIRS)),
    Row("arcee", "Arcee AFM", _GQA, rope=_rope(HALF)),
    Row("apertus", "Apertus", _GQA, rope=_rope(HALF)),
    Row("jetmoe", "JetMoE", {**_GQA, **_MOE, "kv_channels": 16, "num_key_value_heads": 4},
        known_error=r"query must have 4 heads of size 16, got shape \(1, 8, ",
        reason="mixture-of-attention: each token's query heads are num_key_value_heads x num_experts_per_tok, not "
               "the config's num_attention_heads, and hf_polyattn sizes its layers by the latter"),
    Row("lfm2", "LFM2 (attention layers of a conv hybrid)", {**_GQA, "layer_types": ["conv", "full_attention"]},
        known_error=r"Cannot get conv state for non linear attention layer 0 of type PolyAttnCacheLayer",
        reason="generate() gives the model a PolyAttnCache, whose layers hold no conv state for LFM2's "
               "convolution layers (a model of attention layers only converts and generates)"),
    Row("llama", "Llama 3.1 (llama3 scaled RoPE)", {**_GQA, "rope_parameters": dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)}, rope=_rope(HALF), name="llama-llama3"),
    Row("qwen2", "Qwen2.5 with YaRN", {**_GQA, "rope_parameters": dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)}, rope=_rope(HALF),
        name="qwen2-yarn"),
    Row("gpt2", "GPT-2, DistilGPT2 (learned positions)", {}, rope=_rope(None)),
    Row("opt", "OPT (learned positions)", dict(ffn_dim=128, word_embed_proj_dim=64), rope=_rope(None)),
    # refused
    Row("llama", "Llama with dynamic NTK scaling", {**_GQA, "rope_parameters": dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0)}, name="llama-dynamic",
        refusal=r"changes its frequencies with the length of the call.*sink_position='own'",
        reason="'dynamic' RoPE scaling recomputes the frequencies from the length of each call (the model rotates "
               "one position differently in short and long calls): sinks at positions within the window cannot "
               "be re-rotated; converts with `sink_position='own'`"),
    Row("phi3", "Phi-3 128k (longrope)", {**_GQA, "rope_parameters": dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
        original_max_position_embeddings=64)}, name="phi3-longrope",
        refusal=r"changes its frequencies with the length of the call.*sink_position='own'",
        reason="'longrope' switches to its long factors when a call reaches beyond the original context: as "
               "'dynamic'; converts with `sink_position='own'`"),
    Row("deepseek_v3", "DeepSeek-V3, Kimi K2 (multi-head latent attention)",
        {**_MOE, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
         "q_lora_rank": 32},
        refusal=r"are not those rotations of each other.*sink_position='own'",
        reason="MLA rotates the trailing dims of each head (64 of 192) after unrotated ones: the RoPE reading finds "
               "the module's queries are not the rotation read from apply_rotary_pos_emb and refuses"),
    Row("mistral", "Mistral 7B (sliding_window 4096)", _GQA, refusal=SLIDING_WINDOW,
        reason="sliding-window attention on every layer (converts with `sliding_window=None`)"),
    Row("ministral", "Ministral", _GQA, refusal=SLIDING_LAYERS, reason="sliding-window layers"),
    Row("gemma2", "Gemma 2", _GQA, refusal=SLIDING_LAYERS, reason="sliding-window layers (and soft-capping)"),
    Row("gemma3_text", "Gemma 3", _GQA, refusal=SLIDING_LAYERS, reason="sliding-window layers"),
    Row("olmo3", "OLMo 3", _GQA, refusal=SLIDING_LAYERS, reason="sliding-window layers"),
    Row("exaone4", "EXAONE 4", _GQA, refusal=SLIDING_LAYERS, reason="sliding-window layers"),
    Row("bloom", "BLOOM", {}, refusal=NOT_ROUTED, reason="computes softmax (with ALiBi) itself"),
    Row("falcon", "Falcon", {}, refusal=NOT_ROUTED, reason="computes softmax itself"),
    Row("mpt", "MPT", dict(d_model=64, n_heads=4, n_layers=2, expansion_ratio=2), refusal=NOT_ROUTED,
        reason="computes softmax (with ALiBi) itself"),
]

ENCODERS = [
    Row("bert", "BERT, MiniLM", encoder=True),
    Row("roberta", "RoBERTa", encoder=True),
    Row("distilbert", "DistilBERT", dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, dropout=0.0,
                                         attention_dropout=0.0), encoder=True),
    Row("electra", "ELECTRA", encoder=True),
    Row("xlm-roberta", "XLM-RoBERTa", encoder=True),
    Row("albert", "ALBERT", encoder=True),
    Row("camembert", "CamemBERT", encoder=True),
    Row("data2vec-text", "data2vec-text", encoder=True),
    Row("roberta-prelayernorm", "RoBERTa-PreLayerNorm", encoder=True),
    Row("ernie", "ERNIE 1/2/3 (Baidu)", encoder=True),
    Row("esm", "ESM-2 (protein, RoPE)", dict(position_embedding_type="rotary", mask_token_id=4), encoder=True),
    Row("nomic_bert", "nomic-embed-text (RoPE)", encoder=True),
    Row("eurobert", "EuroBERT (RoPE)", encoder=True),
    Row("modernbert", "ModernBERT", dict(global_attn_every_n_layers=2), encoder=True, refusal=SLIDING_LAYERS,
        reason="sliding-window (local) layers"),
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
    return dataclasses.replace(row, refusal=NOT_ROUTED, known_error=None, rope=(),
                               reason=f"transformers {transformers.__version__} computes its attention itself")


def _note(row: Row) -> str:
    if row.refusal is not None or row.known_error is not None:
        return row.reason
    if row.encoder:
        return "polysketch (bidirectional)"
    since = "" if row.since is None else (f" (transformers >= {row.since[0]}.{row.since[1]}; refused before: it "
                                          "computed its attention itself)")
    kinds = {layout for layout in row.rope if layout}
    if not kinds:
        return "no RoPE: nothing to re-rotate" + since
    parts = []
    for layout, dims in sorted(kinds):
        what = "rotate_half pairs (t, t + d/2)" if layout == HALF else "interleaved pairs (2t, 2t + 1)"
        parts.append(what + ("" if dims == 16 else f" on {dims} of 16 dims"))
    if None in row.rope:
        parts.append("a layer without RoPE: nothing to re-rotate")
    return "RoPE read from the model: " + "; ".join(parts) + since


def render() -> str:
    """docs/supported_models.md from :data:`ROWS`."""
    lines = [
        "# Supported model types",
        "",
        "Generated by `python tests/integration/model_matrix.py` from the rows that "
        "`tests/integration/test_model_matrix.py` checks; do not edit by hand.",
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
        "**Refused** rows raise a `ValueError` naming the reason at `convert` / `from_pretrained`, never a "
        "silently different model; rows that **convert, then fail** raise a `ValueError` in `generate()` "
        "(known gaps, tested as such).",
        "",
        "| model type | | example checkpoints | status | reason / note |",
        "|---|---|---|---|---|",
    ]
    for title, rows in (("decoder", DECODERS), ("encoder", ENCODERS)):
        for row in rows:
            lines.append(f"| `{row.model_type}` | {title} | {row.family} | {row.status} | {_note(row)} |")
    supported = [r for r in ROWS if r.supported]
    lines += ["", f"{len({r.model_type for r in supported if not r.encoder})} decoder and "
                  f"{len({r.model_type for r in supported if r.encoder})} encoder model types supported; "
                  f"{len([r for r in ROWS if r.refusal])} rows refused, "
                  f"{len([r for r in ROWS if r.known_error])} converting, then failing.", ""]
    return "\n".join(lines)


def write() -> Path:
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(render())
    return DOC


if __name__ == "__main__":
    print(f"wrote {write()}")
