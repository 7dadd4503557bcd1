"""Assemble recipes/RESULTS.md from the generated result files (no number is typed by hand).

    python recipes/build_results.py

Sections come from ``recipes/results/SECTION_*.md`` (each written with its commands, machine
and date by the run that produced it; the generated ones by the fill scripts under
``recipes/experiments/<study>/``) and the benchmark tables the benchmark scripts write
under ``recipes/results/benchmark_*/``. Works from any working directory.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

HEADER = """# Results

Every figure below was produced by the command quoted with it, on the machine named with it.
Regenerate this file with `python recipes/build_results.py` after rerunning any of them.
"""


def main() -> int:
    parts = [HEADER]
    for name, title in (("benchmark_attention", "Attention kernels: causal forward+backward against SDPA"),
                        ("benchmark_attention_idle", "Attention kernels on the idle machine (default OpenMP waits)"),
                        ("benchmark_attention_xeon",
                         "Attention kernels at 32k on an Intel Xeon (2 cores; SDPA 2x faster than on the AMD EPYC)"),
                        ("benchmark_attention_window", "Attention kernels with the sliding window (window=128)"),
                        ("benchmark_backends", "Causal-product backends: the block loop vs the batched form"),
                        ("benchmark_decode", "Generation: decode step against SDPA + DynamicCache"),
                        ("decode_floor", "Whole-model decoding against its base and against the same step with no "
                                         "attention (recipes/decode_floor.py; one folder per model)")):
        folder = RESULTS / name
        tables = sorted(p for p in folder.rglob("*.md") if "quick" not in p.name) if folder.exists() else []
        if tables:
            parts.append(f"## {title}\n")
            parts += [p.read_text().strip() + "\n" for p in tables]
    for section in sorted(RESULTS.glob("SECTION_*.md")):
        parts.append(section.read_text().strip() + "\n")
    for last in ("PENDING.md", "REMOVED.md"):  # what is still to run, then what git history alone keeps
        if (RESULTS / last).exists():
            parts.append((RESULTS / last).read_text().strip() + "\n")
    (HERE / "RESULTS.md").write_text("\n".join(parts))
    print(f"wrote {HERE / 'RESULTS.md'} from {len(parts) - 1} parts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
