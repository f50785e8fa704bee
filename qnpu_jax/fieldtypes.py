"""Type checks of a config dataclass's fields against their annotations, before any value is
used: `--set model=123` or `stage1.remat: maybe` is one QnpuError naming the key, never a
traceback from deep inside a run."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from qnpu_jax.errors import QnpuError, shown

_HINTS: dict[type, dict[str, Any]] = {}  # each class's resolved annotations


def field_hints(cls: type) -> dict[str, Any]:
    """{field: its annotation, resolved} of the dataclass `cls`."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _arms(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def conforms(value: Any, hint: Any) -> bool:
    """Whether `value` is of type `hint`: bool, int (not bool), float (an int too), str, None,
    unions, tuple[X, ...], classes and Literal (the type of its values: which of them is the
    caller's check, with its own message); other hints (Any, mappings) are not checked."""
    if typing.get_origin(hint) is typing.Literal:
        return any(conforms(value, type(v)) for v in typing.get_args(hint))
    if len(_arms(hint)) > 1:
        return any(conforms(value, arm) for arm in _arms(hint))
    if hint is type(None) or hint is None:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # a config's numbers are finite (`.inf` in YAML is a float)
        return (
            isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        )
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        if len(args) != len(value):
            return False
        return all(conforms(v, a) for v, a in zip(value, args, strict=True))
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def describe(hint: Any) -> str:
    """`hint` in a config's words: "an integer", "null or a number", "a list of strings"."""
    arms = _arms(hint)
    if typing.get_origin(hint) is typing.Literal:
        return describe(type(typing.get_args(hint)[0]))
    if len(arms) > 1:
        rest = [describe(a) for a in arms if a is not type(None)]
        return " or ".join((["null"] if type(None) in arms else []) + rest)
    if hint is bool:
        return "true or false"
    if hint is int:
        return "an integer"
    if hint is float:
        return "a number"
    if hint is str:
        return "a string"
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        of = describe(args[0]).removeprefix("an ").removeprefix("a ")
        return f"a list of {of}s" if len(args) == 2 and args[1] is Ellipsis else "a list"
    if dataclasses.is_dataclass(hint):
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def check_type(value: Any, hint: Any, name: str) -> None:
    """A QnpuError "{name} must be ..., got ..." unless `value` is of type `hint`."""
    if not conforms(value, hint):
        if isinstance(value, float) and not math.isfinite(value):
            raise QnpuError(f"{name} must be a finite number, got {value}")
        raise QnpuError(f"{name} must be {describe(hint)}, got {shown(value)}")


def check_field_types(obj: Any, label: str = "") -> None:
    """A QnpuError "{label}{field} must be ..., got ..." for the first field of the dataclass
    instance `obj` whose value is not of its annotated type."""
    hints = field_hints(type(obj))
    for field in dataclasses.fields(obj):
        check_type(getattr(obj, field.name), hints.get(field.name, Any), f"{label}{field.name}")
