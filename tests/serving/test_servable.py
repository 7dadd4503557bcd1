"""What the vLLM plugin serves, read from a folder's config (hf_polyattn/serving/vllm/servable.py): each family's
specifics it does not implement refused by name at load, never served silently different.

servable.py imports no vLLM, so these run in the package's own venv too (and in vLLM's, with its transformers); the
engine-level tests (test_vllm.py) show that the plugin's models call ``check_servable`` when vLLM builds them.
"""

import pytest
from transformers import Gemma3TextConfig, Qwen2Config, Qwen3Config

from hf_polyattn import PolyAttnConfig
from hf_polyattn.serving import served_architecture
from hf_polyattn.serving.vllm import ARCHITECTURES
from hf_polyattn.serving.vllm.servable import (
    MODEL_TYPES,
    STATE_LAYER_TYPE,
    check_servable,
    converted_layer,
    rope_parameters,
)

SIZES = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
GEMMA_LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LAYER = PolyAttnConfig(kind="linear", feature_map="elu", window=16, sinks=4, decay="gate", softmax_heads=((1, 1),))


def _with(config, cfg: PolyAttnConfig = LAYER):
    config.polyattn = cfg.to_dict()
    return config


def gemma3(cfg: PolyAttnConfig = LAYER, **kwargs):
    return _with(Gemma3TextConfig(**SIZES, sliding_window=10, layer_types=GEMMA_LAYERS, **kwargs), cfg)


def test_every_registered_architecture_has_its_families_and_is_the_name_folders_are_saved_with():
    assert set(ARCHITECTURES) == set(MODEL_TYPES)
    for cls in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert served_architecture(cls) in ARCHITECTURES


def test_the_served_families_pass():
    assert check_servable(_with(Qwen2Config(**SIZES)), "PolyAttnQwen2ForCausalLM").window == 16
    assert check_servable(_with(Qwen3Config(**SIZES)), "PolyAttnQwen3ForCausalLM").window == 16
    config = gemma3()
    assert check_servable(config, "PolyAttnGemma3ForCausalLM").window == 16
    # the sliding-window layers stay vLLM's own attention, as transformers keeps them exact
    assert [converted_layer(config, i) for i in range(4)] == [False, True, False, True]


def test_layers_the_config_hook_renamed_read_as_full_attention():
    # config_hook.py names all-full-attention layer_types STATE_LAYER_TYPE in vLLM's copy of the config (so that
    # vLLM plans the state): a Gemma 3 without sliding layers still reads its global RoPE
    config = gemma3(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    config.layer_types = [STATE_LAYER_TYPE] * 4
    assert check_servable(config, "PolyAttnGemma3ForCausalLM").window == 16
    assert [converted_layer(config, i) for i in range(4)] == [True] * 4
    assert rope_parameters(config, 0)["rope_theta"] == 1e6


@pytest.mark.parametrize(("build", "architecture", "named"), [
    # Gemma 2-style logit soft-capping on a Gemma 3 config: vLLM's Gemma 3 passes no cap to its attention
    (lambda: gemma3(attn_logit_softcapping=50.0), "PolyAttnGemma3ForCausalLM", "attn_logit_softcapping=50.0"),
    # the kind in Gemma 3's sliding-window layers
    (lambda: gemma3(LAYER.replace(sliding_layers="kind")), "PolyAttnGemma3ForCausalLM", "sliding_layers='kind'"),
    # EmbeddingGemma-style bidirectional attention
    (lambda: gemma3(use_bidirectional_attention=True), "PolyAttnGemma3ForCausalLM", "bidirectional attention"),
    # sinks re-rotated with a global RoPE whose rotation is not inv_freq alone (Gemma 3 4B+: linear, factor 8)
    (lambda: gemma3(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "PolyAttnGemma3ForCausalLM", "RoPE type 'linear' (layer 1)"),
    # every kv head of the converted (global) layers softmax: nothing converted to serve
    (lambda: gemma3(LAYER.replace(softmax_heads=((1, 0), (1, 1), (3, 0), (3, 1)))), "PolyAttnGemma3ForCausalLM",
     "every kv head of the converted layers is softmax"),
    # Qwen2 with sliding-window layers above max_window_layers
    (lambda: _with(Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=8, max_window_layers=2)),
     "PolyAttnQwen2ForCausalLM", "sliding-window layers (layer_types)"),
    # BAGEL's q/k norm on a Qwen2 config: vLLM's Qwen2 would apply it, transformers' does not
    (lambda: _with(Qwen2Config(**SIZES, qk_norm=True)), "PolyAttnQwen2ForCausalLM", "qk_norm=True"),
    # a family served under another family's architecture
    (lambda: _with(Qwen3Config(**SIZES)), "PolyAttnQwen2ForCausalLM", "the folder's is 'qwen3'"),
    # a sparse cache on a layer that keeps a short convolution: it does not decode on the ring the plugin packs
    (lambda: _with(Qwen3Config(**SIZES), LAYER.replace(sparse_cache=32, short_conv=4)), "PolyAttnQwen3ForCausalLM",
     "sparse_cache=32 is served on the decoding ring only"),
])
def test_what_the_plugin_does_not_implement_is_refused_by_name(build, architecture, named):
    with pytest.raises(ValueError, match="cannot serve this folder") as err:
        check_servable(build(), architecture)
    assert named in str(err.value)


def test_the_linear_only_layout_with_its_sparse_cache_is_served():
    # the linear-only preset's settings (no softmax head, the sparse cache ranked by attention and chosen again by
    # the prompt's last queries, sinks at their own positions, three quarters of it kept by |v|): no longer refused
    # (test_vllm.py serves it)
    cfg = LAYER.replace(softmax_heads=None, feature_map="hedgehog", sink_position="own", sparse_cache=64,
                        sparse_chunk=16, sparse_score="attention", sparse_observe=8, sparse_value_keys=48)
    for build, architecture in ((lambda: _with(Qwen2Config(**SIZES), cfg), "PolyAttnQwen2ForCausalLM"),
                                (lambda: gemma3(cfg), "PolyAttnGemma3ForCausalLM")):
        served = check_servable(build(), architecture)
        assert (served.sparse_cache, served.sparse_value_keys) == (64, 48)
