"""Scripts of the retrofit study (run from anywhere; see recipes/experiments/README.md)."""
