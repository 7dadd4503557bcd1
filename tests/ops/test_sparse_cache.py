"""``sparse_cache`` (LoLA's bounded sparse cache, ops/sparse.py): the whole-sequence forward against the naive
definition (ops/reference.py), chunked prefill, the generic recurrent step and the decoding ring against the forward,
left padding, causality, half precision, gradients, constant state bytes, what is refused, and a synthetic
associative recall that the kernel state loses and the cache recovers."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn import PolyAttnConfig
from hf_polyattn.ops import HybridState, RecurrentState, build_attention, reference_attention
from hf_polyattn.ops.decode import WindowRing
from hf_polyattn.ops.hybrid import HybridAttention, hybrid_reference
from hf_polyattn.ops.sparse import ATTENTION_CARRY, attention_score, recall_error, select_and_fold, value_rank

from .test_decode_ring import D, _fused
from .test_decode_ring import _inputs as ring_inputs
from .test_decode_ring import _module as ring_module

N = 48  # tokens: the window (5-6), the blocks (3-5) and the cache (2-4) many times over

CONFIGS = {
    "linear-elu": dict(kind="linear", window=6, sparse_cache=3, sparse_chunk=4),
    "linear-sinks-gate-mix": dict(kind="linear", window=5, sinks=2, decay="gate", decay_horizon=8.0, window_mix=True,
                                  sparse_cache=3, sparse_chunk=4),
    "sinks-beyond-a-block": dict(kind="linear", window=3, sinks=6, decay="gate", decay_horizon=8.0, sparse_cache=3,
                                 sparse_chunk=4),
    "polysketch-maps-gate": dict(kind="polysketch", sketch_size=4, window=6, sinks=2, feature_proj=D, qk_norm=True,
                                 decay="gate", sparse_cache=2, sparse_chunk=3),
    "polynomial-window": dict(kind="polysketch", sketch_size=4, window=5, local_kernel="polynomial", sparse_cache=2,
                              sparse_chunk=4),
    "performer": dict(kind="performer", num_features=16, window=6, sinks=2, sparse_cache=4, sparse_chunk=5),
    "hedgehog-scalar": dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, decay="scalar",
                            decay_horizon=8.0, sparse_cache=2, sparse_chunk=3),
    "conv-learned-sinks": dict(kind="linear", window=6, learned_sinks=2, short_conv=3, decay="scalar",
                               sparse_cache=3, sparse_chunk=4),
    "softmax-heads": dict(kind="linear", window=6, sinks=2, decay="gate", sparse_cache=3, sparse_chunk=4,
                          softmax_heads=[(0, 1)]),
    # the linear-only preset's layer (Hedgehog features, projection, q/k LayerNorm, a bounded gate, the mix)
    "hedgehog-preset": dict(kind="linear", feature_map="hedgehog", window=5, sinks=2, decay="gate",
                            decay_max_horizon=3.0, window_mix=True, feature_proj=D, qk_norm=True, sparse_cache=3,
                            sparse_chunk=4),
    # the same layer ranking the candidates by the recall error over |v| (sparse_score='relative')
    "hedgehog-preset-relative": dict(kind="linear", feature_map="hedgehog", window=5, sinks=2, decay="gate",
                                     decay_max_horizon=3.0, window_mix=True, feature_proj=D, qk_norm=True,
                                     sparse_cache=3, sparse_chunk=4, sparse_score="relative"),
    # ranking the candidates by the attention the last sparse_chunk queries give them (sparse_score='attention')
    "hedgehog-preset-attention": dict(kind="linear", feature_map="hedgehog", window=5, sinks=2, decay="gate",
                                      decay_max_horizon=3.0, window_mix=True, feature_proj=D, qk_norm=True,
                                      sparse_cache=3, sparse_chunk=4, sparse_score="attention"),
    "elu-attention-chunk-beyond-window": dict(kind="linear", window=3, sinks=1, sparse_cache=2, sparse_chunk=5,
                                              sparse_score="attention"),
    # part of the cache kept for the keys of largest |v| (sparse_value_keys), beside each ranking
    "hedgehog-preset-attention-value": dict(kind="linear", feature_map="hedgehog", window=5, sinks=2, decay="gate",
                                            decay_max_horizon=3.0, window_mix=True, feature_proj=D, qk_norm=True,
                                            sparse_cache=3, sparse_chunk=4, sparse_score="attention",
                                            sparse_value_keys=2),
    "linear-sinks-gate-mix-value": dict(kind="linear", window=5, sinks=2, decay="gate", decay_horizon=8.0,
                                        window_mix=True, sparse_cache=3, sparse_chunk=4, sparse_value_keys=1),
}
RING = [n for n in CONFIGS if n != "conv-learned-sinks"]  # the ring serves neither convolutions nor learned slots


def _module(opts: dict, heads: int = 4, kv_heads: int = 2, dtype=torch.float64):
    torch.manual_seed(0)  # the perturbed tensors of test_decode_ring's module, the same in every run
    return ring_module(opts, heads, kv_heads, dtype)


def _inputs(b=2, heads=4, kv_heads=2, n=N, dtype=torch.float64, seed=0):
    return ring_inputs(b, heads, kv_heads, n, dtype, seed)


def _left_padded(pad=5, n=N):
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[0, :pad] = False
    return mask


def _kernel(state):
    return state.kernel if isinstance(state, HybridState) else state


def _steps(pa, q, k, v, mask=None, spans=None, grad=False):
    """Outputs and states of a prefill, single tokens, a chunk between them, single tokens again."""
    n = q.shape[2]
    spans = spans or [(0, 13), *((i, i + 1) for i in range(13, 27)), (27, 33), *((i, i + 1) for i in range(33, n))]
    state, outs, states = pa.init_state(), [], []
    with torch.set_grad_enabled(grad):
        for s, t in spans:
            o, state = pa(q[:, :, s:t], k[:, :, s:t], v[:, :, s:t], causal=True, state=state,
                          key_padding_mask=None if mask is None else mask[:, s:t])
            outs.append(o)
            states.append(_kernel(state))
    return torch.cat(outs, dim=2), states


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_equals_the_naive_definition(name):
    """float64, one row left-padded: the block loop computes the definition's weights (its cache chosen one row, head
    and block at a time from freshly summed states)."""
    pa = _module(CONFIGS[name])
    reference = hybrid_reference if isinstance(pa, HybridAttention) else reference_attention
    q, k, v = _inputs()
    mask = _left_padded()
    with torch.no_grad():
        for m in (None, mask):
            got = pa(q, k, v, causal=True, key_padding_mask=m)
            want = reference(pa, q, k, v, causal=True, key_padding_mask=m)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_the_cache_changes_the_output_and_holds_the_worst_recalled_keys():
    """Not a window in disguise: the cache's keys are exact in the forward (it differs from a budget-1 cache), and the
    keys it holds after a prefill are those with the largest recall errors of the last selection."""
    pa = _module(CONFIGS["linear-elu"])
    q, k, v = _inputs()
    with torch.no_grad():
        out = pa(q, k, v, causal=True)
        small = _module({**CONFIGS["linear-elu"], "sparse_cache": 1})
        assert (small(q, k, v, causal=True) - out).abs().max() > 1e-3
        _, state = pa(q[:, :, :30], k[:, :, :30], v[:, :, :30], causal=True, state=pa.init_state())
    assert state.sparse_mask.all() and state.sparse_k.shape == (2, 2, 3, D)
    # each cached key came from the sequence: exactly one key of the prefix per slot
    hits = (state.sparse_k[:, :, :, None, :] == k[:, :, None, :30, :]).all(-1).sum(-1)
    assert (hits == 1).all()


def test_selection_keeps_the_keys_the_state_recalls_worst():
    """A state holding two stored associations: a candidate equal to a stored pair is recalled well (small error), a
    new key with a new value is not; the budget keeps the new one and folds the known one into the state."""
    f = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)  # features of two stored keys
    vals = torch.tensor([[1.0, 2.0], [-3.0, 0.5]], dtype=torch.float64)
    kv = f.T @ torch.cat([vals, torch.ones(2, 1, dtype=torch.float64)], dim=1)  # (F, d + 1)
    cand_f = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    cand_v = torch.tensor([[1.0, 2.0], [5.0, 5.0], [9.0, 9.0]], dtype=torch.float64)
    vext = torch.cat([cand_v, torch.ones(3, 1, dtype=torch.float64)], dim=1)
    err = recall_error(kv, cand_f, vext)
    torch.testing.assert_close(err[0], torch.tensor(0.0, dtype=torch.float64))
    torch.testing.assert_close(err[1], torch.linalg.vector_norm(cand_v[1]))  # nothing recalled: 0
    valid = torch.tensor([True, True, False])  # the third is padding: never kept while a valid one waits
    new_kv, keep, keep_valid = select_and_fold(kv, cand_f, vext, valid, 1)
    assert keep.tolist() == [1] and keep_valid.tolist() == [True]
    torch.testing.assert_close(new_kv, kv + cand_f[:1].T @ vext[:1])  # the known pair joined the state
    _, keep, keep_valid = select_and_fold(kv, cand_f, vext, valid, 3)  # valid ones first, then the padding
    assert keep.tolist() == [0, 1, 2] and keep_valid.tolist() == [True, True, False]


def test_the_relative_score_keeps_a_small_value_the_recall_error_evicts():
    """sparse_score='relative': the error over |v|. Against an empty state (nothing recalled) the recall error is |v|,
    so the key with the smallest value leaves first; relative to |v| every candidate scores 1 there, and against a
    state a small value recalled as a large one scores high (the keys that draw attention but carry little value)."""
    f = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    # the state recalls (0.5, 0.5) for feature 0 and (2, -2) for feature 1
    kv = f.T @ torch.tensor([[0.5, 0.5, 1.0], [2.0, -2.0, 1.0]], dtype=torch.float64)
    cand_f = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    cand_v = torch.tensor([[0.1, 0.1], [3.0, -2.0]], dtype=torch.float64)  # errors 0.57 and 1.0, relative 4.0 and 0.28
    vext = torch.cat([cand_v, torch.ones(2, 1, dtype=torch.float64)], dim=1)
    absolute, relative = recall_error(kv, cand_f, vext), recall_error(kv, cand_f, vext, relative=True)
    torch.testing.assert_close(relative, absolute / torch.linalg.vector_norm(cand_v, dim=-1))
    assert absolute[0] < absolute[1] and relative[0] > relative[1]  # the two rules disagree on these two
    valid = torch.tensor([True, True])
    assert select_and_fold(kv, cand_f, vext, valid, 1)[1].tolist() == [1]
    assert select_and_fold(kv, cand_f, vext, valid, 1, relative=True)[1].tolist() == [0]
    empty = torch.zeros_like(kv)
    torch.testing.assert_close(recall_error(empty, cand_f, vext, relative=True), torch.ones(2, dtype=torch.float64))
    zero = torch.cat([torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)], dim=1)
    assert torch.isfinite(recall_error(kv, cand_f[:1], zero, relative=True)).all()  # a zero value: kept first


def _states_against_recall(name: str):
    """The states after one prefill of CONFIGS[name]'s layer and of the same layer (same weights) with 'recall'."""
    q, k, v = _inputs()
    opts = CONFIGS[name]
    with torch.no_grad():
        mine = _module(opts)
        rec = _module({**opts, "sparse_score": "recall"})
        rec.load_state_dict(mine.state_dict())
        return (mine(q, k, v, causal=True, state=mine.init_state())[1],
                rec(q, k, v, causal=True, state=rec.init_state())[1])


def test_the_relative_score_chooses_another_cache_in_the_layer():
    """The layer reads sparse_score: the same weights and inputs keep other keys (and give other outputs)."""
    s_rel, s_rec = _states_against_recall("hedgehog-preset-relative")
    assert not torch.equal(s_rel.sparse_k, s_rec.sparse_k)


def test_the_attention_score_keeps_the_keys_the_last_queries_read():
    """sparse_score='attention': each candidate's softmax weight over the candidates under each real query, summed
    over the queries and the query heads, plus ATTENTION_CARRY times a cached key's carried score; a padded query
    adds nothing, an invalid candidate gets nothing; the budget keeps the largest scores."""
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 5.0]], dtype=torch.float64)[None, None]
    q = torch.tensor([[[4.0, 0.0], [0.0, 9.0]]], dtype=torch.float64)[None, None]  # (1, 1, G=1, C=2, 2)
    valid = torch.tensor([[[True, True, True, False]]])
    one = torch.tensor([[True, False]])  # the second query is padding
    x = torch.tensor([4.0, 0.0, -4.0], dtype=torch.float64)
    torch.testing.assert_close(attention_score(q, one, keys, valid, 1.0)[0, 0, :3], x.softmax(-1))
    assert attention_score(q, one, keys, valid, 1.0)[0, 0, 3] == 0
    both = attention_score(q, torch.ones(1, 2, dtype=torch.bool), keys, valid, 0.5)
    want = torch.tensor([2.0, 0.0, -2.0]).double().softmax(-1) + torch.tensor([0.0, 4.5, 0.0]).double().softmax(-1)
    torch.testing.assert_close(both[0, 0, :3], want)
    carried = torch.tensor([[[0.0, 0.0, 3.0]]], dtype=torch.float64)  # the cache's three slots, then one block key
    with_carry = attention_score(q, one, keys, valid, 1.0, carried)
    torch.testing.assert_close(with_carry[0, 0, 2], x.softmax(-1)[2] + ATTENTION_CARRY * 3.0)
    feats, vext = torch.ones(1, 1, 4, 1, dtype=torch.float64), torch.ones(1, 1, 4, 3, dtype=torch.float64)
    kv = torch.zeros(1, 1, 1, 3, dtype=torch.float64)
    _, keep, _ = select_and_fold(kv, feats, vext, valid, 2, score=with_carry)
    assert keep.tolist() == [[[0, 2]]]  # the read key and the carried one; the padded-query's key 1 leaves


def test_the_attention_score_chooses_another_cache_in_the_layer():
    """The layer reads sparse_score='attention': the same weights and inputs keep other keys than 'recall', and its
    state carries the last sparse_chunk queries and the cache's scores (the others carry neither)."""
    q = _inputs()[0]
    s_att, s_rec = _states_against_recall("hedgehog-preset-attention")
    assert not torch.equal(s_att.sparse_k, s_rec.sparse_k)
    assert s_att.sparse_q.shape == (2, 2, 2, 4, D) and s_att.sparse_q_mask.all()
    torch.testing.assert_close(s_att.sparse_q, q.view(2, 2, 2, N, D)[:, :, :, -4:])  # the last 4 of the queries
    assert s_att.sparse_score.shape == (2, 2, 3) and (s_att.sparse_score > 0).all()
    assert s_rec.sparse_q is None and s_rec.sparse_score is None


def test_the_value_keys_keep_the_heavy_keys_and_their_neighbours_the_score_evicts():
    """sparse_value_keys: of the budget, the valid candidates first by |v| max-pooled over sparse_value_pool
    neighbours (ties by their own |v|, then the earlier) are kept whatever the score; the rest by the score. An
    invalid candidate, however heavy, is neither kept nor lends its |v| to a neighbour."""
    norms = torch.tensor([1.0, 9.0, 1.0, 2.0, 50.0, 3.0, 0.5], dtype=torch.float64)
    valid = torch.tensor([True, True, True, True, False, True, True])
    vext = torch.cat([torch.stack([norms, torch.zeros_like(norms)], -1), torch.ones(7, 1, dtype=torch.float64)], -1)
    score = torch.tensor([5.0, 0.0, 0.0, 0.0, 9.0, 0.0, 4.0], dtype=torch.float64)  # the score reads 0 and 6
    feats, kv = torch.ones(7, 1, dtype=torch.float64), torch.zeros(1, 3, dtype=torch.float64)
    assert select_and_fold(kv, feats, vext, valid, 2, score=score)[1].tolist() == [0, 6]
    # width 1: the heaviest valid key (1, |v| 9) kept, then the best score (0)
    assert select_and_fold(kv, feats, vext, valid, 2, score=score, value_keys=1)[1].tolist() == [0, 1]
    assert select_and_fold(kv, feats, vext, valid, 3, score=score, value_keys=2)[1].tolist() == [0, 1, 5]
    # width 3: key 1's neighbours 0 and 2 pool its 9 and rank right after it (its own |v| first, then the
    # earlier); the invalid 4 (|v| 50) lends nothing to 3 and 5
    rank = value_rank(norms, valid, 3)
    assert rank.argsort(descending=True).tolist()[:3] == [1, 0, 2]
    assert select_and_fold(kv, feats, vext, valid, 3, score=score, value_keys=3, value_pool=3)[1].tolist() == [0, 1, 2]
    assert select_and_fold(kv, feats, vext, valid, 4, score=score, value_keys=3, value_pool=3)[1].tolist() == [
        0, 1, 2, 6]


@pytest.mark.parametrize("width", [1, 5, 31])
@pytest.mark.parametrize("count", [1, 7, 40, 64])
def test_the_value_reserve_equals_the_first_valid_candidates_by_rank(width, count):
    """value_reserved (a running count over pooled_order) against its naive reference: sort value_rank with the
    invalid candidates last and keep the first ``count`` valid ones. Ties everywhere: |v| drawn from 4 values (a
    repeated filler's tokens carry the same value in the first layer), a third of the candidates invalid, a row with
    fewer valid candidates than ``count``."""
    from hf_polyattn.ops.sparse import value_reserved

    g = torch.Generator().manual_seed(width * 100 + count)
    norms = torch.randint(0, 4, (3, 2, 48), generator=g).to(torch.float32)
    norms[0, 0, 5] = float("nan")
    valid = torch.rand(3, 2, 48, generator=g) > 0.33
    valid[2, 1] = False
    valid[2, 1, :3] = True
    heavy = torch.where(valid, value_rank(norms, valid, width), -1.0)
    top = heavy.sort(dim=-1, descending=True, stable=True).indices[..., :count]
    want = torch.zeros_like(valid).scatter_(-1, top, True) & valid
    got = value_reserved(norms, valid, count, width)
    assert torch.equal(got, want)
    assert torch.equal(got.sum(-1), torch.minimum(valid.sum(-1), torch.tensor(count)))


def test_the_value_keys_choose_another_cache_in_the_layer():
    """The layer reads sparse_value_keys and sparse_value_pool: the same weights and inputs keep other keys."""
    q, k, v = _inputs()
    opts = CONFIGS["hedgehog-preset-attention"]
    states = []
    with torch.no_grad():
        for extra in ({}, {"sparse_value_keys": 2, "sparse_value_pool": 1}, {"sparse_value_keys": 2}):
            pa = _module({**opts, **extra})
            states.append(pa(q, k, v, causal=True, state=pa.init_state())[1])
    assert not torch.equal(states[0].sparse_k, states[1].sparse_k)
    assert not torch.equal(states[1].sparse_k, states[2].sparse_k)


@pytest.mark.parametrize("name,path", [*((n, "generic") for n in CONFIGS), *((n, "ring") for n in RING)])
def test_chunked_prefill_and_decoding_equal_the_forward(name, path):
    """A prefill, single tokens, a chunk, single tokens, one row left-padded: with gradients recorded every call takes
    the generic state; without (generate()'s path) the ring serves the single tokens, the generic state the chunk."""
    pa = _module(CONFIGS[name])
    q, k, v = _inputs()
    mask = _left_padded()
    with torch.no_grad():
        full = pa(q, k, v, causal=True, key_padding_mask=mask)
    out, states = _steps(pa, q, k, v, mask, grad=path == "generic")
    if path == "generic":
        assert all(isinstance(s, RecurrentState) for s in states)
    else:
        assert isinstance(states[-1], WindowRing)
        assert states[-1].extra == pa.config.sparse_cache + pa.config.sparse_chunk
        assert isinstance(states[20], WindowRing) and isinstance(states[15], RecurrentState)  # the chunk, then the ring
    torch.testing.assert_close(out.detach()[:, :, 5:], full[:, :, 5:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.detach()[1], full[1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("grad", [False, True])
def test_selected_rows_continue_as_those_rows(grad):
    """Beam search reorders rows (``index_select``): the ring's and the generic state's sparse buffers follow."""
    pa = _module(CONFIGS["linear-sinks-gate-mix"])
    q, k, v = _inputs(b=3)
    _, states = _steps(pa, q[..., :40, :], k[..., :40, :], v[..., :40, :],
                       spans=[(0, 13), *((i, i + 1) for i in range(13, 40))], grad=grad)
    assert isinstance(states[-1], RecurrentState if grad else WindowRing)
    state = states[-1].index_select(torch.tensor([2, 0]))
    rows = torch.tensor([2, 0])
    outs = []
    with torch.set_grad_enabled(grad):
        for i in range(40, N):
            o, state = pa(q[rows, :, i : i + 1], k[rows, :, i : i + 1], v[rows, :, i : i + 1], causal=True, state=state)
            outs.append(o)
        full = pa(q[rows], k[rows], v[rows], causal=True)
    torch.testing.assert_close(torch.cat(outs, dim=2).detach(), full[:, :, 40:].detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "sinks-beyond-a-block", "softmax-heads",
                                  "hedgehog-preset-attention", "elu-attention-chunk-beyond-window"])
def test_left_padding_equals_each_row_alone(name):
    """Row 0 left-padded by 7 tokens (not a multiple of the block): the forward and decoding of that row equal the row
    computed alone, its blocks counted from its first real key; padded queries give 0."""
    pa = _module(CONFIGS[name])
    q, k, v = _inputs()
    pad = 7
    mask = _left_padded(pad)
    with torch.no_grad():
        full = pa(q, k, v, causal=True, key_padding_mask=mask)
        alone = pa(q[:1, :, pad:], k[:1, :, pad:], v[:1, :, pad:], causal=True)
        other = pa(q[1:], k[1:], v[1:], causal=True)
    decoded, _ = _steps(pa, q, k, v, mask)
    for out in (full, decoded):
        torch.testing.assert_close(out[:1, :, pad:], alone, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(out[1:], other, rtol=1e-10, atol=1e-12)
        assert (out[0, :, :pad] == 0).all()


def test_right_padding_without_a_state_equals_the_definition():
    pa = _module(CONFIGS["linear-sinks-gate-mix"])
    q, k, v = _inputs()
    mask = torch.ones(2, N, dtype=torch.bool)
    mask[1, 40:] = False
    mask[0, :3] = False
    with torch.no_grad():
        got = pa(q, k, v, causal=True, key_padding_mask=mask)
        want = reference_attention(pa, q, k, v, causal=True, key_padding_mask=mask)
        alone = pa(q[1:, :, :40], k[1:, :, :40], v[1:, :, :40], causal=True)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1:, :, :40], alone, rtol=1e-10, atol=1e-12)
    assert (got[1, :, 40:] == 0).all()


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "polysketch-maps-gate", "hedgehog-preset-attention",
                                  "elu-attention-chunk-beyond-window"])
def test_causal(name):
    """Changing tokens from position 30 on leaves every output before 30 unchanged (the selection reads only keys
    that left the window)."""
    pa = _module(CONFIGS[name])
    q, k, v = _inputs()
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[:, :, 30:] = torch.randn_like(x[:, :, 30:]) * 3
    with torch.no_grad():
        a = pa(q, k, v, causal=True)
        b = pa(q2, k2, v2, causal=True)
    torch.testing.assert_close(a[:, :, :30], b[:, :, :30], rtol=0, atol=0)
    assert (a[:, :, 30:] - b[:, :, 30:]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "polysketch-maps-gate", "performer",
                                  "observe:linear-sinks-gate-mix", "observe:polysketch-maps-gate",
                                  "hedgehog-preset-attention", "observe:hedgehog-preset-attention"])
def test_half_precision_is_finite_and_close(dtype, name):
    """Inputs of norm ~8 (scores ~20): the forward and decoding stay finite in the model's half dtype and near the
    float32 model's (with ``observe:``, sparse_observe, the calls of SPANS against the float32 model's same calls:
    the scores' softmax and the fold in float32)."""
    observe, _, name = name.rpartition(":")
    opts = (OBSERVE if observe else CONFIGS)[name]
    pa = _module(opts, dtype=dtype)
    q, k, v = _inputs(dtype=torch.float32)
    q, k = q * 2.8, k * 2.8
    ref = _module(opts, dtype=torch.float32)
    ref.load_state_dict({n: t.float() for n, t in pa.state_dict().items()})
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    spans = SPANS if observe else None
    with torch.no_grad():
        full = pa(qh, kh, vh, causal=True)
        want = ref(qh.float(), kh.float(), vh.float(), causal=True)
    decoded, _ = _steps(pa, qh, kh, vh, spans=spans)
    want_decoded = _steps(ref, qh.float(), kh.float(), vh.float(), spans=spans)[0] if observe else want
    for out, expect in ((full, want), (decoded, want_decoded)):
        assert out.dtype == dtype and torch.isfinite(out).all()
        torch.testing.assert_close(out.float(), expect, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "polysketch-maps-gate", "conv-learned-sinks",
                                  "observe:linear-sinks-gate-mix", "hedgehog-preset-attention",
                                  "observe:hedgehog-preset-attention"])
def test_gradcheck(name):
    """float64, tiny shapes: gradients through the exact part over the selected keys, the state of the evicted ones,
    the gates and maps (the selection itself is not differentiable: a step of 1e-6 leaves it where it is); with
    ``observe:`` (sparse_observe) through the re-chosen caches and the refolded states of the last queries too."""
    observe, _, name = name.rpartition(":")
    opts = {**(OBSERVE if observe else CONFIGS)[name], "window": 3, "sparse_cache": 2, "sparse_chunk": 2}
    pa = _module(opts, heads=2, kv_heads=1)
    q, k, v = (x.requires_grad_() for x in _inputs(b=1, heads=2, kv_heads=1, n=11, seed=3))
    # the small ones (gates, mix, convolution taps, LayerNorm gains); the projection's reach q, k's path
    params = [p for p in pa.parameters() if p.requires_grad and p.numel() <= 32]
    assert params

    def f(q, k, v, *ps):
        return pa(q, k, v, causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v, *params), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_state_bytes_are_constant_and_counted():
    """The ring's bytes do not grow with the context (100 and 300 tokens: the same), the generic state's neither once
    warm, and the sparse cache's buffers are in nbytes: their bytes over a ring without it are (cache + chunk) slots
    of key, [v 1], kernel input, valid flag and log-decay, and one waiting count per row."""
    opts = CONFIGS["linear-sinks-gate-mix"]
    pa = _module(opts)
    plain = _module({**opts, "sparse_cache": 0, "sparse_chunk": 64})
    sizes = {}
    for length in (100, 300):
        q, k, v = _inputs(n=length, seed=length)
        for mod in (pa, plain):
            _, states = _steps(mod, q, k, v, spans=[(0, 9), *((i, i + 1) for i in range(9, length))])
            sizes[mod is pa, length] = {s.nbytes() for s in states[-40:]}
        _, states = _steps(pa, q, k, v, spans=[(0, 9), *((i, i + 1) for i in range(9, length))], grad=True)
        sizes["generic", length] = {s.nbytes() for s in states[-40:]}
    assert sizes[True, 100] == sizes[True, 300] and len(sizes[True, 100]) == 1
    assert sizes["generic", 100] == sizes["generic", 300] and len(sizes["generic", 100]) == 1
    b, hkv, slots, f64 = 2, 2, 3 + 4, 8
    extra = b * hkv * slots * (D + (D + 1) + D + 1) * f64 + b * slots + b * 8
    assert sizes[True, 300].pop() - sizes[False, 300].pop() == extra


def test_refusals():
    with pytest.raises(ValueError, match="sparse_cache=4 needs window > 0"):
        PolyAttnConfig(kind="linear", sparse_cache=4)
    with pytest.raises(ValueError, match="sparse_score='relative' needs sparse_cache > 0"):
        PolyAttnConfig(kind="linear", window=8, sparse_score="relative")
    with pytest.raises(ValueError, match="sparse_score"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_score="mass")
    with pytest.raises(ValueError, match="sparse_chunk=8 needs sparse_cache > 0"):
        PolyAttnConfig(kind="linear", window=8, sparse_chunk=8)
    with pytest.raises(ValueError, match="sparse_chunk must be"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_chunk=0)
    with pytest.raises(ValueError, match="sparse_cache must be"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=-1)
    with pytest.raises(ValueError, match="backend must stay 'auto'"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, backend="loop")
    with pytest.raises(ValueError, match="kind='delta' does not take sparse_cache"):
        PolyAttnConfig.for_kind("delta", sparse_cache=4)
    with pytest.raises(ValueError, match="does not read sparse_cache"):
        PolyAttnConfig(kind="sliding_window", window=8, sparse_cache=4)
    with pytest.raises(ValueError, match="sparse_value_keys=2 needs sparse_cache > 0"):
        PolyAttnConfig(kind="linear", window=8, sparse_value_keys=2)
    with pytest.raises(ValueError, match="sparse_value_keys must be at most sparse_cache=4"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_value_keys=5)
    with pytest.raises(ValueError, match="sparse_value_keys must be"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_value_keys=-1)
    with pytest.raises(ValueError, match="sparse_value_pool=3 needs sparse_value_keys > 0"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_value_pool=3)
    with pytest.raises(ValueError, match="sparse_value_pool must be an odd number"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_value_keys=2, sparse_value_pool=4)
    pa = _module(CONFIGS["linear-elu"])
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="causal attention only"):
        pa(q, k, v, causal=False)
    holes = torch.ones(2, N, dtype=torch.bool)
    holes[1, 20:22] = False
    with pytest.raises(ValueError, match="row 1 has padded keys between real ones"):
        pa(q, k, v, causal=True, key_padding_mask=holes)
    right = torch.ones(2, 10, dtype=torch.bool)
    right[0, 8:] = False
    with pytest.raises(ValueError, match="needs left padding"):
        pa(q[:, :, :10], k[:, :, :10], v[:, :, :10], causal=True, key_padding_mask=right, state=pa.init_state())


# sparse_observe: the cache chosen again at the end of a call by its last queries (small pools, so the ranking's
# ties and the pooling both occur at N = 48)
OBSERVE = {name: {**CONFIGS[name], "sparse_observe": 3, "sparse_observe_pool": 3}
           for name in ("linear-elu", "linear-sinks-gate-mix", "polysketch-maps-gate", "hedgehog-scalar",
                        "conv-learned-sinks", "softmax-heads", "hedgehog-preset-attention",
                        "elu-attention-chunk-beyond-window", "hedgehog-preset-attention-value",
                        "linear-sinks-gate-mix-value")}
SPANS = [(0, 13), *((i, i + 1) for i in range(13, 27)), (27, 33), *((i, i + 1) for i in range(33, N))]


@pytest.mark.parametrize("name", list(OBSERVE))
def test_observe_forward_equals_the_naive_definition(name):
    """float64, no padding, a left-padded row, a right-padded row: the forward computes the definition's weights
    (each of the call's last 3 queries with its own re-choice, one row and head at a time, ops/reference.py); only
    those queries change against the streaming selection alone, and the last one does change."""
    pa, plain = _module(OBSERVE[name]), _module(CONFIGS[name])
    reference = hybrid_reference if isinstance(pa, HybridAttention) else reference_attention
    q, k, v = _inputs()
    right = torch.ones(2, N, dtype=torch.bool)
    right[1, 40:] = False
    with torch.no_grad():
        for m in (None, _left_padded(), right):
            got = pa(q, k, v, causal=True, key_padding_mask=m)
            torch.testing.assert_close(got, reference(pa, q, k, v, causal=True, key_padding_mask=m), rtol=1e-10,
                                       atol=1e-12)
            base = plain(q, k, v, causal=True, key_padding_mask=m)
            last = [N - 1, 39 if m is right else N - 1]
            for row in range(2):
                assert (got[row, :, last[row]] - base[row, :, last[row]]).abs().max() > 1e-3
                before = last[row] - OBSERVE[name]["sparse_observe"] + 1
                torch.testing.assert_close(got[row, :, :before], base[row, :, :before], rtol=0, atol=0)


@pytest.mark.parametrize("name,path", [*((n, "generic") for n in OBSERVE),
                                       *((n, "ring") for n in OBSERVE if n in RING)])
def test_observe_chunked_prefill_and_decoding_equal_the_definition(name, path):
    """A prefill, single tokens, a chunk (a second re-choice, from a carried cache and the state's raw keys), single
    tokens, one row left-padded: every call's outputs are the definition's with those call boundaries, and differ
    from the definition's with one call (the re-choices matter)."""
    pa = _module(OBSERVE[name])
    q, k, v = _inputs()
    mask = _left_padded()
    calls = [t - s for s, t in SPANS]
    reference = hybrid_reference if isinstance(pa, HybridAttention) else reference_attention
    with torch.no_grad():
        want = reference(pa, q, k, v, causal=True, key_padding_mask=mask, calls=calls)
        whole = reference(pa, q, k, v, causal=True, key_padding_mask=mask)
    out, states = _steps(pa, q, k, v, mask, spans=SPANS, grad=path == "generic")
    assert isinstance(states[-1], WindowRing if path == "ring" else RecurrentState)
    torch.testing.assert_close(out.detach()[:, :, 5:], want[:, :, 5:], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.detach()[1], want[1], rtol=1e-10, atol=1e-12)
    assert (want[:, :, 13:] - whole[:, :, 13:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["linear-sinks-gate-mix", "polysketch-maps-gate", "hedgehog-preset-attention"])
def test_observe_causal(name):
    """Changing tokens from position t on leaves every output before t unchanged, with the re-choice at the end: t =
    30 (before the observed queries) and t = N - 1 (the last of them: the two observed before it chose without
    it)."""
    pa = _module(OBSERVE[name])
    q, k, v = _inputs()
    for t in (30, N - 1):
        q2, k2, v2 = (x.clone() for x in (q, k, v))
        for x in (q2, k2, v2):
            x[:, :, t:] = torch.randn_like(x[:, :, t:]) * 3
        with torch.no_grad():
            a, b = pa(q, k, v, causal=True), pa(q2, k2, v2, causal=True)
        torch.testing.assert_close(a[:, :, :t], b[:, :, :t], rtol=0, atol=0)
        assert (a[:, :, t:] - b[:, :, t:]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["linear-elu", "linear-sinks-gate-mix", "hedgehog-scalar"])
def test_observe_reading_every_key_is_softmax_and_leaves_the_same_state(name):
    """``observe_keys`` (the diagnostic of probe_observe_wide.py) at the whole prompt: each observed row of one call
    reads every key exactly and nothing through the state, so it is causal softmax attention over the prompt; the
    rows before them and the state the call leaves (its next token's output) are those of ``sparse_cache``. The
    sinks at their own positions (sink_position='own'; 'window' scores them as if just beyond the window)."""
    pa = _module({**OBSERVE[name], **({"sink_position": "own"} if OBSERVE[name].get("sinks") else {})})
    q, k, v = _inputs()
    nxt = _inputs(n=1, seed=1)
    with torch.no_grad():
        out, state = pa(q, k, v, causal=True, state=pa.init_state())
        step = pa(*nxt, causal=True, state=state)[0]
        pa.observe_keys = N
        try:
            wide, wide_state = pa(q, k, v, causal=True, state=pa.init_state())
            wide_step = pa(*nxt, causal=True, state=wide_state)[0]
        finally:
            pa.observe_keys = None
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    softmax = scores.softmax(-1) @ vv
    n_obs = OBSERVE[name]["sparse_observe"]
    torch.testing.assert_close(wide[:, :, -n_obs:], softmax[:, :, -n_obs:], rtol=1e-10, atol=1e-12)
    assert (out[:, :, -1] - softmax[:, :, -1]).abs().max() > 1e-3  # sparse_cache re-chosen keys alone are not
    torch.testing.assert_close(wide[:, :, :-n_obs], out[:, :, :-n_obs], rtol=0, atol=0)
    torch.testing.assert_close(wide_step, step, rtol=0, atol=0)


# every config whose exact part is softmax, with and without sparse_observe: what the fused rows serve
FUSED = {**{n: c for n, c in CONFIGS.items() if c.get("local_kernel") != "polynomial"},
         **{f"observe:{n}": c for n, c in OBSERVE.items()}}


def _count_fused(monkeypatch) -> list:
    from hf_polyattn.ops import sparse

    calls, fused = [], sparse.rows_flash
    monkeypatch.setattr(sparse, "rows_flash", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    return calls


@pytest.mark.parametrize("name", list(FUSED))
def test_cpu_inference_reads_the_rows_through_the_fused_kernel(name, monkeypatch):
    """float32 without gradients on the CPU: each block's exact part goes through PyTorch's fused flash kernel
    (``window_flash.rows_flash``, its calls counted) and is as close to float64 as the unfused float32 rows (the
    same module with gradients on): within 2x their error, or 1e-5 of the largest output. One call and the chunked
    prefill with the steps after it (sparse_observe chooses again at the end of each call, so each is compared with
    itself); left padding gives rows that see no key (zeroed, not NaN)."""
    import copy

    calls = _count_fused(monkeypatch)
    pa = _module(FUSED[name])
    pa32 = copy.deepcopy(pa).float()
    q, k, v = _inputs()
    x32 = [t.float() for t in (q, k, v)]

    def whole(module, x, m, grad):
        with torch.set_grad_enabled(grad):
            return module(*x, causal=True, key_padding_mask=m)

    def chunked(module, x, m, grad):
        return _steps(module, *x, mask=m, grad=grad)[0]

    for m in (None, _left_padded()):
        for run in (whole, chunked):
            want = run(pa, (q, k, v), m, False)  # float64: the rows as tensors
            calls.clear()
            plain = run(pa32, x32, m, True)
            assert not calls
            got = run(pa32, x32, m, False)
            assert calls, "the fused rows were not used"
            assert torch.isfinite(got).all()
            bound = 2 * (plain.double() - want).abs().max() + 1e-5 * want.abs().max()
            assert (got.double() - want).abs().max() <= bound, run.__name__


def test_polynomial_rows_and_capped_scores_keep_the_unfused_rows(monkeypatch):
    """The fused kernel computes softmax over uncapped scores: a polynomial exact part and a soft-capped layer
    (Gemma 2) keep the rows as tensors, float32 without gradients included (their results are the definition's in
    float64: test_forward_equals_the_naive_definition); so does a layer whose ``fused_rows`` diagnostic is off, with
    the output of the rows as tensors to the bit."""
    calls = _count_fused(monkeypatch)
    q, k, v = (t.float() for t in _inputs())
    capped = _module({**CONFIGS["linear-sinks-gate-mix"], "softcap_mode": "exact_parts"}, dtype=torch.float32)
    capped.softcap = 30.0
    off = _module(CONFIGS["linear-sinks-gate-mix"], dtype=torch.float32)
    off.fused_rows = False
    with torch.no_grad():
        for pa in (_module(CONFIGS["polynomial-window"], dtype=torch.float32), capped, off):
            assert torch.isfinite(pa(q, k, v, causal=True)).all()
        got = off(q, k, v, causal=True)
    assert not calls
    torch.testing.assert_close(got, off(q, k, v, causal=True), rtol=0, atol=0)  # gradients on: as tensors


def test_observe_refusals():
    with pytest.raises(ValueError, match="sparse_observe=4 needs sparse_cache > 0"):
        PolyAttnConfig(kind="linear", window=8, sparse_observe=4)
    with pytest.raises(ValueError, match="sparse_observe_pool=5 needs sparse_observe > 0"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_observe_pool=5)
    with pytest.raises(ValueError, match="sparse_observe_pool must be an odd number"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_observe=4, sparse_observe_pool=4)
    with pytest.raises(ValueError, match="sparse_observe must be"):
        PolyAttnConfig(kind="linear", window=8, sparse_cache=4, sparse_observe=-1)
    with pytest.raises(ValueError, match="does not read sparse_observe"):
        PolyAttnConfig(kind="sliding_window", window=8, sparse_observe=4)
    # the diagnostic's count below the cache (probe_observe_wide.py --keys): refused by name at the call
    pa = _module(OBSERVE["linear-elu"])
    pa.observe_keys = OBSERVE["linear-elu"]["sparse_cache"] - 1
    with torch.no_grad(), pytest.raises(ValueError, match=r"observe_keys=2 .* must be None or >= sparse_cache=3"):
        pa(*_inputs(), causal=True, state=pa.init_state())
    pa.observe_keys = 3  # at the cache's size: the library's own choice, accepted
    with torch.no_grad():
        pa(*_inputs(), causal=True, state=pa.init_state())


def _recall_inputs(n: int, needle_at: int, seed: int):
    """One kv head: n keys cycling through 6 filler patterns whose values are one common value plus 10% noise (text the
    kernel state predicts: it recalls them well), one needle key/value pair at ``needle_at`` (a fact it does not),
    and a last query along the needle's key. The elu features of all keys overlap (positive everywhere), so the
    state recalls the needle as a blend of everything."""
    gen = torch.Generator().manual_seed(seed)
    d = 16
    fill_k = torch.randn(6, d, generator=gen, dtype=torch.float64)
    fill_v = torch.randn(d, generator=gen, dtype=torch.float64) + 0.1 * torch.randn(6, d, generator=gen,
                                                                                     dtype=torch.float64)
    k = fill_k[torch.arange(n) % 6].clone()
    v = fill_v[torch.arange(n) % 6].clone()
    needle_k = torch.randn(d, generator=gen, dtype=torch.float64)
    needle_v = torch.randn(d, generator=gen, dtype=torch.float64)
    k[needle_at], v[needle_at] = needle_k, needle_v
    q = torch.randn(n, d, generator=gen, dtype=torch.float64) * 0.1
    q[-1] = needle_k * 6  # score 6 |k|^2 / 4 ~ 24 on the needle: an exact softmax takes it
    return q[None, None], k[None, None], v[None, None], needle_v


def _distract(k: torch.Tensor, v: torch.Tensor, at: int, count: int, seed: int) -> None:
    """``count`` more surprising pairs (random keys and values, the needle's kind) every 3 keys from ``at`` on, in
    place: facts the question does not ask for, which the streaming selection ranks like the needle."""
    gen = torch.Generator().manual_seed(1000 + seed)
    d = k.shape[-1]
    for i in range(count):
        k[at + 3 * i] = torch.randn(d, generator=gen, dtype=torch.float64)
        v[at + 3 * i] = torch.randn(d, generator=gen, dtype=torch.float64)


def recall_rate(sparse_cache: int, n: int = 256, trials: int = 8, distractors: int = 0, observe: int = 0) -> float:
    """Share of trials whose last output is nearer to the needle's value than to every filler's, with elu features,
    a 16-token window, 1 sink and blocks of 16 keys; ``distractors`` surprising pairs after the needle
    (``_distract``), ``observe`` the cache's ``sparse_observe``."""
    opts = dict(kind="linear", window=16, sinks=1)
    if sparse_cache:
        opts.update(sparse_cache=sparse_cache, sparse_chunk=16)
    if observe:
        opts.update(sparse_observe=observe, sparse_observe_pool=1)
    pa = build_attention(PolyAttnConfig(**opts), 1, 16, 1).double()
    hits = 0
    for t in range(trials):
        q, k, v, needle_v = _recall_inputs(n, needle_at=n // 4 + 7 * t, seed=t)
        if distractors:
            _distract(k[0, 0], v[0, 0], n // 4 + 7 * t + 2, distractors, t)
        with torch.no_grad():
            out = pa(q, k, v, causal=True)[0, 0, -1]
        cands = torch.cat([needle_v[None], v[0, 0, :6]])
        hits += int(torch.linalg.vector_norm(cands - out, dim=-1).argmin() == 0)
    return hits / trials


def test_associative_recall_the_state_loses_and_the_cache_recovers():
    """A needle far behind the window: the kernel state alone returns a blend nearer to a filler's value than to the
    needle's (0 of 8); a cache of a single key keeps the needle (the largest recall error of every selection: the
    fillers are predictable) and the output is the needle's value (8 of 8), and so does a cache of 4, at 256 and
    1,024 tokens."""
    assert recall_rate(0) == 0.0
    assert recall_rate(1) == 1.0
    assert recall_rate(4) == 1.0
    assert recall_rate(4, n=1024, trials=4) == 1.0


def test_the_question_keeps_the_needle_the_stream_drops():
    """Thirty more surprising pairs after the needle: a cache of 2 chosen while streaming keeps other surprises and
    loses the needle in 6 of 8 trials (deterministic seeds), the same cache chosen again by the last 4 queries (the
    question among them) or by the question alone keeps it in 8 of 8."""
    assert recall_rate(2, distractors=30) <= 2 / 8
    assert recall_rate(2, distractors=30, observe=4) == 1.0
    assert recall_rate(2, distractors=30, observe=1) == 1.0


# the configs whose one-sequence decoding steps ``decode.fused_step`` takes: a softmax window, an elementwise or a
# Hedgehog feature map on unscaled inputs (not polysketch's sketches, not FAVOR+'s scaled features)
FUSED_RING = ["linear-elu", "linear-sinks-gate-mix", "sinks-beyond-a-block", "hedgehog-scalar", "softmax-heads",
              "hedgehog-preset", "hedgehog-preset-attention"]


def _single_steps(pa, q, k, v, prefill):
    return _steps(pa, q, k, v, spans=[(0, prefill), *((i, i + 1) for i in range(prefill, q.shape[2]))])


@pytest.mark.parametrize("prefill", [2, 13])  # 2: the sinks fill while decoding, the keys pass through the block
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", FUSED_RING)
def test_fused_steps_with_the_cache_equal_the_general_steps(monkeypatch, name, dtype, prefill):
    """One unpadded sequence: once its ring is steady and no sink waits in the block, ``fused_step`` takes the steps
    (counted), the leaving keys go to the block through its views and the cache is chosen from there (counted);
    outputs equal the general ``ring_step``'s (``fused_decode=False``) and the whole sequence's, and so does every
    tensor of the state at the end. A bf16 layer works in float32 on both paths: finite, its outputs within a bf16
    rounding of the general step's (the whole sequence's prefill rounds differently: not compared)."""
    from hf_polyattn.ops import attention, decode

    pa = _module(CONFIGS[name], dtype=dtype)
    q, k, v = _inputs(b=1, dtype=dtype)
    calls, selections = [], []
    monkeypatch.setattr(attention, "fused_step", lambda *a: calls.append(1) or decode.fused_step(*a))
    select = decode.ring_select
    monkeypatch.setattr(decode, "ring_select", lambda *a: selections.append(1) or select(*a))
    fused, states = _single_steps(pa, q, k, v, prefill)
    cfg = pa.config
    # every step once the window and the sinks are full, but those with a sink in the block (a block's worth)
    assert len(calls) >= N - max(prefill, cfg.window + cfg.sinks) - cfg.sparse_chunk - 1, len(calls)
    assert len(selections) >= 2
    taken = len(calls)
    _fused(pa, False)
    general, general_states = _single_steps(pa, q, k, v, prefill)
    assert len(calls) == taken
    if dtype == torch.bfloat16:
        assert torch.isfinite(fused).all()
        torch.testing.assert_close(fused, general, rtol=1.6e-2, atol=1e-2)
        return
    with torch.no_grad():
        full = pa(q, k, v, causal=True)
    tol = dict(rtol=1e-9, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused, general, **tol)
    torch.testing.assert_close(fused, full, **tol)
    ring, ref = states[-1], general_states[-1]
    assert isinstance(ring, WindowRing) and ring.extra
    assert (ring.head, ring.count, ring.length, ring.pending.tolist()) == (ref.head, ref.count, ref.length,
                                                                            ref.pending.tolist())
    for a, b in zip(ring.tensors(), ref.tensors()):
        torch.testing.assert_close(a, b, **tol)


def test_a_sink_waiting_in_the_block_keeps_the_masked_read(monkeypatch):
    """Sinks that fill while decoding leave the window into the block with ``valid`` False but their key and [v, 1]
    kept (for their gate and the generic state): ``fused_ready`` waits for the block's selection
    (``sink_waiting``). Read unmasked before that, the output changes: the flag is what keeps it right."""
    from hf_polyattn.ops import attention, decode

    pa = _module(CONFIGS["sinks-beyond-a-block"])
    q, k, v = _inputs(b=1)
    general_pa = _module(CONFIGS["sinks-beyond-a-block"])
    _fused(general_pa, False)
    want, _ = _single_steps(general_pa, q, k, v, 2)
    waited = []  # the steps whose ring had every sink filled and one of them in the block
    step = decode.ring_step
    monkeypatch.setattr(attention, "ring_step",
                        lambda *a: waited.append(a[6].sink_waiting and a[6].filled is None) or step(*a))
    got, _ = _single_steps(pa, q, k, v, 2)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    assert any(waited)

    def ignoring_the_flag(ring):
        return (ring.at is None and ring.filled is None and ring.count == ring.window
                and ring.real_run >= ring.window and ring.keys.shape[0] == 1)

    monkeypatch.setattr(attention, "fused_ready", ignoring_the_flag)
    wrong, _ = _single_steps(pa, q, k, v, 2)
    assert (wrong - want).abs().max() > 1e-6


def test_a_fused_step_with_the_cache_dispatches_at_most_half_the_ring_steps_operations():
    """The linear-only preset's layer (Hedgehog, the sparse cache, the projection and the LayerNorm) on a steady
    ring between two selections, counted against the general ``ring_step``."""
    from .test_decode_ring import _CountOps

    pa = _module(CONFIGS["hedgehog-preset"], dtype=torch.float32)
    q, k, v = _inputs(b=1, dtype=torch.float32)
    counts = {}
    for on in (True, False):
        _fused(pa, on)
        with torch.no_grad():
            _, state = pa(q[:, :, :20], k[:, :, :20], v[:, :, :20], causal=True, state=pa.init_state())
            for i in range(20, 23):
                _, state = pa(*(t[:, :, i:i + 1] for t in (q, k, v)), causal=True, state=state)
            assert int(_kernel(state).pending) < pa.config.sparse_chunk - 1  # the next step selects nothing
            with _CountOps() as ops:
                pa(*(t[:, :, 23:24] for t in (q, k, v)), causal=True, state=state)
        counts[on] = ops.count
    assert counts[True] <= 0.5 * counts[False], counts
