"""Defaults of the recipes that point into this repository's checkout (not part of the installed package)."""

# The project's offline copy of Tiny Shakespeare, relative to the repository root (where the recipes run).
TINY_SHAKESPEARE = "../shared/data/tinyshakespeare_train.txt"
