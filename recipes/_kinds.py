"""Attention kinds and their labels, one place for the recipes and the experiment scripts.

paper_tables.py and thesis_reversal.py re-export their grid's names as ``PAPER_KINDS`` / ``ALL_KINDS`` and ``LABELS``;
the fill scripts under recipes/experiments/ import them from there or from here.
"""

# PolySketchFormer Tables 1-2 at small scale (recipes/paper_tables.py)
PAPER_KINDS = ["softmax", "polynomial", "polysketch_random", "polysketch_learned", "polysketch_local", "performer"]
PAPER_LABELS = {
    "softmax": "Softmax (sdpa)",
    "polynomial": "Polynomial p=4 (exact)",
    "polysketch_random": "Polysketch (random)",
    "polysketch_learned": "Polysketch (learned)",
    "polysketch_local": "Polysketch (learned + local exact)",
    "performer": "Performer",
}

# Thesis Chapter 5, sequence reversal (recipes/thesis_reversal.py)
THESIS_SINGLE = ["softmax", "elu", "x2", "x4", "x8"]
THESIS_SQUARED = [f"sq{d}" for d in range(1, 7)]
THESIS_LEARNED = [f"learned{d}" for d in range(1, 7)]
THESIS_KINDS = THESIS_SINGLE + THESIS_SQUARED + THESIS_LEARNED
THESIS_LABELS = {
    "softmax": "softmax", "elu": "elu+1 (linear)", "x2": "x^2", "x4": "x^4", "x8": "x^8",
    **{f"sq{d}": "(" + " + ".join(["1", "x"] + [f"x^{i}" for i in range(2, d + 1)]) + ")^2" for d in range(1, 7)},
    **{f"learned{d}": f"learned, degree {d}" for d in range(1, 7)},
}
# the eager-against-compiled timing check after the grid (recipes/experiments/thesis_reversal/)
THESIS_COMPILE_CHECK_KINDS = ("softmax", "x8", "sq6", "learned6")

# Retrofit study: the runs whose wall times the section quotes (runs/r2/<name>, recipes/results/retrofit/<name>_*)
RETROFIT_RUNS = ("smollm2-softmax", "smollm2-polysketch", "smollm2-polynomial", "smollm2-linear",
                 "smollm2-linear-local", "minilm-softmax", "minilm-polysketch", "minilm-linear", "minilm-linear-local")
