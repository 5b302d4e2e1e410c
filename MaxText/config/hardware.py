"""Target GPU systems a recipe names with `gpu_profile`, as the runtime sees them (no JAX here).

XLA gives every GPU host its own `slice_index`, and on multi-node NVLink (MNNVL) systems such as GB200
NVL72 one slice per NVLink domain instead (xla/pjrt/distributed/topology_util.cc; notes/recipes.md). JAX
maps a process's local rank to its GPU, so a launch runs one process per GPU and as many tasks per node as
the host has GPUs. The preflight builds simulated devices from a profile (`simulated_devices`) and lays
the recipe's mesh over them with the trainer's own builder (sharding.device_grid).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple


class GpuProfile(NamedTuple):
    name: str
    device_kind: str
    gpus_per_host: int       # GPUs per node (a GB200 compute tray has 4): --ntasks-per-node
    nvlink_domain: int       # GPUs one NVLink fabric joins (8 in a DGX; 72 in an NVL72 rack)
    slice_per_domain: bool   # MNNVL: the runtime gives the whole NVLink domain one slice, else one per host
    hbm_gib: float           # per GPU, as the runtime reports it
    host_memory_gib: float   # CPU memory per host (node or tray)
    sm: int                  # compute capability x 10 (90 Hopper, 100 Blackwell)


GPU_PROFILES = {p.name: p for p in (
    GpuProfile("h100-sxm", "NVIDIA H100 80GB HBM3", 8, 8, False, 79.6, 2048.0, 90),
    GpuProfile("h200-sxm", "NVIDIA H200", 8, 8, False, 140.0, 2048.0, 90),
    GpuProfile("gb200-nvl72", "NVIDIA GB200", 4, 72, True, 184.0, 960.0, 100),
    GpuProfile("gb300-nvl72", "NVIDIA GB300", 4, 72, True, 277.0, 960.0, 100),
)}


@dataclasses.dataclass(frozen=True)
class SimulatedDevice:
    """What the mesh builder reads of a device, as one process per GPU would report it (a class, not a
    tuple, so numpy keeps it whole in an object array)."""
    id: int
    process_index: int
    slice_index: int
    host: int
    platform: str = "gpu"


def hosts_per_slice(profile: GpuProfile, num_devices: int) -> int:
    """Hosts one slice holds in a job of num_devices GPUs: 1, or on MNNVL the job's hosts spread evenly over
    the fewest NVLink domains that hold them (as a topology-aware scheduler allocates, e.g. 128 GB200 GPUs
    as 16 trays in each of 2 NVL72 racks)."""
    hosts = -(-num_devices // profile.gpus_per_host)
    if not profile.slice_per_domain:
        return 1
    domains = -(-hosts // max(1, profile.nvlink_domain // profile.gpus_per_host))
    return -(-hosts // domains)


def simulated_devices(profile: GpuProfile, num_devices: int, hosts_order=None) -> list[SimulatedDevice]:
    """num_devices GPUs on whole hosts of `profile`, one process per GPU numbered host by host (or placed on
    hosts_order[rank], e.g. a scheduler's round-robin placement), with the slice_index the runtime gives."""
    hosts = -(-num_devices // profile.gpus_per_host)
    placement = list(hosts_order) if hosts_order is not None else [
        rank // profile.gpus_per_host for rank in range(num_devices)]
    per_slice = hosts_per_slice(profile, num_devices)
    devices = []
    for rank, host in enumerate(placement):
        if not 0 <= host < hosts:
            raise ValueError(f"rank {rank} placed on host {host} of {hosts}")
        devices.append(SimulatedDevice(id=rank, process_index=rank, slice_index=host // per_slice, host=host))
    return devices
