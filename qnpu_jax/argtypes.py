"""Argument types shared by the `qnpu` command and the studies."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def comma_choices(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: a non-empty comma list of `choices`."""

    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items

    return parse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` with each flag's default, where there is one to show: not None, not a switch's
    (store_true's False, store_false's True), not one the help text already states."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        switch = action.nargs == 0
        if default is None or default is False or switch or default == [] or "default" in text:
            return text
        return super()._get_help_string(action)


def use_help_formatter(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser` and every subcommand parser under it with `HelpFormatter`."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                use_help_formatter(sub)
    return parser
