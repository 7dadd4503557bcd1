"""The one runner of the studies under recipes/experiments/: each study is its inputs (``<study>/rows.py``) and this.

    python recipes/experiments/run.py                          # the studies
    python recipes/experiments/run.py retrofit_kinds --list    # a study's rows
    python recipes/experiments/run.py retrofit_kinds           # every row, then its tables and section
    python recipes/experiments/run.py retrofit_kinds smollm2_kinds/bigbird16 --dry-run   # its commands, shell-quoted

Works from any directory: every command runs from the repository root with this Python (``sys.executable``), one
row after another (``JOBS`` of the study at once where the rows are single-threaded processes); each row's output
goes to ``runs/<study>/<row>.log``, a failed row is reported and the next one runs. PEFT's ``method_comparison``
layout: the inputs of a study are data, the runner is shared, the results in ``recipes/results/<study>/`` are data
and generated text only.

A study's ``rows.py`` defines:

* ``ROWS``: row name -> the command's arguments after ``python`` (a script path from the repository root, or
  ``-m module``). ``{out}`` is the row's run folder ``runs/<study>/<row>``, ``{results}`` the study's results
  folder, ``{sst2}`` GLUE SST-2's training file (not bundled: ``$HF_POLYATTN_SST2``);
* ``TABLES`` (optional): results file stem -> the rows whose ``results.json`` it compares
  (``hf_polyattn.eval.compare.compare_runs``, written to ``recipes/results/<study>/<stem>.{md,json}``);
* ``AFTER`` (optional): commands run after the rows when the whole study runs (merging, the section);
* ``ENV`` (optional): environment variables of every command; ``JOBS`` (optional): rows at once (default 1).

The long-context study (``long_context/``) has its own runner, ``long_context/run_rows.py``, over the retrofit
pipeline's Python API.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SST2_ENV = "HF_POLYATTN_SST2"


def option(rows: dict[str, list[str]], names, flag: str) -> str:
    """The one value ``flag`` takes in the rows ``names`` of ``rows`` (a section reads a study's budget from its
    inputs rather than typing it twice); ValueError when they differ."""
    values = {rows[r][rows[r].index(flag) + 1] for r in names if flag in rows[r]}
    if len(values) != 1:
        raise ValueError(f"expected one value of {flag} in {list(names)}, found {sorted(values)}")
    return values.pop()


def studies() -> list[str]:
    return sorted(p.parent.name for p in HERE.glob("*/rows.py") if p.parent.name != "long_context")


def load(study: str) -> ModuleType:
    """The study's ``rows.py``, imported from its file (no package path needed)."""
    path = HERE / study / "rows.py"
    if study == "long_context" or not path.exists():
        raise SystemExit(f"unknown study {study!r}; studies: {studies()} (long_context: long_context/run_rows.py)")
    spec = importlib.util.spec_from_file_location(f"study_{study}_rows", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command(study: str, row: str, argv: list[str]) -> list[str]:
    """The row's full command: this Python, its arguments with the placeholders filled."""
    values = {"out": f"runs/{study}/{row}", "results": f"recipes/results/{study}"}
    if any("{sst2}" in a for a in argv):
        path = os.environ.get(SST2_ENV)
        if not path or not Path(path).is_file():
            raise SystemExit(f"row {row!r} reads SST-2, which is not bundled: set {SST2_ENV} to its training file "
                             "(a sentence<TAB>label .tsv, e.g. GLUE's SST-2/train.tsv)")
        values["sst2"] = path
    filled = []
    for a in argv:  # replace the placeholders only: an argument may be JSON, with braces of its own
        for key, value in values.items():
            a = a.replace("{" + key + "}", value)
        filled.append(a)
    return [sys.executable, *filled]


def run_one(study: str, name: str, cmd: list[str], env: dict[str, str]) -> bool:
    log = ROOT / "runs" / study / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, stdout=f, stderr=subprocess.STDOUT).returncode
    status = "ok" if rc == 0 else f"FAILED (exit {rc})"
    print(f"[{study}] {name}: {status}, {time.time() - start:.0f} s (log: {log.relative_to(ROOT)})", flush=True)
    return rc == 0


def write_tables(study: str, tables: dict[str, tuple[str, ...]]) -> None:
    from hf_polyattn.eval.compare import compare_runs, write_table

    for stem, rows in tables.items():
        done = [ROOT / "runs" / study / r for r in rows if (ROOT / "runs" / study / r / "results.json").exists()]
        if not done:
            continue
        missing = [r for r in rows if ROOT / "runs" / study / r not in done]
        _, md = write_table(compare_runs(done), ROOT / "recipes" / "results" / study / stem)
        print(md.read_text() + (f"\nmissing (failed or not run): {missing}" if missing else ""), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="a folder of recipes/experiments/ with a rows.py")
    p.add_argument("rows", nargs="*", help="rows to run (default: all, then the tables and AFTER)")
    p.add_argument("--list", action="store_true", help="print the study's rows and exit")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    p.add_argument("--jobs", type=int, default=None, help="rows at once (default: the study's JOBS, else 1)")
    args = p.parse_args(argv)
    if args.study is None:
        print("\n".join(studies()))
        return 0
    study = load(args.study)
    rows: dict[str, list[str]] = study.ROWS
    if args.list:
        print("\n".join(rows))
        return 0
    unknown = [r for r in args.rows if r not in rows]
    if unknown:
        raise SystemExit(f"unknown rows {unknown} of {args.study}; rows: {list(rows)}")
    chosen = args.rows or list(rows)
    env = dict(getattr(study, "ENV", {}))
    todo = [(name, command(args.study, name, rows[name])) for name in chosen]
    after = [] if args.rows else [command(args.study, "after", a) for a in getattr(study, "AFTER", [])]
    if args.dry_run:
        # quoted as a shell reads them: a printed line runs as it is from the repository root
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        for cmd in [c for _, c in todo] + after:
            print((prefix + " " if prefix else "") + shlex.join(["python", *cmd[1:]]))
        return 0
    jobs = args.jobs or getattr(study, "JOBS", 1)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ok = list(pool.map(lambda item: run_one(args.study, item[0], item[1], env), todo))
    write_tables(args.study, getattr(study, "TABLES", {}))
    for i, cmd in enumerate(after):
        ok.append(run_one(args.study, f"after{i}", cmd, env))
    return 0 if all(ok) else 1


if __name__ == "__main__":
    raise SystemExit(main())
