"""Where the needle goes under a selection rule (issue 32): one classic passkey prompt prefilled with a
``probe_selection`` mass variant installed (``plumbing`` is the library's rule), and for every layer and kv head
whether the key's tokens (both mentions) entered the sparse cache when their block was scored, their rank among
the candidates then, and whether they are still cached when the question starts.

    python -m recipes.experiments.retrieval.probe_selection_diag VARIANT MODEL --length 4096 --depth 0.45 \
        --sparse-cache 128 [--json OUT]
"""

from __future__ import annotations

import argparse
import json

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("model")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depth", type=float, default=0.45)
    ap.add_argument("--sparse-cache", type=int, default=128)
    ap.add_argument("--seed-index", type=int, default=4, help="which of the eval's draws (seed 0) gives the key")
    ap.add_argument("--json")
    args = ap.parse_args()
    from . import probe_selection as probe

    tok, model, pp, drawn = probe.passkey_setup(args.model, args.sparse_cache, args.length, args.depth,
                                                args.seed_index)
    ids = torch.tensor([pp.prompt])
    needle = sorted(pp.needle_positions)
    probe.install(args.variant)
    # the oracles' pins (the eval's prompt builder, which sets them in an eval, is not called here)
    probe.PINNED["positions"] = list(needle)
    if args.variant == "oracle_needle":
        from hf_polyattn.eval import passkey

        n_ids, at = passkey._needle(tok, passkey._template("classic"), passkey._encode(tok, " " + drawn["key"]), None)
        start = needle[0] - at[0]
        assert pp.ids[start : start + len(n_ids)] == n_ids
        probe.PINNED["positions"] = list(range(start, start + len(n_ids)))
    probe.DIAG = []
    probe.LAST = []
    with torch.no_grad():
        model(ids, use_cache=True)
    layers = [id(m) for m in model.modules() if hasattr(m, "_sparse_call")]
    budget = args.sparse_cache
    report = {"variant": args.variant, "length": ids.shape[1], "depth": args.depth, "key": drawn["key"],
              "needle_positions": needle, "layers": []}
    for li, mid in enumerate(layers):
        steps = [(c, s, k) for m, c, s, k in probe.DIAG if m == mid]
        hkv = steps[0][0].shape[1]
        heads = []
        for h in range(hkv):
            entered, ranks, final = 0, [], 0
            for pos in needle:
                idx = budget + pos
                for cand, score, keep in steps:
                    c = cand[0, h]
                    hit = (c == idx).nonzero()
                    if len(hit) and int(hit[0, 0]) >= budget:  # the step that scored its block
                        j = int(hit[0, 0])
                        ranks.append(int((score[0, h] > score[0, h, j]).sum()) + 1)
                        entered += int(bool((keep[0, h] == j).any()))
                        break
            last_cand, _, last_keep = steps[-1]
            cached = set(last_cand[0, h].gather(-1, last_keep[0, h]).tolist())
            final = sum(int(budget + pos in cached) for pos in needle)
            heads.append({"entered": entered, "rank_min": min(ranks) if ranks else None,
                          "rank_median": sorted(ranks)[len(ranks) // 2] if ranks else None, "cached_at_end": final})
        report["layers"].append(heads)
        print(f"layer {li:2d}: " + "  ".join(f"h{h}: in {x['entered']}/{len(needle)} rank {x['rank_min']}.."
                                             f"{x['rank_median']} end {x['cached_at_end']}"
                                             for h, x in enumerate(heads)))
    # the question's last query (the one that gives the answer's first token): the probability it puts on the key's
    # tokens (every mention, wherever they are held) and the kernel part's share of its row, per layer (sum over the
    # layer's query heads of the key's probability; mean over them of the kernel share)
    last = {mid: (p, pos, far) for mid, p, pos, far in probe.LAST}
    report["last_query"] = []
    for mid in layers:
        p, pos, far = last[mid]
        on_key = torch.zeros_like(pos, dtype=torch.bool)
        for q in needle:
            on_key |= pos == q
        key_p = (p * on_key[:, :, None, :].to(p.dtype)).sum(-1)  # (B, Hkv, G)
        report["last_query"].append({"key_prob_per_head": key_p[0].flatten().tolist(),
                                     "kernel_share_per_head": far[0].flatten().tolist()})
    kp = [sum(x["key_prob_per_head"]) for x in report["last_query"]]
    ks = [sum(x["kernel_share_per_head"]) / len(x["kernel_share_per_head"]) for x in report["last_query"]]
    mx = [max(x["key_prob_per_head"]) for x in report["last_query"]]
    print("last query, per layer: key probability summed over the 9 query heads / its largest head / mean kernel "
          "share of the row")
    print("  " + "  ".join(f"{li}:{a:.2f}/{m:.2f}/{b:.2f}" for li, (a, m, b) in enumerate(zip(kp, mx, ks))))
    tot_in = sum(x["entered"] for hs in report["layers"] for x in hs)
    tot_end = sum(x["cached_at_end"] for hs in report["layers"] for x in hs)
    n = len(needle) * sum(len(hs) for hs in report["layers"])
    print(f"key tokens {needle} (key {drawn['key']}): entered the cache {tot_in}/{n} (layer, head, token), "
          f"still cached at the question {tot_end}/{n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
