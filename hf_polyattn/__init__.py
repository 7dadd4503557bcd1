"""hf_polyattn: polynomial, PolySketch, linear, Performer and other efficient attentions for transformers.

``import hf_polyattn`` registers every attention kind with transformers, without
importing transformers itself (so ``import hf_polyattn.ops`` stays free of it): if
transformers is already imported the kinds are registered now; otherwise a one-shot
``sys.meta_path`` hook registers them right after ``import transformers`` finishes, then
removes itself. The public integration API (``convert``, ``PolyAttnCache``, ...) is
loaded lazily on first attribute access.
"""

from __future__ import annotations

import importlib
import importlib.abc
import sys
import warnings

from .config import PolyAttnConfig
from .registry import KindSpec, Option, get_kind, kind_names, register_kind

__version__ = "0.1.0"

_LAZY = {
    "HFPolyAttention": "integration",
    "PolyAttnCache": "integration",
    "PolyAttnCacheLayer": "integration",
    "cache_kwargs": "integration",
    "capture_decode": "integration",
    "compile_decode": "integration",
    "convert": "integration",
    "decode_memory": "integration",
    "get_polyattn_config": "integration",
    "layer_layout": "integration",
    "read_document": "integration",
    "reconfigure": "integration",
    "returned_cache": "integration",
    "write_model_card": "integration",
}

__all__ = [
    "HFPolyAttention",
    "KindSpec",
    "Option",
    "PolyAttnCache",
    "PolyAttnCacheLayer",
    "PolyAttnConfig",
    "__version__",
    "cache_kwargs",
    "capture_decode",
    "compile_decode",
    "convert",
    "decode_memory",
    "get_kind",
    "get_polyattn_config",
    "kind_names",
    "layer_layout",
    "read_document",
    "reconfigure",
    "register",
    "register_kind",
    "returned_cache",
    "write_model_card",
]


def register() -> None:
    """Register every kind with transformers now (imports transformers; idempotent)."""
    importlib.import_module(".integration", __name__)


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


class _RegisteringLoader(importlib.abc.Loader):
    """Wraps transformers' loader: after its ``exec_module``, register our kinds."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _remove_import_hook()
        try:
            register()
        except Exception as err:  # never break `import transformers` itself
            warnings.warn(f"hf_polyattn could not register its attention kinds with transformers: {err!r}",
                          stacklevel=2)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_source, ...
        return getattr(self._loader, name)


class _TransformersImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


_IMPORT_HOOK = _TransformersImportHook()


def _remove_import_hook() -> None:
    if _IMPORT_HOOK in sys.meta_path:
        sys.meta_path.remove(_IMPORT_HOOK)


if "transformers" in sys.modules:
    register()
elif _IMPORT_HOOK not in sys.meta_path:
    sys.meta_path.insert(0, _IMPORT_HOOK)
