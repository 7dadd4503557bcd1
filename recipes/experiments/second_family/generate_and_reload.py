"""Issue 30, item 5: the converted Gemma 3 shape through generate() and save -> reload (the row ``generate`` of
``rows.py``).

* which layers are which (``hf_polyattn.layer_layout``);
* greedy generation after a prompt longer than the global layers' window + sinks and the sliding layers' window:
  the tokens with the recurrent cache (``PolyAttnCache``, picked by generate) against the uncached forward
  recomputed at every step (``use_cache=False``), and the cache's bytes per layer after two lengths (constant in
  the converted layers, the last window - 1 keys in the sliding ones), beside the softmax model's DynamicCache;
* save -> reload of the converted folder: the same layout and bit-identical logits.

Writes one JSON file (``--out``) with the measured values and the generated text.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_polyattn
from hf_polyattn import machine
from hf_polyattn.data import load_text_data


def cache_bytes(out) -> list[int]:
    """Bytes each layer of a generate() cache holds (keys/values of a DynamicCache, the state of a PolyAttnCache)."""
    cache = out.past_key_values
    if isinstance(cache, hf_polyattn.PolyAttnCache):
        return [layer.nbytes() for layer in cache.layers]
    return [sum(t.numel() * t.element_size() for t in (layer.keys, layer.values)) for layer in cache.layers]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the softmax checkpoint (trained from scratch)")
    p.add_argument("--converted", required=True, help="its converted folder (hf-polyattn convert --out)")
    p.add_argument("--data", required=True, help="the text ('demo': the bundled Tiny Shakespeare, or a file); the "
                   "prompt is the start of its held-out tail")
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--new-tokens", type=int, nargs=2, default=[50, 150], help="two generation lengths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(a.converted)
    model = AutoModelForCausalLM.from_pretrained(a.converted).eval()
    base = AutoModelForCausalLM.from_pretrained(a.base).eval()
    data = load_text_data(a.data, tok, eval_fraction=0.1)
    ids = data.eval_ids[: a.prompt_tokens][None]
    kw = dict(do_sample=False, return_dict_in_generate=True, pad_token_id=tok.pad_token_id, eos_token_id=None)

    record = {"layout": hf_polyattn.layer_layout(model), "polyattn": hf_polyattn.get_polyattn_config(model).to_dict(),
              "prompt_tokens": int(ids.shape[1]), "generation": {}}
    for n in a.new_tokens:
        with torch.no_grad():
            cached = model.generate(ids, max_new_tokens=n, **kw)
            softmax = base.generate(ids, max_new_tokens=n, **kw)
        record["generation"][n] = {"cache_bytes_per_layer": cache_bytes(cached),
                                   "softmax_cache_bytes_per_layer": cache_bytes(softmax),
                                   "cache_class": type(cached.past_key_values).__name__}
    n = max(a.new_tokens)
    with torch.no_grad():
        uncached = model.generate(ids, max_new_tokens=n, use_cache=False, **kw)
    new = cached.sequences[0, ids.shape[1]:]
    record["cache_equals_no_cache"] = bool(torch.equal(new, uncached.sequences[0, ids.shape[1]:]))
    record["prompt_text_tail"] = tok.decode(ids[0, -60:])
    record["generated_text"] = tok.decode(new)
    record["softmax_generated_text"] = tok.decode(softmax.sequences[0, ids.shape[1]:])

    probe = data.eval_ids[: 2 * 512].view(2, 512)
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        model.save_pretrained(tmp)
        again = AutoModelForCausalLM.from_pretrained(tmp).eval()
        record["reload"] = {"same_layout": hf_polyattn.layer_layout(again) == record["layout"],
                            "identical_logits": bool(torch.equal(again(probe).logits, model(probe).logits)),
                            "probe": "2 x 512 held-out tokens"}
    record.update(wall_s=round(time.time() - t0, 1), cpu_s=round(time.process_time(), 1), machine=machine.record())
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("cache_equals_no_cache", "reload", "generation")}, indent=1))


if __name__ == "__main__":
    main()
