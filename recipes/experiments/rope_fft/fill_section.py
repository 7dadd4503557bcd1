"""Write recipes/results/SECTION_rope_fft.md from recipes/results/rope_fft/results.json.

    .venv/bin/python -m recipes.experiments.rope_fft.fill_section

Every number comes from the JSON that ``recipes/rope_fft_accuracy.py`` wrote (the study's row): the command,
the machine, the error grid, the timings and where the two algorithms cross. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "results"

INTRO = """## RoPE attention through the polynomial method + FFT (seed 003)

`recipes/rope_fft.py` implements the seed paper's algorithm ("Fast RoPE attention: combining the polynomial
method and FFT"): the score matrix s_ij = q_i^T W_(i-j) k_j / sqrt(d) is split along the support of the per-offset
matrices W into rescaled Toeplitz matrices, exp is replaced by a degree-g polynomial (Chebyshev interpolant on
[-R, R], R the score bound for entries |q|, |k| <= B: R = B^2 sqrt(d) for RoPE), the polynomial is expanded into
C(2d + g, g) rescaled Toeplitz terms (RoPE's support has 2d entries) and each is applied with FFTs of length 2n.
Causal attention zeroes the negative offsets of every Toeplitz factor (still Toeplitz). Command:
`python recipes/experiments/run.py rope_fft`, which ran `{command}` ({total_s:.0f} s). Machine: {cpu};
{summary}; `uptime` at the end: `{uptime}`; {date}. Results: `recipes/results/rope_fft/` (`results.json`,
`table.md`, `rope_fft.png`).

### Error vs degree g and entry bound B

Causal, float64, n = {acc_n}, {acc_heads} heads, q and k entries uniform in [-B, B], v standard normal; relative
error ||out - exact||_F / ||exact||_F against exact softmax RoPE attention (the n x n definition). Term counts per
degree: {terms}.

{error_table}

{reach}

The module's bound (max error <= 2 eta / (1 - eta) max|v|, eta = R^(g+1) e^(2R) / (2^g (g+1)!), finite when
eta < 1) held at {held} of the {finite} points where it is finite; {exceptions}

### Time vs n against the quadratic algorithm

Causal, float32, B = H = 1, entries |q|, |k| <= {timing_bound:g}; the quadratic algorithm is exact RoPE attention
computed the usual way (rotated q, k; softmax(q k^T) V in blocks of {block} query rows, keys up to the block's
end). Best of repeated calls after a warm-up (a call over 2 s is timed once), the two algorithms called
alternately at each n in one process, torch threads: {threads}.

{timing_table}

{cross}

Plot: `recipes/results/rope_fft/rope_fft.png` (left: error vs g; right: time vs n).

- Cost: the term count C(2d + g, g) grows like d^g; at the head sizes of real models it is out of reach (d = 64,
  g = 4: {terms_d64} terms; the module refuses more than {max_terms} by default). The paper's almost-linear bound
  needs d = O(log n) and g = o(log n). The implementation shares FFTs between terms with the same Q- or K-monomial
  (C(d + g, g) distinct ones each), so the per-term work left is an O(n) product in the frequency domain.
- Standard RoPE scores are (R_i q_i) . (R_j k_j): the score matrix has rank <= d and the classic polynomial method
  (features of the rotated q, k) applies without an FFT. The FFT route is what the paper's general per-offset W
  needs (tested here with random W); RoPE is built as such a W to exercise it.
- The error points at the float64 rounding floor are not covered by the approximation bound, which is about the
  polynomial only; the module's tests check fp32 against fp64 and that bf16 inputs give finite outputs.
"""


def _fmt(x: float) -> str:
    return f"{x:.1e}"


def error_table(acc: list[dict]) -> str:
    gs = sorted({r["g"] for r in acc})
    head = "| d | B | R | " + " | ".join(f"g={g}" for g in gs) + " |"
    sep = "|---|---|---|" + "---|" * len(gs)
    lines = [head, sep]
    for d, b in sorted({(r["d"], r["B"]) for r in acc}):
        rows = {r["g"]: r for r in acc if (r["d"], r["B"]) == (d, b)}
        radius = next(iter(rows.values()))["radius"]
        cells = [_fmt(rows[g]["rel_err_fro"]) if g in rows else "–" for g in gs]
        lines.append(f"| {d} | {b:g} | {radius:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def reach(acc: list[dict]) -> str:
    out = []
    for target in (1e-3, 1e-6):
        parts = []
        for d, b in sorted({(r["d"], r["B"]) for r in acc}):
            rows = sorted((r for r in acc if (r["d"], r["B"]) == (d, b)), key=lambda r: r["g"])
            hit = next((r for r in rows if r["rel_err_fro"] < target), None)
            parts.append(f"d={d}, B={b:g}: " + (f"g={hit['g']} ({hit['terms']} terms)" if hit else
                                                f"not within g <= {rows[-1]['g']}"))
        out.append(f"- Smallest degree with relative error below {target:.0e}: " + "; ".join(parts) + ".")
    return "\n".join(out)


def bound_check(acc: list[dict]) -> tuple[int, int, str]:
    finite = [r for r in acc if math.isfinite(r["bound_max_err_over_max_v"])]
    over = [r for r in finite if r["max_err_over_max_v"] > r["bound_max_err_over_max_v"]]
    if not over:
        return len(finite) - len(over), len(finite), "no exceptions."
    worst = max(r["max_err_over_max_v"] for r in over)
    return (len(finite) - len(over), len(finite),
            f"the {len(over)} exceptions are points where the bound is below the float64 rounding floor (their "
            f"measured max error / max|v| is at most {worst:.1e}).")


def timing_table(timing: list[dict]) -> str:
    lines = ["| d | g | terms | n | fast s | quadratic s | fast / quadratic | rel. error vs quadratic | calls "
             "(fast, quadratic) | load (1 min) before, after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in timing:
        lines.append(f"| {r['d']} | {r['g']} | {r['terms']} | {r['n']} | {r['fast_s']:.4f} | {r['quadratic_s']:.4f} "
                     f"| {r['fast_over_quadratic']:.2f} | {r['rel_err_fro']:.1e} | {r['fast_calls']}, "
                     f"{r['quadratic_calls']} | {r['load_1min'][0]:.2f}, {r['load_1min'][1]:.2f} |")
    return "\n".join(lines)


def crossing_text(res: dict) -> str:
    out = []
    for c in res["crossings"]:
        rows = [r for r in res["timing"] if (r["d"], r["g"]) == (c["d"], c["g"])]
        last = max(rows, key=lambda r: r["n"])
        if c["fast_wins_from_n"] is None:
            out.append(f"- d={c['d']}, g={c['g']} ({c['terms']} terms): the quadratic algorithm was faster at the "
                       f"largest n timed, n={c['largest_n']} (fast / quadratic {last['fast_over_quadratic']:.2f} "
                       f"there).")
        elif c["fast_wins_from_n"] == c["largest_n"]:
            out.append(f"- d={c['d']}, g={c['g']} ({c['terms']} terms): the FFT algorithm is faster only at the "
                       f"largest n timed, n={last['n']}: {last['fast_s']:.3f} s against {last['quadratic_s']:.3f} s "
                       f"({last['fast_over_quadratic']:.2f}x the quadratic time).")
        else:
            out.append(f"- d={c['d']}, g={c['g']} ({c['terms']} terms): the FFT algorithm is faster at every n "
                       f"from n={c['fast_wins_from_n']} on; at n={last['n']} it takes {last['fast_s']:.3f} s against "
                       f"{last['quadratic_s']:.3f} s ({last['fast_over_quadratic']:.2f}x the quadratic time).")
    spans = []
    for c in res["crossings"]:
        errs = [r["rel_err_fro"] for r in res["timing"] if (r["d"], r["g"]) == (c["d"], c["g"])]
        spans.append(f"d={c['d']}, g={c['g']}: {min(errs):.1e} to {max(errs):.1e}")
    errs = "; ".join(spans)
    out.append(f"- Relative error of the float32 FFT output against the quadratic one over the n timed: {errs} (the "
               f"polynomial's error plus float32 rounding, which can grow with n: FFT rounding is relative to a whole "
               f"column).")
    loads = [x for r in res["timing"] for x in r["load_1min"]]
    out.append(f"- The machine was shared while timing: 1-minute load average {min(loads):.2f} to {max(loads):.2f} "
               f"(the table's last column) with torch threads: {res['settings']['threads']}; the best of "
               f"alternated calls keeps what the load did not add, but single points can still be off.")
    return "\n".join(out)


def render(res: dict) -> str:
    acc, timing, st = res["accuracy"], res["timing"], res["settings"]
    terms = "; ".join(f"d={d}: " + ", ".join(f"g={r['g']} {r['terms']}" for r in sorted(
        {r["g"]: r for r in acc if r["d"] == d}.values(), key=lambda r: r["g"])) for d in sorted({r["d"] for r in acc}))
    held, finite, exceptions = bound_check(acc)
    m = res["machine"]
    return INTRO.format(
        command=res["command"], total_s=res["total_s"], cpu=m["cpu"], summary=m["summary"], uptime=m["uptime"],
        date=m["date"], acc_n=st["acc_n"], acc_heads=st["acc_heads"], terms=terms, error_table=error_table(acc),
        reach=reach(acc), held=held, finite=finite, exceptions=exceptions, timing_bound=st["timing_bound"],
        block=st["block"], threads=st["threads"], timing_table=timing_table(timing), cross=crossing_text(res),
        terms_d64=res["term_count_d64_g4"], max_terms=res["max_terms"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(RESULTS / "rope_fft" / "results.json"), help="the recipe's JSON")
    p.add_argument("--out", default=str(RESULTS / "SECTION_rope_fft.md"), help="section file to write")
    args = p.parse_args(argv)
    res = json.loads(Path(args.results).read_text())
    Path(args.out).write_text(render(res))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
