"""The figures users read come from the records: the presets (``hf-polyattn presets``), docs/performance.md and the
README's results table are what recipes/performance.py reads from recipes/results/ now, and the README has no
figure typed outside that table (nor a date, a clock time or a machine's history)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_polyattn.presets import PRESETS
from recipes import performance

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


@pytest.mark.parametrize("preset", PRESETS.values(), ids=lambda p: p.name)
def test_preset_figures_are_the_records(preset):
    """Every figure a preset holds (quality, retrieval, training CPU, speed, decode memory) is the one its records
    give, and it holds every figure they give."""
    assert preset.figures == performance.preset_figures(preset)
    if preset.speed_source:
        assert (ROOT / preset.speed_source).is_file()


@pytest.mark.parametrize("preset", [p for p in PRESETS.values() if p.speed_source], ids=lambda p: p.name)
def test_speed_record_measured_the_presets_attention(preset):
    """The whole-model benchmark a preset's speed comes from ran its attention: the same kind, features, window,
    sinks, decay and sparse cache (after ``reconfigure``), and as many softmax kv heads as the quality record's
    model (the demo's model stands in for long-context's: speed and memory depend on the attention alone)."""
    bench = performance.record(preset.speed_source)["settings"]["polyattn"]
    row, _ = performance.quality_record(preset)
    measured = row.get("attention") or row.get("polyattn")
    spec = {**preset.attention, **preset.reconfigure}
    for name in ("kind", "feature_map", "window", "sinks", "decay", "decay_horizon", "sparse_cache", "sparse_score",
                 "sparse_observe", "sink_position", "decay_max_horizon"):
        if name in spec:
            assert bench[name] == spec[name], name
    assert len(bench["softmax_heads"] or []) == len(measured.get("softmax_heads") or [])
    assert bench["sparse_cache"] == measured.get("sparse_cache", 0)


def test_figures_follow_the_records(monkeypatch):
    """The check can fail: a record that says otherwise changes the figures, the README table and the doc."""
    real = performance.record

    def changed(path):
        r = real(path)
        if path != performance.SOFTMAX_ROW:
            return r
        return {**r, "perplexity": [{**p, "perplexity": p["perplexity"] + 1} for p in r["perplexity"]]}

    monkeypatch.setattr(performance, "record", changed)
    preset = PRESETS["long-context"]
    assert performance.preset_figures(preset)["softmax"] != preset.figures["softmax"]
    assert performance.readme_block() not in README.read_text()
    assert performance.render() != performance.DOC.read_text()


def test_performance_doc_is_up_to_date():
    """docs/performance.md is what the records render to: rerun `python recipes/performance.py`."""
    assert performance.DOC.read_text() == performance.render(), "stale: run python recipes/performance.py"


def test_the_speed_column_comes_from_one_machine():
    """The README's speed cells come from benchmarks on one machine (the record's CPU, cores, threads and dtype):
    a ratio against the base moves with the machine, so a column that mixes machines compares nothing. The table's
    key names that machine."""
    machines = performance.speed_machines()
    assert len(machines) == 1, f"the presets' speed_source records were measured on several machines: {machines}"
    assert machines[0] in performance.table_key()


def test_readme_table_is_up_to_date():
    text = README.read_text()
    assert text.count(performance.TABLE_START) == 1 and text.count(performance.TABLE_END) == 1
    assert performance.with_readme_block(text) == text, "stale: run python recipes/performance.py"


def _outside_table(text: str) -> str:
    start, end = text.index(performance.TABLE_START), text.index(performance.TABLE_END)
    return text[:start] + text[end:]


# what a measured figure looks like: a ratio (1.42x), a size (152.2 MiB), a hit count (7/10), a value with two
# decimals (26.97), a duration (5 min, 14 s, 178 ms), a share (5 %)
FIGURE = re.compile(r"\b\d+(\.\d+)?\s?x\b|\b\d+(\.\d+)?\s?([KMG]iB|[KMG]B)\b|\b\d+\s?/\s?10\b|\b\d+\.\d{2}\b"
                    r"|\b\d+(\.\d+)?\s?(min|ms|us|s)\b|\b\d+(\.\d+)?\s?%")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b|(?<![\d:])\d{1,2}:\d{2}(?![\d:])|\bUTC\b")


def test_readme_is_short_and_types_no_figure():
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 160
    assert not [line for line in lines if DATE.search(line)]
    assert "../shared" not in text
    # transformers' supported versions: one install line, nowhere else
    versions = [line for line in lines if re.search(r"transformers\s+\d", line)]
    assert len(versions) == 1 and "transformers 5.19 - 5.25" in versions[0]
    typed = [line for line in _outside_table(text).splitlines()
             if FIGURE.search(line) and line not in versions]
    assert not typed, typed
    # the two commands a fresh machine runs come first, and the table right after them
    assert lines.index("```bash") < lines.index("## Which preset") < lines.index(performance.TABLE_START) < 40
    assert lines[lines.index("```bash") + 1].startswith("make demo ")
    assert lines[lines.index("```bash") + 2].startswith("make test ")
    # serving: the section links its doc
    serve = lines[lines.index("## Serve"):]
    assert any("docs/serving.md" in line for line in serve[:serve.index("## The kinds")])


def test_readme_limitations_are_short_and_linked():
    lines = README.read_text().splitlines()
    start = lines.index("## Limitations") + 1
    bullets = []
    for line in lines[start:]:
        if line.startswith("## "):
            break
        if line.strip():
            bullets.append(line)
    assert 1 <= len(bullets) <= 8 and all(b.startswith("- ") for b in bullets), bullets
    assert all(re.search(r"\]\([^)]+\)", b) for b in bullets)


def test_readme_links_resolve():
    """Every relative link of the README (the table's cells included) names a file of the repository, and every
    anchor one of its headings."""
    text = README.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(#[^)]*)?\)", text):
        path, anchor = target
        if path.startswith("http"):
            continue
        assert (ROOT / path).exists(), path
        if anchor:
            headings = [re.sub(r"[^\w\- ]", "", h.strip("# ").lower()).replace(" ", "-")
                        for h in (ROOT / path).read_text().splitlines() if h.startswith("#")]
            assert anchor[1:] in headings, (path, anchor)


# the hand-written docs; docs/performance.md and docs/supported_models.md are generated and checked by regeneration
HAND_WRITTEN_DOCS = ("kinds.md", "long_context.md", "numerics_and_backends.md", "integration.md", "serving.md")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
# a figure in prose: a number with a unit of speed, share, size or time, or any number with two or more decimals
# (an arXiv id, arXiv:2309.17453, and a version, torch 2.13.0, are not figures)
DOC_FIGURE = re.compile(r"(?<![\w.\-/:])(\d[\d,]*(?:\.\d+)?)\s?(?:x\b|%|[KMG]iB|ms\b|s\b|us\b)"
                        r"|(?<![\w.\-/:])(\d+\.\d{2,})(?![\w.])")


def recorded_numbers() -> set[str]:
    """Every number the result files hold, as written and rounded to 0-4 decimals (a doc quotes 1.0737 as 1.07 or
    1.074), commas dropped."""
    known: set[str] = set()

    def add(value):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            known.add(str(value))
            known.update(f"{round(value, digits):.{digits}f}" for digits in range(5))

    def walk(node):
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        else:
            add(node)

    for path in (ROOT / "recipes" / "results").rglob("*"):
        if not path.is_file() or path.suffix not in (".md", ".json", ".txt", ".log"):
            continue
        text = path.read_text(errors="replace")
        for token in _NUMBER.findall(text):
            known.add(token.replace(",", ""))
            add(float(token.replace(",", "")))
        if path.suffix == ".json":
            walk(json.loads(text))
    return known


def test_every_figure_of_the_docs_is_in_a_record():
    """Each figure the hand-written docs quote is a number some result file holds (as written or rounded): a
    figure typed from memory, or one whose record was removed, fails. (It traces the value, not which record: the
    generated pages and the presets are traced to their own record by the tests above.)"""
    known = recorded_numbers()
    assert "1.77" in known and "123.456" not in known  # the set holds the records' numbers, not every number
    missing = {}
    for name in HAND_WRITTEN_DOCS:
        text = (ROOT / "docs" / name).read_text()
        figures = [m.group(1) or m.group(2) for m in DOC_FIGURE.finditer(text)]
        assert figures or name in ("integration.md", "serving.md"), name  # the pattern sees the docs' figures
        missing[name] = [f for f in figures if f.replace(",", "") not in known]
    assert not any(missing.values()), missing
