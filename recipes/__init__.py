"""Recipes of hf_polyattn (not part of the installed package); see recipes/README.md."""
