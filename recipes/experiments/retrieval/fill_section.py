"""Write recipes/results/SECTION_retrieval.md and recipes/results/retrieval/retrieval.png from the study's records.

    python -m recipes.experiments.retrieval.fill_section

Every number comes from ``recipes/results/retrieval/<row>.json`` (``collect.py``: each row's long-context record, its
decode state at 8k and training time) and, for the hybrid recipe beside them, the long-context study's record of it.
Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "recipes" / "results"
STUDY = RESULTS / "retrieval"
HYBRID = RESULTS / "long_context" / "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k.json"
# the long-context study's softmax and StreamingLLM records (the same held-out tokens and contexts): the references
# when this study's own 'baselines' row has not run
SOFTMAX = RESULTS / "long_context" / "softmax.json"
STREAMING = RESULTS / "long_context" / "streaming_cachepos.json"


def _model_row(record: dict) -> dict:
    return next(r for r in record["rows"] if not r.get("baseline"))


def _cells(row: dict, contexts: list[int], lengths: list[int], templates: list[str], soft: dict | None) -> list[str]:
    cells = []
    for i, p in enumerate(row["perplexity"]):
        ratio = f" ({p['perplexity'] / soft['perplexity'][i]['perplexity']:.2f}x)" if soft and soft is not row else ""
        cells.append(f"{p['perplexity']:.2f}{ratio}")
    for k, t in enumerate(templates):
        pk = row.get("passkey" if k == 0 else f"passkey_{t}")
        cells.append(" / ".join("–" if pk is None else str(sum(pk["hits"][pk["lengths"].index(n)]))
                                for n in lengths))
    return cells


def diagnostic_lines(diagnostics: dict[str, dict]) -> str:
    """One paragraph per diagnostic row (``rows.DIAGNOSTICS``: another grid than the table's): its passkey hits per
    template and length, its settings and its command."""
    text = ""
    for name, rec in diagnostics.items():
        row = _model_row(rec)
        hits = []
        for key in ("passkey", "passkey_vault"):  # "passkey" holds the first template asked for
            pk = row.get(key)
            if pk:
                template = pk.get("template", "classic")
                hits += [f"{template} {n:,} tokens: {sum(h)} of {len(h)}" for n, h in zip(pk["lengths"], pk["hits"])]
        text += (f"\nDiagnostic row {name} (not in the table: another grid): {row.get('label', '?')}; passkey "
                 f"{', '.join(hits) or '–'}. Command: `{rec.get('command', '?')}`.\n")
    return text


def write_table(collected: dict[str, dict], out: Path, plot: Path,
                diagnostics: dict[str, dict] | None = None) -> list[Path]:
    """table.md (every row beside softmax and StreamingLLM, the hybrid recipe's figures from the long-context study)
    and retrieval.png (perplexity against context, passkey hits against length); ``diagnostics`` (rows of another
    grid) as paragraphs under the table."""
    first = next(iter(collected.values()))
    s = first["settings"]
    contexts, lengths, templates = s["contexts"], s["passkey_lengths"], s.get("passkey_templates", ["classic"])
    base = collected.get("baselines")
    soft = next((r for r in base["rows"] if r.get("baseline") == "softmax"), None) if base else None
    references = [("the hybrid recipe (22 of 90 kv heads softmax, the rest elu + window + sinks + gate, transfer and "
                   "LoRA)", HYBRID)]
    if base is None:
        references = [("softmax (the checkpoint)", SOFTMAX), ("StreamingLLM (4 sinks + 128 window, no training)",
                                                               STREAMING), *references]
        same = [json.loads(f.read_text()) for f in (SOFTMAX,) if f.is_file()]
        if same and same[0].get("tokens") == first["tokens"] and \
                [p["context"] for p in same[0]["perplexity"]] == list(contexts):
            soft = same[0]  # the ratios: softmax on the same tokens at the same contexts
    head = ["row", *[f"ppl {c:,}" for c in contexts],
            *[f"passkey {t} {' / '.join(f'{round(n / 1024)}k' for n in lengths)} (of {s['passkey_depths']})"
              for t in templates], "decode state at 8k (all layers)", "training CPU s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    entries = []
    if base:
        for r in base["rows"]:
            name = "softmax" if r.get("baseline") == "softmax" else "StreamingLLM (4 sinks + 128 window)"
            entries.append((name, r, None))
    entries += [(name, _model_row(rec), rec) for name, rec in collected.items() if name != "baselines"]
    for name, row, rec in entries:
        mem = (rec or {}).get("state_bytes_8k")
        if mem is None and base:
            mem_text = "grows with the context" if name == "softmax" else "constant (sinks + window)"
        else:
            mem_text = f"{mem['total'] / 2**20:.2f} MiB" if mem else "–"
        cells = [name, *_cells(row, contexts, lengths, templates, soft), mem_text,
                 str((rec or {}).get("train_cpu_s", "–"))]
        lines.append("| " + " | ".join(cells) + " |")
    note = ""
    for label, path in references:
        if not path.is_file():
            continue
        ref = json.loads(path.read_text())  # the study's records hold the row's curve and passkey grid at the top
        ppl = " / ".join(f"{p['perplexity']:.2f}" for p in ref["perplexity"])
        pk = ref.get("passkey")
        hits = " / ".join(str(sum(h)) for h in pk["hits"]) if pk else "–"
        note += (f"\n{label[0].upper()}{label[1:]}, from the long-context study's record {path.name} (the same "
                 f"held-out tokens): perplexity {ppl} at {' / '.join(str(p['context']) for p in ref['perplexity'])} "
                 f"tokens, classic passkey {hits} of 10 at "
                 f"{' / '.join(str(n) for n in pk['lengths']) if pk else '–'} tokens (not run at 8k or on 'vault').\n")
    note += diagnostic_lines(diagnostics or {})
    text = ("\n".join(lines) + "\n" + note + f"\nPerplexity over the first {first['tokens']:,} held-out tokens of "
            "the bundled Tiny Shakespeare (ratios to softmax); passkey hits of 10 needle depths per length, greedy "
            f"decoding through the model's own cache (the longest prompt, {lengths[-1]:,} tokens, is what SmolLM2's "
            "8,192 positions leave beside the longest answer); decode state = hf_polyattn.decode_memory of the row's "
            "model after "
            f"8,192 tokens (one sequence, float32). Machine: {first.get('machine', '?')}. Commands: each row's JSON.\n")
    paths = [out]
    out.write_text("## Retrieval with a constant-size state (issue 32)\n\n" + text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, row, _ in entries:
        a.plot([p["context"] for p in row["perplexity"]], [p["perplexity"] for p in row["perplexity"]], marker="o",
               label=name)
        pk = row.get("passkey")
        if pk:
            b.plot(pk["lengths"], [sum(h) for h in pk["hits"]], marker="o", label=name)
    a.set_xscale("log", base=2)
    b.set_xscale("log", base=2)
    a.set(xlabel="context (tokens)", ylabel="perplexity", title="held-out perplexity")
    b.set(xlabel="prompt length (tokens)", ylabel="hits of 10", title="passkey ('classic')")
    a.legend(fontsize=6)
    fig.tight_layout()
    paths.append(plot)
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS / "SECTION_retrieval.md"))
    p.add_argument("--plot", default=str(STUDY / "retrieval.png"))
    args = p.parse_args(argv)
    import importlib.util

    spec = importlib.util.spec_from_file_location("retrieval_rows", Path(__file__).resolve().parent / "rows.py")
    rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows)
    collected = {name: json.loads((STUDY / f"{name}.json").read_text()) for name in rows.ROWS
                 if (STUDY / f"{name}.json").is_file()}
    diagnostics = {name: collected.pop(name) for name in getattr(rows, "DIAGNOSTICS", ()) if name in collected}
    if not collected:
        print(f"no record in {STUDY}: run the study first")
        return 1
    for path in write_table(collected, Path(args.out), Path(args.plot), diagnostics):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
