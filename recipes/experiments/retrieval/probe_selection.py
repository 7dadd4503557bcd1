"""Probe of the sparse cache's selection rule (issue 32): `hf-polyattn eval` with ``ops.sparse.select_and_fold``
replaced by a variant, everything else as in the library.

    python -m recipes.experiments.retrieval.probe_selection VARIANT EVAL_ARGS...

The study's bounded caches retrieve at 4k only the needles of the last ~600 tokens, while the same model with a cache
holding every key retrieves 10 of 10 (SECTION_retrieval.md, row hh+all_keys_4k): the selection drops the needle.
The library scores every candidate (the cache, then the block that left the window) by its self-recall error
|v - phi(k) S_v / (phi(k) . S_1)| against the current state, re-scored at every block. Variants:

- ``frozen``: a cached key keeps the error it had when it entered the cache (a reservoir of the most surprising keys
  of the whole context, instead of the keys the recent state represents worst);
- ``relative``: the error divided by |v| (re-scored every block), so large values do not win by their norm.

A probe, not a library option: the state is kept per layer module in this process (``STORED``), which is right for
one sequence evaluated at a time (the passkey evaluation) and nothing else.
"""

from __future__ import annotations

import sys

import torch

from hf_polyattn.ops import decode, sparse

VARIANTS = ("frozen", "relative")
STORED: dict[int, torch.Tensor] = {}
CURRENT: dict[str, int | None] = {"module": None}


def install(variant: str) -> None:
    if variant not in VARIANTS:
        raise SystemExit(f"VARIANT must be one of {list(VARIANTS)}, got {variant!r}")
    original_call, original_leave = sparse.SparseMixin._sparse_call, sparse.ring_leave

    def sparse_call(self, *args, **kwargs):
        CURRENT["module"] = id(self)
        return original_call(self, *args, **kwargs)

    def ring_leave(module, *args, **kwargs):
        CURRENT["module"] = id(module)
        return original_leave(module, *args, **kwargs)

    def select_and_fold(kv, feats, vext, valid, budget, to_ref=None, decay=None):
        with torch.no_grad():
            err = torch.nan_to_num(sparse.recall_error(kv.detach(), feats.detach(), vext.detach()), nan=0.0)
            if variant == "relative":
                err = err / (torch.linalg.vector_norm(vext[..., :-1].detach(), dim=-1) + 1e-6)
            cache_valid = valid[..., :budget]
            stored = STORED.get(CURRENT["module"])
            if variant == "frozen" and stored is not None and stored.shape == cache_valid.shape \
                    and bool(cache_valid.any()):  # an empty cache starts a sequence: nothing stored applies
                err = torch.cat([torch.where(cache_valid, stored, err[..., :budget]), err[..., budget:]], dim=-1)
            keep = sparse.choose_kept(err, valid, budget)
            STORED[CURRENT["module"]] = err.gather(-1, keep)  # read only where the slot holds a valid key
        return sparse.fold_evicted(kv, feats, vext, valid, keep, to_ref, decay)

    sparse.SparseMixin._sparse_call = sparse_call
    sparse.ring_leave = decode.ring_leave = ring_leave
    sparse.select_and_fold = select_and_fold


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        raise SystemExit(f"usage: python -m recipes.experiments.retrieval.probe_selection {'|'.join(VARIANTS)} "
                         "EVAL_ARGS...")
    install(argv[0])
    from hf_polyattn.cli import main as cli_main

    return cli_main(["eval", *argv[1:]])


if __name__ == "__main__":
    raise SystemExit(main())
