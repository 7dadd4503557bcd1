"""recipes/experiments/retrieval/probe_evicted_mass.py's helpers: which keys a sparse cache evicted, and the softmax
mass every key gets from the last queries."""

from __future__ import annotations

import torch

from recipes.experiments.retrieval.probe_evicted_mass import (
    evicted_positions,
    mass_per_key,
    merged_keys,
    zero_state_values,
)


def test_evicted_are_the_keys_neither_cached_nor_exact():
    torch.manual_seed(0)
    keys = torch.randn(10, 4)
    cached = keys[[2, 5, 7]]
    assert evicted_positions(cached, keys, exact={0, 8, 9}) == [1, 3, 4, 6]
    # a cached copy that differs in one element is not the key
    cached[0, 1] += 1e-3
    assert evicted_positions(cached, keys, exact={0, 8, 9}) == [1, 2, 3, 4, 6]


def test_mass_per_key_is_the_softmax_row_averaged():
    torch.manual_seed(0)
    q, k = torch.randn(3, 2, 8), torch.randn(6, 8)
    mass = mass_per_key(q, k, 0.5)
    assert torch.allclose(mass.sum(), torch.tensor(1.0))
    rows = [torch.softmax(q[g, i] @ k.T * 0.5, -1) for g in range(3) for i in range(2)]
    assert torch.allclose(mass, torch.stack(rows).mean(0), atol=1e-6)
    # a key the queries align with takes the largest share
    k[4] = q.mean((0, 1)) * 4
    assert int(mass_per_key(q, k, 0.5).argmax()) == 4


def test_merged_keys_are_their_cluster_means():
    torch.manual_seed(0)
    k = torch.cat([torch.randn(5, 3) * 0.1 + 10, torch.randn(4, 3) * 0.1 - 10, torch.randn(3, 3)])
    positions = list(range(9))  # the two far clusters; the last 3 keys are not evicted
    merged = merged_keys(k, positions, clusters=2)
    assert torch.allclose(merged[:5], k[:5].mean(0).expand(5, 3), atol=1e-6)
    assert torch.allclose(merged[5:], k[5:9].mean(0).expand(4, 3), atol=1e-6)
    one = merged_keys(k, positions, clusters=1)
    assert torch.allclose(one, k[:9].mean(0).expand(9, 3), atol=1e-6)
    # more clusters than keys: every key its own mean
    assert torch.allclose(merged_keys(k, [1, 6], clusters=4), k[[1, 6]], atol=1e-6)


def test_zero_state_values_zeroes_the_held_copies_of_those_keys_alone():
    from types import SimpleNamespace

    torch.manual_seed(0)
    keys = torch.randn(2, 10, 4)  # (Hkv, n, d)
    # head 0 caches positions 1, 3, 5 in its sparse cache and 8, 9 in its window; head 1 caches 2, 4, 6 and 8, 9
    sparse_k = torch.stack([keys[0, [1, 3, 5]], keys[1, [2, 4, 6]]])[None]
    window_k = keys[:, [8, 9]][None]
    state = SimpleNamespace(sparse_k=sparse_k, sparse_v=torch.ones(1, 2, 3, 4), k=window_k, v=torch.ones(1, 2, 2, 4))
    found = zero_state_values(state, keys, {0: [3, 9, 7], 1: [1]})
    assert found == 2  # position 7 of head 0 is held nowhere; head 1 holds no copy of position 1
    assert state.sparse_v[0, 0, :, 0].tolist() == [1.0, 0.0, 1.0]
    assert state.v[0, 0, :, 0].tolist() == [1.0, 0.0]
    assert bool((state.sparse_v[0, 1] == 1).all()) and bool((state.v[0, 1] == 1).all())
    assert torch.equal(state.sparse_k, sparse_k)  # the keys stay: they keep drawing attention
