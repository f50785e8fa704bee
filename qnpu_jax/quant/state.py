"""The quantizer state of a plan, keyed by plan path: the one place where a path
(`layers/NAME` or a bare `NAME`) meets the nested state `{"layers": {NAME: entry}, "outer":
{NAME: entry}}` (`flax.traverse_util` flattens and rebuilds it). An entry holds `scale`,
`zero_point`, `qmin`, `qmax` (each [L] for a layer tensor)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import traverse_util

LAYER_PREFIX = "layers/"
QuantState = dict[str, Any]  # {"layers": {name: entry}, "outer": {name: entry}}


def is_layer_path(path: str) -> bool:
    """True for a tensor inside every decoder layer (stacked along the layer axis)."""
    return path.startswith(LAYER_PREFIX)


def state_key(path: str) -> tuple[str, str]:
    """("layers", NAME) for `layers/NAME`, ("outer", NAME) for a global tensor."""
    if is_layer_path(path):
        return "layers", path.removeprefix(LAYER_PREFIX)
    return "outer", path


def path_of(group: str, name: str) -> str:
    """The plan path of state entry `state[group][name]`."""
    return LAYER_PREFIX + name if group == "layers" else name


def get_entry(state: Mapping[str, Any], path: str) -> Any:
    group, name = state_key(path)
    return state[group][name]


def with_entry(state: Mapping[str, Any], path: str, entry: Any) -> QuantState:
    """`state` with `path`'s entry replaced (pure: the other entries are shared)."""
    group, name = state_key(path)
    return {**state, group: {**state[group], name: entry}}


def by_path(state: Mapping[str, Any]) -> dict[str, Any]:
    """{plan path: entry} of every entry of `state`."""
    flat = traverse_util.flatten_dict(dict(state), is_leaf=lambda keys, _: len(keys) == 2)
    return {path_of(group, name): entry for (group, name), entry in flat.items()}


def from_paths(entries: Mapping[str, Any]) -> QuantState:
    """The nested state of {plan path: entry} (both groups present, possibly empty)."""
    nested = traverse_util.unflatten_dict({state_key(p): e for p, e in entries.items()})
    return {"layers": dict(nested.get("layers", {})), "outer": dict(nested.get("outer", {}))}
