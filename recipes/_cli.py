"""``HfArgumentParser`` for the recipes, with a help text that says what each boolean option does.

For a ``bool`` field whose default is True, ``HfArgumentParser`` adds ``--no_FIELD`` next to ``--FIELD`` and its help
repeats the field's help with ``(default: False)``, which reads as if the option were off. Here ``--FIELD`` keeps
its help and default and says how to turn it off; ``--no_FIELD`` says it is the same as ``--FIELD false``.
A literal ``%`` in a field's help (``"5% warm-up"``) is escaped: argparse formats help strings with ``%`` and
would fail on ``--help``.
"""

import argparse
import re

from transformers import HfArgumentParser


def parser(*dataclass_types, **defaults) -> HfArgumentParser:
    """``HfArgumentParser(dataclass_types)`` with ``set_defaults(**defaults)`` and truthful boolean help."""
    p = HfArgumentParser(dataclass_types)
    if defaults:
        p.set_defaults(**defaults)
    for action in p._actions:
        if action.help:
            action.help = re.sub(r"%(?!\()", "%%", action.help)
    negations = {a.dest: a for a in p._actions if isinstance(a, argparse._StoreFalseAction)
                 and any(o.startswith("--no_") for o in a.option_strings)}
    for action in p._actions:
        neg = negations.get(action.dest)
        if neg is None or action is neg:
            continue
        flag = f"--{action.dest}"
        action.help = f"{action.help or ''} (--{action.dest} false or --no_{action.dest} turns it off)".strip()
        neg.help = f"same as {flag} false"
        neg.default = argparse.SUPPRESS  # the value's default is the one of {flag}; print none here
    return p
