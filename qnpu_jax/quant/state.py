"""The quantizer state of a plan: one `Encoding` per tensor, keyed by plan path. This module
is the one place where a path (`layers/NAME` or a bare `NAME`) meets the nested state
`{"layers": {NAME: Encoding}, "outer": {NAME: Encoding}}` (`flax.traverse_util` flattens and
rebuilds it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import struct, traverse_util

from qnpu_jax.errors import QnpuError

LAYER_PREFIX = "layers/"
FIELDS = ("scale", "zero_point", "qmin", "qmax")


class Encoding(struct.PyTreeNode):
    """One tensor's static quantizer: x ≈ (clip(round(x/scale) + zero_point, qmin, qmax) −
    zero_point)·scale. For a `layers/` tensor every field has a leading layer axis [L] (qmin /
    qmax carry per-layer bit-widths); a per-channel weight's scale is [(L,) out, 1]. Floats
    throughout: scale and zero point are what stage 1 learns."""

    scale: Any
    zero_point: Any
    qmin: Any
    qmax: Any

    @classmethod
    def from_tree(cls, entry: Any, where: str = "") -> Encoding:
        """An Encoding from its stored form (orbax restores a mapping of the four fields)."""
        if isinstance(entry, Encoding):
            return entry
        if not isinstance(entry, Mapping) or set(entry) != set(FIELDS):
            keys = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
            raise QnpuError(f"{where}: an encoding has the fields {FIELDS}, got {keys}")
        return cls(**{k: entry[k] for k in FIELDS})


QuantState = dict[str, dict[str, Encoding]]  # {"layers": {name: e}, "outer": {name: e}}


def state_from_tree(tree: Mapping[str, Any], where: str = "quantizer state") -> QuantState:
    """A QuantState from its stored form (each entry a mapping of the four fields)."""
    if not isinstance(tree, Mapping) or set(tree) != {"layers", "outer"}:
        raise QnpuError(f"{where}: a quantizer state has the groups 'layers' and 'outer'")
    return {
        group: {
            name: Encoding.from_tree(e, f"{where} {group}/{name}")
            for name, e in tree[group].items()
        }
        for group in ("layers", "outer")
    }


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


def get_entry(state: Mapping[str, Any], path: str) -> Encoding:
    """The entry of plan path `path` (an Encoding in a QuantState)."""
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
