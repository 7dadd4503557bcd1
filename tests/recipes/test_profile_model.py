"""recipes/profile_model.py: the op counts of a retrofit's decoding step and prefill against its softmax base."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_polyattn

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "profile_model.py")


def test_decode_and_prefill_profiles_name_both_models(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    hf_polyattn.convert(model, hf_polyattn.PolyAttnConfig(kind="linear", feature_map="elu", window=8, sinks=2,
                                                          decay="gate", softmax_heads=[(1, 0)]))
    model.save_pretrained(tmp_path / "retrofit")
    for phase in ("decode", "prefill"):
        done = subprocess.run([sys.executable, RECIPE, str(tmp_path / "retrofit"), "--phase", phase, "--length", "40",
                               "--steps", "2", "--timed-steps", "3", "--out", str(tmp_path / "out")],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        record = json.loads((tmp_path / "out" / f"profile_{phase}-cpu.json").read_text())
        if phase == "decode":
            record_decode = record
        assert record["phase"] == phase and set(record["rows"]) == {"retrofit", "base"}
        for row in record["rows"].values():
            # a step of a 2-layer model: its matmuls (q, k, v, o, 3 MLP per layer, the head) and far more calls
            assert row["calls"]["aten::mm"] >= 2 * 7 + 1 and row["aten_calls"] > row["calls"]["aten::mm"]
        # the retrofit's layers run the kernel kind: ops the softmax model never calls
        # (elu + 1: out of place in prefill and the general step, in place in the fused decoding step: aten::elu_)
        calls = record["rows"]["retrofit"]["calls"]
        assert calls.get("aten::elu", 0) + calls.get("aten::elu_", 0) > 0
        assert not {"aten::elu", "aten::elu_"} & set(record["rows"]["base"]["calls"])
        assert f"per {phase} step (1 x 40 tokens)" in (tmp_path / "out" / f"profile_{phase}-cpu.md").read_text()
    # the decoding step split by wall time: every layer's attention call timed, by the class that ran it (layer 0
    # the kind's module, layer 1 hybrid for its softmax head; the base's two LlamaAttention layers), the parts
    # within the step
    parts = {which: row["parts"] for which, row in record_decode["rows"].items()}
    assert set(parts["retrofit"]["classes"]) == {"HFLinearAttention", "HFHybridAttention"}
    assert parts["base"]["classes"] == {"LlamaAttention": parts["base"]["classes"]["LlamaAttention"]}
    assert parts["base"]["classes"]["LlamaAttention"]["layers"] == 2
    for p in parts.values():
        assert 0 < p["attention_ms"] and 0 < p["update_ms"] and p["attention_ms"] + p["update_ms"] < p["step_ms"]
    assert "| attention calls (every layer) |" in (tmp_path / "out" / "profile_decode-cpu.md").read_text()
    assert "parts" not in json.loads((tmp_path / "out" / "profile_prefill-cpu.json").read_text())["rows"]["base"]
    # a batch of sequences: its own files, the batch recorded; a batch of 0 refused by name
    done = subprocess.run([sys.executable, RECIPE, str(tmp_path / "retrofit"), "--phase", "prefill", "--length", "24",
                           "--batch", "3", "--steps", "1", "--out", str(tmp_path / "out")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "out" / "profile_prefill-cpu-batch3.json").read_text())
    assert record["batch"] == 3
    assert "per prefill step (3 x 24 tokens)" in (tmp_path / "out" / "profile_prefill-cpu-batch3.md").read_text()
    bad = subprocess.run([sys.executable, RECIPE, str(tmp_path / "retrofit"), "--batch", "0"], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "--batch must be a positive integer, got 0" in bad.stderr
