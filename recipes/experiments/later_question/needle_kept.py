"""Which of a passkey needle's tokens the training-free matched-memory sparse cache still holds after reading the
document alone (the question not yet asked), per layer and kv head of SmolLM2-135M-Instruct, in the heads where the
question puts the most attention on the needle (``needle_ranks_<template>_<length>.json``, same prompt). Written to
``recipes/results/later_question/needle_kept_<template>_<length>_value<V>[_pool<P>].json``.

    python -m recipes.experiments.later_question.needle_kept --length 8000 --template vault --value-keys 1536

Why: with 1,536 or all 2,048 of the cache's keys chosen by |v|, the question asked in a later turn finds the 8k
needle in 1-2 of 5 prompts (recipes/results/ruler_matched) although the needle ranks in the top 14-15% of the
document's keys by |v| (``needle_ranks``), inside the 26% that 2,048 keys of 7,800 hold. This reads the cache
itself: is the needle kept where the question looks, and in how many of its tokens?

The cache's kept values are matched to the document's tokens by the values the model computed for them in the same
forward (``v_proj`` hooked; values carry no rotary position, so a kept slot is the token whose value it equals).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time

from recipes.experiments.later_question.needle_ranks import OUT, SINKS, WINDOW


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--depth", type=float, default=0.25)
    p.add_argument("--template", default="vault")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=int, default=2048, help="sparse_cache: the selected keys")
    p.add_argument("--value-keys", type=int, default=0, help="sparse_value_keys (0: off)")
    p.add_argument("--value-pool", type=int, default=5, help="sparse_value_pool")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn import cli, machine
    from hf_polyattn.eval.long_context import matched_memory_config
    from hf_polyattn.eval.passkey import draw_passkey, passkey_prompt
    from hf_polyattn.integration import returned_cache

    torch.set_num_threads(args.threads)
    ranks_file = OUT / f"needle_ranks_{args.template}_{args.length}.json"
    if not ranks_file.is_file():
        p.error(f"--length {args.length} / --template {args.template}: run needle_ranks first ({ranks_file} missing: "
                "it names the answering heads)")
    ranks = json.loads(ranks_file.read_text())
    if ranks["depth"] != args.depth:
        p.error(f"--depth {args.depth}: {ranks_file.name} was measured at depth {ranks['depth']}")
    path = cli.resolve_model("smollm2")
    tok = cli.load_tokenizer(path)
    drawn = draw_passkey(random.Random(args.seed), args.template)
    prompt = passkey_prompt(tok, length=args.length, depth=args.depth, template=args.template, **drawn)
    doc = prompt.question_start
    needle = sorted(set(prompt.needle_positions))
    assert needle == ranks["needle_tokens"], "not the prompt needle_ranks measured"

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    selection = {"sink_position": "own", "sparse_observe": 16}
    if args.value_keys:
        selection.update(sparse_value_keys=args.value_keys, sparse_value_pool=args.value_pool)
    cfg = matched_memory_config(args.cache, sinks=SINKS, window=WINDOW, **selection)
    hf_polyattn.convert(model, cfg)
    values: list[torch.Tensor] = []
    hkv = model.config.num_key_value_heads
    d = model.config.hidden_size // model.config.num_attention_heads
    hooks = [layer.self_attn.v_proj.register_forward_hook(
        lambda m, i, o: values.append(o[0].detach().view(-1, hkv, d).transpose(0, 1)))  # (Hkv, n, d)
        for layer in model.model.layers]
    t0 = time.time()
    ids = torch.tensor([prompt.prompt[:doc]])
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    for h in hooks:
        h.remove()
    cache = returned_cache(out)
    n_layers = len(model.model.layers)
    if len(values) % n_layers:
        raise RuntimeError(f"{len(values)} v_proj calls for {n_layers} layers")
    # a long prefill may run the layers over the document in pieces, in order: each layer's pieces joined
    values = [torch.cat(values[li::n_layers], dim=1) for li in range(n_layers)]
    assert all(v.shape[1] == doc for v in values), [v.shape for v in values]
    kept_share = []  # per layer: per kv head, the share of the needle's tokens in the sparse cache
    # the same share if the reserve were the document's top sparse_value_keys by |v| max-pooled over the text's own
    # neighbours, chosen once with the whole document known (no streaming): what the rule could keep at best
    cand = torch.arange(SINKS, doc - WINDOW)  # needle_ranks' candidates
    global_share = []
    for li, v_all in enumerate(values):
        state = cache.layers[li].state
        sv, smask = state.sparse_v[0], state.sparse_mask[0]  # (Hkv, S, d), (Hkv, S)
        per_head, per_global = [], []
        for h in range(hkv):
            slots = sv[h][smask[h]].float()
            # the difference form (no matmul rounding): 0 exactly where a slot holds that token's value (repeated
            # filler can give several tokens one value: any of them counts)
            dist = torch.cdist(slots, v_all[h].float(), compute_mode="donot_use_mm_for_euclid_dist")  # (kept, n)
            equal = dist == 0
            if not bool(equal.any(-1).all()):
                raise RuntimeError(f"layer {li} kv head {h}: a kept value matches no token's value")
            held = set(equal.any(0).nonzero()[:, 0].tolist())
            per_head.append(round(sum(j in held for j in needle) / len(needle), 4))
            if args.value_keys:
                own = v_all[h].float().norm(dim=-1)
                pooled = torch.nn.functional.max_pool1d(own[None, None], args.value_pool, 1,
                                                        args.value_pool // 2)[0, 0]
                order = torch.argsort(pooled[cand] + 1e-6 * own[cand], descending=True, stable=True)
                best = set(cand[order[: args.value_keys]].tolist())
                per_global.append(round(sum(j in best for j in needle) / len(needle), 4))
        kept_share.append(per_head)
        global_share.append(per_global)
    heads = [{**{k: a[k] for k in ("question_mass_on_needle", "layer", "kv_head", "value_norm")},
              "needle_tokens_kept": kept_share[a["layer"]][a["kv_head"]],
              **({"needle_tokens_in_global_top": global_share[a["layer"]][a["kv_head"]]} if args.value_keys else {})}
             for a in ranks["answering_heads"]]
    total = sum(a["question_mass_on_needle"] for a in heads)
    weighted = round(sum(a["question_mass_on_needle"] * a["needle_tokens_kept"] for a in heads) / total, 4)
    global_weighted = round(sum(a["question_mass_on_needle"] * a.get("needle_tokens_in_global_top", 0)
                                for a in heads) / total, 4) if args.value_keys else None
    record = {"command": "python -m recipes.experiments.later_question.needle_kept " + shlex.join(argv),
              "model": "smollm2", "template": args.template, "length": len(prompt.prompt), "document": doc,
              "depth": args.depth, "sparse_cache": args.cache, "sparse_value_keys": args.value_keys,
              "sparse_value_pool": args.value_pool if args.value_keys else None, "needle_tokens": needle,
              "answering_heads": heads, "kept_weighted_by_question_mass": weighted,
              "global_top_weighted_by_question_mass": global_weighted, "kept": kept_share,
              "machine": machine.summary(), "wall_s": round(time.time() - t0, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    pool = f"_pool{args.value_pool}" if args.value_keys and args.value_pool != 5 else ""
    path_out = OUT / f"needle_kept_{args.template}_{args.length}_value{args.value_keys}{pool}.json"
    path_out.write_text(json.dumps(record, indent=1))
    print(json.dumps({"weighted": weighted, "global": global_weighted}), "->", path_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
