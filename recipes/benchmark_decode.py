"""Per-token decode latency and cache memory: polysketch + PolyAttnCache vs sdpa + DynamicCache.

Same run, same weights (a small Llama built in code), contexts 1k / 4k / 16k:

    python recipes/benchmark_decode.py              # full: contexts 1024 4096 16384
    python recipes/benchmark_decode.py --quick      # contexts 256 1024, fewer steps

For each context the prompt is prefilled once per model, then ``--steps`` single-token
forwards of the two models are timed alternately (after ``--warmup`` untimed ones); the
table reports the median milliseconds per
token and the bytes held by the cache after the last step, and the sdpa / polysketch
ratios. A softmax cache grows by 2 * layers * kv_heads * head_dim * 4 bytes per token;
the polysketch state is F x (head_dim + 1) per kv head (F = r(r+1)/2 features), whatever
the context.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, HfArgumentParser, LlamaConfig, LlamaForCausalLM

import hf_polyattn
from hf_polyattn import PolyAttnCache, PolyAttnConfig, cache_kwargs, machine

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class BenchArgs:
    contexts: list[int] = field(default_factory=lambda: [1024, 4096, 16384],
                                metadata={"help": "prompt lengths to decode after"})
    steps: int = field(default=32, metadata={"help": "timed decode steps per context"})
    warmup: int = field(default=3, metadata={"help": "untimed decode steps before timing"})
    threads: int = field(default=2, metadata={"help": "torch threads"})
    layers: int = field(default=4, metadata={"help": "decoder layers"})
    hidden: int = field(default=256, metadata={"help": "hidden size"})
    heads: int = field(default=4, metadata={"help": "attention heads (head_dim = hidden / heads)"})
    kv_heads: int = field(default=4, metadata={"help": "key/value heads"})
    sketch_size: int = field(default=32, metadata={"help": "polysketch sketch size r"})
    local_exact: bool = field(default=False, metadata={"help": "polysketch with exact local blocks"})
    polyattn_json: str | None = field(default=None, metadata={
        "help": "a JSON dict of PolyAttnConfig fields for the polyattn model instead of plain polysketch, e.g. the "
                "long-context default; softmax_heads may be 'quarter': a quarter of the kv heads, spread over the "
                "layers (which heads does not change the cost)"})
    name: str | None = field(default=None, metadata={"help": "result file name (default: cpu-<threads>threads)"})
    prefill_chunk: int = field(default=4096, metadata={"help": "prefill in chunks of this many tokens"})
    quick: bool = field(default=False, metadata={"help": "contexts 256 1024, 8 steps: a smoke run"})
    out: str = field(default=str(RESULTS / "benchmark_decode"), metadata={"help": "where the table goes ('' = none)"})


def build(args: BenchArgs) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.contexts) + 64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def poly_config(args: BenchArgs) -> PolyAttnConfig:
    """Plain polysketch (sketch_size, local_exact), or the fields of --polyattn_json."""
    if not args.polyattn_json:
        return PolyAttnConfig(kind="polysketch", sketch_size=args.sketch_size, local_exact=args.local_exact)
    fields = json.loads(args.polyattn_json)
    if fields.get("softmax_heads") == "quarter":
        # a quarter of the kv heads, spread over the layers and heads
        total = args.layers * args.kv_heads
        fields["softmax_heads"] = [[i * 4 // args.kv_heads, i * 4 % args.kv_heads] for i in range(total // 4)]
    return PolyAttnConfig.from_dict({"kind": "polysketch", **fields})


def cache_bytes(cache) -> int:
    if isinstance(cache, PolyAttnCache):
        return cache.nbytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


@torch.inference_mode()
def prefill(model, cache, context: int, args: BenchArgs) -> torch.Tensor:
    gen = torch.Generator().manual_seed(context)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen)
    for start in range(0, context, args.prefill_chunk):  # chunked prefill keeps sdpa's memory in check
        out = model(prompt[:, start:start + args.prefill_chunk], **cache_kwargs(cache), use_cache=True,
                    logits_to_keep=1)
    return out.logits[:, -1:].argmax(-1)


@torch.inference_mode()
def decode_latency(runs: dict, context: int, args: BenchArgs) -> dict[str, tuple[float, int]]:
    """Median ms per decoded token and cache bytes, for each (model, cache) of ``runs``.

    The models' steps are interleaved (a, b, a, b, ...): on a shared machine both see the
    same background load, so the ratio stays meaningful even when absolute times drift.
    """
    tokens = {name: prefill(model, cache, context, args) for name, (model, cache) in runs.items()}
    times = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, (model, cache) in runs.items():
            t0 = time.perf_counter()
            out = model(tokens[name], **cache_kwargs(cache), use_cache=True)
            tokens[name] = out.logits[:, -1:].argmax(-1)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: (1e3 * statistics.median(times[name]), cache_bytes(cache)) for name, (_, cache) in runs.items()}


def main(args: BenchArgs) -> list[dict]:
    load_before = os.getloadavg()[0]
    if args.quick:
        args.contexts, args.steps, args.warmup = [256, 1024], 8, 2
    torch.set_num_threads(args.threads)
    softmax = build(args)
    poly = build(args)
    cfg = poly_config(args)
    hf_polyattn.convert(poly, cfg)
    label = cfg.spec.table_label(cfg)  # names the softmax kv heads too
    print(f"machine: {machine.describe()}")
    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv heads "
          f"(head_dim {args.hidden // args.heads}); {label}; median of {args.steps} decode steps")
    rows = []
    for context in args.contexts:
        res = decode_latency({"sdpa": (softmax, DynamicCache()), "poly": (poly, PolyAttnCache(poly))}, context, args)
        (sdpa_ms, sdpa_b), (poly_ms, poly_b) = res["sdpa"], res["poly"]
        rows.append(dict(context=context, sdpa_ms=sdpa_ms, poly_ms=poly_ms, sdpa_bytes=sdpa_b, poly_bytes=poly_b))
    lines = [f"machine: {machine.describe()}; load average before the run: "
             f"{load_before:.1f}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}",
             f"model: Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads / {args.kv_heads} kv "
             f"heads; {label}; median of {args.steps} decode steps", "",
             "| context | sdpa+DynamicCache ms/token | polyattn+PolyAttnCache ms/token | speed-up | "
             "sdpa cache | polyattn cache | cache ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        speedup = r["sdpa_ms"] / r["poly_ms"]
        lines.append(f"| {r['context']} | {r['sdpa_ms']:.2f} | {r['poly_ms']:.2f} | {speedup:.1f}x | "
                     f"{r['sdpa_bytes'] / 2**20:.1f} MiB | {r['poly_bytes'] / 2**20:.2f} MiB | "
                     f"{r['sdpa_bytes'] / r['poly_bytes']:.1f}x |")
    print()
    print("\n".join(lines[3:]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        name = args.name or f"cpu-{args.threads}threads{'-quick' if args.quick else ''}"
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        command = " ".join(["python", "recipes/benchmark_decode.py", *map(shlex.quote, sys.argv[1:])])
        (out / f"{name}.md").write_text(f"Run {stamp}: `{command}`\n\n" + "\n".join(lines) + "\n")
        (out / f"{name}.json").write_text(json.dumps({"date": stamp, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    (parsed,) = HfArgumentParser(BenchArgs).parse_args_into_dataclasses()
    main(parsed)
