"""``hf-polyattn bench --engine vllm``: a converted folder and its base model in vLLM, in one run.

Each model runs in its own process (``LLM`` starts an engine per process), one after the other, with the same
engine settings: the same KV-cache memory (``--kv_cache_gib``), prefix caching off for both (the plugin switches it
off for converted folders; a base that reused cached prompts would be timed on less work), the same seeded random
prompts (token ids; no tokenizer), greedy decoding that ignores end-of-sequence. Per context length L:

* ``prefill_s``: one prompt of L tokens, until its first token (best of ``--repeats``);
* ``decode_ms``: batch 1, the mean time between the next n tokens' arrivals: the decoding step after L tokens;
* ``batch_tok_s``: ``--batch`` prompts of L tokens at once, the tokens of the steps after every request has its
  first token over those steps' time: output tokens per second of decoding, the prefill left out.

Requests go through vLLM's engine step by step (``LLMEngine.add_request`` / ``step``), each output timed as it
arrives, so that a figure never subtracts two runs' prefill times;
* ``kv_tokens`` / ``concurrency``: vLLM's own account of the KV memory (its log line "KV cache size: N tokens,
  Maximum concurrency for M tokens per request: Cx"), with ``max_model_len`` the longest L plus the decoded
  tokens: how many sequences of that length the same memory holds.

Ratios are the converted folder's speed over the base's (>1: faster). Results are written as JSON with the command,
the machine, the thread count and the load on the machine before and after (``os.getloadavg``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

__all__ = ["main", "run_bench"]

_CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
                       r"([\d.]+)x")


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _measure(args) -> dict:
    """One model's figures (runs in the child process)."""
    import itertools

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lengths = [int(x) for x in args.lengths.split(",")]
    max_len = max(lengths) + args.decode_tokens + 1
    llm = LLM(model=args.one, dtype=args.dtype, max_model_len=max_len, enable_prefix_caching=False,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2 ** 30), max_num_seqs=max(args.batch, 1),
              skip_tokenizer_init=True, seed=0, enforce_eager=args.eager)
    engine = llm.llm_engine
    vocab = engine.model_config.get_vocab_size()
    ids = itertools.count()

    def run(prompts, tokens) -> dict:
        """The requests through the engine's steps, each output's arrival timed: ``prefill_s`` until every request
        has its first token, then the decoding steps (every request past its prefill) and their tokens."""
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        names = []
        for p in prompts:
            names.append(f"bench-{next(ids)}")
            engine.add_request(names[-1], TokensPrompt(prompt_token_ids=p), params)
        start = last = time.perf_counter()
        produced = dict.fromkeys(names, 0)
        first_all, decode_s, decode_tokens, steps = None, 0.0, 0, 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            new = 0
            for o in outs:
                n = len(o.outputs[0].token_ids)
                new += n - produced[o.request_id]
                produced[o.request_id] = n
            if first_all is not None and new:
                decode_s, decode_tokens, steps = decode_s + now - last, decode_tokens + new, steps + 1
            if first_all is None and all(produced.values()):
                first_all = now
            if new:
                last = now
        assert all(n == tokens for n in produced.values())
        return {"prefill_s": first_all - start, "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
                "step_ms": 1000 * decode_s / steps if steps else 0.0}

    seed = 1
    run(_prompts(1, 16, vocab, 0), 4)  # warm-up: the first call pays one-time costs
    rows = {}
    for length in lengths:
        best = {"prefill_s": float("inf"), "decode_ms": float("inf"), "batch_tok_s": 0.0}
        for _ in range(args.repeats):
            seed += 1
            one = run(_prompts(1, length, vocab, seed), 1 + args.decode_tokens)
            best["prefill_s"] = min(best["prefill_s"], one["prefill_s"])
            best["decode_ms"] = min(best["decode_ms"], one["step_ms"])
            if args.batch > 1 and length <= args.batch_max_length:
                seed += 1
                many = run(_prompts(args.batch, length, vocab, seed), 1 + args.decode_tokens)
                best["batch_tok_s"] = max(best["batch_tok_s"], many["decode_tok_s"])
        rows[str(length)] = best
    result = {"rows": rows, "max_model_len": max_len}
    hf_config = engine.model_config.hf_config
    if getattr(hf_config, "polyattn", None) is not None:  # a converted folder: how its states share state layers
        from .servable import state_plan

        plan = state_plan(hf_config, max_len, engine.model_config.dtype)
        result["state_plan"] = {"per_module": plan.per_module, "modules": plan.modules}
    return result


def _run_one(model: str, args) -> dict:
    cmd = [sys.executable, "-m", "hf_polyattn.serving.vllm.bench", "--one", model, "--lengths", args.lengths,
           "--batch", str(args.batch), "--batch_max_length", str(args.batch_max_length), "--decode_tokens",
           str(args.decode_tokens), "--repeats", str(args.repeats), "--kv_cache_gib", str(args.kv_cache_gib),
           "--dtype", args.dtype] + (["--eager"] if args.eager else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM on {model} failed (exit {proc.returncode}):\n{log[-4000:]}")
    result = json.loads(next(s for s in proc.stdout.splitlines() if s.startswith("{")))
    found = _CAPACITY.search(log)
    if found is None:
        raise RuntimeError(f"vLLM's KV cache capacity line was not in its log for {model}")
    result["kv_tokens"] = int(found.group(1).replace(",", ""))
    result["concurrency"] = float(found.group(3))
    result["wall_s"] = round(time.perf_counter() - start, 1)
    return result


def run_bench(args) -> dict:
    load_before = os.getloadavg()
    base = _run_one(args.base, args)
    model = _run_one(args.model, args)
    ratios = {}
    for length, row in model["rows"].items():
        b = base["rows"][length]
        ratios[length] = {"prefill": b["prefill_s"] / row["prefill_s"], "decode": b["decode_ms"] / row["decode_ms"]}
        if row["batch_tok_s"] and b["batch_tok_s"]:
            ratios[length]["batch_tok_s"] = row["batch_tok_s"] / b["batch_tok_s"]
    ratios["concurrency"] = model["concurrency"] / base["concurrency"]
    import vllm

    return {"command": "hf-polyattn bench --engine vllm " + " ".join(sys.argv[1:]) if args.command is None
            else args.command, "model": args.model, "base": args.base, "vllm": vllm.__version__,
            "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                        "threads": args.threads, "load_before": load_before, "load_after": os.getloadavg()},
            "settings": {k: getattr(args, k) for k in ("lengths", "batch", "batch_max_length", "decode_tokens",
                                                        "repeats", "kv_cache_gib", "dtype", "eager")},
            "base_rows": base, "model_rows": model, "ratios": ratios}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-polyattn bench --engine vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="the converted folder")
    p.add_argument("--base", help="its base model (a folder or a name vLLM loads)")
    p.add_argument("--lengths", default="4096,8192", help="context lengths, comma-separated (default: 4096,8192)")
    p.add_argument("--batch", type=int, default=16, help="sequences decoded at once for batch_tok_s (default: 16)")
    p.add_argument("--batch_max_length", type=int, default=4096,
                   help="the longest context batch_tok_s is measured at (default: 4096)")
    p.add_argument("--decode_tokens", type=int, default=32, help="tokens decoded per timing (default: 32)")
    p.add_argument("--repeats", type=int, default=1, help="timings per figure, the best kept (default: 1)")
    p.add_argument("--kv_cache_gib", type=float, default=4.0, help="KV cache memory of each engine (default: 4)")
    p.add_argument("--dtype", default="float32", help="vLLM dtype (default: float32)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP threads (default: every CPU)")
    p.add_argument("--eager", action="store_true", help="vLLM's enforce_eager (no torch.compile)")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one model's figures
    p.add_argument("--command", default=None, help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.one:
        print(json.dumps(_measure(args)))
        return 0
    if not args.model or not args.base:
        parser().error("--model and --base are required")
    result = run_bench(args)
    text = json.dumps(result, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
