"""Long-context evaluation (training/long_context.py): the perplexity curve, passkey retrieval, the baseline rows,
the written table and plot, and the pipeline stage."""

from __future__ import annotations

import json
import re

import pytest
import torch

import hf_polyattn  # noqa: F401  (registers the kinds)
from hf_polyattn.eval.long_context import (
    LongContextSettings,
    evaluate_rows,
    long_context_markdown,
    passkey_retrieval,
    perplexity_curve,
    write_long_context,
)
from hf_polyattn.eval.metrics import perplexity


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dirs["llama"])


class _Answers(torch.nn.Module):
    """A stand-in causal LM whose greedy answer is the key found in the prompt (or a wrong one)."""

    def __init__(self, tok, right: bool):
        super().__init__()
        self.tok, self.right = tok, right
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"max_position_embeddings": 4096})()

    def generate(self, ids, attention_mask=None, max_new_tokens=8, do_sample=False, pad_token_id=None):
        assert not do_sample and attention_mask.shape == ids.shape
        key = int(re.search(r"pass key is (\d+)", self.tok.decode(ids[0])).group(1))
        answer = f" {key if self.right else key + 1}."
        new = torch.tensor([self.tok(answer, add_special_tokens=False)["input_ids"]])
        return torch.cat([ids, new], dim=1)


def test_passkey_scores_exact_matches_with_seeded_keys(tiny):
    _, tok = tiny
    right = passkey_retrieval(_Answers(tok, True), tok, [300, 600], depths=3, seed=7)
    wrong = passkey_retrieval(_Answers(tok, False), tok, [300, 600], depths=3, seed=7)
    assert right["hits"] == [[1, 1, 1], [1, 1, 1]] and right["accuracy"] == {"300": 1.0, "600": 1.0}
    assert wrong["hits"] == [[0, 0, 0], [0, 0, 0]]
    assert right["keys"] == wrong["keys"]  # same seed, same keys
    assert passkey_retrieval(_Answers(tok, True), tok, [300], depths=3, seed=8)["keys"] != right["keys"][:1]
    assert right["depths"] == pytest.approx([1 / 6, 0.5, 5 / 6])
    with pytest.raises(ValueError, match="positions"):
        passkey_retrieval(_Answers(tok, True), tok, [5000], depths=1)


def test_perplexity_curve_is_metrics_perplexity_at_each_context(tiny, tiny_dirs):
    model, tok = tiny
    ids = torch.randint(0, len(tok), (300,), generator=torch.Generator().manual_seed(0))
    curve = perplexity_curve(model, ids, [16, 64, 128], tokens_per_batch=128)
    for c, r in zip([16, 64, 128], curve):
        ref = perplexity(model, ids, context=c, stride=c, batch_size=1)
        assert r["context"] == c and r["tokens"] == ref["tokens"] > 280
        assert r["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-5)
    with pytest.raises(ValueError, match="longer than the evaluated stream"):
        perplexity_curve(model, ids, [16, 400])
    long_ids = torch.randint(0, len(tok), (600,))
    with pytest.raises(ValueError, match="positions"):
        perplexity_curve(model, long_ids, [512])  # the tiny Llama has 256 positions


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="contexts"):
        LongContextSettings(contexts=())
    with pytest.raises(ValueError, match="baselines"):
        LongContextSettings(baselines=("softmax", "window"))
    with pytest.raises(ValueError, match="passkey_depths"):
        LongContextSettings(passkey_depths=0)


def test_settings_check_positions_with_the_templates_answer_tokens():
    """A prompt + its template's answer (classic: 5 digits + 3; vault: up to 7 + 3) must fit the positions."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=128)
    LongContextSettings(contexts=(128,), passkey_lengths=(120,)).check_positions(cfg)  # 120 + 8 = 128
    LongContextSettings(contexts=(64,), passkey_lengths=(118,),
                        passkey_templates=("classic", "vault")).check_positions(cfg)  # 118 + 10 = 128
    with pytest.raises(ValueError, match=r"passkey_lengths: 120 \(\+10 answer tokens.*use at most 118"):
        LongContextSettings(contexts=(64,), passkey_lengths=(120,),
                            passkey_templates=("classic", "vault")).check_positions(cfg)
    with pytest.raises(ValueError, match=r"contexts \[256\] are longer than the model's 128 positions"):
        LongContextSettings(contexts=(64, 256), passkey_lengths=()).check_positions(cfg)
    from types import SimpleNamespace

    # a config that names no positions: nothing to check
    LongContextSettings(contexts=(4096,), passkey_lengths=(4096,)).check_positions(SimpleNamespace())


def test_rows_with_baselines_table_and_files(tiny, tiny_dirs, tmp_path):
    """The model's row beside softmax and StreamingLLM rows on the same tokens; the streaming row is the
    sliding_window kind with sinks (its perplexity differs from softmax's once the context exceeds sinks + window)."""
    from transformers import AutoModelForCausalLM

    model, tok = tiny
    ids = torch.randint(0, len(tok), (400,), generator=torch.Generator().manual_seed(1))
    settings = LongContextSettings(contexts=(32, 128), max_tokens=256, passkey_lengths=(240,), passkey_depths=2,
                                   streaming_sinks=2, streaming_window=8)
    result = evaluate_rows(model, tok, ids, settings, label="the model",
                           load_base=lambda: AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"]),
                           log=lambda m: None)
    soft, stream, own = result["rows"]
    assert [soft.get("baseline"), stream.get("baseline")] == ["softmax", "streaming"]
    assert result["tokens"] == 256
    # the model here is the softmax checkpoint itself: its row equals the softmax row
    assert [p["perplexity"] for p in own["perplexity"]] == pytest.approx([p["perplexity"] for p in soft["perplexity"]])
    assert stream["attention"]["kind"] == "sliding_window" and stream["attention"]["sinks"] == 2
    assert stream["perplexity"][1]["perplexity"] != pytest.approx(soft["perplexity"][1]["perplexity"])
    md = long_context_markdown(result)
    assert "| softmax (the checkpoint) |" in md and "ppl @ 128" in md and "passkey @ 240" in md and "(1.00x)" in md
    paths = write_long_context(result, tmp_path)
    assert json.loads(paths["json"].read_text())["rows"][2]["label"] == "the model"
    assert paths["png"].stat().st_size > 1000


def test_pipeline_long_context_stage_and_card(tiny_dirs, text_file, tmp_path):
    from hf_polyattn.training.pipeline import RetrofitArgs, run

    out = tmp_path / "run"
    attention = {"kind": "linear", "window": 8, "block_size": 64, "qk_norm": True, "sinks": 4, "decay": "gate",
                 "decay_horizon": 256.0, "window_mix": True, "window_mix_init": 0.01}
    res = run(RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention=attention, context=32,
                                 eval_context=32, eval_stride=32, max_eval_tokens=64, transfer_steps=1,
                                 progress=False, eval_contexts="16,64", passkey_lengths="240", passkey_depths=1,
                                 long_eval_tokens=256, long_eval_baselines="softmax", output_dir=str(out)))
    rows = res["long_context"]["rows"]
    assert [r.get("baseline") for r in rows] == ["softmax", None]
    assert [p["context"] for p in rows[1]["perplexity"]] == [16, 64]
    for f in ("long_context.json", "long_context.md", "long_context.png"):
        assert (out / f).exists(), f
    card = (out / "model" / "README.md").read_text()
    assert "Long context" in card and "long_context.png" in card and (out / "model" / "long_context.png").exists()
    with pytest.raises(ValueError, match="eval_contexts"):
        RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention="polysketch", eval_contexts="16,x")
    # a passkey the model's positions cannot hold is refused before any training, not at the evaluation
    late = out.parent / "late"
    with pytest.raises(ValueError, match="passkey_lengths: .* is longer than the model's"):
        run(RetrofitArgs.build(model=tiny_dirs["llama"], data=text_file, attention=attention, context=32,
                               transfer_steps=1, progress=False, passkey_lengths="100000", output_dir=str(late)))
    assert not (late / "checkpoint-transfer").exists()
