"""Model cards fit for the Hub: the base model by its Hub id, no local path anywhere, only the settings the kind
reads, the decode memory, and a card that huggingface_hub parses back."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

import hf_polyattn
from hf_polyattn import PolyAttnConfig
from hf_polyattn.checkpoints import known_hub_id
from tests.conftest import assert_no_local_path

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
def test_the_path_check_catches_paths(tmp_path):
    """The regex above finds what it must (else every test below would pass vacuously)."""
    for text in (f"loaded from `{tmp_path}`", "data /work/x/data.txt.", "(/home/u/.cache/hf_polyattn/m)"):
        with pytest.raises(AssertionError):
            assert_no_local_path(text)
    assert_no_local_path("see [x](https://huggingface.co/org/m) and `hf_polyattn/integration/memory` and 1/2")


@pytest.fixture
def packaged_smollm2(tiny_dirs, tmp_path, monkeypatch):
    """A tiny Llama where the packaged SmolLM2's local copy lives (checkpoints.cache_dir()), as after
    resolve_checkpoint('smollm2'): loading it gives a local _name_or_path."""
    monkeypatch.setenv("HF_POLYATTN_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    shutil.copytree(tiny_dirs["llama"], folder)
    return folder


def test_known_hub_id_of_aliases_and_local_copies(packaged_smollm2, tmp_path):
    assert known_hub_id("smollm2") == known_hub_id(SMOLLM2) == SMOLLM2
    assert known_hub_id(str(packaged_smollm2)) == SMOLLM2
    assert known_hub_id("minilm") == "sentence-transformers/all-MiniLM-L6-v2"
    assert known_hub_id(str(tmp_path)) is None and known_hub_id("my-org/model") is None


def test_converted_model_card(packaged_smollm2, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(packaged_smollm2)
    assert model.config._name_or_path == str(packaged_smollm2)
    cfg = PolyAttnConfig(kind="linear", window=8, sinks=2, decay="gate", feature_proj=8, qk_norm=True,
                         softmax_heads=((0, 1), (1, 0)))
    out = tmp_path / "converted"
    hf_polyattn.convert(model, cfg).save_pretrained(out)
    text = (out / "README.md").read_text()
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == SMOLLM2 and card.data.library_name == "transformers"
    assert card.data.pipeline_tag == "text-generation" and card.data.tags[:2] == ["hf_polyattn", "linear"]
    assert "# SmolLM2-135M-Instruct with linear attention and 2 softmax kv heads" in text.splitlines()
    assert_no_local_path(text, tmp_path, packaged_smollm2)
    # only what linear reads: its table rows and metadata, none of polysketch's / polynomial's / performer's fields
    table = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert table == [k for k in cfg.read_settings() if k != "options"]
    assert {"window", "sinks", "decay", "feature_map"} <= set(table)
    assert not {"degree", "sketch", "sketch_size", "num_features", "alpha", "beta", "exact_path"} & set(table)
    assert set(card.data.polyattn) == set(cfg.read_settings())
    # the softmax-head layout, one row per layer, and the decode memory of base and retrofit at 4k / 16k / 32k
    assert "| 0 | 1 | 1 of 2 |" in text and "| 1 | 0 | 1 of 2 |" in text
    # 2 layers x 2 kv heads x 2 x 8 dims x 4 bytes = 256 B a token for softmax; 2 of the 4 kv heads keep theirs
    assert f"| softmax `{SMOLLM2}` | 256 B | 1.0 MiB | 4.0 MiB | 8.0 MiB |" in text
    assert "| this model | 128 B |" in text and "cache at 32,768 tokens" in text


def test_pipeline_card(packaged_smollm2, text_file, tmp_path):
    """A retrofit run's card: base model from the alias's local copy, the data by its file name, the run's results,
    the long-context table and plot, no path of this machine."""
    from hf_polyattn.training.pipeline import RetrofitArgs, run

    data = tmp_path / "my data" / "tiny.txt"
    data.parent.mkdir()
    shutil.copy(text_file, data)
    out = tmp_path / "run"
    # the attention the retrofit's old flags (attention="linear", window=8, feature_proj=0) built: their recommended
    # long-context settings (4 sinks, gated decay of horizon 256, window_mix from 0.01) with qk_norm and 64-token
    # blocks
    attention = {"kind": "linear", "window": 8, "feature_proj": 0, "block_size": 64, "qk_norm": True, "sinks": 4,
                 "decay": "gate", "decay_horizon": 256.0, "window_mix": True, "window_mix_init": 0.01}
    run(RetrofitArgs.build(model=str(packaged_smollm2), data=str(data), attention=attention, context=32,
                           eval_context=32, eval_stride=32, max_eval_tokens=64, transfer_steps=1, eval_before=False,
                           progress=False, eval_contexts="16,64", passkey_lengths="", passkey_depths=1,
                           long_eval_tokens=128, long_eval_baselines="softmax", output_dir=str(out)))
    folder = out / "model"
    text = (folder / "README.md").read_text()
    assert_no_local_path(text, tmp_path, packaged_smollm2, data)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == SMOLLM2
    assert card.data.eval_results[0].dataset_name == "tiny.txt" and card.data.datasets is None
    assert "- data: `tiny.txt`" in text and "## Retrofit results" in text
    assert "### Long context" in text and "](long_context.png)" in text and (folder / "long_context.png").exists()
    settings = json.loads((folder / "config.json").read_text())["polyattn"]
    table = re.findall(r"^\| `(\w+)` \|", text, flags=re.M)
    assert table == [k for k in PolyAttnConfig.from_dict(settings).read_settings() if k != "options"]
    assert "sketch_size" not in table and "degree" not in table
    # a second card written into the same folder replaces the run's section rather than appending another
    from hf_polyattn.eval.card import write_card

    write_card(folder, json.loads((out / "results.json").read_text()))
    assert (folder / "README.md").read_text().count("## Retrofit results") == 1


def test_card_from_committed_results_names_hub_dataset(tmp_path):
    """card_from_results writes a card from a results record and a config alone (how model_cards/ is made); a Hub
    dataset id becomes the card's datasets metadata and a link."""
    from transformers import LlamaConfig

    from hf_polyattn.eval.card import card_from_results

    config = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
    cfg = PolyAttnConfig(kind="polysketch", sketch_size=8, window=16, softmax_heads=((2, 1),))
    results = {"args": {"model": "smollm2", "data": "HuggingFaceFW/fineweb-edu", "task": "causal_lm",
                        "transfer_steps": 60, "transfer_lr": 0.01},
               "polyattn": cfg.to_dict(), "evaluations": {}, "machine": "a test machine"}
    path = card_from_results(tmp_path, results, config, command="hf-polyattn retrofit --model smollm2 ...")
    card = ModelCard.load(path)
    assert card.data.base_model == SMOLLM2 and card.data.datasets == ["HuggingFaceFW/fineweb-edu"]
    text = path.read_text()
    assert "](https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu)" in text
    assert "- attention transfer: 60 steps (lr 0.01)" in text and "- command: `hf-polyattn retrofit" in text
    assert "| 2 | 1 | 1 of 2 |" in text and "| `sketch_size` | `8` |" in text
    assert_no_local_path(text, tmp_path)


def test_bf16_decoder_and_encoder_cards(tmp_path):
    """A bf16 checkpoint's decode memory is counted in bf16; an encoder, which never decodes, has no such table but
    still only the settings its kind reads; a GPT-2 (no kv heads in its config) counts its heads."""
    import torch
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    small = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=64)
    llama = LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2)).to(torch.bfloat16)
    llama.config.dtype = torch.bfloat16  # as from_pretrained(dtype=torch.bfloat16) records it
    hf_polyattn.convert(llama, PolyAttnConfig(kind="linear", window=8)).save_pretrained(tmp_path / "bf16")
    text = (tmp_path / "bf16" / "README.md").read_text()
    assert "(batch 1, bfloat16;" in text and "| this model | 0 (constant) |" in text
    bert = hf_polyattn.convert(BertModel(BertConfig(**small)), PolyAttnConfig(kind="polysketch", sketch_size=8))
    bert.save_pretrained(tmp_path / "bert")
    text = (tmp_path / "bert" / "README.md").read_text()
    assert "### Decode memory" not in text and "| `sketch_size` | `8` |" in text and "feature_map" not in text
    gpt2 = hf_polyattn.convert(GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64)),
                               "performer")
    gpt2.save_pretrained(tmp_path / "gpt2")
    card = ModelCard.load(tmp_path / "gpt2" / "README.md")
    assert "### Decode memory" in card.text and card.data.polyattn["kind"] == "performer"
    assert_no_local_path(card.content, tmp_path)


def test_card_lists_a_gated_setting_only_while_its_gate_is_on(tmp_path):
    """A model without a sparse cache lists none of the sparse cache's settings (card table and metadata); with one
    it lists them. A field left out is at the value every config with its gate off must hold, so the listed
    settings still rebuild the same config."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    small = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64, vocab_size=64,
                 num_key_value_heads=2)
    sparse_fields = {f for f in PolyAttnConfig().to_dict() if f.startswith("sparse_")}
    assert len(sparse_fields) >= 5  # the walk below sees the sparse cache's fields
    for name, cfg, listed in (
            ("off", PolyAttnConfig(kind="linear", window=8, sinks=2, decay="gate"), set()),
            ("on", PolyAttnConfig(kind="linear", window=8, sinks=2, decay="gate", sparse_cache=16, sparse_observe=4,
                                  sparse_value_keys=4), sparse_fields)):
        torch.manual_seed(0)
        model = hf_polyattn.convert(LlamaForCausalLM(LlamaConfig(**small)), cfg)
        model.save_pretrained(tmp_path / name)
        text = (tmp_path / name / "README.md").read_text()
        table = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
        card = ModelCard.load(tmp_path / name / "README.md")
        assert table & sparse_fields == set(card.data.polyattn) & sparse_fields == listed, name
        assert {"window", "sinks", "sink_position", "decay", "decay_horizon"} <= table
        assert PolyAttnConfig.from_dict(card.data.polyattn) == cfg
    bare = PolyAttnConfig(kind="linear").read_settings()  # no window, no decay: nothing they gate
    assert not {"sinks", "window_mix", "sink_position", "decay_horizon", "decay_max_horizon", "local_kernel"} & set(
        bare)


def test_every_gated_setting_is_refused_off_its_gate():
    """READ_WHEN and the sparse prefix say a field is unread while its gate is off; that holds only because the
    config refuses the field at any other value then: each one, set away from its default with its gate off, is an
    error (else read_settings would drop a setting that changes the attention)."""
    from hf_polyattn.config import READ_WHEN

    off = {"window": 0, "local_exact": False, "decay": "none", "sparse_cache": 0}
    other = {"local_kernel": "softmax", "window_mix": True, "window_mix_init": 0.5, "sinks": 2, "learned_sinks": 2,
             "sink_position": "own", "sink_span": 300, "decay_horizon": 64.0, "decay_max_horizon": 64.0,
             "sparse_observe_pool": 3, "sparse_chunk": 32, "sparse_score": "attention", "sparse_observe": 4,
             "sparse_value_keys": 4, "sparse_value_pool": 3}
    gated = set(READ_WHEN) | {f for f in PolyAttnConfig().to_dict() if f.startswith("sparse_")} - {"sparse_cache"}
    assert gated == set(other)
    for name, value in other.items():
        with pytest.raises(ValueError, match="needs"):
            PolyAttnConfig(kind="linear", **{**off, name: value})
    # and each gate is off in that config, on in one that sets it
    cfg = PolyAttnConfig(kind="linear", **off)
    assert not any(READ_WHEN[n](cfg) for n in READ_WHEN)
    on = PolyAttnConfig(kind="linear", window=8, sinks=2, window_mix=True, decay="gate", sparse_cache=16,
                        sparse_observe=4, sparse_value_keys=4)
    assert all(READ_WHEN[n](on) for n in READ_WHEN if n != "local_kernel") and READ_WHEN["local_kernel"](on)


def test_long_context_plot_titles_and_legend_fit():
    """The card's plot with the labels a real record carries (a kind's settings run to 150 characters): every title,
    label and legend lies inside the figure, the heatmaps' titles do not run into each other, the legend stays
    inside its panel, and each row is named whole (no '…'). Before: the titles overlapped and ran off the right
    edge, the legend cut the model's name."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from hf_polyattn.eval.long_context import long_context_figure

    long_label = ("linear (elu, exact softmax 128-token sliding window (mixed) + 4 sink tokens (positions within the "
                  "window), gated decay, learnable projection to 64, qk LayerNorm; 22 kv heads exact softmax)")
    passkey = {"lengths": [1024, 2048, 4096], "depths": [0.05 + 0.1 * i for i in range(10)], "seed": 0,
               "hits": [[1] * 10] * 3}
    curve = [{"context": c, "perplexity": 40.0 - i} for i, c in enumerate((256, 1024, 2048, 4096, 8192))]
    rows = [{"label": "softmax (the checkpoint)", "baseline": "softmax", "perplexity": curve, "passkey": passkey},
            {"label": "sliding_window (exact softmax 128-token sliding window + 4 sink tokens (positions within the "
                      "window))", "baseline": "streaming", "perplexity": curve, "passkey": passkey},
            {"label": long_label, "attention": {"kind": "linear"}, "perplexity": curve, "passkey": passkey}]
    fig = long_context_figure({"rows": rows})
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        page = fig.bbox
        axes = fig.axes

        def shown(ticks, labels, limits):  # matplotlib keeps labels of ticks outside the view: not drawn
            lo, hi = sorted(limits)
            return [label for tick, label in zip(ticks, labels) if lo <= tick <= hi]

        texts = [t for ax in axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label,
                                            *shown(ax.get_xticks(), ax.get_xticklabels(), ax.get_xlim()),
                                            *shown(ax.get_yticks(), ax.get_yticklabels(), ax.get_ylim()))
                 if t.get_text()]
        for t in texts:
            box = t.get_window_extent(renderer)
            assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, t.get_text()
        titles = [ax.title.get_window_extent(renderer) for ax in axes]
        for i in range(len(titles) - 1):
            assert titles[i].x1 < titles[i + 1].x0, (axes[i].get_title(), axes[i + 1].get_title())
        legend = axes[0].get_legend()
        assert axes[0].bbox.contains(*legend.get_window_extent(renderer).p0)
        assert axes[0].bbox.contains(*legend.get_window_extent(renderer).p1)
        names = [t.get_text() for t in legend.get_texts()]
        assert names == ["softmax", "StreamingLLM", "this model (linear)"]
        assert [ax.get_title() for ax in axes[1:]] == [f"passkey: {n}" for n in names]
        assert not any("…" in t.get_text() for t in texts)
    finally:
        plt.close(fig)
