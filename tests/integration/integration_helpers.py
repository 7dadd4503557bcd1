"""Tiny models built in code (2 layers, hidden 64, vocab 100) for every supported architecture."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import hf_polyattn
from hf_polyattn import PolyAttnConfig, returned_cache

VOCAB = 100


@dataclass(frozen=True)
class Arch:
    name: str
    make_config: Callable
    model_cls: str
    auto_cls: str
    causal: bool
    # RoBERTa derives positions from input_ids (pads = padding_idx): never pass position_ids there.
    pass_position_ids: bool = True
    pad_id: int = 0


def _bert():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def _roberta():
    from transformers import RobertaConfig

    return RobertaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=80, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, pad_token_id=1)


def _distilbert():
    from transformers import DistilBertConfig

    return DistilBertConfig(vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                            max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                      scale_attn_by_inverse_layer_idx=True, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         sliding_window=None, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _gpt_neox():
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=128, attention_dropout=0.0,
                         hidden_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)


ARCHS = {
    "bert": Arch("bert", _bert, "BertForMaskedLM", "AutoModelForMaskedLM", causal=False),
    "roberta": Arch("roberta", _roberta, "RobertaForMaskedLM", "AutoModelForMaskedLM", causal=False,
                    pass_position_ids=False, pad_id=1),
    "distilbert": Arch("distilbert", _distilbert, "DistilBertForMaskedLM", "AutoModelForMaskedLM", causal=False),
    "gpt2": Arch("gpt2", _gpt2, "GPT2LMHeadModel", "AutoModelForCausalLM", causal=True),
    "llama": Arch("llama", _llama, "LlamaForCausalLM", "AutoModelForCausalLM", causal=True),
    "mistral": Arch("mistral", _mistral, "MistralForCausalLM", "AutoModelForCausalLM", causal=True),
    "qwen2": Arch("qwen2", _qwen2, "Qwen2ForCausalLM", "AutoModelForCausalLM", causal=True),
    "gpt_neox": Arch("gpt_neox", _gpt_neox, "GPTNeoXForCausalLM", "AutoModelForCausalLM", causal=True),
}
CAUSAL_ARCHS = [a for a in ARCHS if ARCHS[a].causal]

# Small options of every kind, chosen to exercise the interesting code: learned sketches and
# exact local blocks (block 4 < sequence 12), softmax local windows, q/k LayerNorms, FAVOR+.
KIND_CONFIGS = {
    "polynomial": PolyAttnConfig(kind="polynomial", degree=2, qk_norm=True),
    "polysketch": PolyAttnConfig(kind="polysketch", degree=4, sketch="learned", sketch_size=8, local_exact=True,
                                 block_size=4),
    "linear": PolyAttnConfig(kind="linear", feature_map="elu", local_exact=True, block_size=4),
    "performer": PolyAttnConfig(kind="performer", num_features=16, qk_norm=True),
    "sliding_window": PolyAttnConfig(kind="sliding_window", window=4),
    "taylor": PolyAttnConfig(kind="taylor", local_exact=True, block_size=4),
    # the seed documents' other systems (hf_polyattn/kinds/): E/F for the tiny models' 80 positions
    "linformer": PolyAttnConfig.for_kind("linformer", projection_length=4, max_length=80),
    "nystrom": PolyAttnConfig.for_kind("nystrom", num_landmarks=4),
    "fnet": PolyAttnConfig.for_kind("fnet"),
    # blocks of 2 in 12-40 token sequences: window, global and random blocks all present, and keys left out
    "bigbird": PolyAttnConfig.for_kind("bigbird", block=2, random_blocks=1),
    # the paper's shared-QK LSH with 4 buckets, 2 rounds and 4 keys per bucket window
    "reformer": PolyAttnConfig.for_kind("reformer", num_buckets=4, bucket_window=4),
    # the gated delta rule beside a 4-token window and a sink, on q / k convolved over 3 tokens; the delta read-out
    # mixed in from 0.5 (its default 0 would leave the model its window + sink at init)
    "delta": PolyAttnConfig.for_kind("delta", window=4, sinks=1, short_conv=3, delta_mix_init=0.5),
}


def serves(arch_name: str, kind: str) -> bool:
    """Whether ``kind`` serves the attention direction of ``arch_name`` (bidirectional-only kinds: encoders)."""
    spec = KIND_CONFIGS[kind].spec
    return spec.causal if ARCHS[arch_name].causal else spec.bidirectional


def arch_kind_params(archs, kinds=None) -> list:
    """pytest params (arch, kind) of every pair where the kind serves the architecture."""
    import pytest

    return [pytest.param(a, k, id=f"{a}-{k}") for a in archs for k in (kinds or KIND_CONFIGS) if serves(a, k)]


CAUSAL_KINDS = [k for k in KIND_CONFIGS if KIND_CONFIGS[k].spec.causal]


def has_tensors(kind: str) -> bool:
    """Whether the kind's layer holds parameters or buffers (sketches, features, E/F, ...)."""
    cfg = KIND_CONFIGS[kind]
    mod = cfg.spec.module_class()(cfg, 4, 16, 4, 0)
    return any(True for _ in mod.parameters()) or any(True for _ in mod.buffers())


def model_class(arch: Arch):
    import transformers

    return getattr(transformers, arch.model_cls)


def auto_class(arch: Arch):
    import transformers

    return getattr(transformers, arch.auto_cls)


def build(arch_name: str, kind: str | PolyAttnConfig | None = None, seed: int = 0):
    """A fresh tiny model (own config object), converted to ``kind`` unless None."""
    arch = ARCHS[arch_name]
    torch.manual_seed(seed)
    model = model_class(arch)(arch.make_config()).eval()
    if kind is not None:
        cfg = KIND_CONFIGS[kind] if isinstance(kind, str) else kind
        hf_polyattn.convert(model, cfg)
    return model


def perturb_polyattn(model, seed: int = 1) -> None:
    """Move every polyattn tensor off its seed value, so reload tests can fail."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if ".polyattn." in name and t.is_floating_point():
                t.add_(0.05 * torch.randn(t.shape, generator=gen).to(t.dtype))


def generating(model):
    """``model`` set up for greedy generate() of a fixed number of tokens: no eos, pad id 0."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt_ids(batch: int = 1, length: int = 10, seed: int = 0) -> torch.Tensor:
    """Seeded token ids in [3, VOCAB) (0..2 are the tiny models' pad / bos / eos)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


def assert_left_padded_generation_equals_rows(model, pad: int = 4, length: int = 12) -> None:
    """A batch of a prompt of ``length`` tokens and one ``pad`` tokens shorter, left-padded, generates (tokens and
    logits) what each prompt generates alone."""
    check_left_padded_generation(model, [prompt_ids(1, length, seed=1)[0], prompt_ids(1, length - pad, seed=2)[0]],
                                 length)


def check_left_padded_generation(model, prompts: list[torch.Tensor], width: int) -> None:
    """Greedy ``generate`` of ``prompts`` left-padded to ``width`` in one batch gives each row the tokens and logits
    of the prompt generated alone."""
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):], mask[row, width - len(prompt):] = prompt, 1
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=mask, **kw)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], **kw)
        assert torch.equal(batch.sequences[row, width:], alone.sequences[0, len(prompt):])
        for a, b in zip(batch.logits, alone.logits):
            torch.testing.assert_close(a[row], b[0], rtol=1e-4, atol=1e-4)


def check_greedy_steps(model, ids: torch.Tensor, steps: int = 8) -> None:
    """Greedy ``generate`` with the recurrent cache (picked automatically) gives at every step the logits of the
    uncached forward on the sequence so far, and its argmax."""
    from hf_polyattn import PolyAttnCache

    out = model.generate(ids, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert isinstance(returned_cache(out), PolyAttnCache)
    seq = out.sequences
    assert seq.shape[1] == ids.shape[1] + steps
    for step, logits in enumerate(out.logits):
        upto = ids.shape[1] + step
        with torch.no_grad():
            full = model(seq[:, :upto], use_cache=False).logits[:, -1]
        torch.testing.assert_close(logits, full, rtol=1e-4, atol=1e-4, msg=f"step {step}")
        assert torch.equal(full.argmax(-1), seq[:, upto])
