"""Put on PYTHONPATH by test_multiprocess.py for a resumed two-process launch. HF_POLYATTN_TEST_SLOW_RESUME names
one stage's checkpoint file as FOLDER/FILE (the test builds it from train_loop's own names): the main process (RANK 0)
waits 4 s between removing that folder and moving the new one in, and the other process waits 2 s before it looks
for the file. A process that looks while the main one saves finds no checkpoint, starts from step 0 and waits in a
collective the main process never joins (CI's hang before train_loop's meeting after the resume). Without the
variable nothing changes."""
import os
import pathlib
import time

_TARGET = os.environ.get("HF_POLYATTN_TEST_SLOW_RESUME")
if _TARGET:
    _folder, _file = _TARGET.split("/")
    _rank = os.environ.get("RANK")

    if _rank == "0":
        _replace = os.replace

        def _slow_replace(src, dst, *a, **kw):
            if os.path.basename(os.fspath(dst)) == _folder:
                time.sleep(4)
            return _replace(src, dst, *a, **kw)

        os.replace = _slow_replace
    elif _rank == "1":
        _exists = pathlib.Path.exists

        def _slow_exists(self, *a, **kw):
            if self.name == _file and self.parent.name == _folder:
                time.sleep(2)
            return _exists(self, *a, **kw)

        pathlib.Path.exists = _slow_exists
