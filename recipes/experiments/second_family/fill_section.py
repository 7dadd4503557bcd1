"""Write recipes/results/SECTION_second_family.md from recipes/results/second_family/.

    .venv/bin/python -m recipes.experiments.second_family.fill_section

Every number comes from the files the study's rows wrote (``python recipes/experiments/run.py second_family``):
``train.json`` (the scratch run), ``convert.txt``, ``generate.json`` (layout, generation, cache bytes, reload,
machine) and ``long_context_{linear,streaming}.{json,md}``. Nothing is measured here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from recipes.experiments import section_main

# softmax's perplexity changing by less than this from the shortest to the longest context: a model that does not
# use its long context (the recorded one: 179.80 at 256 tokens, 179.79 at 4,096)
FLAT = 0.01

SECTION = """## A second family end to end: a Gemma 3 shape with its sliding-window layers (issue 30, item 5)

`python recipes/experiments/run.py second_family` (the inputs: `recipes/experiments/second_family/rows.py`; the
recorded run was the same commands in one shell script, its text a copy of the bundled Tiny Shakespeare), on the
project's {cpus}-core CPU: {cpu}, no GPU, torch {torch}, {threads} threads, load average {load} from other jobs
({date}, as `generate.json` records it). Results: `recipes/results/second_family/`.

- **The model** (`train.json`): a Gemma 3 text model trained from scratch by `recipes/train_gpt2_scratch.py
  --family gemma3`: {layers} layers ({sliding} sliding-window layers of window {window}, then {globals} global),
  hidden {hidden}, {heads} heads / {kv_heads} kv heads, a {vocab:,}-token byte-level BPE, {steps} steps of {batch} x
  {context} tokens at lr {lr:g} ({train_cpu:.0f} CPU-s, {train_wall:.0f} s wall); held-out perplexity {ppl:.2f} at
  context {context} ({eval_tokens:,} tokens).
- **The conversion** (`convert.txt`), training-free: `hf-polyattn convert` with the long-context recipe on the
  converted layers, the sliding layers kept exact (`sliding_layers='{sliding_layers}'`); no attention transfer.

```
{convert}
```

- **Generation and reload** (`generate.json`): the layers are {layout}. Greedy generation of {new:,} tokens
  after a {prompt}-token held-out prompt through `{cache_class}` gives {equal} the uncached forward's tokens; save
  -> reload gives {reload}.
  Cache bytes per layer (layers 0 ... {last_layer}) after each number of new tokens:

| new tokens | converted model | softmax model |
|---|---|---|
{cache_rows}

- **Long context** (`long_context_linear.*`: the converted model beside the softmax checkpoint;
  `long_context_streaming.*`: StreamingLLM, the checkpoint with kind `sliding_window` on the same layers):

{linear_table}

{streaming_table}

What it measured: {reading}
"""


def _load(results: Path, name: str) -> dict:
    return json.loads((results / name).read_text())


def _table(md: str) -> str:
    """The markdown table of an evaluation, without the note under it (said once, below the second)."""
    return md.strip().split("\n\n")[0]


def _bytes(per_layer: list[int]) -> str:
    return " / ".join(f"{b:,}" for b in per_layer)


def _reading(lin: dict, stream: dict, gen: dict, layout: list[dict], steps: int) -> str:
    """The paragraph under the tables: how flat softmax is in the context, how far the other rows are from it, the
    passkeys, and the cache (constant in the converted layers, window - 1 keys in the sliding ones)."""
    soft = next(r for r in lin["rows"] if r.get("baseline") == "softmax")
    rows = {"converted": next(r for r in lin["rows"] if not r.get("baseline")), "StreamingLLM": stream["rows"][-1]}
    assert stream["tokens"] == lin["tokens"], "the two evaluations scored different tokens"
    ppl = {p["context"]: p["perplexity"] for p in soft["perplexity"]}
    first, last = min(ppl), max(ppl)
    spread = max(abs(p["perplexity"] / ppl[p["context"]] - 1) for r in rows.values() for p in r["perplexity"])
    hits = {name: sum(map(sum, r["passkey"]["hits"])) for name, r in {"softmax": soft, **rows}.items()}
    total = sum(len(h) for h in soft["passkey"]["hits"])
    keys = ("no row retrieves a passkey" if not any(hits.values()) else
            "passkeys found: " + ", ".join(f"{n} {h}/{total}" for n, h in hits.items()))
    gens = gen["generation"]
    short, long = sorted(gens, key=int)[0], sorted(gens, key=int)[-1]
    kind = [i for i, e in enumerate(layout) if e["role"] == "kind"]
    sliding = [i for i, e in enumerate(layout) if e["role"] == "sliding"]
    constant = all(gens[short]["cache_bytes_per_layer"][i] == gens[long]["cache_bytes_per_layer"][i] for i in kind)
    soft_grows = all(gens[long]["softmax_cache_bytes_per_layer"][i] > gens[short]["softmax_cache_bytes_per_layer"][i]
                     for i in kind)
    same_sliding = all(gens[n]["cache_bytes_per_layer"][i] == gens[n]["softmax_cache_bytes_per_layer"][i]
                       for n in gens for i in sliding)
    change = ppl[last] / ppl[first] - 1
    scores = f"the softmax checkpoint scores {ppl[first]:.2f} at {first:,} tokens and {ppl[last]:.2f} at {last:,}"
    if abs(change) < FLAT:
        context = (f"the {steps}-step model is flat in the context ({scores}): it does not use its long context, so "
                   f"the converted and StreamingLLM rows match softmax within {100 * spread:.2f} % at every length, "
                   f"and {keys}. The run shows the family's path, not a long-context gain")
    else:
        context = (f"{scores} ({100 * change:+.1f} %); the converted and StreamingLLM rows are within "
                   f"{100 * spread:.2f} % of softmax at every length, and {keys}. Beside the long context")
    return (f"{context}: generation through the cache "
            f"{'gives' if gen['cache_equals_no_cache'] else 'does not give'} the uncached forward's tokens; the "
            f"converted layers' state {'stays' if constant else 'does not stay'} the same size from {short} to "
            f"{long} new tokens while the softmax global layers' keys {'grow' if soft_grows else 'do not grow'}; the "
            f"sliding layers keep {'as many bytes as' if same_sliding else 'other sizes than'} the softmax model's "
            f"sliding layers; the saved folder reloads "
            f"{'with the same layout' if gen['reload']['same_layout'] else 'with another layout'} and "
            f"{'identical' if gen['reload']['identical_logits'] else 'different'} logits.")


def section(results: Path) -> str:
    train, gen = _load(results, "train.json"), _load(results, "generate.json")
    lin, stream = _load(results, "long_context_linear.json"), _load(results, "long_context_streaming.json")
    a, layout, m = train["args"], gen["layout"], gen["machine"]
    sliding = [e for e in layout if e["role"] == "sliding"]
    windows = {e["window"] for e in sliding}
    assert len(windows) == 1, windows
    gens = gen["generation"]
    roles = "; ".join(f"{text}: {[i for i, x in enumerate(layout) if x['text'] == text]}"
                      for text in dict.fromkeys(e["text"] for e in layout))
    cache_rows = "\n".join(f"| {int(n):,} | {_bytes(g['cache_bytes_per_layer'])} | "
                           f"{_bytes(g['softmax_cache_bytes_per_layer'])} |"
                           for n, g in sorted(gens.items(), key=lambda kv: int(kv[0])))
    reload = gen["reload"]
    load = re.search(r"load average: (.*)$", m["uptime"])
    return SECTION.format(
        cpus=m["cpus"], cpu=m["cpu"], torch=m["torch"], threads=m["threads"], load=load.group(1) if load else "?",
        date=m["date"], layers=a["n_layer"], sliding=len(sliding), window=windows.pop(),
        globals=len(layout) - len(sliding), hidden=a["n_embd"], heads=a["n_head"], kv_heads=max(1, a["n_head"] // 2),
        vocab=a["vocab_size"], steps=a["steps"], batch=a["batch_size"], context=a["context"], lr=a["lr"],
        train_cpu=train["pretrain"]["cpu_s"], train_wall=train["pretrain"]["wall_s"], ppl=train["eval"]["perplexity"],
        eval_tokens=train["eval"]["tokens"], sliding_layers=gen["polyattn"]["sliding_layers"],
        convert=(results / "convert.txt").read_text().strip(), layout=roles, new=max(map(int, gens)),
        prompt=gen["prompt_tokens"], cache_class=gens[max(gens, key=int)]["cache_class"],
        equal="exactly" if gen["cache_equals_no_cache"] else "not", last_layer=len(layout) - 1,
        cache_rows=cache_rows,
        reload=(f"{'the same' if reload['same_layout'] else 'another'} layout and "
                f"{'identical' if reload['identical_logits'] else 'different'} logits on {reload['probe']}"),
        linear_table=_table((results / "long_context_linear.md").read_text()),
        streaming_table=(results / "long_context_streaming.md").read_text().strip(),
        reading=_reading(lin, stream, gen, layout, a["steps"]))


def main(argv=None) -> int:
    return section_main(section, "second_family", __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
