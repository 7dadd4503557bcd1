"""Paths the recipes use inside this repository's checkout (not part of the installed package).

Every path is absolute, computed from this file's location, so the recipes and the experiment scripts work
from any working directory. The data the recipes read by default ships with the package.
"""

import os
from pathlib import Path

from hf_polyattn.data import demo_text_path

ROOT = Path(__file__).resolve().parents[1]  # the repository root
RESULTS = ROOT / "recipes" / "results"  # recorded results: data and generated sections only
EXPERIMENTS = ROOT / "recipes" / "experiments"  # the scripts that produced them

TINY_SHAKESPEARE = str(demo_text_path())  # the bundled demo text (`--data demo`)
SST2_ENV = "HF_POLYATTN_SST2"


def sst2_file() -> str:
    """GLUE SST-2's training file (sentence<TAB>label rows, 67,349 of them): not bundled, named by $HF_POLYATTN_SST2
    (the file GLUE distributes as SST-2/train.tsv, or the Hub's stanfordnlp/sst2 train split saved as a .tsv)."""
    path = os.environ.get(SST2_ENV)
    if not path or not Path(path).is_file():
        raise SystemExit(f"SST-2 is not bundled: set {SST2_ENV} to its training file (a sentence<TAB>label .tsv, "
                         f"e.g. GLUE's SST-2/train.tsv){'; ' + repr(path) + ' is not a file' if path else ''}")
    return path
