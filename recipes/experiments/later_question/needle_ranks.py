"""Where a passkey needle's tokens rank, per layer and kv head of SmolLM2-135M's own softmax attention, under
statistics a bounded cache could rank keys by before any question is asked, beside the attention the question itself
gives them. Written to ``recipes/results/later_question/needle_ranks_<template>_<length>.json``.

    python -m recipes.experiments.later_question.needle_ranks --length 4096 --depth 0.25 --template vault

One forward of the whole prompt (document and question) with every key exact, computed by this script's own
attention function (registered with transformers' AttentionInterface, softmax in blocks of 512 queries). For each
key j past the 4 sinks and out of the last 128-token window at the document's end, and each kv head (its query
heads summed):

* ``late``: the attention j gets from document queries 128 or more tokens after it (what a streaming rule that
  scores a key once it left a 128-token window sees: ``sparse_score='attention'``);
* ``local``: from the queries within 128 tokens after it (while it is in the window);
* ``max``: the largest weight any document query gives it;
* ``value_norm``: |v_j| (``sparse_value_keys``);
* ``expected``: the attention a query drawn from the document's last 512 queries' distribution is expected to give
  it, times |v_j| (Expected Attention, Devoto et al. 2025, KVpress: a Gaussian (mu, Sigma) per query head,
  E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2), normalised over the candidates, summed over the query heads);
  query-agnostic and of constant size (mu, Sigma per head), so a streaming rule could keep it;
* ``reconstruct``: the largest weight j gets from a query that copies the document (KVzip, Kim et al., NeurIPS
  2025: after the document, "Repeat the previous context exactly:" and the document again, in chunks of
  ``--reconstruct-chunk`` tokens, each on the document's cache; max over the copying queries and the query heads):
  query-agnostic but a second pass over the document;
* ``question``: the attention from the question's queries (what a later question reads).

For each statistic: the share of candidate keys ranked above each needle key token (0: first, 1: last), the median
over the needle's key tokens, per layer and kv head; and the heads where the question puts the most of its attention
on the needle (the heads that answer). Why: choosing keys before the question, a rule keeps what later questions
need only if the needle ranks high under it in those heads."""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = ROOT / "recipes" / "results" / "later_question"
WINDOW, SINKS = 128, 4
STATS = ("late", "local", "max", "value_norm", "expected", "reconstruct", "question")
# the document queries whose statistics ``expected`` reads: those nearest where a later question starts
EXPECTED_QUERIES = 512
REPEAT = "\n\nRepeat the previous context exactly:\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--depth", type=float, default=0.25)
    p.add_argument("--template", default="classic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heads", type=int, default=10, help="answering heads reported (most question mass first)")
    p.add_argument("--reconstruct-chunk", type=int, default=1024,
                   help="document tokens copied per reconstruction call (KVzip's chunks)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.reconstruct_chunk < 1:
        p.error(f"--reconstruct-chunk must be a positive number of tokens, got {args.reconstruct_chunk}")

    import torch
    from transformers import AttentionInterface, AutoModelForCausalLM

    from hf_polyattn import cli, machine
    from hf_polyattn.eval.passkey import draw_passkey, passkey_prompt
    from hf_polyattn.integration import cache_kwargs, returned_cache

    torch.set_num_threads(args.threads)
    path = cli.resolve_model("smollm2")
    tok = cli.load_tokenizer(path)
    drawn = draw_passkey(random.Random(args.seed), args.template)
    prompt = passkey_prompt(tok, length=args.length, depth=args.depth, template=args.template, **drawn)
    n, doc = len(prompt.prompt), prompt.question_start
    layers: list[dict[str, torch.Tensor]] = []
    copying = {"on": False}  # the reconstruction calls: their queries only score ``reconstruct``

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        _, h, nq, _ = query.shape
        hkv, nk = key.shape[1], key.shape[2]
        g = h // hkv
        k, v = key.repeat_interleave(g, 1)[0], value.repeat_interleave(g, 1)[0]
        out = torch.empty_like(query)
        qpos = torch.arange(nk - nq, nk)  # the call's queries are the last nq positions (a cache before them)
        kpos = torch.arange(nk)
        if copying["on"]:
            best = torch.zeros(h, doc)
            for s in range(0, nq, 512):
                e = min(nq, s + 512)
                x = (query[0, :, s:e] @ k.transpose(-1, -2)) * scaling
                w = x.masked_fill(kpos[None, :] > qpos[s:e, None], float("-inf")).softmax(-1)
                out[0, :, s:e] = w @ v
                best = torch.maximum(best, w[:, :, :doc].amax(1))
            layer = layers[module.layer_idx]
            layer["reconstruct"][:, :doc] = torch.maximum(layer["reconstruct"][:, :doc], best.view(hkv, g, doc).amax(1))
            return out.transpose(1, 2).contiguous(), None
        acc = {name: torch.zeros(h, n) for name in ("late", "local", "max", "question")}
        for s in range(0, nq, 512):
            e = min(nq, s + 512)
            x = (query[0, :, s:e] @ k.transpose(-1, -2)) * scaling
            w = x.masked_fill(kpos[None, :] > qpos[s:e, None], float("-inf")).softmax(-1)
            out[0, :, s:e] = w @ v
            back = qpos[s:e, None] - kpos[None, :]
            in_doc = (qpos[s:e] < doc)[:, None]
            acc["late"] += (w * ((back >= WINDOW) & in_doc)).sum(1)
            acc["local"] += (w * ((back >= 0) & (back < WINDOW) & in_doc)).sum(1)
            acc["max"] = torch.maximum(acc["max"], (w * in_doc).amax(1))
            acc["question"] += (w * ~in_doc).sum(1)
        layer = {name: t.view(hkv, g, n).sum(1) for name, t in acc.items()}
        layer["value_norm"] = value[0].float().norm(dim=-1)
        # Expected Attention: a Gaussian fitted to the last EXPECTED_QUERIES document queries of each query head
        qd = query[0, :, max(0, doc - EXPECTED_QUERIES) : doc].float()  # (h, Q, d)
        mu = qd.mean(1)
        centred = qd - mu[:, None]
        sigma = centred.transpose(1, 2) @ centred / (qd.shape[1] - 1)  # (h, d, d)
        kf = k.float()
        log_w = scaling * (kf @ mu[:, :, None])[..., 0] + 0.5 * scaling**2 * ((kf @ sigma) * kf).sum(-1)  # (h, n)
        log_w[:, doc:] = float("-inf")  # the candidates are the document's keys
        layer["expected"] = log_w.softmax(-1).view(hkv, g, n).sum(1) * layer["value_norm"]
        layer["reconstruct"] = torch.zeros(hkv, n)
        layers.append(layer)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("needle_ranks", attention)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="needle_ranks", dtype=torch.float32)
    t0 = time.time()
    with torch.no_grad():
        cache = returned_cache(model(torch.tensor([prompt.prompt]), use_cache=True))
        # back to the document's cache (what a later question, and the copying queries, read): a negative crop
        # removes that many tokens in every transformers 5.x (5.25 refuses the older positive 'final length')
        cache.crop(doc - cache.get_seq_length())
        repeat = tok(REPEAT, add_special_tokens=False).input_ids
        copying["on"] = True
        for c in range(0, doc, args.reconstruct_chunk):
            model(torch.tensor([repeat + prompt.prompt[c : c + args.reconstruct_chunk]]), use_cache=True,
                  **cache_kwargs(cache))
            cache.crop(doc - cache.get_seq_length())
    needle = sorted(set(prompt.needle_positions))
    cand = torch.arange(SINKS, doc - WINDOW)
    at = torch.tensor([j - SINKS for j in needle])
    ranks = {}
    for name in STATS:
        per_layer = []
        for layer in layers:
            x = layer[name][:, cand]  # (Hkv, candidates)
            above = (x[:, :, None] > x[:, at][:, None, :]).float().mean(1)  # (Hkv, needle tokens)
            per_layer.append([round(float(r), 4) for r in above.median(-1).values])
        ranks[name] = per_layer
    mass = []
    for li, layer in enumerate(layers):
        q = layer["question"]
        share = q[:, needle].sum(-1) / q[:, SINKS:].sum(-1)
        mass += [(round(float(share[h]), 4), li, h) for h in range(q.shape[0])]
    mass.sort(reverse=True)
    top = mass[: args.heads]
    total = sum(m for m, _, _ in top)
    weighted = {name: round(sum(m * ranks[name][li][h] for m, li, h in top) / total, 4) for name in STATS}
    record = {"command": "python -m recipes.experiments.later_question.needle_ranks " + shlex.join(argv),
              "model": "smollm2", "template": args.template, "length": n, "depth": args.depth,
              "candidates": int(cand.numel()), "needle_tokens": needle,
              "answering_heads": [{"question_mass_on_needle": m, "layer": li, "kv_head": h,
                                   **{name: ranks[name][li][h] for name in STATS}} for m, li, h in top],
              "share_above_weighted_by_question_mass": weighted, "share_above": ranks,
              "machine": machine.summary(), "wall_s": round(time.time() - t0, 1)}
    OUT.mkdir(parents=True, exist_ok=True)
    path_out = OUT / f"needle_ranks_{args.template}_{args.length}.json"
    path_out.write_text(json.dumps(record, indent=1))
    print(json.dumps(weighted), "->", path_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
