import json

import pytest
import torch

from hf_polyattn.training.loop import IncompatibleCheckpointError, LoopConfig, fingerprint_of, train_loop
from hf_polyattn.training.pipeline import Retrofit, RetrofitArgs, run


def _setup(seed=0):
    from accelerate import Accelerator

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return Accelerator(), model, list(model.named_parameters())


def _batch(step, micro, rank, fail_at=None):
    if fail_at is not None and step == fail_at:
        raise KeyboardInterrupt  # what Ctrl-C / SIGTERM does in the middle of a run
    g = torch.Generator().manual_seed(step * 100 + micro)
    x = torch.randn(4, 8, generator=g)
    return {"x": x, "y": x.sum(-1, keepdim=True)}


def _loss(m, b):
    return torch.nn.functional.mse_loss(m(b["x"]), b["y"])


def _cfg(out, **kw):
    return LoopConfig(output_dir=str(out), max_steps=6, lr=1e-2, grad_accum=2, progress=False, desc="toy", **kw)


def test_interrupted_run_resumes_without_losing_steps(tmp_path):
    acc, model, params = _setup()
    train_loop(acc, model, params, _batch, _loss, _cfg(tmp_path / "full"), fingerprint_of(params, run="toy"))
    reference = [p.detach().clone() for _, p in params]

    acc, model, params = _setup()
    fp = fingerprint_of(params, run="toy")
    with pytest.raises(KeyboardInterrupt):
        train_loop(acc, model, params, lambda s, m, r: _batch(s, m, r, fail_at=3), _loss, _cfg(tmp_path / "cut"), fp)
    meta = json.loads((tmp_path / "cut" / "checkpoint-toy" / "trainer_state.json").read_text())
    assert meta["step"] == 3  # steps 1-3 were done and saved at the interruption

    acc, model, params = _setup(seed=123)  # a fresh process: other initial weights, restored from the checkpoint
    summary = train_loop(acc, model, params, _batch, _loss, _cfg(tmp_path / "cut"), fp)
    assert summary["resumed_from"] == 3 and summary["steps"] == 6
    assert [h["step"] for h in summary["history"]] == [1, 2, 3, 4, 5, 6]
    for (_, p), ref in zip(params, reference):
        torch.testing.assert_close(p.detach(), ref)
    assert (tmp_path / "cut" / "toy_metrics.json").exists() and (tmp_path / "cut" / "toy_loss.png").exists()


def test_incompatible_checkpoint_fails_before_any_step(tmp_path):
    acc, model, params = _setup()
    train_loop(acc, model, params, _batch, _loss, _cfg(tmp_path, save_every=2), fingerprint_of(params, kind="a"))
    calls = []

    def batch(step, micro, rank):
        calls.append(step)
        return _batch(step, micro, rank)

    acc, model, params = _setup()
    with pytest.raises(IncompatibleCheckpointError, match="kind: checkpoint='a', this run='b'"):
        train_loop(acc, model, params, batch, _loss, _cfg(tmp_path), fingerprint_of(params, kind="b"))
    assert calls == []


def _args(tiny_dirs, text_file, out, **kw):
    # the exact-block polysketch the recipe ran with window 0 (learned sketch, q/k LayerNorm)
    attention = {"kind": "polysketch", "sketch": "learned", "sketch_size": 8, "block_size": 16, "local_exact": True,
                 "qk_norm": True}
    base = dict(model=tiny_dirs["llama"], data=text_file, attention=attention, transfer_steps=2, context=32,
                eval_context=32, eval_stride=32, max_eval_tokens=256, eval_before=False, save_model=False,
                progress=False, output_dir=str(out))
    base.update(kw)
    return RetrofitArgs.build(**base)


def test_pipeline_refuses_another_runs_output_dir(tiny_dirs, text_file, tmp_path):
    run(_args(tiny_dirs, text_file, tmp_path))
    r = Retrofit(_args(tiny_dirs, text_file, tmp_path, attention={"kind": "linear", "local_exact": True}))
    with pytest.raises(IncompatibleCheckpointError, match="holds a run with other settings.*attention"):
        r.prepare()
    assert not hasattr(r, "model")  # refused before loading the model, let alone training


def test_pipeline_bad_inputs_fail_before_training(tiny_dirs, text_file, tsv_file, tmp_path):
    from hf_polyattn.checkpoints import CheckpointError
    from hf_polyattn.data import DataError

    with pytest.raises(DataError, match="does not exist"):
        Retrofit(_args(tiny_dirs, "../elsewhere/missing.txt", tmp_path / "a")).prepare()
    with pytest.raises(DataError, match="no column 'review'"):
        Retrofit(_args(tiny_dirs, tsv_file, tmp_path / "b", model=tiny_dirs["bert"], task="classification",
                       text_column="review")).prepare()
    with pytest.raises(CheckpointError, match="does not exist"):
        Retrofit(_args(tiny_dirs, text_file, tmp_path / "c", model="./nowhere/model")).prepare()
    with pytest.raises(ValueError, match="attention kind must be one of"):
        _args(tiny_dirs, text_file, tmp_path / "d", attention="flash")
