"""``sink_span`` through transformers models: on a Llama, a span S scores the sinks as 'own' does up to position S
and as nothing else beyond (the logits of positions <= S equal 'own''s, the later ones differ from both 'own' and
the default), generate() with the recurrent cache equals the uncached forward while crossing S, left-padded rows
equal themselves alone, save -> reload keeps the span, a config.json from before the field reloads as the default
rule, ``reconfigure`` sets it on a converted model (what --reconfigure / --set sink_span=N do) and the command line
parses it."""

from __future__ import annotations

import json

import pytest
import torch
from integration_helpers import check_greedy_steps, check_left_padded_generation
from test_sink_position_models import POLYSKETCH, STREAMING, S, W, _layers, _model, _prompt

import hf_polyattn

SPAN = 9  # beyond w + s - 1 = 5, short of the prompts below


@pytest.mark.parametrize("cfg", [STREAMING, POLYSKETCH], ids=["streaming", "polysketch"])
def test_greedy_equals_full_forward_every_step(cfg):
    """A 12-token prompt and 8 decoded tokens (positions 12-19, beyond the span): cache = no cache at every step."""
    model = _model("llama", cfg.replace(sink_span=SPAN))
    assert all(layer.config.sink_span == SPAN for layer in _layers(model))
    check_greedy_steps(model, _prompt())


def test_left_padded_generation_equals_rows():
    """Left padding moves no position: row 1's 3 tokens reach beyond the span while decoding."""
    check_left_padded_generation(_model("llama", POLYSKETCH.replace(sink_span=SPAN)),
                                 [_prompt(1, 12, seed=1)[0], _prompt(1, 3, seed=2)[0]], 12)


def test_span_is_own_up_to_it_and_neither_beyond():
    """Same weights: with the span the logits of positions 0..S equal 'own''s (no query there is turned), every later
    one differs from 'own'; against the default (w + s - 1) positions 0..w + s - 1 are equal, every later one
    differs."""
    ids = _prompt(1, 16, seed=4)
    logits = {}
    for name, cfg in (("span", STREAMING.replace(sink_span=SPAN)), ("own", STREAMING.replace(sink_position="own")),
                      ("default", STREAMING)):
        with torch.no_grad():
            logits[name] = _model("llama", cfg)(ids).logits[0]
    own = (logits["span"] - logits["own"]).abs().amax(-1)
    default = (logits["span"] - logits["default"]).abs().amax(-1)
    assert (own[: SPAN + 1] < 1e-6).all() and (own[SPAN + 1 :] > 1e-4).all(), own
    assert (default[: W + S] < 1e-6).all() and (default[W + S :] > 1e-4).all(), default


def test_reload_and_reconfigure_keep_the_span(tmp_path):
    """save -> reload keeps sink_span and the logits; a config.json without the field reloads as 0; reconfigure sets
    it on a converted model (the same logits as one converted with it) and back to 0 (the default's)."""
    import transformers

    ids = _prompt(1, 14, seed=6)
    spanned = STREAMING.replace(sink_span=SPAN)
    model = _model("llama", spanned)
    with torch.no_grad():
        want = model(ids).logits
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_polyattn.get_polyattn_config(again).sink_span == SPAN
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, want, rtol=0, atol=0)
    path = tmp_path / "config.json"
    stored = json.loads(path.read_text())
    assert stored["polyattn"]["sink_span"] == SPAN
    del stored["polyattn"]["sink_span"]
    path.write_text(json.dumps(stored))
    old = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert hf_polyattn.get_polyattn_config(old).sink_span == 0
    default = _model("llama", STREAMING)
    with torch.no_grad():
        base = default(ids).logits
        torch.testing.assert_close(old(ids).logits, base, rtol=0, atol=0)
        hf_polyattn.reconfigure(default, sink_span=SPAN)
        assert all(layer.config.sink_span == SPAN for layer in _layers(default))
        torch.testing.assert_close(default(ids).logits, want, rtol=0, atol=0)
        hf_polyattn.reconfigure(default, sink_span=0)
        torch.testing.assert_close(default(ids).logits, base, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"sink_span must be 0 or >= window \+ sinks - 1 = 5"):
        hf_polyattn.reconfigure(default, sink_span=3)


def test_command_line_parses_the_span():
    """--set / --reconfigure sink_span=N (the retrieval study's settings strings) give the int."""
    from hf_polyattn.cli import parse_settings

    assert parse_settings("linear", ["sink_span=2048", "sparse_cache=512"]) == {"sink_span": 2048,
                                                                                "sparse_cache": 512}
