"""Which keys a bounded sparse cache evicts, and how much attention the prompt's last queries gave them (issue 32).

One passkey prompt (as ``probe_observe_diag``: seed 0, the draw of that length alone) is prefilled through a saved
model with the given settings; the keys that are neither sinks, in the window / pending block, nor in the final
sparse cache are the evicted ones (folded into the kernel state). For each layer and kv head, the exact softmax
weights of the prompt's last ``--queries`` queries over every key (the model's own q, k, post-rotary: what the
question would read had every key stayed exact) give the share of attention mass the evicted keys carry, beside the
same count of keys drawn at random from the cached ones and the needle's share, and the evicted keys' most common
tokens.

``--then zero_late`` asks whether that mass or those keys' values is what an answer needs: the same prompt again with
every key exact, the prompt but its last ``--queries`` queries reading every value, then the evicted keys' values
set to 0 in the cache (their keys kept) for those queries and the answer. ``--kernel-estimate`` prints how the kernel
part, undecayed, would estimate the evicted keys' mass. The hooks of ``--then`` go on the modules
``hf_polyattn.reconfigure`` builds (it replaces them), and a run where they did not fire in every layer is refused.

    python -m recipes.experiments.retrieval.probe_evicted_mass MODEL --length 4096 --template vault --depth-index 0 \
        --set decay_max_horizon=256 --set sparse_cache=3840 [--evict random] [--then zero_late] [--kernel-estimate]
"""

from __future__ import annotations

import collections

import torch

from .probe_observe_diag import greedy_answer, kept_positions, load_prompt, prompt_parser, recorded_inputs


def evicted_positions(cached: torch.Tensor, keys: torch.Tensor, exact: set[int]) -> list[int]:
    """The positions of ``keys`` (n, d) that are neither in ``exact`` (the sinks, the window, the pending block) nor
    among the rows of ``cached`` (lambda, d): the keys a kv head's sparse cache evicted into the state."""
    kept = kept_positions(cached, keys)
    return [p for p in range(keys.shape[0]) if p not in kept and p not in exact]


def mass_per_key(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(n,) the softmax weight each of the n keys ``k`` (n, d) gets, averaged over the queries ``q`` (G, L, d) of
    the kv head's G query heads: what the rows would give every key had every key stayed exact."""
    w = torch.softmax((q.float() @ k.float().T) * scale, -1)
    return w.mean((0, 1))


@torch.no_grad()
def kernel_estimate(module, q: torch.Tensor, k: torch.Tensor, head: int, positions: list[int]) -> float:
    """The median over the queries ``q`` (G, L, d) of one kv head of |window_mix| phi(q) . sum_j phi(k_j) over the
    ``positions`` of ``k`` (n, d), divided by their exact sum_j exp(s q . k_j) (the model's own q, k): how well the
    kernel part, undecayed, would give back the mass of the keys evicted into it (1: exactly)."""
    from hf_polyattn.ops.reference import _kernel_inputs

    if not positions:
        return float("nan")
    g, lq, d = q.shape
    full_q = q.new_zeros(1, module.num_heads, lq, d)
    full_q[0, head * g:(head + 1) * g] = q
    full_k = k.new_zeros(1, module.num_kv_heads, k.shape[0], d)
    full_k[0, head] = k
    q5, k5, _ = _kernel_inputs(module, full_q, full_k)
    s = module.head_dim ** -0.5
    root = s ** 0.5 if module.feature_map.scaled_inputs else 1.0
    # the feature map may hold weights per kv head: it reads the whole (1, Hkv, G | 1, L, p) layout
    fq = module.feature_map(q5 * root, True)[0, head].double()  # (G, L, F)
    fk = module.feature_map(k5 * root, False)[0, head, 0, positions].double()  # (m, F)
    mix = module.window_mix.abs()[head].double()  # (G, 1, 1)
    est = mix[..., 0] * (fq @ fk.sum(0))  # (G, L)
    exact = torch.exp((q.double() @ k[positions].double().T) * s).sum(-1)
    return float((est / exact).median())


def merged_keys(k: torch.Tensor, positions: list[int], clusters: int, iters: int = 10) -> torch.Tensor:
    """(len(positions), d): each key of ``k`` (n, d) at ``positions`` replaced by the mean of its cluster, ``clusters``
    clusters by k-means (``iters`` Lloyd steps from evenly spaced keys; an empty cluster keeps its centre)."""
    x = k[positions].double()
    m = min(clusters, x.shape[0])
    centre = x[torch.linspace(0, x.shape[0] - 1, m).round().long()].clone()
    for _ in range(iters):
        assign = torch.cdist(x, centre).argmin(-1)
        for c in range(m):
            members = x[assign == c]
            if members.shape[0]:
                centre[c] = members.mean(0)
    assign = torch.cdist(x, centre).argmin(-1)
    return centre[assign].to(k.dtype)


def zero_state_values(state, keys: torch.Tensor, positions: dict[int, list[int]]) -> int:
    """Set to 0, in a prefilled layer's ``RecurrentState``, the values of the keys of ``keys`` (Hkv, n, d) at
    ``positions`` (per kv head) wherever the state holds them exactly (the sparse cache and the window); their keys
    stay, so they keep drawing attention. Returns how many were found."""
    found = 0
    for k_name, v_name in (("sparse_k", "sparse_v"), ("k", "v")):
        held_k, held_v = getattr(state, k_name), getattr(state, v_name)
        if held_k is None:
            continue
        for head, pos in positions.items():
            if not pos:
                continue
            same = (held_k[0, head][:, None, :] == keys[head][pos][None, :, :].to(held_k.dtype)).all(-1).any(-1)
            held_v[0, head][same] = 0
            found += int(same.sum())
    return found


def main(argv: list[str] | None = None) -> int:
    ap = prompt_parser(__doc__.split("\n\n")[0], "vault", 1)
    ap.add_argument("--queries", type=int, default=16, help="the prompt's last queries whose weights are summed")
    ap.add_argument("--then", choices=("none", "zero_evicted", "zero_random", "merge_evicted", "zero_late"),
                    default="none",
                    help="then prefill again with every key exact (sparse_cache = the prompt's length) and the values "
                    "of the evicted keys (zero_evicted) or of as many random cached ones (zero_random) set to 0 in "
                    "every layer and kv head, and print the greedy answer: whether the evicted keys matter by their "
                    "values or by the attention they draw. merge_evicted: the evicted keys' values 0 and each key "
                    "replaced by the mean of its cluster (--clusters per kv head, k-means): what M merged slots of "
                    "log-count weight (sum_j exp(s q.k_j) estimated as n_c exp(s q.mean_c) per cluster) would give. "
                    "zero_late: as zero_evicted, but the values are set to 0 in the cache after the prompt but its "
                    "last --queries queries, so every earlier query reads them")
    ap.add_argument("--clusters", type=int, default=1, help="merge_evicted's clusters per kv head")
    ap.add_argument("--kernel-estimate", action="store_true",
                    help="also print, per layer, how the kernel part would estimate the evicted keys' softmax mass "
                    "without decay: |window_mix| phi(q) . sum phi(k) over them, against their exact sum of "
                    "exp(s q.k) (the median ratio over the queries and query heads)")
    args = ap.parse_args(argv)
    import hf_polyattn
    from hf_polyattn.integration.state import HFPolyAttention

    tok, model, drawn, pp, ids = load_prompt(args)
    cfg = hf_polyattn.get_polyattn_config(model)
    n = ids.shape[1]
    needle = sorted(pp.needle_positions)
    modules = [m for m in model.modules() if isinstance(m, HFPolyAttention)]
    cache = hf_polyattn.PolyAttnCache(model)
    with recorded_inputs(modules, args.queries) as qk, torch.inference_mode():
        model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True)
    # exact beside the cache at the prompt's end: the sinks, then the window and the pending block (< window +
    # sparse_chunk keys); a key outside those that the cache does not hold was folded into the state
    recent = set(range(n - cfg.window - cfg.sparse_chunk, n)) | set(range(cfg.sinks))
    tokens = collections.Counter()
    gen = torch.Generator().manual_seed(0)
    rows, ev_mass, rnd_mass, nd_mass, counted = [], 0.0, 0.0, 0.0, 0
    zeroed, estimates = {}, {}
    for li, (layer, m) in enumerate(zip(cache.layers, modules)):
        q, k = qk[m]
        cached = layer.state.sparse_k[0]
        g = q.shape[0] // k.shape[0]
        row = []
        for head in range(k.shape[0]):
            evicted = evicted_positions(cached[head], k[head], recent)
            mass = mass_per_key(q[head * g:(head + 1) * g], k[head], m.head_dim ** -0.5)
            pool = sorted(set(range(n)) - set(evicted) - recent)
            pick = [pool[i] for i in torch.randperm(len(pool), generator=gen)[:len(evicted)].tolist()]
            e, r, nd = (float(mass[idx].sum()) if idx else 0.0 for idx in (evicted, pick, needle))
            if args.kernel_estimate:
                estimates.setdefault(li, []).append(kernel_estimate(m, q[head * g:(head + 1) * g], k[head], head,
                                                                    evicted))
            row.append((len(evicted), e, r, nd))
            chosen = pick if args.then == "zero_random" else evicted
            zeroed.setdefault(m, {})[head] = (chosen, merged_keys(k[head], chosen, args.clusters)
                                              if args.then == "merge_evicted" and chosen else None)
            ev_mass, rnd_mass, nd_mass, counted = ev_mass + e, rnd_mass + r, nd_mass + nd, counted + 1
            tokens.update(pp.prompt[p] for p in evicted)
        rows.append(row)
    print(f"key {drawn['key']} at tokens {needle} of {n}; settings {args.set}; eviction {args.evict}")
    print("per layer, kv heads: evicted count / their mass / the mass of as many random cached keys (every cached key "
          "when fewer) / the needle's")
    for li, row in enumerate(rows):
        print(f"{li}: " + "  ".join(f"{c} {e:.3f}/{r:.3f}/{nd:.3f}" for c, e, r, nd in row))
    print(f"mean over kv heads: evicted {ev_mass / counted:.4f}, random cached {rnd_mass / counted:.4f}, "
          f"needle {nd_mass / counted:.4f}")
    for li, heads in estimates.items():
        print(f"kernel estimate / exact evicted mass, layer {li}: " + " ".join(f"{x:.3g}" for x in heads))
    print("evicted tokens, most common: " + ", ".join(f"{tok.decode([t])!r} x{c}" for t, c in tokens.most_common(15)))
    if args.then == "none":
        return 0
    hf_polyattn.reconfigure(model, sparse_cache=n, sparse_observe=0)
    # reconfigure builds new attention modules: the hooks go on those, in the same layer order
    fresh = [m for m in model.modules() if isinstance(m, HFPolyAttention)]
    zeroed = {new: zeroed[old] for old, new in zip(modules, fresh, strict=True)}
    modules, fired = fresh, []

    def zero(module, a, kw):
        if len(a) < 3:
            raise NotImplementedError("the probe expects the attention's query, key and value as positional arguments")
        key, value = a[1].clone(), a[2].clone()
        if value.shape[2] == n:  # the prompt's call only: decoding's keys and values stay
            fired.append(module)
            for head, (positions, merged) in zeroed[module].items():
                value[:, head, positions] = 0
                if merged is not None:
                    key[:, head, positions] = merged.to(key.dtype)
        return (a[0], key, value, *a[3:]), kw

    cache = hf_polyattn.PolyAttnCache(model)
    hooks = []
    with torch.inference_mode():
        if args.then == "zero_late":
            # the prompt but its last queries with every value; then the evicted keys' values 0 in the cache, for
            # the last queries and the answer alone. This pass's own keys: above the first layer the hidden states
            # differ from the first pass's
            with recorded_inputs(modules) as inputs:
                model(ids[:, :-args.queries], **hf_polyattn.cache_kwargs(cache), use_cache=True)
            if len(inputs) != len(modules):
                raise RuntimeError(f"the keys were read in {len(inputs)} of {len(modules)} layers")
            found, wanted = 0, 0
            for layer, m in zip(cache.layers, modules):
                positions = {h: p for h, (p, _) in zeroed[m].items()}
                found += zero_state_values(layer.state, inputs[m][1], positions)
                wanted += sum(len(p) for p in positions.values())
            print(f"values set to 0 in {found} cache slots (the sparse cache and the window may both hold a key) "
                  f"for the {wanted} evicted keys")
            logits = model(ids[:, -args.queries:], **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[:, -1]
        else:
            hooks = [m.register_forward_pre_hook(zero, with_kwargs=True) for m in modules]
            logits = model(ids, **hf_polyattn.cache_kwargs(cache), use_cache=True).logits[:, -1]
    out = greedy_answer(model, cache, logits, args.new_tokens)
    for h in hooks:
        h.remove()
    if args.then != "zero_late" and len(fired) != len(modules):
        raise RuntimeError(f"the values were set to 0 in {len(fired)} of {len(modules)} layers")
    what = {"zero_evicted": "the evicted keys' values 0", "zero_random": "the random cached keys' values 0",
            "zero_late": f"the evicted keys' values 0 for the last {args.queries} queries and the answer alone",
            "merge_evicted": f"the evicted keys' values 0 and each key its cluster's mean ({args.clusters} per kv "
                             "head)"}
    print(f"every key exact, {what[args.then]}: answer {tok.decode(out)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
