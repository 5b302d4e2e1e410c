"""How a launcher announces the processes of a job, and jax.distributed.initialize() from it.

Four announcements are read, in this order:
  ours (scripts/launch.sh)  JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
  upstream MaxText's GPU    JAX_COORDINATOR_IP, JAX_COORDINATOR_PORT, NNODES, NODE_RANK (one process per node,
                            each with every GPU it sees)
  SLURM, Open MPI           found by jax.distributed itself (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE)
An incomplete or inconsistent announcement is a ConfigError naming the variables, raised before JAX starts.
Single-process runs never start the distributed runtime.
"""

from __future__ import annotations

import os

from MaxText.config.errors import ConfigError

UPSTREAM_VARS = ("JAX_COORDINATOR_IP", "JAX_COORDINATOR_PORT", "NNODES", "NODE_RANK")


def _int(environ, name: str) -> int:
    value = environ.get(name, "")
    if not value.strip().isdigit():
        raise ConfigError(f"environment: {name}={value!r} must be a whole number (MaxText's multi-node variables: "
                          f"{', '.join(UPSTREAM_VARS)})")
    return int(value)


def launch_kwargs(environ=os.environ) -> dict:
    """jax.distributed.initialize's arguments from our or upstream's variables ({} when neither is set: SLURM,
    Open MPI or nothing)."""
    upstream = {}
    if any(name in environ for name in UPSTREAM_VARS):
        missing = [name for name in UPSTREAM_VARS if not environ.get(name)]
        if missing:
            given = ", ".join(n for n in UPSTREAM_VARS if n not in missing)
            raise ConfigError(f"environment: {', '.join(missing)} unset while {given} is set; MaxText's multi-node "
                              "launch needs all of JAX_COORDINATOR_IP, JAX_COORDINATOR_PORT, NNODES and NODE_RANK")
        nodes, rank = _int(environ, "NNODES"), _int(environ, "NODE_RANK")
        port = _int(environ, "JAX_COORDINATOR_PORT")
        if not 0 <= rank < nodes:
            raise ConfigError(f"environment: NODE_RANK={rank} must be in [0, NNODES={nodes})")
        upstream = dict(coordinator_address=f"{environ['JAX_COORDINATOR_IP']}:{port}", num_processes=nodes,
                        process_id=rank)
    ours = {}
    if "JAX_COORDINATOR_ADDRESS" in environ:
        ours = dict(coordinator_address=environ["JAX_COORDINATOR_ADDRESS"],
                    num_processes=_int(environ, "JAX_NUM_PROCESSES"), process_id=_int(environ, "JAX_PROCESS_ID"))
    if ours and upstream and ours != upstream:
        raise ConfigError(f"environment: JAX_COORDINATOR_ADDRESS/JAX_NUM_PROCESSES/JAX_PROCESS_ID give {ours} but "
                          f"MaxText's JAX_COORDINATOR_IP/PORT/NNODES/NODE_RANK give {upstream}; set one of the two")
    return ours or upstream


def process_count(environ=os.environ) -> int:
    """Processes in this job as its launcher announces them; 1 when none does."""
    kwargs = launch_kwargs(environ)
    if kwargs:
        return kwargs["num_processes"]
    for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        value = environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 1


def maybe_initialize_distributed(cfg) -> None:
    """jax.distributed.initialize() when the job has several processes (or hardware=gpu_multiprocess), unless
    skip_jax_distributed_system."""
    import jax

    if cfg.skip_jax_distributed_system or (cfg.hardware != "gpu_multiprocess" and process_count() <= 1):
        return
    if cfg.hardware == "cpu" or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**launch_kwargs())
