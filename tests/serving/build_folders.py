"""Build tiny converted folders and transformers' greedy tokens for them (run by tests/serving/test_vllm.py).

Runs in the package's own venv (the transformers it supports); vLLM's venv pins an older transformers. Usage:
``python tests/serving/build_folders.py OUT`` writes OUT/<case>/ (a saved folder) and OUT/reference.json
(case -> prompt name -> greedy token ids from ``generate()``)."""

import json
import sys
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_polyattn
from hf_polyattn import PolyAttnConfig

WINDOW, SINKS = 16, 4
# prompts shorter than, equal to and longer than window + sinks, and long enough to be chunked by a budget of
# 32 tokens a step (test_vllm.py); token ids from a fixed generator
PROMPT_LENGTHS = {"short": 5, "window": WINDOW - 1, "window+sinks": WINDOW + SINKS, "past": WINDOW + SINKS + 1,
                  "long": 90}
NEW_TOKENS = 12

LAYER = dict(kind="linear", feature_map="elu", window=WINDOW, sinks=SINKS, decay="gate", window_mix=True,
             window_mix_init=0.01, block_size=16, qk_norm=True, feature_proj=64, decay_horizon=64.0)
CASES = {
    # the long-context preset's layout: some kv heads softmax (a layer with none, one with both)
    "hybrid": PolyAttnConfig(**LAYER, softmax_heads=((0, 0), (1, 1), (3, 0), (3, 1))),
    # the linear-only layout: no softmax head, the sinks at their own positions, Hedgehog features
    "linear_only": PolyAttnConfig(**{**LAYER, "feature_map": "hedgehog", "sink_position": "own"}),
    # no learned parameter at all (exact softmax over the window and the sinks): the folder vLLM served as the base
    # model before it named its own architecture
    "sliding": PolyAttnConfig(kind="sliding_window", window=WINDOW, sinks=SINKS),
    # what the plugin refuses at load: a sparse cache on a layer that does not decode on a ring (a short convolution)
    "sparse": PolyAttnConfig(**LAYER, sparse_cache=32, short_conv=4),
    # the bounded sparse cache (16 keys chosen in blocks of 8, LoLA's recall error), no softmax head: 16 + 4 + 16
    # keys exact, so the 90-token prompt folds and re-chooses keys in its prefill and while decoding; chosen by the
    # streaming rule alone, so chunked prefill (test_vllm.py's 32 tokens a step) equals one call
    "sparse_stream": PolyAttnConfig(**LAYER, sparse_cache=16, sparse_chunk=8),
    # the linear-only preset's layout (hf_polyattn/presets.py 'linear-only') at the test's sizes: Hedgehog, decay,
    # sinks at their own positions, the cache ranked by attention and chosen again by a prompt's last 4 queries
    "linear_only_sparse": PolyAttnConfig(**{**LAYER, "feature_map": "hedgehog", "sink_position": "own"},
                                         sparse_cache=16, sparse_chunk=8, sparse_score="attention",
                                         sparse_observe=4),
    # the same with half the cache kept for the keys of largest |v| (sparse_value_keys, pooled over 3 neighbours)
    "linear_only_sparse_value": PolyAttnConfig(**{**LAYER, "feature_map": "hedgehog", "sink_position": "own"},
                                               sparse_cache=16, sparse_chunk=8, sparse_score="attention",
                                               sparse_observe=4, sparse_value_keys=8, sparse_value_pool=3),
    # the other families, each a hybrid layout (a layer with softmax heads, one without)
    "qwen2": PolyAttnConfig(**LAYER, softmax_heads=((0, 1), (2, 0))),
    "qwen3": PolyAttnConfig(**LAYER, softmax_heads=((1, 0), (2, 1))),
    # Gemma 3: layers 0 and 2 sliding-window (kept exact), 1 and 3 global (converted)
    "gemma3": PolyAttnConfig(**LAYER, softmax_heads=((1, 1),)),
}

# head_dim 64 everywhere: vLLM's CPU attention refuses 32
_SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
# case -> (the transformers class, its config): each family's own specifics set away from what another family
# does, so that serving one as another shows
FAMILIES = {
    # q/k/v bias (random, non-zero), o_proj without; weights wider than the default init (0.02), whose greedy
    # tokens repeated one token on most prompts
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**_SIZES, initializer_range=0.06,
                                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # q_norm / k_norm per head before RoPE; head_dim from the config, not hidden_size / heads (192 / 4 = 48)
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**{**_SIZES, "hidden_size": 192})),
    # query_pre_attn_scalar 48 (not head_dim), Gemma norms, the final logit soft-cap, local RoPE theta 10k and
    # global 1M, a sliding window (10) shorter than the longer prompts
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        **_SIZES, query_pre_attn_scalar=48, final_logit_softcapping=30.0, sliding_window=10,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"])),
}


# the demo's attention on the real SmolLM2-135M (its 22 softmax kv heads scattered over 30 layers, window 128, 4
# sinks, gated decay), untrained: the plugin's layout at full size; greedy tokens after 300 tokens of real text
DEMO_RECORD = Path(__file__).resolve().parents[2] / "recipes/results/long_context/" \
    "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k.json"
DEMO_PROMPT_TOKENS = 300


def build_demo(out: Path) -> dict:
    from hf_polyattn.checkpoints import load_tokenizer, resolve_checkpoint

    path = resolve_checkpoint("smollm2")
    cfg = PolyAttnConfig.from_dict(json.loads(DEMO_RECORD.read_text())["polyattn"])
    model = hf_polyattn.convert(LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), cfg)
    model.save_pretrained(out / "smollm2_demo")
    text = (Path(hf_polyattn.__file__).parent / "bundled" / "tinyshakespeare.txt").read_text()[:4000]
    ids = load_tokenizer(path)(text)["input_ids"][:DEMO_PROMPT_TOKENS]
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    chosen = gen.sequences[0, len(ids):]
    return {"prompt": ids, "tokens": chosen.tolist(),
            "logprobs": [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(gen.scores, chosen)]}


def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(1)
    return {name: torch.randint(3, 250, (n,), generator=gen).tolist() for name, n in PROMPT_LENGTHS.items()}


def build(out: Path) -> dict:
    reference = {}
    for name, cfg in CASES.items():
        torch.manual_seed(0)
        cls, make_config = FAMILIES.get(name, (LlamaForCausalLM, lambda: LlamaConfig(**_SIZES)))
        model = hf_polyattn.convert(cls(make_config()).eval(), cfg)
        # every norm's weights (q/k norms included) away from their init (Gemma's 1 + w: w = 0), so that a norm
        # skipped or misread shows
        if name in ("qwen3", "gemma3"):
            with torch.no_grad():
                for pname, p in model.named_parameters():
                    if "norm" in pname:
                        p.add_(0.2 * torch.randn_like(p))
        with torch.no_grad():  # the kernel parameters away from their initial values: a weight not loaded shows
            for pname, p in model.named_parameters():  # (none in 'sliding')
                if "polyattn" in pname:
                    p.add_(0.05 * torch.randn_like(p))
        model.save_pretrained(out / name)
        if name == "sparse":
            continue
        reloaded = cls.from_pretrained(out / name).eval()
        tokens, logprobs = {}, {}
        for pname, ids in prompts().items():
            with torch.no_grad():
                # eos never stops it: vLLM is run with ignore_eos
                gen = reloaded.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                        eos_token_id=None, pad_token_id=0, output_scores=True,
                                        return_dict_in_generate=True)
            chosen = gen.sequences[0, len(ids):]
            tokens[pname] = chosen.tolist()
            # the log-probability of each chosen token: compared with vLLM's (a near tie between two tokens would
            # let both engines pick either; the log-probabilities show a wrong state even where tokens agree)
            logprobs[pname] = [torch.log_softmax(s[0].double(), -1)[t].item() for s, t in zip(gen.scores, chosen)]
        reference[name] = {"tokens": tokens, "logprobs": logprobs}
    (out / "reference.json").write_text(json.dumps({"prompts": prompts(), "cases": reference,
                                                    "smollm2_demo": build_demo(out)}))
    return reference


if __name__ == "__main__":
    build(Path(sys.argv[1]))
