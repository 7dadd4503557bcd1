"""Model card (README.md) of a retrofit result folder, generated from its results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["eval_results_for_card", "long_context_section", "results_markdown", "write_card"]


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

    A converted model's ``save_pretrained`` has already written the library's card (YAML metadata,
    attention settings, eval results): the recipe's results section is appended to it (replaced on
    a re-save). A softmax baseline gets a small card of its own.
    """
    folder = Path(folder)
    a = results["args"]
    body = [
        "",
        "## Retrofit results (hf_polyattn recipes)",
        "",
        f"- base model: `{a['model']}` (loaded from `{model_path}`)",
        f"- attention: `{a['attention']}`" + (f", PolyAttnConfig `{results.get('polyattn')}`"
                                               if results.get("polyattn") else ""),
        *_softmax_heads_bullet(folder, results),
        *_layers_bullet(results),
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
    if results.get("long_context"):
        body += long_context_section(results["long_context"], folder)
    text = "\n".join(body)
    readme = folder / "README.md"
    if readme.exists():  # the library's card (hf_polyattn.write_model_card via save_pretrained): append
        old = readme.read_text()
        marker = "## Retrofit results (hf_polyattn recipes)"
        if marker in old:
            old = old[: old.index(marker)].rstrip() + "\n"
        readme.write_text(old.rstrip() + "\n" + text)
        return readme
    return _plain_card(folder, results, text)


def long_context_section(result: dict[str, Any], folder: Path) -> list[str]:
    """The card's long-context section: the table and, when matplotlib is installed, the plot (written beside)."""
    from .long_context import long_context_markdown, plot_long_context

    lines = ["### Long context: perplexity at every context and passkey retrieval", "",
             long_context_markdown(result)]
    if plot_long_context(result, folder / "long_context.png") is not None:
        lines += ["![perplexity vs context and passkey heatmaps](long_context.png)", ""]
    return lines


def _layers_bullet(results: dict[str, Any]) -> list[str]:
    """'- layers: ...' where the model has sliding-window layers (``results['layer_layout']``, from
    ``hf_polyattn.integration.layer_layout``); nothing when every layer runs the kind."""
    from ..integration.layout import describe_layout, has_sliding

    entries = results.get("layer_layout") or []
    if not has_sliding(entries):
        return []
    return [f"- layers: {describe_layout(entries)}"]


def _softmax_heads_bullet(folder: Path, results: dict[str, Any]) -> list[str]:
    """'- softmax heads: ...' for a hybrid (``PolyAttnConfig.softmax_heads``), read with the model's config.json in
    ``folder``; nothing otherwise."""
    settings = results.get("polyattn") or {}
    if not settings.get("softmax_heads"):
        return []
    from transformers import AutoConfig

    from ..config import PolyAttnConfig
    from ..integration.hub import softmax_heads_summary

    summary = softmax_heads_summary(AutoConfig.from_pretrained(folder), PolyAttnConfig.from_dict(settings))
    return [f"- softmax heads: {summary}"]


def eval_results_for_card(results: dict[str, Any]) -> list[dict[str, Any]]:
    """huggingface_hub.EvalResult fields of the last evaluation (for the card's model-index)."""
    a = results["args"]
    evals = results["evaluations"]
    if not evals:
        return []
    last = evals[list(evals)[-1]]
    if a["task"] == "causal_lm":
        return [{"task_type": "text-generation", "dataset_type": "text", "dataset_name": Path(a["data"]).name,
                 "metric_type": "perplexity", "metric_value": round(last["perplexity"], 4),
                 "metric_config": f"context {a['eval_context']}, stride {a['eval_stride']}, held-out tail"}]
    return [{"task_type": "text-classification", "dataset_type": "csv", "dataset_name": Path(a["data"]).name,
             "metric_type": "accuracy", "metric_value": round(last["accuracy"], 4),
             "metric_config": f"seeded validation split of {last['examples']} rows"}]


def _plain_card(folder: Path, results: dict[str, Any], text: str) -> Path:
    """Card of a softmax (unconverted) result folder."""
    from huggingface_hub import ModelCard, ModelCardData

    a = results["args"]
    data = ModelCardData(library_name="transformers", tags=["hf_polyattn-baseline", "softmax"])
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {a['model']} fine-tuned with softmax attention\n"
                     "\nThe softmax baseline of an hf_polyattn retrofit comparison.\n" + text)
    path = folder / "README.md"
    card.save(str(path))
    return path
