"""Paths the recipes use inside this repository's checkout (not part of the installed package).

Every path is absolute, computed from this file's location, so the recipes and the experiment scripts work
from any working directory: ``python /path/to/repo/recipes/retrofit.py --help`` shows a data path that exists.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
RESULTS = ROOT / "recipes" / "results"  # recorded results: data and generated sections only
EXPERIMENTS = ROOT / "recipes" / "experiments"  # the scripts that produced them
SHARED_DATA = ROOT.parent / "shared" / "data"  # the project's offline data sets, next to the checkout

TINY_SHAKESPEARE = str(SHARED_DATA / "tinyshakespeare_train.txt")
SST2 = str(SHARED_DATA / "sst2_train.tsv")
