"""What changes between the releases before 5.24 (the pinned minimum 5.19 to 5.23) and 5.24, 5.25: the cache's name.
5.24 renamed ``past_key_values`` to ``cache`` in generate(), the models' forward and their outputs, warning
FutureWarning on the old name (removed in 5.40). generate() with the recurrent cache, and a forward with the cache
passed through ``hf_polyattn.cache_kwargs``, warn nothing on any of them; ``returned_cache`` reads it back."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import transformers
from integration_helpers import build, prompt_ids

from hf_polyattn import PolyAttnCache, PolyAttnCacheLayer, PolyAttnConfig, cache_kwargs, returned_cache
from hf_polyattn.integration.compatibility import CACHE_ARGUMENT

RECIPE = PolyAttnConfig(kind="linear", window=4, sinks=2, decay="gate")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_and_cached_forward_warn_nothing(arch):
    """warnings.simplefilter('error') around generate() (a left-padded batch, the PolyAttnCache picked by the
    plugin, then one handed in) and a chunked forward through the returned cache: no warning of any category, and
    no deprecation logged by transformers."""
    model = build(arch, RECIPE)
    model.generation_config.pad_token_id = 0
    ids = prompt_ids(2, 10, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    records = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(records)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                 return_dict_in_generate=True)
            cache = returned_cache(out)
            assert isinstance(cache, PolyAttnCache)
            again = model.generate(ids[:1], max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                                   **cache_kwargs(PolyAttnCache(model.config)))
            with torch.no_grad():
                first = model(ids[:1, :6], use_cache=True)
                second = model(ids[:1, 6:], **cache_kwargs(returned_cache(first)), use_cache=True)
    finally:
        logger.removeHandler(records)
    assert isinstance(returned_cache(again), PolyAttnCache)
    # a forward makes transformers' DynamicCache, whose layers are the plugin's recurrent ones
    assert all(isinstance(layer, PolyAttnCacheLayer) for layer in returned_cache(second).layers)
    assert not [m for m in records.messages if "deprecat" in m.lower()], records.messages


def test_the_cache_name_is_the_installed_transformers_one():
    """'cache' where generate() takes it (5.24 on), 'past_key_values' before; the helpers follow it."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    assert CACHE_ARGUMENT == ("cache" if "cache" in params else "past_key_values")
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert CACHE_ARGUMENT == ("cache" if (major, minor) >= (5, 24) else "past_key_values")
    assert cache_kwargs(None) == {CACHE_ARGUMENT: None}
