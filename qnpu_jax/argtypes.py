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
