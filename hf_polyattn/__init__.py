"""hf_polyattn: polynomial, PolySketch, linear and Performer attention for transformers."""
from .config import PolyAttnConfig

__version__ = "0.1.0"
__all__ = ["PolyAttnConfig", "__version__"]
