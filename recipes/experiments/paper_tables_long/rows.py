"""Inputs of the paper_tables_long study (issue 5, item 2): PolySketchFormer's Tables 1-2 at small scale, every kind
training the same small GPT-2 from scratch on Tiny Shakespeare (``recipes/paper_tables.py``), 600 steps at contexts
2048, 1024 and 256 with seeds 0 and 1, then softmax and the learned polysketch kinds 2,400 steps at 2048.

    python recipes/experiments/run.py paper_tables_long [ROW ...]

Each row is one single-threaded ``paper_tables.py`` call. The recorded runs ran the two seeds side by side, one
process per core (``run.py paper_tables_long seed0/...`` and ``... seed1/...`` in two shells); a seed's rows run in
the order below: ``seed<S>/ctx256_first`` trains the models that the grid's context-256 call finds finished in the
same runs folder and only evaluates again.
"""

PAPER = "recipes/paper_tables.py"
SEEDS = (0, 1)
LEARNED = ("softmax", "polysketch_learned", "polysketch_local")
RESULTS = "recipes/results/paper_tables_long"


def _row(seed: int, *args: str) -> list[str]:
    return [PAPER, *args, "--seed", str(seed), "--threads", "1"]


ROWS = {}
for _s in SEEDS:
    ROWS[f"seed{_s}/ctx256_first"] = _row(_s, "--contexts", "256", "--steps", "600", "--kinds", *LEARNED,
                                          "--runs_dir", f"runs/paper_tables_long/seed{_s}",
                                          "--out", f"runs/paper_tables_long/seed{_s}/ctx256_first")
    for _c in (2048, 1024, 256):
        ROWS[f"seed{_s}/ctx{_c}"] = _row(_s, "--contexts", str(_c), "--steps", "600",
                                         "--runs_dir", f"runs/paper_tables_long/seed{_s}",
                                         "--out", f"{RESULTS}/seed{_s}/ctx{_c}")
    for _k in LEARNED:
        ROWS[f"seed{_s}/long2048_{_k}"] = _row(_s, "--contexts", "2048", "--steps", "2400", "--kinds", _k,
                                               "--runs_dir", f"runs/paper_tables_long2048/seed{_s}",
                                               "--out", f"{RESULTS}/long2048/seed{_s}/{_k}")
ENV = {"OMP_NUM_THREADS": "1"}
AFTER = [["-m", "recipes.experiments.paper_tables_long.fill_section"]]
