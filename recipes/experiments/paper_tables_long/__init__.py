"""Scripts of the paper_tables_long study (run from anywhere; see recipes/experiments/README.md)."""
