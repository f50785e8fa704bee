"""`qnpu study NAME --help`: every study's flags have a help line and show their defaults."""

from __future__ import annotations

import argparse
import re

import pytest

from qnpu_jax.argtypes import HelpFormatter
from qnpu_jax.studies import STUDIES, run_study


class _Built(Exception):
    """Raised in place of parsing: the parser a study's `main` built, before it ran anything."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def _stop(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Built(parser)


def _entries(text: str) -> dict[str, str]:
    """First option string -> its entry in the help text, whitespace collapsed."""
    out = {}
    for chunk in re.split(r"\n(?=  -)", text):
        words = chunk.split()
        if words and words[0].startswith("-"):
            out[words[0].rstrip(",")] = " ".join(words)
    return out


def test_every_study_flag_has_a_help_line_and_shows_its_default(monkeypatch):
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", _stop)
    problems = []
    for name in STUDIES:
        with pytest.raises(_Built) as built:
            run_study(name, [])
        parser = built.value.parser
        assert issubclass(parser.formatter_class, HelpFormatter), name
        text = parser.format_help()
        assert text.startswith(f"usage: qnpu study {name}"), name
        for shown in ("(default: None)", "(default: False)", "(default: True)"):
            assert shown not in text, (name, shown)
        entries = _entries(text)
        for action in parser._actions:
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                problems.append(f"{flag}: no help")
            default = action.default
            if default is None or default is False or default == [] or action.nargs == 0:
                continue  # nothing to show: no value, an empty list, a switch
            if default == argparse.SUPPRESS or not action.option_strings:
                continue
            if "(default: " not in entries.get(action.option_strings[0], ""):
                problems.append(f"{flag}: default {default!r} not shown")
            if isinstance(default, str) and callable(action.type):
                try:
                    action.type(default)  # a default given as text must parse
                except (argparse.ArgumentTypeError, ValueError) as e:
                    problems.append(f"{flag}: default {default!r}: {e}")
            choices = action.choices
            if isinstance(default, str) and choices is not None and default not in choices:
                problems.append(f"{flag}: default {default!r} not among its choices")
    assert problems == []
