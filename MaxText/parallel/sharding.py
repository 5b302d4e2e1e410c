"""The device mesh (axes data, fsdp, context, expert, tensor) and logical-axis -> mesh-axis shardings.

Model code names logical axes only; `logical_axis_rules` (base.yml) maps them onto the mesh here.
"""

from __future__ import annotations

import collections
import math

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from MaxText.config.schema import MESH_AXES
from MaxText.config.errors import ConfigError
from MaxText.parallel.checks import DATA_AXES, check_mesh



def _fill(group: str, cfg, total: int) -> list[int]:
    sizes = [cfg[f"{group}_{a}_parallelism"] for a in MESH_AXES]
    known = math.prod(s for s in sizes if s not in (None, -1))
    if any(s in (None, -1) for s in sizes):
        if total % known:
            raise ConfigError(
                f"{group}_*_parallelism: the fixed sizes multiply to {known}, which does not divide the "
                f"{total} {'devices per slice' if group == 'ici' else 'slices'}; change them")
        sizes = [total // known if s in (None, -1) else s for s in sizes]
    elif known != total:
        raise ConfigError(
            f"{group}_*_parallelism multiply to {known} but there are {total} "
            f"{'devices per slice' if group == 'ici' else 'slices'}; make the product {total} or set one axis to -1")
    return sizes


def mesh_shape(cfg, num_devices: int, num_slices: int = 1) -> dict[str, int]:
    """Size of each mesh axis: ici (within a slice/node) x dcn (across them); -1 axes absorb the rest."""
    if num_devices % num_slices:
        raise ConfigError(f"{num_devices} devices do not split into {num_slices} equal slices")
    dcn = _fill("dcn", cfg, num_slices) if num_slices > 1 else None
    if dcn is None:
        # One slice (a single process, or processes the runtime does not group): dcn sizes set by the
        # user still split the devices, as on a GPU cluster with one process per GPU.
        sizes = [cfg[f"dcn_{a}_parallelism"] for a in MESH_AXES]
        dcn = [1 if s in (None, -1) else s for s in sizes]
        if num_devices % math.prod(dcn):
            raise ConfigError(
                f"dcn_*_parallelism multiply to {math.prod(dcn)}, which does not divide the {num_devices} devices")
    ici = _fill("ici", cfg, num_devices // math.prod(dcn))
    shape = {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)}
    check_mesh(cfg, shape)  # every check of the config against this shape, before anything is built on it
    return shape | {"_dcn": tuple(dcn), "_ici": tuple(ici)}


def device_grid(cfg, devices) -> np.ndarray:
    """The devices arranged as the mesh [data, fsdp, context, expert, tensor]. XLA gives each GPU host (or each
    multi-node NVLink domain) its own slice_index; with more than one slice the dcn_* sizes must multiply to
    the number of slices (mesh_shape) and the ici_* sizes to the devices of one. Ordered by (slice, process,
    id), every ICI block is then exactly one slice, whatever order the scheduler numbered the processes in
    (ordered by process alone, a round-robin rank placement would put NVLink traffic on the network).
    Works on any objects with id, process_index and slice_index (the preflight's simulated devices)."""
    def slice_of(d):
        return getattr(d, "slice_index", 0) or 0

    devices = sorted(devices, key=lambda d: (slice_of(d), d.process_index, d.id))
    sizes = collections.Counter(slice_of(d) for d in devices)
    if len(set(sizes.values())) > 1:
        raise ConfigError(f"the {len(devices)} devices fall into slices of unequal sizes "
                          f"({dict(sorted(sizes.items()))}: hosts or NVLink domains used unevenly); allocate the "
                          "same number of GPUs in every host / NVLink domain")
    slices = set(sizes)
    shape = mesh_shape(cfg, len(devices), len(slices))
    dcn, ici = shape["_dcn"], shape["_ici"]
    grid = np.array(devices, dtype=object).reshape(*dcn, *ici)
    n = len(MESH_AXES)
    # Interleave (dcn_a, ici_a) per axis, then merge each pair into one mesh axis.
    grid = grid.transpose([k for a in range(n) for k in (a, n + a)])
    return grid.reshape([shape[a] for a in MESH_AXES])


def create_mesh(cfg, devices=None) -> Mesh:
    """The training mesh over these devices (all of JAX's by default), laid out by device_grid."""
    grid = device_grid(cfg, list(devices if devices is not None else jax.devices()))
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def axis_rules(cfg) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """logical_axis_rules as flax expects them: (logical name, tuple of mesh axes). Without context parallelism the
    `context` axis (one device) is left out, so that every spec is what it was before the axis existed (TE's
    partitioners read the specs of the arrays they are given)."""
    unsplit = {"context"} if cfg.ici_context_parallelism == 1 and cfg.dcn_context_parallelism == 1 else set()
    rules = []
    for name, axes in cfg.logical_axis_rules:
        axes = tuple(a for a in spec_axes(axes) if a not in unsplit)
        rules.append((name, axes or None))
    return tuple(rules)


def spec_axes(entry) -> tuple[str, ...]:
    """One PartitionSpec entry (None, an axis name or a tuple of them) as a tuple of mesh axes."""
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def context_axes(rules) -> tuple[str, ...]:
    """The current mesh's axes of more than one device that split the sequence (activation_length): context
    parallelism's; () without rules or outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return ()
    return tuple(a for a in spec_axes(logical_to_spec(("activation_length",), rules)[0]) if mesh.shape.get(a, 1) > 1)


def logical_to_spec(logical_axes, rules) -> P:
    """PartitionSpec for one array from its logical axis names."""
    return nn.logical_to_mesh_axes(tuple(logical_axes), rules)


def logical_sharding(tree_of_logical_specs, mesh: Mesh, rules):
    """NamedShardings for a tree whose leaves are logical PartitionSpecs."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, logical_to_spec(spec, rules)),
        tree_of_logical_specs, is_leaf=lambda x: isinstance(x, P))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays [B, L] are split over the data axes along B."""
    return NamedSharding(mesh, P(DATA_AXES))


def constrain(x, logical_axes, rules):
    """Sharding constraint on an activation by logical axis names (a no-op without rules or a mesh in
    context, so the model also runs unsharded in tests and references)."""
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, rules))
