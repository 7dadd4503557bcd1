"""The built-in attention kinds, one file each: its module (or the ops class it uses), its
reference and one ``register_kind`` call. Importing this package registers them all, in the order
below (``hf_polyattn.registry`` does so on its first lookup)."""

from __future__ import annotations

import importlib

BUILTIN = ("polynomial", "polysketch", "linear", "performer", "taylor", "sliding_window", "linformer", "nystrom",
           "fnet", "bigbird", "reformer",
           "delta")

for _name in BUILTIN:
    importlib.import_module(f"{__name__}.{_name}")
