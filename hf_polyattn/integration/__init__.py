"""transformers integration: the only subpackage of hf_polyattn that imports transformers.

Importing it registers every attention kind (``hf_polyattn.registry``) with
``AttentionInterface`` and ``AttentionMaskInterface`` and installs the construction hook
that gives polyattn models their per-layer ``polyattn`` submodules.
"""

from .cache import PolyAttnCache, PolyAttnCacheLayer
from .compatibility import cache_kwargs, returned_cache
from .convert import convert, get_polyattn_config
from .hub import write_model_card
from .registry import register_all
from .state import HFPolyAttention

register_all()

__all__ = [
    "HFPolyAttention",
    "PolyAttnCache",
    "PolyAttnCacheLayer",
    "cache_kwargs",
    "convert",
    "get_polyattn_config",
    "register_all",
    "returned_cache",
    "write_model_card",
]
