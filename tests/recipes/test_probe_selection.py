"""recipes/experiments/retrieval/probe_selection.py: the selection variants replace the library's rule only while
installed, keep its contract (budget kept, valid first, the state folded), and a wrong variant is refused by name."""

from __future__ import annotations

import pytest
import torch

from hf_polyattn.ops import PolyAttention, decode, sparse
from recipes.experiments.retrieval import probe_selection


@pytest.fixture
def restored(monkeypatch):
    for obj, name in ((sparse.SparseMixin, "_sparse_call"), (sparse, "ring_leave"), (decode, "ring_leave"),
                      (sparse, "select_and_fold"), (PolyAttention, "fused_decode")):
        monkeypatch.setattr(obj, name, getattr(obj, name))
    probe_selection.STORED.clear()
    yield
    probe_selection.STORED.clear()


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit, match="VARIANT must be one of"):
        probe_selection.install("biggest")


@pytest.mark.parametrize("variant", ["frozen", "relative"])
def test_variants_keep_the_selection_contract(restored, variant):
    original = sparse.select_and_fold
    probe_selection.install(variant)
    assert sparse.select_and_fold is not original
    assert PolyAttention.fused_decode is False  # the probe watches the general ring step's selections
    g = torch.Generator().manual_seed(0)
    kv = torch.rand(1, 2, 8, 5, generator=g)
    feats, vext = torch.rand(1, 2, 12, 8, generator=g), torch.rand(1, 2, 12, 5, generator=g)
    vext[..., -1] = 1.0
    valid = torch.ones(1, 2, 12, dtype=torch.bool)
    valid[..., :2] = False  # two empty cache slots
    new_kv, keep, keep_valid = sparse.select_and_fold(kv, feats, vext, valid, 4)
    _, keep_ref, _ = original(kv, feats, vext, valid, 4)
    assert keep.shape == keep_ref.shape == (1, 2, 4) and keep_valid.all()
    kept = torch.zeros_like(valid).scatter_(-1, keep, True)
    folded = ((valid & ~kept).float().unsqueeze(-1) * feats).transpose(-1, -2) @ vext
    torch.testing.assert_close(new_kv, kv + folded)  # every valid key not kept is added to the state
    # the frozen rule keeps the scores of the kept keys for the next step of the same module
    assert probe_selection.STORED[None].shape == (1, 2, 4)


def test_rows_with_mass_give_the_library_rows(monkeypatch):
    """The probe's prefill rows (``_rows_with_mass``, on ``SparseMixin._sparse_parts``) give the library's output,
    with and without a running prefill's mass bookkeeping: the library's rows as tensors (gradients on; without
    them a float32 CPU call fuses the rows, test_sparse_cache.py)."""
    from hf_polyattn import PolyAttnConfig
    from hf_polyattn.ops import PolyAttention

    cfg = PolyAttnConfig(kind="linear", window=8, sinks=2, sparse_cache=4, sparse_chunk=4, decay="gate")
    mod = PolyAttention(cfg, 4, 8, 2)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 40, 8, generator=g) for h in (4, 2, 2))
    ref = mod(q, k, v, causal=True).detach()
    with torch.no_grad():
        monkeypatch.setattr(sparse.SparseMixin, "_sparse_rows", probe_selection._rows_with_mass)
        torch.testing.assert_close(mod(q, k, v, causal=True), ref, rtol=0, atol=0)
