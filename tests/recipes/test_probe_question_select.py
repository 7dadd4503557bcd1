"""recipes/experiments/retrieval/probe_question_select.py: the question-chosen cache keeps the keys the observed
queries attend most (pooled over neighbours), in their order, with every per-key field cut the same way."""

from __future__ import annotations

import torch

from hf_polyattn.ops.state import RecurrentState
from recipes.experiments.retrieval.probe_question_select import _keep


def _state(slots=12, d=4, valid=10):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, slots, d, generator=gen)
    mask = torch.zeros(1, 2, slots, dtype=torch.bool)
    mask[..., :valid] = True
    return RecurrentState(None, None, None, None, 20, sparse_k=k, sparse_v=k + 1, sparse_mask=mask,
                          sparse_kin=k * 2, sparse_logs=-torch.arange(slots).float().expand(1, 2, slots).clone())


def test_keeps_the_keys_the_question_attends_most_in_order():
    state = _state()
    q = torch.zeros(1, 4, 3, 4)  # 2 kv heads x 2 query heads, 3 observed queries
    q[:, :2] = 20 * state.sparse_k[:, 0, 7]  # kv head 0's queries point at its key 7
    q[:, 2:] = 20 * state.sparse_k[:, 1, 2]  # kv head 1's at its key 2
    kept = _keep(state, 3, q, groups=2, scale=1.0, pool=1)
    assert kept.sparse_k.shape == (1, 2, 3, 4) and kept.sparse_mask.all()
    for head, key in ((0, 7), (1, 2)):
        index = [int(torch.nonzero((state.sparse_k[0, head] == row).all(-1))) for row in kept.sparse_k[0, head]]
        assert key in index and index == sorted(index)  # the attended key, and the kept keys in their order
        assert all(i < 10 for i in index)  # never an empty slot
        torch.testing.assert_close(kept.sparse_v[0, head], state.sparse_v[0, head, index])
        torch.testing.assert_close(kept.sparse_kin[0, head], state.sparse_kin[0, head, index])
        torch.testing.assert_close(kept.sparse_logs[0, head], state.sparse_logs[0, head, index])


def test_pooling_keeps_the_neighbours_of_an_attended_key():
    state = _state()
    q = 50 * state.sparse_k[:, 0, 5].expand(1, 4, 1, 4).clone()  # every query at kv head 0's key 5
    kept = _keep(state, 3, q, groups=2, scale=1.0, pool=3)
    index = [int(torch.nonzero((state.sparse_k[0, 0] == row).all(-1))) for row in kept.sparse_k[0, 0]]
    assert index == [4, 5, 6]  # the key and its neighbours share its pooled score
