"""Model cards and push_to_hub for polyattn models.

``save_pretrained`` of a polyattn model writes README.md next to the weights: YAML
metadata (``library_name``, ``base_model``, ``tags`` with ``hf_polyattn`` and the kind,
the settings under ``polyattn``, eval results when known) and a section rendered from
``model_card_template.md`` between ``<!-- hf_polyattn:start/end -->`` markers, so an
existing README keeps its own text and only our section is replaced.

``library_name: transformers``: the checkpoint is a plain transformers checkpoint
(config.json + safetensors, loaded by ``AutoModel*``), so the Hub's "use this model"
snippet, download counting and widgets work; the ``hf_polyattn`` tag and the usage
section say what loading gives with ``import hf_polyattn``, with ``trust_remote_code=True``
(the loader module of ``remote_code.py``, written by every save) and with neither.

``push_to_hub`` follows the standard path (create the repo, ``save_pretrained`` into a
folder, upload that folder in one commit); transformers' own ``push_to_hub`` would replace
README.md with its generic card after saving, hence the per-instance override.
"""

from __future__ import annotations

import json
import os
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import EvalResult, HfApi, ModelCard, ModelCardData
from torch import nn

from ..config import PolyAttnConfig
from ..serving import served_architecture
from .cache import decode_memory
from .layout import describe_layout, has_sliding, layer_layout
from .remote_code import LOADER_FILE, set_auto_map, write_loader
from .settings import BASE_MODEL_KEY, hub_model_id
from .state import HFPolyAttention, get_polyattn_config, sync_config

__all__ = ["card_title", "decode_memory_rows", "hub_model_id", "layout_note", "polyattn_push_to_hub",
           "polyattn_save_pretrained", "softmax_heads_note", "softmax_heads_summary", "write_model_card"]

_START, _END = "<!-- hf_polyattn:start -->", "<!-- hf_polyattn:end -->"


def template_path() -> str:
    """The model-card template shipped inside the package (the only copy in the repository)."""
    return str(resources.files("hf_polyattn").joinpath("model_card_template.md"))


def _as_eval_results(eval_results) -> list[EvalResult] | None:
    if eval_results is None:
        return None
    out = []
    for r in eval_results:
        if isinstance(r, EvalResult):
            out.append(r)
        elif isinstance(r, dict):
            out.append(EvalResult(**r))
        else:
            raise TypeError(f"eval_results items must be huggingface_hub.EvalResult or dicts of its fields, "
                            f"got {type(r).__name__}")
    return out


# the decode-memory table's prompt lengths
MEMORY_LENGTHS = (4096, 16384, 32768)


def cache_dims(config) -> tuple[int, int, int, int]:
    """(layers, query heads, kv heads per layer, head_dim) of a transformers config's decoder."""
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, heads, kv_heads, head_dim


def softmax_heads_summary(config, cfg: PolyAttnConfig) -> str | None:
    """One sentence on ``cfg.softmax_heads`` of a model with transformers config ``config``: how many kv heads stay
    softmax and the decode cache per token against softmax's (None without softmax heads).

    Softmax keeps 2 * Hkv * D numbers per token per layer (keys and values); the hybrid 2 * D per softmax kv head
    and token, plus the other heads' constant-size state (it does not grow with the length)."""
    if not cfg.softmax_heads:
        return None
    layers, _, kv_heads, head_dim = cache_dims(config)
    n = len(cfg.softmax_heads)
    full, kept = 2 * kv_heads * head_dim * layers, 2 * n * head_dim
    return (f"{n} of the {layers * kv_heads} KV heads ({layers} layers x {kv_heads}) keep exact softmax attention and "
            f"a full key/value cache; decode memory per token (all layers): 2 x {n} x {head_dim} = {kept} numbers "
            f"against softmax's 2 x {kv_heads} x {head_dim} x {layers} = {full} ({kept / full:.3f}x), plus the "
            "constant-size state of the other heads")


def softmax_heads_note(config, cfg: PolyAttnConfig) -> str | None:
    """The model card's paragraph on the softmax heads: which they are, and the decode memory per token."""
    summary = softmax_heads_summary(config, cfg)
    if summary is None:
        return None
    layers, _, kv_heads, _ = cache_dims(config)
    by_layer: dict[int, list[int]] = {}
    for layer, head in cfg.softmax_heads:
        by_layer.setdefault(layer, []).append(head)
    # the layout, one row per layer: which kv heads stay softmax and how many run the kind
    rows = ["| layer | softmax kv heads | kv heads running `" + cfg.kind + "` |", "|---|---|---|"]
    rows += [f"| {layer} | {', '.join(map(str, sorted(by_layer.get(layer, [])))) or '–'} | "
             f"{kv_heads - len(by_layer.get(layer, []))} of {kv_heads} |" for layer in range(layers)]
    return (f"{summary[0].upper()}{summary[1:]}. The other heads run `{cfg.kind}`: {cfg.spec.memory_note(cfg)}\n\n"
            + "\n".join(rows))


def _bytes(n: int) -> str:
    """1,234 B / 12.3 KiB / 45.6 MiB / 1.23 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n:,} B"


def decode_memory_rows(model, base: str | None, lengths: tuple[int, ...] = MEMORY_LENGTHS
                       ) -> tuple[list[dict[str, Any]], torch.dtype | None]:
    """The card's decode-memory rows, the softmax model and this one (``cache.decode_memory`` of ``model``, a model
    or its config, one sequence), and the dtype they count; ([], None) where the kind's decoding state is not
    modelled there."""
    try:
        mem = decode_memory(model, lengths)
    except ValueError:  # e.g. the quadratic polynomial kind, whose state keeps every key: not a constant to state
        return [], None
    rows = []
    for label, per_token, totals in (
            (f"softmax `{base}`" if base else "softmax (the base model)", mem.softmax_per_token, mem.softmax_total),
            ("this model", mem.per_token, mem.total)):
        shown = [_bytes(b) + (f" ({s / b:.1f}x smaller)" if totals is mem.total else "")
                 for b, s in zip(totals, mem.softmax_total)]
        rows.append({"label": label, "per_token": _bytes(per_token) if per_token else "0 (constant)",
                     "totals": shown})
    return rows, mem.dtype


def layout_note(model: nn.Module) -> str | None:
    """The model card's paragraph on which layers run the kind, for a model with sliding-window layers or soft-capped
    layers (None without: every layer runs it, uncapped)."""
    entries = layer_layout(model)
    if not has_sliding(entries) and not any(e.get("softcap") is not None for e in entries):
        return None
    kept = [e for e in entries if e["role"] == "sliding"]
    text = f"By layer: {describe_layout(entries)}."
    if kept:
        text += (f" The {len(kept)} sliding-window layers stay the model's own softmax attention over each query's "
                 "last `window` keys (`sliding_layers='exact'`, the default): they were linear time already, and "
                 "generation keeps their last window - 1 keys (constant size) beside the converted layers' state.")
    return text


_AUTO_CLASSES = (
    (("ForCausalLM", "LMHeadModel"), "AutoModelForCausalLM"),
    (("ForMaskedLM",), "AutoModelForMaskedLM"),
    (("ForSequenceClassification",), "AutoModelForSequenceClassification"),
    (("ForTokenClassification",), "AutoModelForTokenClassification"),
    (("ForQuestionAnswering",), "AutoModelForQuestionAnswering"),
)
_PIPELINE_TAGS = {"AutoModelForCausalLM": "text-generation", "AutoModelForMaskedLM": "fill-mask",
                  "AutoModelForSequenceClassification": "text-classification",
                  "AutoModelForTokenClassification": "token-classification",
                  "AutoModelForQuestionAnswering": "question-answering"}


def _auto_class(architectures: list[str]) -> str:
    for suffixes, auto in _AUTO_CLASSES:
        if any(a.endswith(s) for a in architectures for s in suffixes):
            return auto
    return "AutoModel"


def _setting_rows(cfg: PolyAttnConfig) -> list[tuple[str, str]]:
    """(name, value) of the settings the kind reads (``read_settings``), the kind's options flattened; the softmax
    heads summarised (they are listed in their own section)."""
    settings = cfg.read_settings()
    options = settings.pop("options", {})
    rows = []
    for name, value in [*settings.items(), *options.items()]:
        if name == "softmax_heads" and value:
            rows.append((name, f"{len(value)} (layer, kv head) pairs, listed below"))
        else:
            rows.append((name, f"`{value}`"))
    return rows


def card_title(base: str | None, cfg: PolyAttnConfig, fallback: str) -> str:
    """'SmolLM2-135M-Instruct with linear attention (22 softmax kv heads)': the base model and the attention."""
    name = base.split("/")[-1] if base else fallback
    n = len(cfg.softmax_heads or ())
    heads = f" and {n} softmax kv head{'s' if n != 1 else ''}" if n else ""
    return f"{name} with {cfg.kind} attention{heads}"


def write_model_card(save_directory: str | os.PathLike, model, *, eval_results=None, tags: list[str] | None = None,
                     base_model: str | None = None, model_name: str | None = None, repo_id: str | None = None,
                     datasets: list[str] | None = None) -> ModelCard:
    """Create or update ``save_directory/README.md`` for a polyattn model; returns the card.

    Args:
        save_directory: folder holding (or about to hold) the checkpoint.
        model: the polyattn model (or its transformers config).
        eval_results: ``huggingface_hub.EvalResult`` objects or dicts of their fields
            (task_type, dataset_type, dataset_name, metric_type, metric_value, ...).
            ``None`` keeps the results already in the card.
        tags: extra tags (``hf_polyattn`` and the kind are always added).
        base_model: Hub id of the base checkpoint; default: recorded at conversion/loading (a local folder never is).
        model_name, repo_id: names shown in the card (default: the base model's name and the kind).
        datasets: Hub ids of the datasets it was trained on (the card's ``datasets`` metadata); default: kept.

    The card names no local path: the base model by its Hub id, the repository by ``repo_id`` or ``model_name``.
    """
    config = model.config if isinstance(model, nn.Module) else model
    cfg = get_polyattn_config(model)
    if cfg is None:
        raise ValueError("write_model_card needs a model converted to a hf_polyattn attention kind "
                         "(config._attn_implementation is not one of them)")
    save_directory = Path(save_directory)
    save_directory.mkdir(parents=True, exist_ok=True)
    readme = save_directory / "README.md"
    existing = ModelCard.load(readme) if readme.exists() else None
    old = existing.data.to_dict() if existing is not None else {}

    base = (base_model or getattr(config, BASE_MODEL_KEY, None) or hub_model_id(getattr(config, "_name_or_path", None))
            or old.get("base_model"))
    name = model_name or old.get("model_name") or f"{(base or save_directory.resolve().name).split('/')[-1]}-{cfg.kind}"
    repo = repo_id or name
    model_tags = list(getattr(model, "model_tags", None) or []) if isinstance(model, nn.Module) else []
    all_tags = []
    for t in ["hf_polyattn", cfg.kind, *model_tags, *(tags or []), *(old.get("tags") or [])]:
        if t not in all_tags:
            all_tags.append(t)
    evals = _as_eval_results(eval_results)
    if evals is None and existing is not None:
        evals = existing.data.eval_results
    extra = {k: v for k, v in old.items()
             if k not in {"library_name", "base_model", "tags", "model-index", "model_name", "polyattn", "datasets",
                          "pipeline_tag"}}
    auto_class = _auto_class(getattr(config, "architectures", None) or [])
    data = ModelCardData(
        library_name="transformers",
        base_model=base,
        pipeline_tag=_PIPELINE_TAGS.get(auto_class),
        tags=all_tags,
        datasets=datasets if datasets is not None else old.get("datasets"),
        model_name=name if evals else None,
        eval_results=evals or None,
        polyattn=cfg.read_settings(),
        **extra,
    )
    # decode memory only where the model generates (an encoder keeps no cache)
    memory_rows, memory_dtype = (decode_memory_rows(model, base) if auto_class == "AutoModelForCausalLM"
                                 else ([], None))
    rendered = ModelCard.from_template(
        data,
        template_path=template_path(),
        # a name given by the caller (push_to_hub's repo) heads the title, then the base model and the attention
        title=(f"{model_name}: " if model_name else "") + card_title(base, cfg, save_directory.resolve().name),
        description=(f"A transformers checkpoint with hf_polyattn `{cfg.kind}` attention"
                     + (f", made from `{base}`." if base else ".")),
        kind=cfg.kind,
        kind_title=cfg.spec.title,
        base_model=base,
        auto_class=auto_class,
        repo_id=repo,
        settings=_setting_rows(cfg),
        memory_note=cfg.spec.memory_note(cfg) if not cfg.softmax_heads else "",
        memory_rows=memory_rows,
        memory_lengths=[f"{n:,}" for n in MEMORY_LENGTHS],
        memory_dtype=str(memory_dtype).replace("torch.", ""),
        softmax_heads_note=softmax_heads_note(config, cfg),
        layout_note=layout_note(model) if isinstance(model, nn.Module) else None,
        remote_code=(save_directory / LOADER_FILE).exists(),  # written by the save that precedes the card
        loader_file=LOADER_FILE,
        eval_rows=[vars(r) for r in (evals or [])],
    )
    if existing is not None:
        section = rendered.text[rendered.text.index(_START): rendered.text.index(_END) + len(_END)]
        body = existing.text
        if _START in body and _END in body:
            body = body[: body.index(_START)] + section + body[body.index(_END) + len(_END):]
        else:
            body = body.rstrip() + "\n\n" + section + "\n"
        card = ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")
    else:
        card = rendered
    card.save(readme)
    return card


# ----------------------------------------------------------- per-instance overrides
def _check_all_ready(model) -> None:
    for m in model.modules():
        if isinstance(m, HFPolyAttention):
            m.check_ready()


def _save_checkpoint(model, save_directory, *args, **kwargs):
    """The stock save_pretrained, after making config.json carry the attention settings and an ``auto_map`` to
    the loader module, which is written beside it (``remote_code.py``: loading with ``trust_remote_code=True``)."""
    sync_config(model)
    _check_all_ready(model)
    kind = get_polyattn_config(model).kind
    set_auto_map(model.config, kind)
    result = type(model).save_pretrained(model, save_directory, *args, **kwargs)
    if model.should_save_on_this_rank(kwargs.get("is_main_process", args[0] if args else True)):
        write_loader(save_directory, model.config, kind)
        mark_architectures(save_directory)
    return result


def mark_architectures(save_directory) -> list[str]:
    """Rename config.json's ``architectures`` in ``save_directory`` to the served names
    (``serving.served_architecture``: ``LlamaForCausalLM`` -> ``PolyAttnLlamaForCausalLM``); the names written.

    ``save_pretrained`` records the class it saved; an engine that reads that name (vLLM, SGLang, TGI) would serve
    the folder as the base model, softmax attention on the converted weights. transformers does not read the name
    to load (``model_type`` and ``auto_map`` choose the class), so its loading is unchanged."""
    path = Path(save_directory) / "config.json"
    data = json.loads(path.read_text())
    names = [served_architecture(a) for a in data.get("architectures") or []]
    if names and names != data["architectures"]:
        data["architectures"] = names
        path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return names


_HUB_KWARGS = ("repo_id", "commit_message", "commit_description", "create_pr", "private", "token", "revision")


def polyattn_save_pretrained(self, save_directory, *args, push_to_hub: bool = False, eval_results=None,
                             **kwargs):
    """``save_pretrained`` that also records the attention settings and writes the model card.

    Extra keyword: ``eval_results`` (see :func:`write_model_card`).
    """
    hub = {k: kwargs.pop(k) for k in _HUB_KWARGS if k in kwargs} if push_to_hub else {}
    if "token" in hub:
        kwargs["token"] = hub["token"]
    result = _save_checkpoint(self, save_directory, *args, **kwargs)
    is_main = kwargs.get("is_main_process", args[0] if args else True)
    should_save = getattr(self, "should_save_on_this_rank", None)
    if should_save is None or should_save(is_main):
        write_model_card(save_directory, self, eval_results=eval_results,
                         repo_id=hub.get("repo_id"))
        if push_to_hub:
            repo_id = hub.pop("repo_id", os.path.basename(os.path.normpath(os.fspath(save_directory))))
            _upload_folder(save_directory, repo_id, **hub)
    return result


def _load_remote_card(repo_id: str, token) -> ModelCard | None:
    try:
        return ModelCard.load(repo_id, token=token)
    except Exception:  # no card yet, no network, no access: write a fresh one
        return None


def _upload_folder(folder, repo_id: str, *, commit_message=None, commit_description=None, create_pr=False,
                   private=None, token=None, revision=None):
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None and not revision.startswith("refs/pr"):
        api.create_branch(repo_id=repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message or "Upload model with hf_polyattn attention",
        commit_description=commit_description,
        revision=revision,
        create_pr=create_pr,
    )


def polyattn_push_to_hub(self, repo_id: str, *, commit_message: str | None = None,
                         commit_description: str | None = None, private: bool | None = None, token=None,
                         revision: str | None = None, create_pr: bool = False, max_shard_size="50GB",
                         tags: list[str] | None = None, eval_results: Any = None, **kwargs):
    """Upload weights, config.json (with the attention settings) and the model card in one commit."""
    if kwargs:
        raise TypeError(f"push_to_hub() got unexpected arguments {sorted(kwargs)}")
    with tempfile.TemporaryDirectory() as tmp:
        remote = _load_remote_card(repo_id, token)
        if remote is not None:
            remote.save(os.path.join(tmp, "README.md"))  # keep the existing card's text
        _save_checkpoint(self, tmp, max_shard_size=max_shard_size)
        write_model_card(tmp, self, eval_results=eval_results, tags=tags, repo_id=repo_id,
                         model_name=repo_id.split("/")[-1])
        return _upload_folder(tmp, repo_id, commit_message=commit_message, commit_description=commit_description,
                              create_pr=create_pr, private=private, token=token, revision=revision)
