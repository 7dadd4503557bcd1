"""Issue 32's study: each row's long-context record into recipes/results/retrieval/<row>.json, with the decode state's
bytes at 8k tokens (``hf_polyattn.decode_memory`` of the row's model, its sparse cache included), then the table
(``table.md``) and the plot (``retrieval.png``). Rows that did not run are left out; nothing is typed.

    python recipes/experiments/retrieval/collect.py [--runs runs/retrieval]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RESULTS = ROOT / "recipes" / "results" / "retrieval"
HYBRID = ROOT / "recipes" / "results" / "long_context" / "lin_w128_s4w_top22_dgate_h256_mix_t1k_lora1k2k.json"


def rows_module():
    spec = importlib.util.spec_from_file_location("retrieval_rows", HERE / "rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings(argv: list[str]) -> dict[str, str]:
    """The --set FIELD=VALUE items of a row's command."""
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def state_bytes(row: str, argv: list[str], runs: Path) -> dict[str, int] | None:
    """Decode cache bytes of one sequence after 8,192 tokens, per layer and in all, of the row's model."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn.checkpoints import resolve_checkpoint

    if row == "baselines":
        return None  # two models in one record: their memory is the softmax / StreamingLLM rows of the table
    folder = runs / row / "model" if "-m" in argv and "hf_polyattn.retrofit" in argv else Path(argv[3])
    if not folder.is_absolute():
        folder = ROOT / folder
    model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(str(folder)))
    settings = _settings(argv) if "hf_polyattn.cli" in argv else {}
    if settings:
        hf_polyattn.reconfigure(model, **{k: int(v) for k, v in settings.items()})
    mem = hf_polyattn.decode_memory(model, (8192,))
    layers = model.config.num_hidden_layers
    return {"total": mem.total[0], "per_layer": mem.total[0] // layers, "softmax_total": mem.softmax_total[0],
            "per_token": mem.per_token}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(ROOT / "runs" / "retrieval"), help="the rows' run folders")
    args = p.parse_args(argv)
    runs = Path(args.runs)
    rows = rows_module().ROWS
    RESULTS.mkdir(parents=True, exist_ok=True)
    collected = {}
    for name, argv_ in rows.items():
        record = runs / name / "long_context.json"
        if not record.is_file():
            continue
        data = json.loads(record.read_text())
        data["command"] = "python " + " ".join(a.replace("{out}", f"runs/retrieval/{name}") for a in argv_)
        data["state_bytes_8k"] = state_bytes(name, argv_, runs)
        results = runs / name / "results.json"
        if results.is_file():  # a trained row: its training time
            stages = json.loads(results.read_text()).get("stages", {})
            data["train_cpu_s"] = round(sum(s.get("cpu_s", 0) for s in stages.values() if isinstance(s, dict)), 1)
        (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))
        collected[name] = data
    if not collected:
        print(f"no row has run yet (looked in {runs})")
        return 1
    for path in write_table(collected, RESULTS):
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


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


def write_table(collected: dict[str, dict], out: Path) -> list[Path]:
    """table.md (every row beside softmax and StreamingLLM, the hybrid recipe's figures from the long-context study)
    and retrieval.png (perplexity against context, passkey hits against length)."""
    first = next(iter(collected.values()))
    s = first["settings"]
    contexts, lengths, templates = s["contexts"], s["passkey_lengths"], s.get("passkey_templates", ["classic"])
    base = collected.get("baselines")
    soft = next((r for r in base["rows"] if r.get("baseline") == "softmax"), None) if base else None
    head = ["row", *[f"ppl {c:,}" for c in contexts],
            *[f"passkey {t} {' / '.join(f'{n // 1024}k' for n in lengths)} (of {s['passkey_depths']})"
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
    hybrid = json.loads(HYBRID.read_text()) if HYBRID.is_file() else None
    note = ""
    if hybrid:
        hrow = hybrid  # the study's records hold the row's curve and passkey grid at the top level
        ppl = " / ".join(f"{p['perplexity']:.2f}" for p in hrow["perplexity"])
        pk = hrow.get("passkey")
        hits = " / ".join(str(sum(h)) for h in pk["hits"]) if pk else "–"
        note = (f"\nThe hybrid recipe (22 of 90 kv heads softmax, the rest elu + window + sinks + gate, transfer and "
                f"LoRA; the long-context study, {HYBRID.name}): perplexity {ppl} at "
                f"{' / '.join(str(p['context']) for p in hrow['perplexity'])} tokens, classic passkey {hits} of 10 at "
                f"{' / '.join(str(n) for n in pk['lengths']) if pk else '–'} tokens (not run at 8k or on 'vault').\n")
    text = ("\n".join(lines) + "\n" + note + f"\nPerplexity over the first {first['tokens']:,} held-out tokens of "
            "the bundled Tiny Shakespeare (ratios to softmax); passkey hits of 10 needle depths per length, greedy "
            "decoding through the model's own cache; decode state = hf_polyattn.decode_memory of the row's model after "
            f"8,192 tokens (one sequence, float32). Machine: {first.get('machine', '?')}. Commands: each row's JSON.\n")
    paths = [out / "table.md"]
    paths[0].write_text(text)
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
    paths.append(out / "retrieval.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


if __name__ == "__main__":
    raise SystemExit(main())
