"""Put on PYTHONPATH by test_multiprocess.py for a resumed two-process launch: the main process (RANK 0) waits 4 s
between removing the transfer stage's old checkpoint folder and moving the new one in, and the other process waits 2 s
before it looks for that checkpoint. A process that looks while the main one saves finds no checkpoint, starts
from step 0 and waits in a collective the main process never joins (CI's hang before train_loop's meeting after the
resume). Only with HF_POLYATTN_TEST_SLOW_RESUME=1; nothing else changes."""
import os
import pathlib
import time

if os.environ.get("HF_POLYATTN_TEST_SLOW_RESUME") == "1":
    _rank = os.environ.get("RANK")
    _STAGE = "checkpoint-transfer"

    if _rank == "0":
        _replace = os.replace

        def _slow_replace(src, dst, *a, **kw):
            if str(dst).endswith(_STAGE):
                time.sleep(4)
            return _replace(src, dst, *a, **kw)

        os.replace = _slow_replace
    elif _rank == "1":
        _exists = pathlib.Path.exists

        def _slow_exists(self, *a, **kw):
            if self.name == "trainer_state.json" and self.parent.name == _STAGE:
                time.sleep(2)
            return _exists(self, *a, **kw)

        pathlib.Path.exists = _slow_exists
