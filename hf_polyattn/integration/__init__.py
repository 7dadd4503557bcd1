"""transformers integration: the only subpackage of hf_polyattn that imports transformers.

Importing it registers every attention kind (``hf_polyattn.registry``) with
``AttentionInterface`` and ``AttentionMaskInterface`` and installs the construction hook
that gives polyattn models their per-layer ``polyattn`` submodules.
"""

from .cache import PolyAttnCache, PolyAttnCacheLayer, decode_memory
from .compatibility import cache_kwargs, returned_cache
from .convert import compile_decode, convert, get_polyattn_config, reconfigure
from .graphs import DecodeGraphs, capture_decode
from .hub import write_model_card
from .layout import layer_layout
from .reading import read_document
from .registry import register_all
from .state import HFPolyAttention

register_all()

__all__ = [
    "DecodeGraphs",
    "HFPolyAttention",
    "PolyAttnCache",
    "PolyAttnCacheLayer",
    "cache_kwargs",
    "capture_decode",
    "compile_decode",
    "convert",
    "decode_memory",
    "get_polyattn_config",
    "layer_layout",
    "read_document",
    "reconfigure",
    "register_all",
    "returned_cache",
    "write_model_card",
]
