"""Issue 32's study: each row's long-context record into recipes/results/retrieval/<row>.json, with the decode state's
bytes at 8k tokens (``hf_polyattn.decode_memory`` of the row's model, its sparse cache included) and its training
CPU time. Rows that did not run are left out; ``fill_section.py`` writes the section from these files.

    python -m recipes.experiments.retrieval.collect [--runs runs/retrieval]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
RESULTS = ROOT / "recipes" / "results" / "retrieval"


def rows_module():
    spec = importlib.util.spec_from_file_location("retrieval_rows", HERE / "rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _settings(argv: list[str]) -> dict[str, str]:
    """The --set FIELD=VALUE items of a row's command."""
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def state_bytes(row: str, argv: list[str], runs: Path) -> dict[str, int] | None:
    """Decode cache bytes of one sequence after 8,192 tokens, per layer and in all, of the row's model."""
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM

    import hf_polyattn
    from hf_polyattn.checkpoints import resolve_checkpoint

    model_arg = next((a for a in argv[2:] if a.startswith("runs/") or a == "smollm2"), argv[3])
    if row == "baselines" or model_arg == "smollm2":
        return None  # the softmax checkpoint (and StreamingLLM beside it): their memory is the table's baseline rows
    if "hf_polyattn.retrofit" in argv:
        folder = runs / row / "model"
    else:  # an evaluation of another row's model: runs/retrieval/<row>/model, read from --runs
        folder = Path(model_arg)
        if folder.parts[:2] == ("runs", "retrieval"):
            folder = runs.joinpath(*folder.parts[2:])
        elif not folder.is_absolute():
            folder = ROOT / folder
    model = AutoModelForCausalLM.from_pretrained(resolve_checkpoint(str(folder)))
    settings = _settings(argv)
    if settings:
        from hf_polyattn.cli import parse_settings  # each value by its field's type (sparse_score is a name)

        kind = hf_polyattn.get_polyattn_config(model).kind
        hf_polyattn.reconfigure(model, **parse_settings(kind, [f"{k}={v}" for k, v in settings.items()]))
    mem = hf_polyattn.decode_memory(model, (8192,))
    layers = model.config.num_hidden_layers
    return {"total": mem.total[0], "per_layer": mem.total[0] // layers, "softmax_total": mem.softmax_total[0],
            "per_token": mem.per_token}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=str(ROOT / "runs" / "retrieval"), help="the rows' run folders")
    args = p.parse_args(argv)
    runs = Path(args.runs)
    rows = rows_module().ROWS
    RESULTS.mkdir(parents=True, exist_ok=True)
    collected = {}
    for name, argv_ in rows.items():
        record = runs / name / "long_context.json"
        if not record.is_file():
            continue
        data = json.loads(record.read_text())
        data["command"] = "python " + " ".join(a.replace("{out}", f"runs/retrieval/{name}") for a in argv_)
        data["state_bytes_8k"] = state_bytes(name, argv_, runs)
        results = runs / name / "results.json"
        if results.is_file():  # a trained row: its training time
            stages = json.loads(results.read_text()).get("stages", {})
            data["train_cpu_s"] = round(sum(s.get("cpu_s", 0) for s in stages.values() if isinstance(s, dict)), 1)
        (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=1))
        collected[name] = data
    if not collected:
        print(f"no row has run yet (looked in {runs})")
        return 1
    print(f"wrote {len(collected)} records to {RESULTS.relative_to(ROOT)}: {', '.join(collected)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
