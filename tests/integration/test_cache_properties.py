"""Seeded property sweep: cache = no cache, recurrent = full, batch rows independent.

Each case draws a kind with options, an architecture, a head shape (head_dim 8, 16 or 32, with and
without grouped key/value heads), a batch size, a block size, a prompt length (one token, shorter
than a block, across a block boundary, several blocks), the chunks the continuation is fed in and
the model's seed from one seed, then checks three properties of the converted model:

* greedy ``generate`` with the recurrent cache returns the tokens of ``use_cache=False``;
* teacher-forced decoding (prefill the prompt, then chunks of 1-3 tokens through the cache)
  gives the logits of one full forward (recurrent = full);
* a row's logits do not depend on the other rows of its batch, also when the others are left-padded
  to other lengths (forward and greedy ``generate``).

Regression (issue 12, item 1): the default polynomial kind (degree 4, head_dim 16: 3,876 tensor
features) decoded through float32 tensor features while the uncached forward was quadratic; logits
differed by up to 0.28 and greedy tokens changed. The sweep draws that configuration in several
architectures and seeds, and its tolerance is tight enough to see it: with the float32 tensor path
put back, three cases of this sweep fail (the correct paths agree to 6e-7 of the logits' scale, that
one differed by 9e-6 to 8e-3 here, 0.28 in the issue), and so does :func:`test_issue_reproduction`,
the issue's own example.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from integration_helpers import ARCHS, VOCAB

import hf_polyattn
from hf_polyattn import PolyAttnConfig, cache_kwargs, returned_cache

OPTIONS = [
    dict(kind="polynomial"),  # the issue's default: degree 4 through the exact tensor path with a cache
    dict(kind="polynomial"),  # drawn twice as often: its float32 failure depends on the model's seed
    dict(kind="polynomial", degree=2, alpha=0.5, beta=2.0, qk_norm=True),
    dict(kind="polynomial", poly_coefficients=(1.0, -0.5, 0.25)),
    dict(kind="polynomial", poly_coefficients=(0.5, 1.0), learn_coefficients=True, exact_path="tensor"),
    dict(kind="polynomial", exact_path="quadratic", denominator_offset=1.0),
    dict(kind="polynomial", degree=2, feature_proj=40),
    dict(kind="polysketch", sketch="gaussian", sketch_size=8),
    dict(kind="polysketch", sketch="srht", sketch_size=8, degree=2, denominator_offset=0.5),
    dict(kind="polysketch", sketch="learned", sketch_size=8, local_exact=True),
    dict(kind="polysketch", sketch_size=8, local_exact=True, local_kernel="softmax", qk_norm=True),
    dict(kind="polysketch", sketch_size=8, causal_algorithm="cumsum"),
    dict(kind="polysketch", sketch="learned", sketch_size=8, feature_proj=40, qk_norm=True),
    dict(kind="linear", feature_map="elu"),
    dict(kind="linear", feature_map="relu", causal_algorithm="cumsum"),
    dict(kind="linear", feature_map="taylor", local_exact=True),
    dict(kind="performer", num_features=16),
    dict(kind="performer", num_features=16, local_exact=True),
    dict(kind="polysketch", sketch="learned", sketch_size=8, window=5),
    dict(kind="polysketch", sketch_size=8, window=3, local_kernel="polynomial", feature_proj=40, window_mix=True),
    dict(kind="linear", window=3, window_mix=True),
    dict(kind="performer", num_features=16, window=4, local_kernel="polynomial"),
]
ARCH_NAMES = ["llama", "gpt2", "qwen2", "gpt_neox"]
# (heads, key/value heads): hidden 64, so head_dim 16, 32, 8; kv heads only where the model has them
SHAPES = [(4, 2), (2, 1), (8, 2), (4, 4)]
N_CASES = 2 * len(OPTIONS)  # every option twice, each time with other draws
# recurrent/full and row/batch differences of every correct path stay below 6e-7 of the logits'
# scale on this sweep (5e-6 next to padded rows: 4 x ATOL there); the float32 tensor path of the
# regression differed by 9e-6 to 8e-3
ATOL = 4e-6
# Known float32 precision gap, not a cache defect: polysketch with causal_algorithm='cumsum' forms
# the squared-sketch features for every key, whose mixed-sign products cancel like the old tensor
# path's (1e-3 against a float64 reference where the block algorithm, which squares the diagonal
# blocks' scores directly, stays near 1e-5); a token's output then moves by ~2e-5 of the logits
# with the sequence length, by ~3e-3 with left padding. The cached prefill equals the uncached
# forward exactly and greedy tokens agree.
ATOL_POLYSKETCH_CUMSUM = 2e-3


def _atol(opts: dict) -> float:
    if opts["kind"] == "polysketch" and opts.get("causal_algorithm") == "cumsum":
        return ATOL_POLYSKETCH_CUMSUM
    return ATOL


def _cases():
    rng = random.Random(20261122)
    cases = []
    for i in range(N_CASES):
        opts = OPTIONS[i % len(OPTIONS)]
        block = rng.choice([4, 8])
        prompt = rng.choice([1, block - 1, block + 3, 2 * block + 1])
        arch, shape = rng.choice(ARCH_NAMES), rng.choice(SHAPES)
        batch, seed = rng.choice([1, 2, 3]), rng.randrange(1000)
        chunks = rng.choice([(1,), (1, 3), (2, 1, 3)])
        name = "-".join(f"{k}={v}" for k, v in opts.items())
        cases.append(pytest.param(opts, arch, shape, batch, block, prompt, chunks, seed,
                                  id=f"{i}-{name}-{arch}-h{shape[0]}kv{shape[1]}-B{batch}-b{block}-p{prompt}"))
    return cases


def build_shaped(arch_name: str, shape: tuple[int, int], cfg: PolyAttnConfig, seed: int):
    """A tiny model of ``arch_name`` (hidden 64) with ``shape`` = (heads, kv heads), converted to ``cfg``."""
    heads, kv = shape
    config = ARCHS[arch_name].make_config()
    config.num_attention_heads = heads
    if getattr(config, "num_key_value_heads", None) is not None:
        config.num_key_value_heads = kv
    if getattr(config, "head_dim", None) is not None:
        config.head_dim = config.hidden_size // heads
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHS[arch_name].model_cls)(config).eval()
    hf_polyattn.convert(model, cfg)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def recurrent_logits(model, ids: torch.Tensor, prompt: int, chunks: tuple[int, ...]) -> torch.Tensor:
    """Logits of ``ids``: the prompt prefilled, then the rest through the cache in chunks cycling over ``chunks``."""
    with torch.no_grad():
        out = model(ids[:, :prompt], use_cache=True)
        steps, past, t, i = [out.logits], returned_cache(out), prompt, 0
        while t < ids.shape[1]:
            n = chunks[i % len(chunks)]
            out = model(ids[:, t : t + n], **cache_kwargs(past), use_cache=True)
            steps.append(out.logits)
            past, t, i = returned_cache(out), t + n, i + 1
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("opts,arch,shape,batch,block,prompt,chunks,seed", _cases())
def test_cache_properties(opts, arch, shape, batch, block, prompt, chunks, seed):
    model = build_shaped(arch, shape, PolyAttnConfig(block_size=block, **opts), seed)
    gen = torch.Generator().manual_seed(seed)
    new = 2 * block + 1  # decoding crosses at least two block boundaries
    ids = torch.randint(3, VOCAB, (batch, prompt + new), generator=gen)

    # cache = no cache (tokens)
    cached = model.generate(ids[:, :prompt], max_new_tokens=new, do_sample=False)
    uncached = model.generate(ids[:, :prompt], max_new_tokens=new, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)

    # recurrent = full (logits, teacher forced)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    atol = _atol(opts) * max(full.abs().max().item(), 1.0)
    torch.testing.assert_close(recurrent_logits(model, ids, prompt, chunks), full, rtol=0, atol=atol)
    # the cached prefill of the whole sequence (one chunk) equals the uncached forward too
    with torch.no_grad():
        torch.testing.assert_close(model(ids, use_cache=True).logits, full, rtol=0, atol=atol)

    # batch rows independent: each row alone gives its logits in the batch
    with torch.no_grad():
        for row in range(batch):
            alone = model(ids[row : row + 1], use_cache=False).logits
            torch.testing.assert_close(alone, full[row : row + 1], rtol=0, atol=atol)

    # ... also next to left-padded rows of other lengths, in a forward and in generate (not with
    # local_exact: its blocks move with the padding, a documented limit that warns)
    if not opts.get("local_exact"):
        lengths = [ids.shape[1], max(1, ids.shape[1] - 2), max(1, ids.shape[1] - 5)]
        mask = torch.zeros(3, ids.shape[1], dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, ids.shape[1] - n :] = 1
        padded = torch.randint(3, VOCAB, mask.shape, generator=gen) * mask  # pad id 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            batched = model(padded, attention_mask=mask, position_ids=positions).logits
        generated = model.generate(padded, attention_mask=mask, max_new_tokens=new, do_sample=False)
        for row, n in enumerate(lengths):
            alone_ids = padded[row : row + 1, ids.shape[1] - n :]
            with torch.no_grad():
                alone = model(alone_ids).logits
            torch.testing.assert_close(batched[row : row + 1, ids.shape[1] - n :], alone, rtol=0,
                                       atol=4 * _atol(opts) * max(alone.abs().max().item(), 1.0))
            alone_generated = model.generate(alone_ids, max_new_tokens=new, do_sample=False)
            assert torch.equal(generated[row, ids.shape[1] :], alone_generated[0, n:]), row


def test_issue_reproduction():
    """Issue 12, item 1, as filed: a tiny Llama with the default polynomial kind; cache and no cache differed
    by 0.28 in logits and greedy generate() returned other tokens (its model was not seeded: here several seeds,
    of which the float32 tensor path fails most)."""
    for seed in range(4):
        torch.manual_seed(seed)
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=500)).eval()
        hf_polyattn.convert(m, hf_polyattn.PolyAttnConfig(kind="polynomial"))
        ids = torch.randint(1, 500, (2, 10), generator=torch.Generator().manual_seed(5))[1:]
        with torch.no_grad():
            diff = (m(ids, use_cache=True).logits - m(ids, use_cache=False).logits).abs().max().item()
        assert diff < 1e-5, (seed, diff)
        m.generation_config.eos_token_id = None
        cached = m.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
        uncached = m.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0, use_cache=False)
        assert torch.equal(cached, uncached), seed
