"""Check retrofits on held-out text that is not in the repository: the license texts every Debian machine ships in
/usr/share/common-licenses (long, coherent English documents, never trained on), concatenated in a fixed order.

    .venv/bin/python recipes/experiments/long_context/heldout_licenses.py ROW [ROW...]

Each ROW names a run of ``run_rows.py`` that kept its folder (``runs/long_context/<row>/model``; with ``--runs
runs/retrieval`` a row of the retrieval study, and ``ROW+sparseN`` that row's model with N sparse keys; ``--set
FIELD=VALUE ... --label NAME`` that row's model with settings that add no tensor, recorded as NAME); the softmax
checkpoint and StreamingLLM (4 sinks + a 128 window) are evaluated beside them on the same tokens. Perplexity only
(the passkey prompt does not depend on the data), at the study's contexts, over the first 12,288 tokens. Writes
``recipes/results/long_context/heldout/licenses.json`` and ``.md`` (the rows of every call so far, by name).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
LICENSES = Path("/usr/share/common-licenses")
# the order the texts are read in: the GNU licenses share passages, which a long context can use
FILES = ("GPL-3", "LGPL-2.1", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "GPL-2", "MPL-1.1", "LGPL-2", "Artistic")
OUT = ROOT / "recipes" / "results" / "long_context" / "heldout"


def licenses_text() -> str:
    missing = [f for f in FILES if not (LICENSES / f).is_file()]
    if missing:
        raise SystemExit(f"{LICENSES} lacks {missing}: this check needs a Debian-like machine")
    return "\n\n".join((LICENSES / f).read_text() for f in FILES)


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_polyattn  # registers the kinds the folders were saved with
    from hf_polyattn import machine
    from hf_polyattn.checkpoints import resolve_checkpoint
    from hf_polyattn.eval.long_context import LongContextSettings, evaluate_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", nargs="+", help="run_rows.py rows whose runs/long_context/<row>/model exists")
    p.add_argument("--runs", default=str(ROOT / "runs" / "long_context"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help="a setting that adds no tensor (hf_polyattn.reconfigure) for the one ROW; needs --label")
    p.add_argument("--label", help="the row's name in the record when --set changes it")
    a = p.parse_args(argv)
    if a.set and (not a.label or len(a.rows) != 1):
        p.error("--set applies to one ROW and needs --label (the row's name in the record)")
    torch.set_num_threads(a.threads)
    base = resolve_checkpoint("smollm2")
    tok = AutoTokenizer.from_pretrained(base)
    ids = torch.tensor(tok(licenses_text(), add_special_tokens=False)["input_ids"])
    settings = LongContextSettings(contexts=(256, 1024, 2048, 4096, 8192), max_tokens=12288, passkey_lengths=(),
                                   baselines=("softmax", "streaming"))
    OUT.mkdir(parents=True, exist_ok=True)
    record = OUT / "licenses.json"
    result = json.loads(record.read_text()) if record.exists() else None
    if result is None:  # the baseline rows, once
        from hf_polyattn import convert
        from hf_polyattn.eval.long_context import BASELINES, streaming_config

        rows = []
        for name in settings.baselines:
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            if name == "streaming":
                convert(model, streaming_config(settings.streaming_sinks, settings.streaming_window))
            rows.append(evaluate_model(BASELINES[name](settings), model, tok, ids, settings) | {"baseline": name})
        result = {"settings": {k: list(v) if isinstance(v, tuple) else v for k, v in settings.__dict__.items()},
                  "tokens": settings.max_tokens, "rows": rows, "machine": machine.summary(),
                  "data": {"files": [str(LICENSES / f) for f in FILES], "tokens_in_text": int(ids.numel())}}
    for row in a.rows:
        trained, _, sparse = row.partition("+sparse")  # the retrieval study's 'ROW+sparseN': ROW with N sparse keys
        if sparse and not sparse.isdigit():
            print(f"row {row!r}: after '+sparse' comes the cache's keys per kv head, e.g. hh+sparse64", file=sys.stderr)
            return 2
        folder = Path(a.runs) / trained / "model"
        if not folder.is_dir():
            print(f"no folder {folder}: run the row {trained} (with its model saved) first", file=sys.stderr)
            return 2
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if sparse:
            hf_polyattn.reconfigure(model, sparse_cache=int(sparse))
        if a.set:
            from hf_polyattn.cli import parse_settings

            changes = parse_settings(hf_polyattn.get_polyattn_config(model).kind, a.set)
            hf_polyattn.reconfigure(model, **changes)
            row = a.label
        r = evaluate_model(row, model, tok, ids, settings)
        result["rows"] = [x for x in result["rows"] if x["label"] != row] + [r | {"row": row}]
    record.write_text(json.dumps(result, indent=1) + "\n")
    from hf_polyattn.eval.long_context import long_context_markdown

    md = long_context_markdown(result).replace(
        "held-out tokens", "tokens of the license texts in /usr/share/common-licenses (not in the repository)")
    (OUT / "licenses.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
