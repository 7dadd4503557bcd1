"""Datasets of the lm-eval tasks shipped with hf_polyattn, read from local files (no Hub access needed).

lm-eval calls ``custom_dataset`` with the task's metadata: ``--metadata`` (a JSON object) merged with the model
arguments, so every function takes ``**metadata`` and reads its own keys. A file is found from the metadata key,
else an environment variable, else (Tiny Shakespeare) the text bundled with the package. SST-2 is not bundled
(67,349 rows of GLUE): its task needs the file named.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# held out exactly as the retrofit pipeline holds out a text file (training/data.py load_text_data): the last
# 10% of the lines
EVAL_FRACTION = 0.1
LINES_PER_DOCUMENT = 100  # ~3.7k characters, ~1k tokens of SmolLM2's tokenizer: several rolling windows each

def data_file(metadata: dict, key: str, env: str, name: str, bundled: Path | None = None,
              missing: str = "") -> str:
    """The local file of a task: ``metadata[key]``, else ``$env``, else the ``bundled`` file.

    A file named in the metadata or the environment must exist: it is never replaced by the bundled one.
    """
    how = f"--metadata '{{\"{key}\": \"/path/{name}\"}}' or {env}=/path/{name}"
    for given, where in ((metadata.get(key), f"metadata {key!r}"), (os.environ.get(env), f"${env}")):
        if given:
            if not Path(given).is_file():
                raise FileNotFoundError(f"{where} = {given!r} is not a file ({how})")
            return str(given)
    if bundled is not None:
        return str(bundled)
    raise FileNotFoundError(f"no {name}: {missing}point the task at its local file with {how}")


def held_out_documents(lines: list[str]) -> list[str]:
    """The held-out tail of the lines, in documents of ``LINES_PER_DOCUMENT`` lines."""
    tail = lines[int(round(len(lines) * (1.0 - EVAL_FRACTION))):]
    return ["\n".join(tail[i : i + LINES_PER_DOCUMENT]) for i in range(0, len(tail), LINES_PER_DOCUMENT)]


def tiny_shakespeare(**metadata):
    import datasets

    from hf_polyattn.data import demo_text_path

    path = data_file(metadata, "tinyshakespeare_file", "HF_POLYATTN_TINYSHAKESPEARE", "tinyshakespeare_train.txt",
                     bundled=demo_text_path())
    docs = held_out_documents(Path(path).read_text(encoding="utf-8").splitlines())
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": docs})})


def rolling_results(doc, results):
    """lm-eval's perplexity metrics of one document: (its loglikelihood, its words / bytes)."""
    (loglikelihood,) = results
    text = doc["text"]
    words, num_bytes = len(re.split(r"\s+", text)), len(text.encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, num_bytes),
            "bits_per_byte": (loglikelihood, num_bytes)}


def sst2(**metadata):
    import datasets

    from hf_polyattn.data import load_classification_data

    path = data_file(metadata, "sst2_file", "HF_POLYATTN_SST2", "sst2_train.tsv",
                     missing="SST-2 is not bundled with hf_polyattn (GLUE's SST-2/train.tsv, sentence<TAB>label); ")
    data = load_classification_data(path, num_eval=int(metadata.get("sst2_num_eval", 2000)),
                                    seed=int(metadata.get("sst2_seed", 0)))
    return datasets.DatasetDict({"train": data.train, "validation": data.eval})
