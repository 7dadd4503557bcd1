"""Model card (README.md) of a retrofit result folder, generated from its results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["results_markdown", "write_card"]


def results_markdown(results: dict[str, Any]) -> str:
    """The evaluation table of one run as Markdown."""
    a = results["args"]
    metric = "perplexity" if a["task"] == "causal_lm" else "accuracy"
    rows = ["| stage | " + metric + " | eval wall s |", "|---|---|---|"]
    for tag, r in results["evaluations"].items():
        rows.append(f"| {tag} | {r[metric]:.4f} | {r.get('wall_s', '')} |")
    return "\n".join(rows)


def write_card(folder: str | Path, results: dict[str, Any], *, model_path: str) -> Path:
    """Write README.md into ``folder`` with the attention settings and eval results.

    Uses ``hf_polyattn.integration.hub.write_model_card`` when the integration layer provides it (for
    the library's standard card: tags, attention settings, YAML metadata) and appends the recipe's
    results; otherwise writes a self-contained card with ``huggingface_hub.ModelCard``.
    """
    folder = Path(folder)
    a = results["args"]
    evals = results["evaluations"]
    last = list(evals)[-1] if evals else None
    metric = "perplexity" if a["task"] == "causal_lm" else "accuracy"
    body = [
        "",
        "## Retrofit results (hf_polyattn recipes)",
        "",
        f"- base model: `{a['model']}` (loaded from `{model_path}`)",
        f"- attention: `{a['attention']}`" + (f", PolyAttnConfig `{results.get('polyattn')}`"
                                               if results.get("polyattn") else ""),
        f"- data: `{a['data']}` ({results.get('data')})",
        f"- attention transfer steps: {a['transfer_steps']} (lr {a['transfer_lr']}), fine-tuning steps: "
        f"{a['finetune_steps']} (lr {a['finetune_lr']}, {'LoRA r=' + str(a['lora_r']) if a['lora'] else 'full'})",
    ]
    if a["task"] == "causal_lm":
        body.append(f"- perplexity = exp(mean token NLL) on the held-out tail, context {a['eval_context']}, "
                    f"stride {a['eval_stride']}")
    else:
        body.append("- accuracy on a seeded validation split carved from the training file")
    body += ["", results_markdown(results), "", f"Machine: {results.get('machine', '?')}; total wall time "
             f"{results.get('total_wall_s', '?')} s, CPU time {results.get('total_cpu_s', '?')} s.", ""]
    text = "\n".join(body)
    try:
        from hf_polyattn.integration import hub  # noqa: F401  (helper API, optional)

        wrote = _integration_card(folder, results, metric, evals[last][metric] if last else None, text)
        if wrote:
            return wrote
    except ImportError:
        pass
    return _plain_card(folder, results, metric, evals[last][metric] if last else None, text)


def _integration_card(folder, results, metric, value, text):
    from hf_polyattn.integration import hub

    fn = getattr(hub, "write_model_card", None)
    if fn is None:
        return None
    try:
        path = fn(folder)
    except TypeError:
        return None
    path = Path(path) if path else folder / "README.md"
    if path.is_dir():
        path = path / "README.md"
    if not path.exists():
        return None
    path.write_text(path.read_text() + "\n" + text)
    return path


def _plain_card(folder, results, metric, value, text):
    from huggingface_hub import ModelCard, ModelCardData

    a = results["args"]
    data = ModelCardData(library_name="transformers", tags=["hf_polyattn", f"attention-{a['attention']}"],
                         base_model=None)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {a['model']} with {a['attention']} attention\n"
                     "\nLoad with `import hf_polyattn` before `from_pretrained` (it registers the attention).\n"
                     + text)
    path = Path(folder) / "README.md"
    card.save(str(path))
    return path
