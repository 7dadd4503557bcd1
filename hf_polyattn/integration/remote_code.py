"""Checkpoints that load without ``import hf_polyattn``: an ``auto_map`` and a loader module beside the weights.

Clients that load a model by path (lm-eval, ``pipeline``, TRL, serving stacks) never import the plugin, so
``from_pretrained`` meets ``"attn_implementation": "polysketch"`` with no such attention registered and raises.
Transformers' own answer for code a checkpoint needs is ``auto_map`` + ``trust_remote_code=True``: config.json
names, for each auto class, ``module.Class`` in a file of the checkpoint, and ``from_pretrained(...,
trust_remote_code=True)`` imports that file and instantiates the class it names.

The file written here (:data:`LOADER_FILE`) holds no model code. It imports the *installed* plugin, which
registers the attention kinds with transformers, and re-exports the stock transformers classes the auto classes
map the checkpoint's config to, so the model built is the one ``import hf_polyattn`` + ``from_pretrained`` builds:
the same class, weights and logits. What a user gets:

* ``import hf_polyattn`` first: the model, as always (the loader is not read);
* ``trust_remote_code=True`` without the import: the same model when hf_polyattn is installed; without it an
  ``ImportError`` that says ``pip install hf_polyattn``;
* neither: transformers' ``ValueError: Specified attn_implementation="..." is not supported`` (never a silent
  softmax model).

A kind registered by the user's own code (``register_kind``) gets no loader: importing hf_polyattn would not
register it, so such a folder keeps the third behaviour only.

Loading through the remote-code path makes transformers call ``register_for_auto_class`` on the class it got
from the loader, here the stock class itself: from then on every ``save_pretrained`` of that class in the process
would copy transformers' own modeling file into the saved folder (``custom_object_save``) and point ``auto_map`` at
it, a folder that no longer loads. :func:`forget_auto_class_registration` puts the stock default back when a
polyattn model is built; our save writes the loader itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers.configuration_utils import PreTrainedConfig

__all__ = ["AUTO_CLASSES", "LOADER_FILE", "forget_auto_class_registration", "loader_classes", "loader_source",
           "set_auto_map", "write_loader"]

logger = logging.getLogger(__name__)

LOADER_MODULE = "hf_polyattn_loader"
LOADER_FILE = f"{LOADER_MODULE}.py"

# The auto classes a polyattn checkpoint is loaded with (tasks of the kinds' models: decoders and encoders).
AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForPreTraining",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForMultipleChoice",
)


def _is_stock(cls) -> bool:
    """A class transformers itself defines and exports at the top level (importable as ``from transformers import``)."""
    import transformers

    return (isinstance(cls, type) and cls.__module__.startswith("transformers.models.")
            and getattr(transformers, cls.__name__, None) is cls)


def loader_classes(config: PreTrainedConfig) -> dict[str, str]:
    """Auto class name -> stock class name, for every auto class in :data:`AUTO_CLASSES` that maps ``config``.

    Empty for a config transformers does not know (a remote-code architecture): its checkpoint keeps its own
    ``auto_map`` and no loader is written.
    """
    import transformers

    out = {}
    for auto in AUTO_CLASSES:
        cls = getattr(transformers, auto)._model_mapping.get(type(config), None)
        if _is_stock(cls):
            out[auto] = cls.__name__
    return out


def loader_source(kind: str, classes: list[str]) -> str:
    """The text of the loader module: the plugin's import and the stock classes, nothing else."""
    from .. import __version__

    names = "".join(f"    {name},\n" for name in sorted(set(classes)))
    return f'''"""from_pretrained(..., trust_remote_code=True) of a checkpoint with hf_polyattn attention ({kind!r}).

Written by hf_polyattn {__version__}. It holds no model code: importing the installed hf_polyattn registers its
attention kinds with transformers, and the classes below are transformers' own.
"""

try:
    import hf_polyattn  # noqa: F401  (registers the attention kinds with transformers)
except ImportError as err:
    raise ImportError(
        "This checkpoint computes attention with hf_polyattn ({kind!r}), which is not installed: "
        "pip install hf_polyattn"
    ) from err

from transformers import (  # noqa: E402,F401  (the stock classes config.json's auto_map names)
{names})
'''


def set_auto_map(config: PreTrainedConfig, kind: str) -> dict[str, str]:
    """Point ``config.auto_map`` at the loader for every auto class that maps the config (other entries kept).

    Returns the classes the loader must export; {} when there is nothing the loader could load, and then no entry
    names it: an architecture transformers does not know (a remote-code one keeps its own ``auto_map``), or a kind
    registered by the user's code (importing hf_polyattn does not register it: the load would fail on the kind).
    """
    from ..kinds import BUILTIN

    existing = {auto: ref for auto, ref in (getattr(config, "auto_map", None) or {}).items()
                if not (isinstance(ref, str) and ref.startswith(f"{LOADER_MODULE}."))}
    classes = loader_classes(config) if kind in BUILTIN else {}
    if not classes:
        why = "a kind registered outside hf_polyattn" if kind not in BUILTIN else "not a transformers architecture"
        logger.info("no %s for %s with attention %r: %s", LOADER_FILE, type(config).__name__, kind, why)
    existing.update({auto: f"{LOADER_MODULE}.{name}" for auto, name in classes.items()})
    if existing or getattr(config, "auto_map", None) is not None:
        config.auto_map = existing
    return classes


def write_loader(save_directory, config: PreTrainedConfig, kind: str) -> Path | None:
    """Write :data:`LOADER_FILE` into ``save_directory`` for the classes ``config.auto_map`` names; its path."""
    auto_map = getattr(config, "auto_map", None) or {}
    classes = [ref.split(".", 1)[1] for ref in auto_map.values()
               if isinstance(ref, str) and ref.startswith(f"{LOADER_MODULE}.")]
    if not classes:
        return None
    path = Path(save_directory) / LOADER_FILE
    path.write_text(loader_source(kind, classes))
    return path


def forget_auto_class_registration(model_class: type) -> None:
    """Undo ``register_for_auto_class`` on a stock transformers class (see the module docstring).

    transformers sets ``_auto_class`` on the class the remote-code path returned; a stock class inherits ``None``
    from ``PreTrainedModel`` otherwise, so removing the class's own attribute restores exactly that.
    """
    for cls in model_class.__mro__:
        if "_auto_class" in cls.__dict__ and cls.__module__.startswith("transformers.models."):
            delattr(cls, "_auto_class")
