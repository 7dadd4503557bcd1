"""PolyAttnConfig rejects every value it would otherwise misread, naming the field and what is allowed.

Before: ``alpha=nan`` / ``denominator_offset=inf`` silently zeroed the attention,
``qk_norm="no"`` switched q/k LayerNorms ON, ``poly_coefficients="12"`` became (1.0, 2.0).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from integration_helpers import ARCHS, VOCAB, build

import hf_polyattn
from hf_polyattn import PolyAttnConfig
from hf_polyattn.config import BACKENDS

NAN, INF = float("nan"), float("inf")
# every field but the kind's own options (a dict validated by the kind: test_kind_options_are_validated)
FIELDS = {f.name: str(f.type) for f in dataclasses.fields(PolyAttnConfig) if f.name != "options"}
# A config in which every float field may take any finite value (alpha/beta are polynomial-only).
BASE = {"kind": "polynomial", "degree": 2}


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", ["alpha", "beta", "denominator_offset"])
def test_non_finite_floats_rejected(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be a finite real number \(int or float\), got -?(nan|inf)"):
        PolyAttnConfig(**BASE, **{name: value})


@pytest.mark.parametrize(
    "coefficients",
    [(NAN, 1.0), (1.0, INF), [1.0, -INF], "12", 12, [1.0, "2"], (True, 1.0), {1.0: 2.0}, (1.0, None)],
    ids=["nan", "inf", "-inf-list", "str", "int", "str-item", "bool-item", "dict", "none-item"],
)
def test_bad_poly_coefficients_rejected(coefficients):
    with pytest.raises(ValueError, match=r"^poly_coefficients must be a list or tuple of finite real numbers"):
        PolyAttnConfig(kind="polynomial", poly_coefficients=coefficients)


def _wrong_values(annotation: str) -> list:
    """Values of the wrong type for a field annotated ``annotation`` (None where the field is not optional)."""
    optional = annotation.endswith(" | None")
    base = annotation.removesuffix(" | None")
    wrong = {
        "bool": ["no", "False", 1, 0, 1.0],
        "int": [4.0, True, "4", 2.5],
        "float": ["1", True, "nan", NAN, INF, [1.0]],
        "str": [3, True, "bogus", ["auto"]],
        "tuple[float, ...]": ["12", 1.0, (NAN,), ("1",)],
        # (layer, kv_head) pairs: a flat pair, a str, a set, a pair of 1 or 3, negative, float, bool, str, None items
        "tuple[tuple[int, int], ...]": [(0, 1), "0,1", 3, {(0, 1)}, [(0,)], [(0, 1, 2)], [(-1, 0)], [(0, 1.0)],
                                        [(True, 0)], [["0", 1]], [None]],
    }[base]  # KeyError: a new annotation this test does not know yet (add it here and in config.py)
    return wrong if optional else [*wrong, None]


@pytest.mark.parametrize("name", list(FIELDS))
def test_every_field_rejects_wrong_types_naming_itself(name):
    for value in _wrong_values(FIELDS[name]):
        with pytest.raises(ValueError, match=rf"^{name} must be ") as err:
            PolyAttnConfig(**{**BASE, name: value})
        assert repr(value) in str(err.value) or (isinstance(value, float) and math.isnan(value)), str(err.value)


@pytest.mark.parametrize(
    "name, value, match",
    [
        ("qk_norm", "no", r"qk_norm must be a bool \(True or False\), got 'no'"),
        ("local_exact", "False", r"local_exact must be a bool \(True or False\), got 'False'"),
        ("learn_coefficients", 1, r"learn_coefficients must be a bool \(True or False\), got 1"),
        ("beta", "2", r"beta must be a finite real number \(int or float\), got '2'"),
        ("denominator_offset", "1", r"denominator_offset must be a finite real number \(int or float\), got '1'"),
        ("degree", 4.0, r"degree must be an int >= 1, got 4\.0"),
        ("seed", False, r"seed must be an int >= 0, got False"),
        ("backend", "cuda", r"backend must be one of \['auto', 'loop', 'batched', 'triton', 'fla'\], got 'cuda'"),
        ("window", -1, r"window must be an int >= 0, got -1"),
        ("window", 4.0, r"window must be an int >= 0, got 4.0"),
        ("window_mix", "yes", r"window_mix must be a bool"),
        ("exact_path", None, r"exact_path must be one of \['auto', 'quadratic', 'tensor'\], got None"),
    ],
)
def test_reported_cases(name, value, match):
    with pytest.raises(ValueError, match=match):
        PolyAttnConfig(**{**BASE, name: value})


def test_numbers_are_normalised():
    cfg = PolyAttnConfig(kind="polynomial", degree=2, alpha=1, beta=2, denominator_offset=0,
                         poly_coefficients=[0, 1, 2])
    assert (cfg.alpha, cfg.beta, cfg.denominator_offset) == (1.0, 2.0, 0.0)
    assert all(type(x) is float for x in (cfg.alpha, cfg.beta, cfg.denominator_offset))
    assert cfg.poly_coefficients == (0.0, 1.0, 2.0) and all(type(c) is float for c in cfg.poly_coefficients)
    with pytest.raises(ValueError, match="beta must be a non-zero"):
        PolyAttnConfig(**BASE, beta=0)
    with pytest.raises(ValueError, match="denominator_offset must be a finite real number >= 0"):
        PolyAttnConfig(kind="linear", denominator_offset=-1)


def test_backend_field():
    field = next(f for f in dataclasses.fields(PolyAttnConfig) if f.name == "backend")
    assert field.default == "auto" and BACKENDS == ("auto", "loop", "batched", "triton", "fla")
    assert "HF_POLYATTN_BACKEND" in field.metadata["help"]
    for backend in BACKENDS:
        cfg = PolyAttnConfig(kind="linear", backend=backend)
        assert PolyAttnConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    old = PolyAttnConfig(kind="linear").to_dict()
    del old["backend"]  # a config.json written before the field existed
    assert PolyAttnConfig.from_dict(old).backend == "auto"


def test_window_options():
    assert PolyAttnConfig(kind="linear", window=8).resolved_local_kernel == "softmax"
    assert PolyAttnConfig(kind="polysketch", window=8).resolved_local_kernel == "softmax"
    assert PolyAttnConfig(kind="polysketch", local_exact=True).resolved_local_kernel == "polynomial"
    with pytest.raises(ValueError, match="window applies to the linear-time kinds"):
        PolyAttnConfig(kind="polynomial", window=8)
    with pytest.raises(ValueError, match="window and local_exact are two forms"):
        PolyAttnConfig(kind="linear", window=8, local_exact=True)
    with pytest.raises(ValueError, match="window needs causal_algorithm='block'"):
        PolyAttnConfig(kind="linear", window=8, causal_algorithm="cumsum")
    with pytest.raises(ValueError, match="window_mix needs window > 0"):
        PolyAttnConfig(kind="linear", window_mix=True)
    with pytest.raises(ValueError, match="local_kernel='softmax' needs local_exact=True or window > 0"):
        PolyAttnConfig(kind="linear", local_kernel="softmax")
    with pytest.raises(ValueError, match="denominator_offset is not allowed with exp-based weights"):
        PolyAttnConfig(kind="linear", window=8, denominator_offset=1.0)


def test_json_round_trip_of_every_field():
    cfg = PolyAttnConfig(kind="polynomial", degree=2, alpha=0.5, beta=2.0, denominator_offset=1.0,
                         poly_coefficients=(1.0, 0.0, 2.0), learn_coefficients=True, qk_norm=True, seed=3,
                         backend="triton")
    assert PolyAttnConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def _config_json(path):
    return json.loads((path / "config.json").read_text())


def test_backend_round_trips_through_config_json_and_old_checkpoints_load(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build("llama", PolyAttnConfig(kind="linear", backend="triton"))
    model.save_pretrained(tmp_path / "new")
    assert _config_json(tmp_path / "new")["polyattn"]["backend"] == "triton"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "new")  # loading runs no kernel
    assert hf_polyattn.get_polyattn_config(reloaded).backend == "triton"

    build("llama", PolyAttnConfig(kind="linear")).save_pretrained(tmp_path / "old")
    data = _config_json(tmp_path / "old")
    del data["polyattn"]["backend"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(data))
    old = AutoModelForCausalLM.from_pretrained(tmp_path / "old")
    assert hf_polyattn.get_polyattn_config(old).backend == "auto"
    old(torch.randint(3, VOCAB, (1, 6)))


def test_bad_stored_config_refused_at_load(tmp_path):
    from transformers import AutoModelForCausalLM

    build("llama", PolyAttnConfig(kind="linear")).save_pretrained(tmp_path)
    data = _config_json(tmp_path)
    data["polyattn"]["qk_norm"] = "no"  # hand-edited config.json
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"not a valid PolyAttnConfig: qk_norm must be a bool"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


# ------------------------------------------------- values finite in Python but not in the kernels
@pytest.mark.parametrize("name, value", [("alpha", 1e300), ("beta", -1e39), ("denominator_offset", 1e300)])
def test_floats_beyond_float32_rejected(name, value):
    """1e300 is finite in Python but inf in the float32 kernels: denominator_offset=1e300 zeroed the attention
    exactly as inf did; alpha=1e300 and poly_coefficients=(1e300, 1) gave NaN."""
    with pytest.raises(ValueError, match=rf"^{name} must be a finite real number \(int or float\) of magnitude "
                                         r"<= 3\.4028235e\+38 \(float32"):
        PolyAttnConfig(**BASE, **{name: value})
    with pytest.raises(ValueError, match=r"^poly_coefficients must be .* of magnitude <= 3\.4028235e\+38 .*got "
                                         r"1e\+300 at index 0"):
        PolyAttnConfig(kind="polynomial", poly_coefficients=(1e300, 1.0))
    PolyAttnConfig(**BASE, **{name: 3.0e38 if name != "beta" else -3.0e38})  # the largest float32s still pass


def test_seed_beyond_the_layer_seed_range_rejected():
    """layer_seed reduces seed * 1_000_003 modulo 2**62: seed 2**62 drew seed 0's sketches, silently."""
    with pytest.raises(ValueError, match=r"^seed must be an int in \[0, 4611686018427387903\], got 46116860184"):
        PolyAttnConfig(kind="polysketch", seed=2**62)
    assert PolyAttnConfig(kind="polysketch", seed=2**62 - 1).seed == 2**62 - 1


# ------------------------------------------------- a config edited after construction is validated again
@pytest.mark.parametrize("name, value, match", [
    ("qk_norm", "no", r"qk_norm must be a bool"),
    ("alpha", NAN, r"alpha must be a finite real number"),
    ("denominator_offset", INF, r"denominator_offset must be a finite real number"),
    ("degree", 3, r"degree must be even for kind='polynomial'"),
    ("kind", "bogus", r"kind must be one of \['polynomial'"),
])
def test_fields_assigned_after_construction_are_validated_by_convert(name, value, match):
    """PolyAttnConfig is a plain dataclass: ``cfg.qk_norm = "no"`` skipped __post_init__ and convert() used it
    (q/k LayerNorms ON, NaN alpha -> zero attention, kind='bogus' -> a transformers error naming nothing)."""
    cfg = PolyAttnConfig(kind="polynomial", degree=2)
    setattr(cfg, name, value)
    model = build("llama")
    with pytest.raises(ValueError, match=match):
        hf_polyattn.convert(model, cfg)
    assert model.config._attn_implementation not in hf_polyattn.kind_names()  # nothing changed
    from transformers import LlamaForCausalLM

    config = ARCHS["llama"].make_config()
    config._attn_implementation = "polynomial"
    config.polyattn = cfg  # construction with a PolyAttnConfig object in the model config
    with pytest.raises(ValueError, match=rf"^config\.polyattn is not a valid PolyAttnConfig: {match}"):
        LlamaForCausalLM(config)


def test_convert_keeps_a_copy_of_the_callers_config():
    cfg = PolyAttnConfig(kind="linear")
    model = hf_polyattn.convert(build("llama"), cfg)
    cfg.qk_norm = True  # an edit after convert() does not reach the converted model
    assert hf_polyattn.get_polyattn_config(model).qk_norm is False


@pytest.mark.parametrize("opts,match", [
    (dict(), "needs window >= 1"),
    (dict(window=8, qk_norm=True), "qk_norm"),
    (dict(window=8, feature_proj=16), "feature_proj"),
    (dict(window=8, local_exact=True), "local_exact"),
    (dict(window=8, window_mix=True), "window_mix"),
    (dict(window=8, local_kernel="polynomial", degree=3), "degree must be even"),
])
def test_sliding_window_kind_refuses_what_it_cannot_honour(opts, match):
    with pytest.raises(ValueError, match=match):
        PolyAttnConfig(kind="sliding_window", **opts)


def test_kind_named_alone_takes_its_own_defaults():
    assert PolyAttnConfig.for_kind("sliding_window").window == 256
    assert PolyAttnConfig.for_kind("sliding_window", window=32).window == 32
    assert PolyAttnConfig.for_kind("polysketch") == PolyAttnConfig(kind="polysketch")


def test_polysketch_degree_is_capped():
    """degree=2**40 used to hang (2p - 1 sketch factors per head); a clear error names the range instead."""
    assert PolyAttnConfig(kind="polysketch", degree=64).degree == 64
    for degree in (128, 2**40):
        with pytest.raises(ValueError, match=r"power of two in \[2, 64\]"):
            PolyAttnConfig(kind="polysketch", degree=degree)


def test_softmax_heads_field():
    cfg = PolyAttnConfig(kind="linear", softmax_heads=[[7, 2], (6, 0)])
    assert cfg.softmax_heads == ((6, 0), (7, 2))  # a set of heads: stored sorted, as tuples
    assert cfg.to_dict()["softmax_heads"] == [[6, 0], [7, 2]]  # JSON: lists of [layer, head]
    assert PolyAttnConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert PolyAttnConfig(kind="linear", softmax_heads=[]).softmax_heads is None  # no pair: the same as None
    assert PolyAttnConfig(kind="linear").to_dict()["softmax_heads"] is None
    for kind in ("polysketch", "performer", "sliding_window", "bigbird"):  # any kind takes it
        assert PolyAttnConfig.for_kind(kind, softmax_heads=[(0, 0)]).softmax_heads == ((0, 0),)
    with pytest.raises(ValueError, match=r"^softmax_heads must name each \(layer, kv_head\) pair once, got "
                                         r"\[\(1, 0\)\] more than once"):
        PolyAttnConfig(kind="linear", softmax_heads=[(1, 0), (0, 1), [1, 0]])
    with pytest.raises(ValueError, match=r"^softmax_heads must be a list of \[layer, kv_head\] pairs of ints >= 0, got "
                                         r"\(0, -1\) at index 1"):
        PolyAttnConfig(kind="linear", softmax_heads=[(0, 0), (0, -1)])
