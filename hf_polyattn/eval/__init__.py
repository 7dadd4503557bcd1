"""Evaluation: perplexity across contexts and passkey retrieval (``long_context``, ``passkey``, ``metrics``),
retrieval-head scores (``heads``), run comparisons (``compare``), model cards (``card``) and lm-eval glue with its
offline tasks (``harness``, ``lm_eval_tasks/``). Imports transformers only where a function needs it."""
