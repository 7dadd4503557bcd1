"""The RULER-style suite (eval/ruler.py): seeded generation, needles and gold answers, prompt lengths, RULER's
string-match score on hand-made outputs, run_ruler's plumbing with stand-in models, and a tiny model end to end (the
library call and `hf-polyattn eval --ruler` with the baseline rows)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from hf_polyattn.eval.ruler import (
    NIAH_NEEDLE,
    RULER_TASKS,
    check_length,
    ruler_markdown,
    ruler_sample,
    run_ruler,
    string_match_all,
)

LENGTH = 1024  # the fixtures' byte-level tokenizer (320 tokens) takes ~3 tokens a word: cwe needs ~500 without haystack


@pytest.fixture(scope="module")
def tok(tiny_dirs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dirs["llama"])


@pytest.mark.parametrize("task", list(RULER_TASKS))
def test_samples_are_seeded_hold_their_needles_and_fit_the_length(tok, task):
    a = ruler_sample(tok, task, LENGTH, seed=0, index=0)
    assert a == ruler_sample(tok, task, LENGTH, seed=0, index=0)  # deterministic
    assert a.text != ruler_sample(tok, task, LENGTH, seed=1, index=0).text
    assert a.text != ruler_sample(tok, task, LENGTH, seed=0, index=1).text
    assert check_length(a) and 0.9 * LENGTH <= len(a.ids) <= LENGTH
    # the document (intro and haystack, through its last newline) as the tokenizer reads it alone, then the question
    assert a.ids[: a.question_start] == list(tok(a.text[: a.text.rindex("\n") + 1])["input_ids"])
    assert tok.decode(a.ids[a.question_start:]).strip().startswith(("What are", "Question:"))
    doc = a.text.split("\n")[1]  # the haystack line between the intro and the question
    spec = RULER_TASKS[task]
    if task.startswith("niah"):
        kind = "uuids" if spec.value == "uuid" else "numbers"
        keys = re.findall(r"special magic \w+ for ([\w-]+) is: ([\w-]+)\.", doc)
        assert len(keys) == spec.keys * spec.values  # every needle is in the prompt
        asked = re.search(r"magic \w+ for (.+?) mentioned", a.text.split("\n")[-1]).group(1).split(", ")
        assert len(asked) == spec.asked
        gold = [v for k in asked for key, v in keys if key == k]
        assert sorted(gold) == sorted(a.answers) and len(a.answers) == spec.asked * spec.values
        for k, v in keys:
            assert NIAH_NEEDLE.format(kind=kind, key=k, value=v) in doc
        if spec.value == "uuid":
            assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", a.answers[0])
        else:
            assert all(re.fullmatch(r"\d{7}", v) for v in a.answers)
        if spec.haystack == "noise":
            assert "The grass is green." in doc
        else:
            assert "The grass is green." not in doc
    elif task == "vt":
        chain = re.findall(r"VAR (\w+) = (\w+)\.", doc)
        assert [name for name, _ in chain] == a.answers and chain[0][1].isdigit()
        assert all(src == prev for (_, src), (prev, _) in zip(chain[1:], chain))  # each names the one before
        assert f"assigned the value {chain[0][1]}" in a.text
    else:  # cwe: the ten gold words are the most frequent of the list
        counts = Counter(re.findall(r"\d+\. (\w+)", doc))
        least_common = min(counts[w] for w in a.answers)
        assert len(a.answers) == 10 and all(counts[w] < least_common for w in counts if w not in a.answers)


def test_length_search_is_tight_at_several_lengths(tok):
    for n in (700, 1500, 2048):
        s = ruler_sample(tok, "niah_single_2", n, seed=3)
        assert check_length(s)
        assert len(s.ids) > 0.97 * n  # a line of text is ~20-60 tokens: within one or two of them
    with pytest.raises(ValueError, match="too short for task 'cwe'"):
        ruler_sample(tok, "cwe", 200)
    with pytest.raises(ValueError, match="task must be one of"):
        ruler_sample(tok, "niah", 1024)
    with pytest.raises(ValueError, match="length must be an int >= 64"):
        ruler_sample(tok, "vt", 10)


def test_string_match_all_on_hand_made_outputs():
    assert string_match_all(" 1234567, 7654321 and more", ["1234567", "7654321"]) == 1.0
    assert string_match_all(" 1234567.", ["1234567", "7654321"]) == 0.5
    assert string_match_all("The words are APPLE, pear", ["apple", "Pear", "plum", "fig"]) == 0.5  # case-blind
    assert string_match_all("123456", ["1234567"]) == 0.0  # a prefix of the gold is no hit
    with pytest.raises(ValueError, match="answers must hold at least one"):
        string_match_all("x", [])


class _Oracle(torch.nn.Module):
    """A stand-in LM that answers each known prompt with its gold strings (``right``) or with nothing of them."""

    def __init__(self, tok, samples, right: bool):
        super().__init__()
        self.tok, self.right = tok, right
        self.gold = {tuple(s.ids): ", ".join(s.answers) for s in samples}
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"max_position_embeddings": 4096})()

    def generate(self, ids, attention_mask=None, max_new_tokens=8, do_sample=False, pad_token_id=None):
        assert not do_sample and attention_mask.shape == ids.shape
        text = " " + self.gold[tuple(ids[0].tolist())] if self.right else " none"
        new = torch.tensor([self.tok(text, add_special_tokens=False)["input_ids"]])
        return torch.cat([ids, new], dim=1)


def test_run_ruler_scores_an_oracle_and_a_wrong_model(tok):
    tasks = ["niah_single_1", "niah_multivalue", "vt", "cwe"]
    samples = [ruler_sample(tok, t, LENGTH, seed=5, index=i) for t in tasks for i in range(2)]
    right = run_ruler(_Oracle(tok, samples, True), tok, [LENGTH], tasks, samples=2, seed=5)
    wrong = run_ruler(_Oracle(tok, samples, False), tok, [LENGTH], tasks, samples=2, seed=5)
    assert right["scores"] == {t: {str(LENGTH): 1.0} for t in tasks} and right["average"] == {str(LENGTH): 1.0}
    assert wrong["average"] == {str(LENGTH): 0.0} and len(wrong["outputs"]) == 8
    with pytest.raises(ValueError, match="positions"):
        run_ruler(_Oracle(tok, samples, True), tok, [4090], tasks)
    with pytest.raises(ValueError, match="tasks must be distinct names"):
        run_ruler(_Oracle(tok, samples, True), tok, [LENGTH], ["niah_single_1", "nope"])
    with pytest.raises(ValueError, match="samples must be an int >= 1"):
        run_ruler(_Oracle(tok, samples, True), tok, [LENGTH], tasks, samples=0)
    table = ruler_markdown([{"label": "oracle", "ruler": right}, {"label": "wrong", "ruler": wrong}])
    assert "| oracle | single | 100 | 100 | 100 | 100 | 100.0 |" in table
    assert "| wrong | single | 0 | 0 | 0 | 0 | 0.0 |" in table


def test_tiny_model_runs_the_suite_end_to_end(tok, tiny_dirs, tmp_path, text_file, capsys):
    """Every task, single prompt and multi-turn, on a tiny random Llama; then `hf-polyattn eval --ruler` with the
    softmax, StreamingLLM and both matched-memory rows beside the model (multi-turn passkey too)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_polyattn import cli

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1200, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=1)).eval()
    for multi in (False, True):
        res = run_ruler(model, tok, [LENGTH], samples=1, multi_turn=multi)
        assert set(res["scores"]) == set(RULER_TASKS) and len(res["outputs"]) == len(RULER_TASKS)
        assert all(0.0 <= o["score"] <= 1.0 and o["tokens"] <= LENGTH for o in res["outputs"])
    d = tmp_path / "m"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    out = tmp_path / "out"
    rc = cli.main(["eval", str(d), "--data", text_file, "--contexts", "64", "--max-eval-tokens", "256",
                   "--passkey", "300", "--passkey-depths", "1", "--multi-turn", "--ruler", "900",
                   "--ruler-tasks", "niah_single_1,vt", "--ruler-samples", "1", "--threads", "1",
                   "--baselines", "softmax,streaming,sparse,streaming_matched", "--matched-cache", "64",
                   "--streaming-window", "32", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "long_context.json").read_text())
    names = [r.get("baseline") for r in result["rows"]]
    assert names == ["softmax", "streaming", "sparse", "streaming_matched", None]
    for r in result["rows"]:
        assert set(r) >= {"passkey", "passkey_multi_turn", "ruler", "ruler_multi_turn"}
        assert r["ruler"]["tasks"] == ["niah_single_1", "vt"] and r["ruler"]["lengths"] == [900]
    assert "32 selected" not in result["rows"][2]["label"] and "64 selected keys" in result["rows"][2]["label"]
    assert "a 96-token window" in result["rows"][3]["label"]
    md = (out / "long_context.md").read_text()
    assert "passkey turn 2 @ 300" in md and "niah_single_1 @ 900" in md and "| multi |" in md
    assert cli.main(["eval", str(d), "--data", text_file, "--ruler", "900", "--ruler-tasks", "nope"]) == 2
    assert "expected distinct comma-separated names" in capsys.readouterr().err
    # --read copy: the rows with a sparse cache read the document by copy scores, the others by their forward call
    out = tmp_path / "copy"
    rc = cli.main(["eval", str(d), "--data", text_file, "--contexts", "64", "--max-eval-tokens", "128",
                   "--passkey", "300", "--passkey-depths", "1", "--multi-turn", "--read", "copy", "--threads", "1",
                   "--baselines", "softmax,sparse", "--matched-cache", "64", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "long_context.json").read_text())
    assert [r["passkey_multi_turn"]["read"] for r in result["rows"]] == ["stream", "copy", "stream"]
    assert "Rows whose document was read by copy scores" in (out / "long_context.md").read_text()
    assert cli.main(["eval", str(d), "--data", text_file, "--read", "copy"]) == 2
    assert "set multi_turn (--multi-turn) too" in capsys.readouterr().err


def test_cli_prefill_chunk_reads_in_calls_and_refuses_a_sparse_cache(tok, tmp_path, text_file, capsys):
    """`hf-polyattn eval --prefill-chunk N`: every row's RULER and passkey prompts read in calls of N tokens, the
    answers those of one call (tests/eval/test_prefill_chunk.py), recorded; refused with the 'sparse' baseline and
    for a model with a sparse cache, before any evaluation."""
    import copy
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_polyattn
    from hf_polyattn import cli

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=1200, pad_token_id=0, eos_token_id=1,
                                         bos_token_id=1)).eval()
    d = tmp_path / "m"
    model.save_pretrained(d)
    tok.save_pretrained(d)
    answers = []
    for chunk in ("0", "128"):
        out = tmp_path / f"out{chunk}"
        rc = cli.main(["eval", str(d), "--data", text_file, "--contexts", "64", "--max-eval-tokens", "128",
                       "--passkey", "300", "--passkey-depths", "2", "--ruler", "900", "--ruler-tasks",
                       "niah_single_1,vt", "--ruler-samples", "1", "--threads", "1", "--baselines", "streaming",
                       "--streaming-window", "32", "--prefill-chunk", chunk, "--out", str(out)])
        assert rc == 0
        rows = json.loads((out / "long_context.json").read_text())["rows"]
        recorded = [None, None] if chunk == "0" else [128, 128]
        assert [r["ruler"].get("prefill_chunk") for r in rows] == recorded
        assert [r["passkey"].get("prefill_chunk") for r in rows] == recorded
        answers.append([(r["passkey"]["answers"], [o["output"] for o in r["ruler"]["outputs"]]) for r in rows])
    assert answers[0] == answers[1]
    assert cli.main(["eval", str(d), "--data", text_file, "--ruler", "900", "--prefill-chunk", "128",
                     "--baselines", "softmax,sparse"]) == 2
    assert "prefill_chunk=128 with the 'sparse' baseline" in capsys.readouterr().err
    assert cli.main(["eval", str(d), "--data", text_file, "--ruler", "900", "--prefill-chunk", "-1"]) == 2
    assert "--prefill-chunk" in capsys.readouterr().err
    sparse = hf_polyattn.convert(copy.deepcopy(model), hf_polyattn.PolyAttnConfig.for_kind(
        "linear", window=8, sinks=2, sparse_cache=8, sparse_chunk=4, sparse_score="attention", window_mix=True,
        window_mix_init=0.0))
    sparse.save_pretrained(tmp_path / "sparse")
    tok.save_pretrained(tmp_path / "sparse")
    assert cli.main(["eval", str(tmp_path / "sparse"), "--data", text_file, "--contexts", "64", "--ruler", "900",
                     "--prefill-chunk", "128", "--baselines", "none"]) == 2
    assert "prefill_chunk=128: " in capsys.readouterr().err


def test_ruler_table_shows_the_union_of_the_rows_lengths():
    both = {"tasks": ["vt", "cwe"], "lengths": [1024, 2048], "samples": 2, "seed": 0,
            "scores": {"vt": {"1024": 1.0, "2048": 0.5}, "cwe": {"1024": 0.25, "2048": 0.0}},
            "average": {"1024": 0.625, "2048": 0.25}}
    short = {"tasks": ["vt", "cwe"], "lengths": [1024], "samples": 2, "seed": 0,
             "scores": {"vt": {"1024": 0.5}, "cwe": {"1024": 0.0}}, "average": {"1024": 0.25}}
    table = ruler_markdown([{"label": "A", "ruler": both}, {"label": "B", "ruler": short, "ruler_multi_turn": short}])
    assert "| A | single | 100 | 50 | 25 | 0 | 62.5 | 25.0 |" in table
    assert "| B | single | 50 | – | 0 | – | 25.0 | – |" in table
    assert "| B | multi | 50 | – | 0 | – | 25.0 | – |" in table
    assert ruler_markdown([{"label": "no ruler"}]) == ""
    # a row asked in a later turn only, its document read by copy scores: its own line, marked
    table = ruler_markdown([{"label": "A", "ruler": both},
                            {"label": "C", "ruler_multi_turn": {**short, "read": "copy"}}])
    assert "| C | multi (copy) | 50 | – | 0 | – | 25.0 | – |" in table and "| C | single" not in table
    assert ruler_markdown([{"label": "C", "ruler_multi_turn": short}]).startswith("| attention | turns | vt @ 1,024 |")
