"""Inputs of the thesis_reversal study (issue 5, item 1): thesis Chapter 5's sequence reversal, 17 attentions x 3
seeds x 10,000 iterations (``recipes/thesis_reversal.py``), split over two single-threaded processes (one per core),
merged; then eager against compiled time per iteration (300 iterations of seed 0); then the section.

    python recipes/experiments/run.py thesis_reversal [ROW ...]

The recorded grid ran 2026-11-22 09:28 UTC on the idle 2-core CPU; the eager/compiled check after it, while one
paper_tables.py run used the other core. It then lived in the results folder and wrote to
recipes/results/thesis_reversal_10k (since renamed recipes/results/thesis_reversal): the commands are the same, with
paths from the repository root.
"""

REVERSAL = "recipes/thesis_reversal.py"
OUT = "recipes/results/thesis_reversal"
GRID = ["--iterations", "10000", "--seeds", "0", "1", "2", "--threads", "1", "--compile"]
# the eager-against-compiled timing check after the grid
COMPILE_CHECK_KINDS = ("softmax", "x8", "sq6", "learned6")

ROWS = {
    "grid_a": [REVERSAL, *GRID, "--kinds", "softmax", "elu", "x2", "x4", "x8", "sq1", "sq2", "sq3", "sq4",
               "--tag", "_a", "--out", OUT],
    "grid_b": [REVERSAL, *GRID, "--kinds", "sq5", "sq6", "learned1", "learned2", "learned3", "learned4", "learned5",
               "learned6", "--tag", "_b", "--out", OUT],
}
JOBS = 2  # one process per core
ENV = {"OMP_NUM_THREADS": "1"}
CHECK = ["--iterations", "300", "--seeds", "0", "--threads", "1", "--kinds", *COMPILE_CHECK_KINDS]
AFTER = [
    [REVERSAL, "--merge", "results_a.json", "results_b.json", "--out", OUT],
    [REVERSAL, *CHECK, "--out", f"{OUT}/compile_check/eager"],
    [REVERSAL, *CHECK, "--compile", "--out", f"{OUT}/compile_check/compile"],
    ["-m", "recipes.experiments.thesis_reversal.fill_section"],
]
