"""The registry of attention kinds: one :class:`KindSpec` per kind, registered with one call.

A kind declares everything the rest of the library needs to know about it: its module (the
ops implementation), its naive reference, which directions it serves, its own options with
defaults and validation, the shared ``PolyAttnConfig`` fields it reads, its extra checks, its
model-card title, its results-table label, how its generation state grows and its benchmark
rows. ``PolyAttnConfig``, the transformers integration, the hub card, the training recipes,
the CLI, ``bench`` and the test matrices read it; none of them names a kind.

The built-in kinds live one file each in ``hf_polyattn/kinds/`` and are loaded on the first
lookup. A user's kind works the same way::

    from hf_polyattn import KindSpec, Option, register_kind
    register_kind(KindSpec(name="my_kind", module=MyAttention, title="my attention", ...))
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="my_kind")

Pure Python: importing it imports neither torch nor transformers (``config.py`` reads it).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .validation import check_bool, check_choice, check_float, check_int

__all__ = ["KindSpec", "Option", "all_kinds", "get_kind", "is_kind", "kind_names", "on_register", "register_kind",
           "unregister_kind"]

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# transformers' own attention implementations and its "paged|"/"kernels" prefixes: a kind with one
# of these names would replace a stock implementation for every model.
_RESERVED = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention", "paged_attention",
             "softmax")
_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class Option:
    """One option of a kind (stored in ``PolyAttnConfig.options``): default, type, range, help."""

    default: Any
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if type(self.default) not in _TYPES:
            raise TypeError(f"Option default must be a bool, int, float or str, got {self.default!r}")
        if isinstance(self.default, str) and not self.choices:
            raise TypeError("a str Option needs choices (the allowed values)")
        self.check("default", self.default)

    @property
    def type(self) -> type:
        return type(self.default)

    def check(self, name: str, value: Any) -> Any:
        """The validated value (ints stay ints, reals become floats); ValueError naming ``name`` otherwise."""
        t = self.type
        if t is bool:
            return check_bool(name, value)
        if t is str:
            return check_choice(name, value, self.choices)
        if t is int:
            lo = -(2**63) if self.minimum is None else int(self.minimum)
            hi = None if self.maximum is None else int(self.maximum)
            return check_int(name, value, lo, hi)
        x = check_float(name, value)
        if (self.minimum is not None and x < self.minimum) or (self.maximum is not None and x > self.maximum):
            raise ValueError(f"{name} must be a real number in [{self.minimum}, {self.maximum}], got {value!r}")
        return x


def _no_checks(config) -> None:
    return None


@dataclass(frozen=True)
class KindSpec:
    """Everything about one attention kind.

    name: the ``attn_implementation`` / ``PolyAttnConfig.kind`` name (lowercase, ``_`` allowed).
    module: the ops class, built as ``module(config, num_heads, head_dim, num_kv_heads, layer_idx)``
        (``hf_polyattn.ops.base``), or ``"package.module:Class"`` imported on first use.
    title: the model card's name for the attention, with its source.
    reference: the naive definition ``reference(module, q, k, v, *, causal, scaling, key_padding_mask)``
        the module is tested against (or ``"package.module:function"``).
    causal / bidirectional: the directions it serves; a model needing the other fails at convert time.
    linear_time: cost linear in the sequence length (for a fixed setting).
    fields: the shared ``PolyAttnConfig`` fields it reads; any other shared field must stay at its default.
    options: its own options (``PolyAttnConfig.options``), name -> :class:`Option`.
    defaults: shared-field values when the kind is named alone (``attn_implementation="sliding_window"``).
    validate: extra checks across fields, ``validate(config)`` raising ValueError.
    label: results-table label details, ``label(config) -> "..."`` (the part inside the parentheses).
    memory: one sentence for the model card: what generation keeps per layer.
    bench: benchmark rows, row name -> config fields (and ``options``) for ``PolyAttnConfig``.
    block_kernel: a kernel kind's default exact kernel on ``local_exact`` diagonal blocks.
    cross_attention: whether it serves cross-attention (queries of one sequence, keys of another); False for kinds
        defined within one sequence (positions, blocks or hashes shared by queries and keys).
    """

    name: str
    module: type | str
    title: str
    reference: Callable | str | None = None
    causal: bool = True
    bidirectional: bool = True
    linear_time: bool = True
    fields: tuple[str, ...] = ()
    options: Mapping[str, Option] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    validate: Callable[[Any], None] = _no_checks
    label: Callable[[Any], str] | None = None
    memory: Callable[[Any], str] | str = "Generation keeps every key and value, like a softmax KV cache."
    bench: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    block_kernel: str = "softmax"
    cross_attention: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"kind name must match {_NAME.pattern} (lowercase letters, digits, '_'), got "
                             f"{self.name!r}")
        if self.name in _RESERVED:
            raise ValueError(f"kind name {self.name!r} is taken by transformers / softmax; allowed: any other "
                             "lowercase name")
        if not (self.causal or self.bidirectional):
            raise ValueError(f"kind {self.name!r} must serve causal or bidirectional attention (or both)")
        for name, opt in self.options.items():
            if not isinstance(opt, Option):
                raise TypeError(f"options[{name!r}] of kind {self.name!r} must be an Option, got {opt!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "fields", tuple(self.fields))

    def module_class(self) -> type:
        return _resolve(self.module)

    def reference_function(self) -> Callable | None:
        return None if self.reference is None else _resolve(self.reference)

    def memory_note(self, config) -> str:
        return self.memory(config) if callable(self.memory) else self.memory

    def detail(self, config) -> str:
        """'gaussian r=32, p=4, ...': this setting's details (``label``), and how many kv heads stay exact softmax
        (``softmax_heads``: a hybrid must never read as the kind alone)."""
        parts = [self.label(config)] if self.label is not None else []
        parts = [p for p in parts if p]
        if getattr(config, "softmax_heads", None):
            n = len(config.softmax_heads)
            parts.append(f"{n} kv head{'s' if n != 1 else ''} exact softmax")
        return "; ".join(parts)

    def table_label(self, config) -> str:
        """'polysketch (gaussian r=32, p=4, ...)': the name and the details of this setting."""
        detail = self.detail(config)
        return f"{self.name} ({detail})" if detail else self.name


def _resolve(target):
    if not isinstance(target, str):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


_KINDS: dict[str, KindSpec] = {}
_LISTENERS: list[Callable[[KindSpec], None]] = []
_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        importlib.import_module("hf_polyattn.kinds")  # each file registers its kind


def register_kind(spec: KindSpec, *, replace: bool = False) -> KindSpec:
    """Add a kind. Registered with transformers right away when the integration is loaded, else
    when it loads. ``replace=True`` re-registers a name (a notebook re-running its cell)."""
    if not isinstance(spec, KindSpec):
        raise TypeError(f"register_kind takes a KindSpec, got {type(spec).__name__}")
    if spec.name in _KINDS and not replace and _KINDS[spec.name] != spec:
        raise ValueError(f"kind {spec.name!r} is already registered; pass replace=True to redefine it")
    _KINDS[spec.name] = spec
    for listener in list(_LISTENERS):
        listener(spec)
    return spec


def unregister_kind(name: str) -> KindSpec:
    """Remove a kind added with :func:`register_kind` (a notebook or a test cleaning up); a built-in kind stays."""
    _load_builtins()
    import hf_polyattn.kinds as builtin

    if name in builtin.BUILTIN:
        raise ValueError(f"{name!r} is a built-in kind and cannot be unregistered")
    if name not in _KINDS:
        raise ValueError(f"kind {name!r} is not registered")
    return _KINDS.pop(name)


def on_register(listener: Callable[[KindSpec], None]) -> None:
    """Call ``listener(spec)`` for every kind registered so far and every later one."""
    _LISTENERS.append(listener)
    for spec in list(all_kinds()):
        listener(spec)


def get_kind(name: Any) -> KindSpec:
    """The spec of ``name``; ValueError listing the registered kinds otherwise."""
    _load_builtins()
    if isinstance(name, str) and name in _KINDS:
        return _KINDS[name]
    raise ValueError(f"kind must be one of {list(_KINDS)} (or a kind registered with hf_polyattn.register_kind), "
                     f"got {name!r}")


def kind_names() -> tuple[str, ...]:
    """Every registered kind, built-in ones first, in registration order."""
    _load_builtins()
    return tuple(_KINDS)


def all_kinds() -> tuple[KindSpec, ...]:
    _load_builtins()
    return tuple(_KINDS.values())


def is_kind(name: Any) -> bool:
    _load_builtins()
    return isinstance(name, str) and name in _KINDS


def check_options(spec: KindSpec, options: Any) -> dict[str, Any]:
    """``options`` validated against ``spec`` with every missing option at its default."""
    if options is None:
        options = {}
    if not isinstance(options, Mapping):
        raise ValueError(f"options must be a dict of kind {spec.name!r}'s options {sorted(spec.options)}, got "
                         f"{options!r}")
    unknown = sorted(set(options) - set(spec.options))
    if unknown:
        allowed = sorted(spec.options) or "none"
        raise ValueError(f"unknown option(s) {unknown} for kind={spec.name!r}; its options: {allowed}")
    return {name: opt.check(name, options.get(name, opt.default)) for name, opt in spec.options.items()}
