"""Fill the @@...@@ fields of SECTION_retrofit.md from the run results (no number typed by hand).

    python -m recipes.experiments.retrofit.fill_section [TEMPLATE [OUT]]

(from the repository root; defaults: SECTION_retrofit.template.md next to this file and
recipes/results/SECTION_retrofit.md; the results are read from recipes/results/retrofit).
"""

import json
import sys
from pathlib import Path

from recipes._defaults import RESULTS
from recipes._kinds import RETROFIT_RUNS

D = RESULTS / "retrofit"
TEMPLATE = Path(__file__).resolve().parent / "SECTION_retrofit.template.md"
OUT = RESULTS / "SECTION_retrofit.md"


def load(name):
    p = D / f"{name}_results.json"
    return json.loads(p.read_text()) if p.exists() else None


def table(stem):
    p = D / f"{stem}.md"
    return "\n".join(p.read_text().strip().splitlines()[2:]) if p.exists() else "(not run)"


def ratio(stem, label_start):
    t = json.loads((D / f"{stem}.json").read_text())
    for r in t["rows"]:
        if r["label"].startswith(label_start):
            return r["vs_softmax"]
    return None


def main(template, out):
    s = Path(template).read_text()
    for name in RETROFIT_RUNS:
        r = load(name)
        if r is None:
            continue
        s = s.replace(f"@@W_{name}@@", f"{r['total_wall_s']:,.0f}")
        if "transfer" in r["stages"]:
            s = s.replace(f"@@WT_{name}@@", f"{r['stages']['transfer']['wall_s']:,.0f}")
    ll = load("smollm2-linear-local")
    s = s.replace("@@W_LL@@", f", linear + softmax blocks {ll['total_wall_s']:,.0f} s" if ll else "")
    s = s.replace("@@LINEAR_LOCAL_CMD@@", "python recipes/retrofit.py $LM $R --attention linear --feature_map elu "
                  "--local_exact true --block_size 64 --qk_norm true \\\n    --transfer_steps 40 --output_dir "
                  "runs/r2/smollm2-linear-local" if ll else "")
    s = s.replace("@@SMOLLM2_TABLE@@", table("smollm2_tinyshakespeare"))
    s = s.replace("@@MINILM_TABLE@@", table("minilm_sst2"))
    s = s.replace("@@PILOT_TABLE@@", table("smollm2_pilot_local_kernel"))
    st = "smollm2_tinyshakespeare"
    s = s.replace("@@R_poly@@", f"{ratio(st, 'polysketch'):.2f}")
    s = s.replace("@@R_polynomial@@", f"{ratio(st, 'polynomial'):.2f}")
    s = s.replace("@@R_linear@@", f"{ratio(st, 'linear (elu, qk'):.1f}")
    ll_ratio = ratio(st, "linear (elu, exact")
    s = s.replace("@@R_linear_local@@", "(not run)" if ll_ratio is None else f"{ll_ratio:.2f}")
    mt = "minilm_sst2"
    s = s.replace("@@R_mp@@", f"{100 * ratio(mt, 'polysketch'):.1f} %")
    s = s.replace("@@R_mll@@", f"{100 * ratio(mt, 'linear (elu, exact'):.1f} %")
    s = s.replace("@@R_ml@@", f"{100 * ratio(mt, 'linear (elu, qk'):.1f} %")
    paired = D / "minilm_sst2_paired.md"
    s = s.replace("@@PAIRED@@", (
        "Re-evaluation of the four saved models with the per-example record (same 1,000 rows; "
        "`recipes/experiments/retrofit/run_gpt2_scratch_sketch_transfer_minilm_paired.sh`):\n\n"
        "```bash\npython recipes/evaluate.py --model runs/r2/minilm-polysketch/model --attention polysketch "
        "--task classification \\\n    --data ../shared/data/sst2_train.tsv --max_length 64 --num_eval 1000 "
        "--output_dir runs/r2/eval-minilm-polysketch   # likewise softmax, linear, linear-local\n"
        "python recipes/evaluate.py --runs runs/r2/eval-minilm-softmax runs/r2/eval-minilm-polysketch "
        "runs/r2/eval-minilm-linear \\\n    runs/r2/eval-minilm-linear-local --output "
        "recipes/results/retrofit/minilm_sst2_paired\n```\n\n" + table("minilm_sst2_paired")
    ) if paired.exists() else "(paired re-evaluation not run)")
    pj = D / "minilm_sst2_paired.json"
    if pj.exists():
        parts = [f"{r['label']}: {r['paired_vs_softmax']['only_softmax_right']} rows only softmax gets right, "
                 f"{r['paired_vs_softmax']['only_this_right']} only it, McNemar p = "
                 f"{r['paired_vs_softmax']['mcnemar_p']:.2g}"
                 for r in json.loads(pj.read_text())["rows"] if "paired_vs_softmax" in r]
        s = s.replace("@@PAIRED_SUMMARY@@", "; ".join(parts) + ".")
    gpt2 = D / "gpt2_scratch.md"
    scratch = D / "gpt2-scratch_results.json"
    if scratch.exists():
        sc = json.loads(scratch.read_text())
        pre = (f"The scratch model after pre-training: perplexity {sc['eval']['perplexity']:.2f} "
               f"({sc['pretrain']['wall_s']:,.0f} s wall, {sc['pretrain']['cpu_s']:,.0f} CPU-s).")
    else:
        pre = "(scratch model not trained)"
    if (D / "gpt2_scratch.json").exists():
        s = s.replace("@@R_g_poly@@", f"{ratio('gpt2_scratch', 'polysketch'):.3f}")
        s = s.replace("@@R_g_lin@@", f"{ratio('gpt2_scratch', 'linear'):.3f}")
    s = s.replace("@@GPT2@@", pre + "\n\n" + table("gpt2_scratch") if gpt2.exists() else pre + " Retrofits not run.")
    Path(out).write_text(s)
    left = [w for w in s.split("@@")[1::2]]
    print("unfilled:", left)


if __name__ == "__main__":
    main(*(sys.argv[1:3] + [str(TEMPLATE), str(OUT)][len(sys.argv[1:3]):]))
