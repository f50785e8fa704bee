"""Device meshes: where stage 1, calibration, the sensitivity scan and evaluation run.

A mesh has two axes (`jax.sharding.Mesh`): `data` splits batches, `fsdp` splits parameters,
optimizer state and quantizer state (fully sharded data parallel; layers stay stacked and
scanned, so the layer axis is never split). XLA inserts the gathers and reductions; nothing
here is home-made communication. `MeshConfig()` chooses automatically: one device gives the
(1, 1) mesh; several give (1, n), all on `fsdp`, since the models that need several devices
are the ones that do not fit one.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qnpu_jax.errors import QnpuError

DATA = "data"
FSDP = "fsdp"
AXES = (DATA, FSDP)
# Arrays smaller than this stay replicated: splitting a few KiB of scales costs a gather for
# nothing (a SmolLM2 per-channel scale row is 576 floats; its R1 is 331,776).
MIN_SHARDED_ELEMENTS = 1 << 16
# Subtrees whose arrays carry a leading layer axis that the scan walks (never split).
STACKED_KEYS = ("layers", "r2")
DISTRIBUTED_ENV = "QNPU_DISTRIBUTED"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """The mesh's axis sizes; None on both: automatic (see the module doc), None on one: the
    devices left after the other."""

    data: int | None = None
    fsdp: int | None = None

    def __post_init__(self) -> None:
        for name in AXES:
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise QnpuError(f"mesh {name} must be a positive integer or null, got {value!r}")

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """ "DATAxFSDP" (e.g. "2x4"), or "auto"."""
        if text == "auto":
            return cls()
        parts = text.lower().split("x")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise QnpuError(f"mesh {text!r}: write DATAxFSDP (positive sizes, e.g. 2x4) or auto")
        return cls(data=int(parts[0]), fsdp=int(parts[1]))

    def shape(self, device_count: int) -> tuple[int, int]:
        """(data, fsdp) on `device_count` devices: both given, at most that many devices are
        used (the first ones); one given, the other takes the rest, which it must divide."""
        data, fsdp = self.data, self.fsdp
        if data is None and fsdp is None:
            data, fsdp = 1, device_count
        elif data is None:
            assert fsdp is not None
            data = device_count // fsdp
        elif fsdp is None:
            fsdp = device_count // data
        fits = (
            data * fsdp <= device_count
            if None not in (self.data, self.fsdp)
            else (data * fsdp == device_count)
        )
        if not fits or data < 1 or fsdp < 1:
            raise QnpuError(
                f"mesh data={self.data} fsdp={self.fsdp} does not fit the {device_count} "
                f"device(s) here (data × fsdp devices; one size given, it must divide them)"
            )
        return data, fsdp

    def to_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


def make_mesh(config: MeshConfig | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """The (data, fsdp) mesh over `devices` (default: every device of every process)."""
    devices = list(jax.devices() if devices is None else devices)
    data, fsdp = (config or MeshConfig()).shape(len(devices))
    chosen = devices[: data * fsdp]
    return Mesh(np.asarray(chosen, dtype=object).reshape(data, fsdp), AXES)


def initialize_distributed(enabled: bool | None = None) -> bool:
    """Join a multi-host job (`jax.distributed.initialize`). The coordinator, process count and
    id come from the cluster (TPU slices, SLURM, Open MPI), or from JAX_COORDINATOR_ADDRESS with
    JAX_NUM_PROCESSES and JAX_PROCESS_ID. `enabled` None reads QNPU_DISTRIBUTED=1 from the
    environment. Returns whether it initialized; call before anything touches a device. CPU
    processes talk through gloo."""
    if enabled is None:
        enabled = os.environ.get(DISTRIBUTED_ENV, "") not in ("", "0")
    if not enabled:
        return False
    num_processes, process_id = (_env_int(e) for e in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(num_processes=num_processes, process_id=process_id)
    except Exception as e:  # the cluster environment is missing or wrong: say which
        raise QnpuError(f"jax.distributed.initialize failed: {e}") from e
    return True


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError as e:
        raise QnpuError(f"{name} must be an integer, got {text!r}") from e


def is_primary() -> bool:
    """Whether this process writes the run directory (process 0 of a multi-host job)."""
    return jax.process_index() == 0


def sync(name: str) -> None:
    """A barrier across the job's processes (nothing on one process): the others wait until
    the primary has written what they read next."""
    if jax.process_count() > 1:

        multihost_utils.sync_global_devices(name)


def host_platform_flags(devices: int, existing: str = "") -> str:
    """XLA_FLAGS for `devices` CPU platform devices standing in for accelerators (set before
    JAX starts): the count, and collective timeouts long enough for a loaded 2-core machine
    (XLA:CPU aborts a collective whose device threads arrive more than 40 s apart)."""
    flags = [
        f"--xla_force_host_platform_device_count={devices}",
        "--xla_cpu_collective_call_terminate_timeout_seconds=1800",
        "--xla_cpu_collective_timeout_seconds=1800",
    ]
    return " ".join([existing.strip(), *flags]).strip()


def _stacked(path: tuple[Any, ...]) -> bool:
    return any(getattr(k, "key", None) in STACKED_KEYS for k in path)


def array_spec(shape: tuple[int, ...], fsdp: int, *, stacked: bool) -> PartitionSpec:
    """The PartitionSpec of one parameter-like array: its largest axis that `fsdp` divides
    split along `fsdp` (the layer axis of a stacked array excluded), or replicated when
    nothing divides or the array is small."""
    if fsdp == 1 or math.prod(shape) < MIN_SHARDED_ELEMENTS:
        return PartitionSpec()
    axes = [a for a in range(1 if stacked else 0, len(shape)) if shape[a] % fsdp == 0]
    if not axes:
        return PartitionSpec()
    best = max(axes, key=lambda a: (shape[a], -a))
    return PartitionSpec(*(FSDP if a == best else None for a in range(len(shape))))


def param_shardings(mesh: Mesh, tree: Any) -> Any:
    """NamedShardings for a pytree of parameters, quantizer state or optimizer state (arrays
    or ShapeDtypeStructs): `array_spec` of each leaf; under a STACKED_KEYS key the leading
    axis is the layer axis."""
    fsdp = mesh.shape[FSDP]

    def one(path: tuple[Any, ...], x: Any) -> NamedSharding:
        return NamedSharding(mesh, array_spec(tuple(np.shape(x)), fsdp, stacked=_stacked(path)))

    return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
    """Split axis `axis` of an `ndim`-array of token windows along `data`."""
    return NamedSharding(mesh, PartitionSpec(*(DATA if a == axis else None for a in range(ndim))))


def check_batch(mesh: Mesh, size: int, what: str) -> None:
    data = mesh.shape[DATA]
    if size % data:
        raise QnpuError(f"{what} {size} is not a multiple of the mesh's data axis ({data})")


def place(tree: Any, shardings: Any) -> Any:
    """`tree` on the mesh (`jax.device_put`: a no-op for arrays already placed so)."""
    return jax.device_put(tree, shardings)


def place_params(mesh: Mesh | None, tree: Any) -> Any:
    """`tree` split on the mesh by `param_shardings`; unchanged without a mesh."""
    return tree if mesh is None else place(tree, param_shardings(mesh, tree))


def place_batch(mesh: Mesh, batch: np.ndarray | jax.Array, axis: int = 0) -> jax.Array:
    return jax.device_put(batch, batch_sharding(mesh, np.ndim(batch), axis))


def put_batch(mesh: Mesh | None, batch: Any) -> Any:
    """A batch of windows [B, ...] for a jitted forward: split along `data` when the mesh's
    data axis divides B, replicated on the mesh when not (a last, shorter batch); unchanged
    without a mesh."""
    if mesh is None:
        return batch
    if len(batch) % mesh.shape[DATA]:
        return jax.device_put(batch, replicated(mesh))
    return place_batch(mesh, batch)


def data_size(mesh: Mesh | None) -> int:
    """How many windows a forward on `mesh` takes at once: its data axis (1 without one)."""
    return 1 if mesh is None else int(mesh.shape[DATA])


def host_tree(tree: Any) -> Any:
    """Every jax.Array leaf of `tree` as a numpy array on this host (gathered from every
    process when one holds only its shards): what a run directory stores, so that it loads
    on any device count (orbax refuses a sharded tree restored under another topology)."""
    return jax.tree.map(host_array, tree)


def local_value(x: Any) -> Any:
    """`x` itself when this process holds all of it, else its value gathered here: eager ops
    on an array spread over several processes each become a job-wide computation."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return host_array(x)
    return x


def host_array(x: Any) -> Any:
    """A jax.Array as a numpy array on this host, gathered from every process when this one
    holds only some of its shards; anything else unchanged."""
    if not isinstance(x, jax.Array):
        return x
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def describe(mesh: Mesh) -> dict[str, Any]:
    """The mesh as a report records it."""
    return {
        "data": int(mesh.shape[DATA]),
        "fsdp": int(mesh.shape[FSDP]),
        "devices": int(mesh.size),
        "platform": str(mesh.devices.flat[0].platform),
        "processes": int(jax.process_count()),
    }
