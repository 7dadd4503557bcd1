"""The sliding-window hybrid, the learnable projection and the Hedgehog map through transformers models: save -> reload
identical, left padding exact, and the demo's configuration end to end on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import ARCHS, VOCAB, auto_class, build, perturb_polyattn

import hf_polyattn
from hf_polyattn import PolyAttnConfig

WINDOWED = {
    "llama": PolyAttnConfig(kind="polysketch", sketch="learned", sketch_size=8, window=5, feature_proj=16,
                            qk_norm=True, block_size=4),
    "gpt2": PolyAttnConfig(kind="performer", num_features=16, window=3, window_mix=True, block_size=4),
    "bert": PolyAttnConfig(kind="linear", window=4, feature_proj=20, local_kernel="polynomial", degree=2),
    # Hedgehog's learnable softmax feature map (its W is a polyattn parameter: perturbed, saved, reloaded)
    "mistral": PolyAttnConfig(kind="linear", feature_map="hedgehog", window=4, qk_norm=True, block_size=4),
}


@pytest.mark.parametrize("arch_name", list(WINDOWED))
def test_window_save_reload_identical(tmp_path, arch_name):
    model = build(arch_name, WINDOWED[arch_name])
    perturb_polyattn(model)  # projection, sketches, mixing factor off their initial values
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = auto_class(ARCHS[arch_name]).from_pretrained(tmp_path).eval()
    assert hf_polyattn.get_polyattn_config(again) == WINDOWED[arch_name]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)


def test_window_left_padding_exact_in_a_model():
    """A left-padded prompt gives the logits of the unpadded one (windows are relative to each query)."""
    model = build("llama", WINDOWED["llama"])
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    pad = 3
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = model(ids).logits
        both = model(padded, attention_mask=mask, position_ids=position_ids).logits[:, pad:]
    torch.testing.assert_close(both, alone, rtol=1e-5, atol=1e-5)
