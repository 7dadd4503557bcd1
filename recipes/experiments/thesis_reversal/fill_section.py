"""Write recipes/results/SECTION_thesis.md from the merged 10,000-iteration grid (no number typed by hand).

    python -m recipes.experiments.thesis_reversal.fill_section [TEMPLATE [OUT [RESULTS_DIR]]]

(from the repository root; defaults: SECTION_thesis.template.md next to this file, recipes/results/SECTION_thesis.md,
recipes/results/thesis_reversal). Every @@FIELD@@ of the template is computed here from RESULTS_DIR/results.json
and the tables recipes/thesis_reversal.py wrote next to it.
"""

import json
import sys
from pathlib import Path

from recipes.thesis_reversal import ALL_KINDS, CHANCE_PER_POSITION, LABELS, SOLVED, fmt, seconds_per_iteration

from .rows import COMPILE_CHECK_KINDS

RESULTS = Path(__file__).resolve().parents[2] / "results"
D = RESULTS / "thesis_reversal"
TEMPLATE = Path(__file__).resolve().parent / "SECTION_thesis.template.md"
OUT = RESULTS / "SECTION_thesis.md"


def names(kinds):
    return ", ".join(LABELS[k] for k in kinds) if kinds else "none"


def fields() -> dict:
    global D
    if len(sys.argv) > 3:  # a third argument: another results folder (a copy of partial results, to try it)
        D = Path(sys.argv[3])
    res = json.loads((D / "results.json").read_text())
    runs, summary = res["runs"], res["summary"]
    srcs = res["merged_from"]
    f = {
        "TABLE": (D / "table.md").read_text().strip(),
        "RUNS": (D / "runs.md").read_text().strip(),
        "STARTED": min(m["started"] for m in srcs),
        "TORCH": srcs[0]["settings"]["torch"],
        "N_RUNS": f"{len(runs)}",
        "N_ITS": f"{sum(r['iterations'] for r in runs):,}",
        "CPU_H": f"{sum(r['seconds'] for r in runs) / 3600:.2f}",
    }
    per_process = {}
    for m in srcs:
        part = json.loads((D / m["file"]).read_text())["runs"]
        per_process[m["file"]] = sum(r["seconds"] for r in part) / 3600
    f["WALL_H"] = " and ".join(f"{h:.2f} h ({name})" for name, h in per_process.items())
    ms = {k: s["seconds_per_iteration"] * 1000 for k, s in summary.items()}
    lo, hi = min(ms, key=ms.get), max(ms, key=ms.get)
    f["MS_RANGE"] = f"{ms[lo]:.1f} ms ({LABELS[lo]}) to {ms[hi]:.1f} ms ({LABELS[hi]})"
    firsts = [r["first_iteration_seconds"] for r in runs if r.get("first_iteration_seconds") is not None]
    f["COMPILE_RANGE"] = f"{min(firsts):.1f}-{max(firsts):.1f} s"
    gains = []
    for kind in COMPILE_CHECK_KINDS:
        t = {}
        for mode in ("eager", "compile"):
            p = D / "compile_check" / mode / "results.json"
            if p.exists():
                for r in json.loads(p.read_text())["runs"]:
                    if r["kind"] == kind:
                        t[mode] = 1000 * seconds_per_iteration(r)
        if len(t) == 2:
            gains.append(f"{LABELS[kind]} {t['eager']:.1f} ms/it eager, {t['compile']:.1f} compiled")
    f["COMPILE_GAIN"] = "; ".join(gains) if gains else "eager/compiled check not run"
    seeds = {k: len(s["seeds"]) for k, s in summary.items()}
    f["SEEDS"] = "/".join(str(n) for n in sorted(set(seeds.values())))
    its = {i for r in runs for i in [r["iterations"]]}
    complete = len(summary) == len(ALL_KINDS) and set(seeds.values()) == {3} and its == {10_000}
    f["PROTOCOL"] = ("This is the thesis' protocol" if complete else
                     "PARTIAL: not every attention has 3 seeds of 10,000 iterations")
    f["N_KINDS"] = f"{len(summary)}"
    solved_all = [k for k in ALL_KINDS if k in summary and summary[k]["solved"] == seeds[k]]
    solved_none = [k for k in ALL_KINDS if k in summary and summary[k]["solved"] == 0]
    solved_some = [k for k in ALL_KINDS if k in summary and k not in solved_all and k not in solved_none]
    f["SOLVED_ALL"] = names(solved_all)
    f["SOLVED_NONE"] = names(solved_none)
    f["SOLVED_SOME"] = ", ".join(f"{LABELS[k]} ({summary[k]['solved']} of {seeds[k]})" for k in solved_some) or "none"
    f["N_SOLVED_RUNS"] = f"{sum(s['solved'] for s in summary.values())}"
    f["NONFINITE"] = f"{sum(s['n_nonfinite'] for s in summary.values())}"
    # the thesis' single run per kernel against our seeds, as outcomes (solved or not) rather than digits
    th = {k: s["thesis_final"] for k, s in summary.items() if s["thesis_final"] is not None}
    agree = [k for k in th if (th[k] < SOLVED) == (summary[k]["solved"] == seeds[k])
             and (th[k] < SOLVED or summary[k]["solved"] == 0)]
    f["THESIS_AGREE"] = f"{len(agree)} of {len(th)} ({names([k for k in ALL_KINDS if k in agree])})"
    f["THESIS_SOLVED_OURS_NOT"] = names([k for k in ALL_KINDS if k in th and th[k] < SOLVED
                                          and summary[k]["solved"] < seeds[k]])
    f["OURS_SOLVED_THESIS_NOT"] = names([k for k in ALL_KINDS if k in th and th[k] >= SOLVED
                                          and summary[k]["solved"] > 0])
    # by the kernel's total degree in q'.k': x^p -> p; (sum of d+1 terms)^2 -> 2d
    deg = {}
    for k in summary:
        d = int(k[1:]) if k in ("x2", "x4", "x8") else 2 * int(k[2:]) if k.startswith("sq") else \
            2 * int(k[7:]) if k.startswith("learned") else None
        if d is not None:
            deg.setdefault(d, [0, 0])
            deg[d][0] += summary[k]["solved"]
            deg[d][1] += seeds[k]
    f["BY_DEGREE"] = "; ".join(f"degree {d}: {a} of {n}" for d, (a, n) in sorted(deg.items()))
    # unsolved runs: how many of the 50 positions are left at chance (final loss / (ln 10 / 50))
    left = [(r["final_loss"] / CHANCE_PER_POSITION, r) for r in runs if r["final_loss"] >= SOLVED]
    f["PLATEAUS"] = ", ".join(f"{x:.2f}" for x, _ in sorted(left, key=lambda t: t[0])) or "none"
    near_int = [x for x, _ in left if abs(x - round(x)) < 0.05 and round(x) >= 1]
    f["N_UNSOLVED"] = f"{len(left)}"
    f["N_NEAR_INT"] = f"{len(near_int)}"
    spread = sorted(((summary[k]["max"] / max(summary[k]["min"], 1e-12), k) for k in summary), reverse=True)[:3]
    f["SPREAD"] = "; ".join(f"{LABELS[k]}: {fmt(summary[k]['min'])} to {fmt(summary[k]['max'])}" for _, k in spread)
    return f


def main(template: str, out: str) -> int:
    s = Path(template).read_text()
    for key, value in fields().items():
        s = s.replace(f"@@{key}@@", value)
    if "@@" in s:
        raise SystemExit(f"unfilled field in {template}: {s[s.index('@@'):][:40]}")
    Path(out).write_text(s)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*(sys.argv[1:3] + [str(TEMPLATE), str(OUT)][len(sys.argv[1:3]):])))
