"""Probe (issue 32): what one merged slot of the evicted keys would give a bounded sparse cache's perplexity.

``probe_position_loss`` finds a linear-only retrofit's loss gap growing along an 8k window once its cache evicts
(the keys it folds into a kernel state that, with ``decay_max_horizon`` 256, forgets them within ~256 tokens). Here
every kv head also keeps one slot for everything it evicted: the sum of the evicted keys (post-rotary, the model's
own) and of their [v, 1], scored as one more exact key k_mean = sum k / n with the [sum v, n] value, i.e. weight
n exp(s q . k_mean) on the mean value (a lower bound of sum exp(s q . k_i) by Jensen's inequality). Only the
chunked prefill path (``SparseMixin._sparse_call``) gets it, by rewriting that method's source at three anchors (an
anchor that moved is refused, not skipped); the fused CPU rows (``window_flash.rows_flash``, which read a unit
normaliser column) are switched off, and ``sparse_observe``'s re-computed last rows, decoding and the saved state do
not see the slot. So it is a perplexity probe, not a library option.

    python -m recipes.experiments.retrieval.probe_mass_slot [--no-slot] smollm2 \
        'runs/retrieval/hh/model|decay_max_horizon=256,sparse_cache=2048,sparse_observe=16,sink_span=1024' \
        [probe_position_loss's options]

``--no-slot`` runs the same rewritten path without the slot (the check that the rewrite alone changes nothing).
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import torch

ANCHORS = (
    ("        kv_in = kv  #",
     "        m_k = torch.zeros(b, hkv, pool_raw.shape[-1], dtype=work, device=device)\n"
     "        m_v = torch.zeros(b, hkv, e_dim, dtype=work, device=device)\n"
     "        kv_in = kv  #"),
    ("                active = (epoch * chunk + w - 1 <= last)[:, None]  # rows whose queries reach this epoch\n",
     "                active = (epoch * chunk + w - 1 <= last)[:, None]  # rows whose queries reach this epoch\n"
     "                kept_ = torch.zeros_like(cand_valid).scatter_(-1, keep, True)\n"
     "                ev_ = (cand_valid & ~kept_).to(work)[..., None]\n"
     "                m_k = torch.where(active[..., None], m_k + (ev_ * _take(pool_raw, cand)).sum(2), m_k)\n"
     "                m_v = torch.where(active[..., None], m_v + (ev_ * _take(pool_vext, cand)).sum(2), m_v)\n"),
    ("_take(pool_raw, cache_idx), _take(pool_vext, cache_idx), cache_valid,",
     "*_with_mass_slot(_take(pool_raw, cache_idx), _take(pool_vext, cache_idx), cache_valid, m_k, m_v),"),
)


def with_mass_slot(ck, cv, c_valid, m_k, m_v, slot: bool = True):
    """The cache's keys (B, Hkv, lambda, d), [v, 1] (B, Hkv, lambda, d + 1) and validity, with one more slot per kv
    head when ``slot``: key sum k / n, value [sum v, n] (``m_k``, ``m_v``: the evicted keys' sums), valid when n > 0."""
    if not slot:
        return ck, cv, c_valid
    n = m_v[..., -1]
    mean = m_k / n.clamp(min=1)[..., None]
    return (torch.cat([ck, mean[:, :, None]], 2), torch.cat([cv, m_v[:, :, None]], 2),
            torch.cat([c_valid, (n > 0)[..., None]], 2))


def install(slot: bool = True) -> None:
    """Replace ``SparseMixin._sparse_call`` by its source with the slot's three insertions (module docstring)."""
    from functools import partial

    from hf_polyattn.ops import sparse

    # the library's method, also when a rewritten one is installed (installing twice switches the slot)
    original = getattr(sparse.SparseMixin._sparse_call, "library_method", sparse.SparseMixin._sparse_call)
    src = inspect.getsource(original)
    for anchor, new in ANCHORS:
        if src.count(anchor) != 1:
            raise SystemExit(f"probe_mass_slot: SparseMixin._sparse_call changed; anchor not found once: {anchor!r}")
        src = src.replace(anchor, new)
    namespace = dict(vars(sparse), _with_mass_slot=partial(with_mass_slot, slot=slot))
    exec(textwrap.dedent(src), namespace)  # noqa: S102 - the library's own method, rewritten at fixed anchors
    namespace["_sparse_call"].library_method = original
    sparse.SparseMixin._sparse_call = namespace["_sparse_call"]
    sparse.SparseMixin.fused_rows = False


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    slot = "--no-slot" not in argv
    if not slot:
        argv.remove("--no-slot")
    install(slot)
    from .probe_position_loss import main as position_loss

    name = "python -m recipes.experiments.retrieval.probe_mass_slot"
    return position_loss(argv, name if slot else name + " --no-slot")


if __name__ == "__main__":
    raise SystemExit(main())
