"""What reading a prompt in forward calls of 2,048 tokens (``--prefill-chunk``, ``hf_polyattn.eval.turns.prefill``)
changes on the Gemma 3 270M checkpoint: the seconds of one read in one call and in chunks, and the largest
difference of the two reads' last logits (the prediction of the token after the prompt).

    python -m recipes.experiments.gemma3_270m.prefill_chunk --out DIR [--lengths 4096,16384] [--chunk 2048]

Why: transformers runs the checkpoint's 15 sliding layers (window 512) as full attention under a mask in one call,
so their cost grows as n^2; in chunks each call reads the cache's last 511 keys and its own. Writes
``prefill_chunk.json`` and ``.md`` to DIR. One thread, random token ids (a fixed seed), float32.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def measure(model, n: int, chunk: int, seed: int = 0) -> dict:
    from hf_polyattn.eval.turns import prefill

    ids = torch.randint(100, 20000, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        t0 = time.perf_counter()
        one = model(ids, use_cache=True, logits_to_keep=1).logits[0, -1]
        t_one = time.perf_counter() - t0
        t0 = time.perf_counter()
        cache = prefill(model, ids[:, :-1], chunk)
        from hf_polyattn import cache_kwargs

        chunked = model(ids[:, -1:], attention_mask=torch.ones(1, n, dtype=torch.long), use_cache=True,
                        logits_to_keep=1, **cache_kwargs(cache)).logits[0, -1]
        t_chunk = time.perf_counter() - t0
    return {"tokens": n, "chunk": chunk, "one_call_s": round(t_one, 1), "chunked_s": round(t_chunk, 1),
            "speedup": round(t_one / t_chunk, 2), "max_abs_logit_diff": float((one - chunked).abs().max()),
            "max_abs_logit": float(one.abs().max()), "same_argmax": bool(one.argmax() == chunked.argmax())}


def markdown(record: dict) -> str:
    lines = [f"Gemma 3 270M (the checkpoint), one read of random token ids: {record['machine']['cpu']}, "
             f"{record['machine']['threads']} thread, float32, transformers {record['transformers']} (load when it "
             f"started: {record['machine']['uptime']}):", "",
             "| tokens | one call (s) | calls of {} tokens (s) | speed-up | largest logit difference | same top token |"
             .format(record["rows"][0]["chunk"]), "|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['tokens']:,} | {r['one_call_s']} | {r['chunked_s']} | {r['speedup']:.2f}x | "
                     f"{r['max_abs_logit_diff']:.1e} (of {r['max_abs_logit']:.1f}) | "
                     f"{'yes' if r['same_argmax'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import transformers

    from hf_polyattn.checkpoints import load_model, resolve_checkpoint
    from hf_polyattn.machine import record as machine_record

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="4096,16384")
    p.add_argument("--chunk", type=int, default=2048)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model = load_model(resolve_checkpoint("gemma3"), dtype=torch.float32).eval()
    machine = machine_record()
    rows = [measure(model, int(n), a.chunk) for n in a.lengths.split(",")]
    record = {"rows": rows, "transformers": transformers.__version__, "machine": machine}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_chunk.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "prefill_chunk.md").write_text(markdown(record))
    print(markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
