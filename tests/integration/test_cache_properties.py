"""Seeded property sweep: cache = no cache, recurrent = full, batch rows independent.

Each case draws a kind with options, an architecture, a batch size, a block size and a prompt
length (shorter than a block, across a block boundary, several blocks) from one seed, then
checks three properties of the converted model:

* greedy ``generate`` with the recurrent cache returns the tokens of ``use_cache=False``;
* teacher-forced decoding (prefill the prompt, then one token at a time through the cache)
  gives the logits of one full forward (recurrent = full);
* a row's logits do not depend on the other rows of its batch.

Regression: the default polynomial kind (degree 4, d=16: 3,876 tensor features) decoded
through float32 tensor features while the uncached forward was quadratic; logits differed by
0.28 and greedy tokens changed. The sweep draws that configuration on purpose.
"""

from __future__ import annotations

import random

import pytest
import torch
from integration_helpers import VOCAB, build

from hf_polyattn import PolyAttnConfig

OPTIONS = [
    dict(kind="polynomial"),  # the default: degree 4 through the exact tensor path with a cache
    dict(kind="polynomial", degree=2, alpha=0.5, beta=2.0, qk_norm=True),
    dict(kind="polynomial", poly_coefficients=(1.0, -0.5, 0.25)),
    dict(kind="polynomial", exact_path="quadratic", denominator_offset=1.0),
    dict(kind="polysketch", sketch="gaussian", sketch_size=8),
    dict(kind="polysketch", sketch="srht", sketch_size=8, degree=2),
    dict(kind="polysketch", sketch="learned", sketch_size=8, local_exact=True),
    dict(kind="polysketch", sketch_size=8, local_exact=True, local_kernel="softmax", qk_norm=True),
    dict(kind="linear", feature_map="elu"),
    dict(kind="linear", feature_map="taylor", local_exact=True),
    dict(kind="performer", num_features=16),
    dict(kind="performer", num_features=16, local_exact=True),
    dict(kind="polysketch", sketch="learned", sketch_size=8, window=5),
    dict(kind="linear", window=3, window_mix=True),
    dict(kind="performer", num_features=16, window=4, local_kernel="polynomial"),
]
ARCHS = ["llama", "gpt2", "qwen2", "gpt_neox"]
N_CASES = 30


def _cases():
    rng = random.Random(20261122)
    cases = []
    for i in range(N_CASES):
        opts = OPTIONS[i % len(OPTIONS)]  # every option twice
        block = rng.choice([4, 8])
        prompt = rng.choice([1, block - 1, block + 3, 2 * block + 1])
        cases.append(pytest.param(opts, rng.choice(ARCHS), rng.choice([1, 2, 3]), block, prompt,
                                  id=f"{i}-{'-'.join(str(v) for v in opts.values())}-b{block}-p{prompt}"))
    return cases


@pytest.mark.parametrize("opts,arch,batch,block,prompt", _cases())
def test_cache_properties(opts, arch, batch, block, prompt):
    cfg = PolyAttnConfig(block_size=block, **opts)
    model = build(arch, cfg, seed=len(opts) + block)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(block * 100 + prompt)
    new = 2 * block + 1  # decoding crosses at least two block boundaries
    ids = torch.randint(3, VOCAB, (batch, prompt + new), generator=gen)

    # cache = no cache (tokens)
    cached = model.generate(ids[:, :prompt], max_new_tokens=new, do_sample=False)
    uncached = model.generate(ids[:, :prompt], max_new_tokens=new, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)

    # recurrent = full (logits, teacher forced)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :prompt], use_cache=True)
        steps, past = [out.logits], out.past_key_values
        for t in range(prompt, ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            steps.append(out.logits)
            past = out.past_key_values
    recurrent = torch.cat(steps, dim=1)
    scale = full.abs().max().item()
    torch.testing.assert_close(recurrent, full, rtol=0, atol=2e-5 * max(scale, 1.0))

    # batch rows independent: each row alone gives its logits in the batch
    with torch.no_grad():
        for row in range(batch):
            alone = model(ids[row : row + 1], use_cache=False).logits
            torch.testing.assert_close(alone, full[row : row + 1], rtol=0, atol=2e-5 * max(scale, 1.0))
