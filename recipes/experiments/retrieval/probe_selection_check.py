"""Check of ``probe_selection``'s mass variants against the library (issue 32): one classic passkey prompt, greedy
decoding with the step logits, first with the library, then with the probe installed (in the same process).

    python -m recipes.experiments.retrieval.probe_selection_check VARIANT MODEL --length N --sparse-cache LAMBDA

``plumbing`` (the library's rule through the probe's bookkeeping) must give the library's logits at any budget;
``h2o`` / ``h2o_window`` must give them when the budget keeps every key (LAMBDA >= N). Also checked: the decoding
step's recomputed normaliser reproduces the step's output (``install(check_ring=True)``), and no query gives more
than its whole row (the masses a prefill's query spreads over the keys sum to at most 1 per query head).
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--sparse-cache", type=int, default=128)
    ap.add_argument("--depth", type=float, default=0.35)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args()
    import hf_polyattn

    from . import probe_selection as probe

    tok, model, pp, drawn = probe.passkey_setup(args.model, args.sparse_cache, args.length, args.depth)
    ids = torch.tensor([pp.prompt])

    def run():
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                 do_sample=False, pad_token_id=tok.eos_token_id, output_logits=True,
                                 return_dict_in_generate=True)
        text = tok.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
        return torch.stack(out.logits), text, time.time() - t0

    lib, lib_text, t_lib = run()
    probe.install(args.variant, check_ring=True)
    probe.CHECK["rows"] = True
    got, got_text, t_probe = run()
    diff = (lib - got).abs().max().item()
    print(f"prompt {ids.shape[1]} tokens, key {drawn['key']}, sparse_cache={args.sparse_cache}")
    print(f"library: {lib_text!r} ({t_lib:.1f} s); probe {args.variant}: {got_text!r} ({t_probe:.1f} s)")
    print(f"max |logit difference| over {lib.shape[0]} steps: {diff:.3g}; same tokens: {lib_text == got_text}")
    ok = diff < 1e-3 and lib_text == got_text
    # the prefill's masses in the ring's slots: prefill L tokens and decode one == prefill L + 1 tokens, compared
    # as sorted values of the waiting block and the window (the ring's order differs), no block boundary between
    cfg = hf_polyattn.get_polyattn_config(model)
    mid = id(next(m for m in model.modules() if hasattr(m, "_sparse_call")))
    n = ids.shape[1] - 1
    while (n - cfg.window) % cfg.sparse_chunk in (0, cfg.sparse_chunk - 1):
        n -= 1
    s, lam = cfg.sinks, cfg.sparse_cache
    with torch.no_grad():
        past = model(ids[:, :n], use_cache=True).past_key_values
        model(ids[:, n : n + 1], past_key_values=past, use_cache=True)
        stepped = probe.RING[mid]["mass"][..., s + lam :].sort(-1).values
        model(ids[:, : n + 1], use_cache=True)
        fresh = probe.PREFILL_RING.pop(mid)[..., s + lam :].sort(-1).values
    slot_diff = (stepped - fresh).abs().max().item()
    print(f"ring slots after prefill {n} + 1 step vs prefill {n + 1}: max |mass difference| {slot_diff:.3g} "
          f"(masses up to {float(fresh.max()):.3g})")
    ok = ok and slot_diff < 1e-3 * max(1.0, float(fresh.max()))
    masses = [st["mass"] for st in probe.RING.values()]
    print(f"decode rings tracked: {len(masses)}; slot mass range {min(float(m.min()) for m in masses):.3g} .. "
          f"{max(float(m.max()) for m in masses):.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
