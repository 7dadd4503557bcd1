"""lm-eval (EleutherAI's lm-evaluation-harness) with hf_polyattn models.

* ``hf-polyattn lm-eval ARGS...`` runs lm-eval's own command line (``lm-eval ARGS...``: every task, model type and
  option it has) in a process where ``import hf_polyattn`` registered the attention kinds, with the tasks shipped
  in this package (``lm_eval_tasks/``) added to ``--include_path``. A saved folder also loads in lm-eval's own
  CLI, without this command, through its loader: ``--model_args pretrained=DIR,trust_remote_code=True``.
* :func:`evaluate` scores a model object in this process (the retrofit pipeline's ``--lm_eval_tasks``).
* The shipped tasks read local files, for machines without the Hub: ``polyattn_tinyshakespeare`` (rolling
  loglikelihood of the held-out tail of Tiny Shakespeare: word / byte perplexity, bits per byte) and
  ``polyattn_sst2`` (SST-2 as two-way multiple choice on a fixed seeded validation split). Their files:
  ``--metadata '{"tinyshakespeare_file": ..., "sst2_file": ...}'`` (``lm_eval_tasks/hf_polyattn_tasks.py``).

lm-eval is an optional dependency: ``pip install "hf_polyattn[eval]"`` (pinned to the version this was written and
tested against).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["TASKS", "TASKS_DIR", "evaluate", "main_metric", "run_cli"]

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"
TASKS = ("polyattn_tinyshakespeare", "polyattn_sst2")
INSTALL = 'pip install "hf_polyattn[eval]"'


def _require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise ImportError(f"lm-eval is not installed: {INSTALL}") from err


def task_manager(metadata: dict[str, Any] | None = None):
    """An lm-eval TaskManager that knows lm-eval's tasks and the ones shipped here (one per metadata: indexing
    lm-eval's task folders took 5-7 s here, paid once per process instead of at every evaluation)."""
    _require_lm_eval()
    return _task_manager(json.dumps(metadata or {}, sort_keys=True))


@functools.lru_cache(maxsize=8)
def _task_manager(metadata_json: str):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), metadata=json.loads(metadata_json))


def run_cli(argv: list[str], prog: str = "lm-eval") -> int:
    """``lm-eval ARGS...`` in this process, the attention kinds registered and the shipped tasks included; the exit
    code lm-eval gives (0 on success). ``prog`` names the command in lm-eval's usage lines."""
    _require_lm_eval()
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from .. import register

    register()
    setup_logging()
    cli = HarnessCLI()
    cli._parser.prog = prog  # lm-eval 0.4.13 keeps its top-level parser there
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]  # lm-eval's parser reads sys.argv (and inserts `run` when no command is named)
    try:
        args = cli.parse_args()
        if "include_path" in vars(args):  # run / ls / validate: the user's paths after ours
            given = args.include_path
            args.include_path = [str(TASKS_DIR), *([given] if given else [])]
        cli.execute(args)
    except SystemExit as stop:  # --help, usage errors
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def evaluate(model, tokenizer, tasks: list[str], *, limit: int | float | None = None, batch_size: int = 1,
             max_length: int | None = None, metadata: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Score a model object on lm-eval tasks in this process: ``{task: {metric: value}}`` (lm-eval's
    ``metric,filter`` keys, standard errors left out)."""
    _require_lm_eval()
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, log_samples=False,
                                  task_manager=task_manager(metadata), metadata=metadata or {})
    return {task: {k: v for k, v in values.items() if "," in k and "_stderr" not in k}  # metric,filter
            for task, values in out["results"].items()}


def main_metric(values: dict[str, float]) -> tuple[str, float]:
    """The headline number of a task's results: bits per byte, else accuracy, else the first metric."""
    for prefix in ("bits_per_byte", "acc,", "acc"):
        for key, value in values.items():
            if key.startswith(prefix):
                return key, value
    key = next(iter(values))
    return key, values[key]
