"""Model card (README.md) of a retrofit, generated from its results: the run's folder or the committed result files.

``write_card(folder, results)`` is what the retrofit pipeline calls after saving; ``card_from_results(folder, results,
config)`` writes the same card from a results record and the model's transformers config alone (no weights), which
is how ``recipes/model_cards.py`` regenerates the cards in ``model_cards/`` from ``recipes/results/``.

The card names no local path: the base model by its Hub id (``hf_polyattn.checkpoints.known_hub_id`` maps the
packaged SmolLM2 / MiniLM and their local copies), a data file by its file name, a Hub dataset by its id (also the
card's ``datasets`` metadata).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

__all__ = ["card_from_results", "data_name", "eval_results_for_card", "long_context_section", "results_markdown",
           "write_card"]

SECTION = "## Retrofit results (hf_polyattn)"
_HUB_DATASET = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FILE_SUFFIXES = (".txt", ".json", ".jsonl", ".parquet", ".csv", ".tsv", ".gz", ".zst")


def _arg(results: dict[str, Any], name: str, default: Any = None) -> Any:
    """A run argument from ``results["args"]``: flat, or one level down in argument groups."""
    args = results.get("args") or {}
    if name in args:
        return args[name]
    for group in args.values():
        if isinstance(group, dict) and name in group:
            return group[name]
    return default


def data_name(source: Any) -> tuple[str, str | None]:
    """(how the card names the data, its Hub dataset id or None): a local file by its name, never its folder."""
    if not source or not isinstance(source, str):
        return "unknown", None
    if source == "demo":
        return "the demo text bundled with hf_polyattn (Tiny Shakespeare, public domain)", None
    local = (os.path.isabs(source) or source.startswith(("~", ".")) or os.path.exists(source)
             or Path(source).suffix in _FILE_SUFFIXES)
    if not local and _HUB_DATASET.match(source.split(":")[0]):
        hub_id = source.split(":")[0]
        return f"[`{source}`](https://huggingface.co/datasets/{hub_id})", hub_id
    return f"`{Path(source).name}`", None


def results_markdown(results: dict[str, Any]) -> str:
    """The evaluation table of one run as Markdown."""
    metric = "perplexity" if _arg(results, "task", "causal_lm") == "causal_lm" else "accuracy"
    rows = ["| stage | " + metric + " | eval wall s |", "|---|---|---|"]
    for tag, r in results["evaluations"].items():
        rows.append(f"| {tag} | {r[metric]:.4f} | {r.get('wall_s', '')} |")
    return "\n".join(rows)


def _training_bullets(results: dict[str, Any]) -> list[str]:
    stages = results.get("stages") or {}
    lines = []
    steps = _arg(results, "transfer_steps") or (stages.get("transfer") or {}).get("steps")
    if steps:
        schedule = _arg(results, "transfer_schedule")
        lines.append(f"- attention transfer: {steps} steps (lr {_arg(results, 'transfer_lr')}"
                     + (f", schedule `{schedule}` = context:steps:batch" if schedule else "") + ")")
    steps = _arg(results, "finetune_steps") or (stages.get("finetune") or {}).get("steps")
    if steps:
        how = f"LoRA r={_arg(results, 'lora_r')}" if _arg(results, "lora") else "full"
        schedule = _arg(results, "finetune_schedule")
        lines.append(f"- fine-tuning: {steps} steps ({how}, lr {_arg(results, 'finetune_lr')}"
                     + (f", schedule `{schedule}`" if schedule else "") + ")")
    changed = results.get("reconfigured")
    if changed:  # ModelArgs.reconfigure: after training, before the long-context evaluation and the saved folder
        items = ", ".join(f"`{k}={v}`" for k, v in changed.items())
        lines.append(f"- then, without training (`hf_polyattn.reconfigure`): {items}; the evaluations after each "
                     "stage ran without them, the long-context table and this folder with them")
    return lines


def _section(results: dict[str, Any], folder: Path, base: str | None, cfg, config,
             command: str | None) -> list[str]:
    """The card's retrofit section: how the model was made, its evaluations and the long-context table."""
    data, _ = data_name(_arg(results, "data") or (results.get("data") or {}).get("source"))
    body = ["", SECTION, ""]
    if base:
        body.append(f"- base model: [`{base}`](https://huggingface.co/{base})")
    if cfg is not None:
        body.append(f"- attention: {cfg.spec.table_label(cfg)}")
        summary = _softmax_heads_summary(config, cfg)
        if summary:
            body.append(f"- softmax heads: {summary}")
    else:
        body.append("- attention: softmax (the base model's own)")
    body += _layers_bullet(results)
    body.append(f"- data: {data}")
    body += _training_bullets(results)
    if command:
        body.append(f"- command: `{command}`")
    if results.get("evaluations"):
        if _arg(results, "task", "causal_lm") == "causal_lm":
            body.append("- perplexity = exp(mean token NLL) on the held-out tail, context "
                        f"{_arg(results, 'eval_context')}, stride {_arg(results, 'eval_stride')}")
        else:
            body.append("- accuracy on a seeded validation split carved from the training data")
        body += ["", results_markdown(results)]
    timing = ""
    if results.get("total_wall_s") is not None:
        timing = (f"; total wall time {results.get('total_wall_s')} s, CPU time {results.get('total_cpu_s', '?')} s")
    body += ["", f"Machine: {results.get('machine', '?')}{timing}.", ""]
    if results.get("long_context"):
        body += long_context_section(results["long_context"], folder)
    return body


def _softmax_heads_summary(config, cfg) -> str | None:
    from ..integration.hub import softmax_heads_summary

    return softmax_heads_summary(config, cfg) if config is not None else None


def card_from_results(folder: str | Path, results: dict[str, Any], config, *, base_model: str | None = None,
                      command: str | None = None, model_name: str | None = None, eval_results=None,
                      fresh: bool = True) -> Path:
    """Write ``folder/README.md`` for a retrofit from its ``results`` record (the pipeline's results.json, or one
    assembled from committed result files) and the model's transformers ``config`` (with its ``polyattn`` settings;
    a softmax config gives the baseline's small card). ``fresh`` starts from an empty card (else the text outside
    the library's section and this one is kept). Returns the README's path."""
    from ..config import PolyAttnConfig
    from ..integration.hub import write_model_card
    from ..integration.settings import hub_model_id

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    readme = folder / "README.md"
    base = base_model or hub_model_id(_arg(results, "model"))
    _, dataset = data_name(_arg(results, "data") or (results.get("data") or {}).get("source"))
    settings = results.get("polyattn")
    cfg = PolyAttnConfig.from_dict(settings) if settings else None
    if fresh and readme.exists():
        readme.unlink()
    text = "\n".join(_section(results, folder, base, cfg, config, command))
    if cfg is None:
        return _plain_card(folder, base or str(_arg(results, "model")), text, dataset)
    if getattr(config, "_attn_implementation", None) != cfg.kind:  # a config read from a file: name the kind
        from ..integration.settings import persist_settings

        persist_settings(config, cfg)
        config._attn_implementation = cfg.kind
    write_model_card(folder, config, base_model=base, datasets=[dataset] if dataset else None, model_name=model_name,
                     eval_results=eval_results if eval_results is not None else eval_results_for_card(results))
    old = readme.read_text()
    if SECTION in old:
        old = old[: old.index(SECTION)].rstrip() + "\n"
    readme.write_text(old.rstrip() + "\n" + text)
    return readme


def write_card(folder: str | Path, results: dict[str, Any], *, model_path: str | None = None) -> Path:
    """The card of a retrofit run's saved model folder (``folder`` holds config.json): the library's card
    (``write_model_card``) with this run's results after it. ``model_path`` (where the base was loaded from) only
    helps find the base model's Hub id; the card never shows it."""
    from transformers import AutoConfig

    from ..integration.settings import hub_model_id

    folder = Path(folder)
    config = AutoConfig.from_pretrained(folder)
    base = hub_model_id(_arg(results, "model")) or hub_model_id(model_path)
    return card_from_results(folder, results, config, base_model=base)


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


def eval_results_for_card(results: dict[str, Any]) -> list[dict[str, Any]]:
    """huggingface_hub.EvalResult fields for the card's model-index: the last evaluation, and the model's row of the
    long-context evaluation (perplexity at every context, passkey accuracy at every length)."""
    evals = results.get("evaluations") or {}
    name, hub_id = data_name(_arg(results, "data") or (results.get("data") or {}).get("source"))
    data = {"dataset_type": hub_id or "text", "dataset_name": hub_id or name.strip("`")}
    out = []
    if evals:
        last = evals[list(evals)[-1]]
        if _arg(results, "task", "causal_lm") == "causal_lm":
            out.append({"task_type": "text-generation", **data, "metric_type": "perplexity",
                        "metric_value": round(last["perplexity"], 4),
                        "metric_config": f"context {_arg(results, 'eval_context')}, stride "
                                         f"{_arg(results, 'eval_stride')}, held-out tail"})
        else:
            out.append({"task_type": "text-classification", **data, "dataset_type": hub_id or "csv",
                        "metric_type": "accuracy", "metric_value": round(last["accuracy"], 4),
                        "metric_config": f"seeded validation split of {last['examples']} rows"})
    long = results.get("long_context")
    row = next((r for r in (long or {}).get("rows", []) if not r.get("baseline")), None)
    if row is not None:
        for p in row["perplexity"]:
            out.append({"task_type": "text-generation", **data, "metric_type": "perplexity",
                        "metric_name": f"perplexity @ {p['context']:,} tokens",
                        "metric_value": round(p["perplexity"], 2),
                        "metric_config": f"context {p['context']}, the first {long['tokens']:,} held-out tokens"})
        pk = row.get("passkey")
        for n, hits in zip(pk["lengths"], pk["hits"]) if pk else ():
            out.append({"task_type": "text-generation", **data, "metric_type": "accuracy",
                        "metric_name": f"passkey retrieval @ {n:,} tokens", "metric_value": sum(hits) / len(hits),
                        "metric_config": f"{len(hits)} needle depths, seed {pk['seed']}, greedy"})
    return out


def _plain_card(folder: Path, base: str, text: str, dataset: str | None) -> Path:
    """Card of a softmax (unconverted) result folder."""
    from huggingface_hub import ModelCard, ModelCardData

    from ..integration.settings import hub_model_id

    hub_id = hub_model_id(base)
    data = ModelCardData(library_name="transformers", base_model=hub_id, tags=["hf_polyattn-baseline", "softmax"],
                         datasets=[dataset] if dataset else None)
    name = hub_id.split("/")[-1] if hub_id else "the base model"
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n# {name} fine-tuned with softmax attention\n"
                     "\nThe softmax baseline of an hf_polyattn retrofit comparison.\n" + text)
    path = folder / "README.md"
    card.save(str(path))
    return path
