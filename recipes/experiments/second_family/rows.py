"""Inputs of the second_family study (issue 30, item 5): a second model family end to end, a Gemma 3 shape with its
sliding-window layers, trained from scratch here, converted without training, generated, reloaded and judged.

    python recipes/experiments/run.py second_family [ROW ...]

The rows run in order, each reading what the one before wrote under ``runs/second_family/``:

* ``gemma3-scratch``: a Gemma 3 text model (6 layers, 5 sliding-window layers of window 64 per global one, as Gemma
  3's 5:1; hidden 128, 4 heads / 2 kv heads, a 2,048-token byte-level BPE) trained from scratch on Tiny Shakespeare
  (the scratch trainer's default ``--data``: the bundled text, the file ``--data demo`` reads) by the project's
  scratch trainer;
* ``gemma3-linear``: ``hf-polyattn convert`` with the long-context recipe on the converted layers (linear elu + a
  128-token softmax window + 4 sinks + gated decay, horizon 256): the global layer gets it, the sliding layers stay
  exact (``sliding_layers='exact'``). No attention transfer: a training-free conversion. The sinks sit at their own
  positions (``sink_position=own``), as recorded: the run predates ``integration/rope.py`` reading Gemma's RoPE;
* ``generate``: generate() with and without the cache, cache bytes at two lengths, save -> reload
  (``generate_and_reload.py``, written straight to ``recipes/results/second_family/generate.json``);
* ``eval-linear``, ``eval-streaming``: ``hf-polyattn eval`` at 256 ... 4,096 tokens and passkey at 1k / 2k of the
  converted model beside the softmax checkpoint, and the StreamingLLM row (kind sliding_window, 4 sinks + 128
  window, on the same layers, own positions).

Then ``collect`` copies what the rows wrote under ``runs/`` into ``recipes/results/second_family/`` and
``fill_section`` writes ``SECTION_second_family.md`` from those files. The recorded run was these commands in one
shell script (2 threads, one after another) on a copy of the same text.
"""

RUN = "runs/second_family"
SCRATCH = f"{RUN}/gemma3-scratch/model"  # the row gemma3-scratch's model
LINEAR = f"{RUN}/gemma3-linear"  # the row gemma3-linear's folder
EVAL = ["--data", "demo", "--contexts", "256,1024,2048,4096", "--passkey", "1024,2048", "--passkey-depths", "5",
        "--max-eval-tokens", "4096", "--threads", "2"]
OWN = ["--set", "window=128", "--set", "sinks=4", "--set", "sink_position=own"]
RECIPE = ["--kind", "linear", *OWN, "--set", "decay=gate", "--set", "decay_horizon=256"]

ROWS = {
    "gemma3-scratch": ["recipes/train_gpt2_scratch.py", "--family", "gemma3", "--n_layer", "6", "--n_embd", "128",
                       "--n_head", "4", "--context", "256", "--sliding_window", "64", "--global_every", "6", "--steps",
                       "150", "--batch_size", "8", "--lr", "2e-3", "--threads", "2", "--progress", "false",
                       "--save_every", "50", "--output_dir", "{out}"],
    "gemma3-linear": ["-m", "hf_polyattn.cli", "convert", SCRATCH, *RECIPE, "--out", "{out}", "--overwrite"],
    "generate": ["recipes/experiments/second_family/generate_and_reload.py", "--base", SCRATCH, "--converted", LINEAR,
                 "--data", "demo", "--out", "{results}/generate.json"],
    "eval-linear": ["-m", "hf_polyattn.cli", "eval", LINEAR, *EVAL, "--base", SCRATCH, "--baselines", "softmax",
                    "--out", "{out}"],
    "eval-streaming": ["-m", "hf_polyattn.cli", "eval", SCRATCH, *EVAL, "--kind", "sliding_window", *OWN,
                       "--baselines", "none", "--out", "{out}"],
}
AFTER = [["-m", "recipes.experiments.second_family.collect"],
         ["-m", "recipes.experiments.second_family.fill_section"]]
