"""Device mesh, logical-axis sharding and multi-host start-up.

One code path for every scale: a ``jax.sharding.Mesh`` with three named axes

* ``data``   -- pure data parallelism: parameters replicated, the batch split;
* ``fsdp``   -- fully-sharded data parallelism: the batch split *and* every parameter
  (and its optimizer state) sharded along its ``embed`` dimension; XLA all-gathers a
  weight right before its matmul and reduce-scatters its gradient;
* ``tensor`` -- tensor (model) parallelism: attention heads and the MLP hidden
  dimension split (Megatron-style column / row parallel projections).

The model annotates each parameter with *logical* axis names (``("embed", "mlp")``...);
the model's ``logical_to_mesh_rules()`` maps them to mesh axes, and
``microscale.model.logical_to_mesh_spec`` turns that into a ``PartitionSpec`` per
parameter. A dimension whose size is not divisible by its mesh axes is replicated instead
(so every preset runs on every mesh; the choice is logged and listed by
``microscale plan``). Batches are ``[batch, seq]`` sharded over
``("data", "fsdp")``. Everything else -- the collectives, their overlap, the per-device
programs -- is JAX's SPMD partitioner (``jax.jit`` with in/out shardings); microscale has
no distribution code of its own.

Sizes: ``mesh.data=-1`` takes all devices not used by ``fsdp`` and ``tensor``; explicit
sizes that multiply to fewer devices than there are use the first ones (a warning is
logged), e.g. ``mesh.data=1`` runs on one device of eight. The global batch must be
divisible by ``data * fsdp`` (times ``data.grad_accum``).

Multi-host (GPU clusters, TPU pods): start the *same* command on every host; JAX's
runtime connects them. With SLURM / Open MPI / TPU / Kubernetes environments,
``jax.distributed.initialize()`` discovers everything by itself::

    srun --nodes=4 --ntasks-per-node=1 microscale train --config llama_1b \\
        mesh.fsdp=32 out=/shared/runs/llama1b

otherwise name the coordinator explicitly (same line on each host, its own id)::

    microscale train --config llama_1b mesh.fsdp=16 \\
        mesh.coordinator_address=10.0.0.1:1234 mesh.num_processes=2 mesh.process_id=0

``mesh.distributed="auto"`` initializes when such an environment (or a coordinator) is
present, ``"on"`` always, ``"off"`` never. ``out`` must be on a filesystem all hosts
share (checkpoints are written by all of them, metrics by process 0 only); before the
first step every process writes a probe there and all of them stop, each with one line,
when any cannot (:func:`check_every_process_writes`).

Faults end the job, never hang it: a process waits ``mesh.init_timeout_s`` for the others
to join and counts a peer dead after ``mesh.heartbeat_timeout_s`` without its heartbeat.
JAX's runtime then ends the process with a native fatal error; ``microscale train``
supervises its training process and turns that into one line naming the cause and the
last complete checkpoint (``microscale.cli.supervise``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from microscale.files import check_output_dir
from microscale.model import MESH_AXES, logical_to_mesh_rules

__all__ = [
    "AXES",
    "BATCH_AXES",
    "build_mesh",
    "check_every_process_writes",
    "maybe_initialize_distributed",
    "resolve_mesh_shape",
    "shard_batch",
]

log = logging.getLogger(__name__)

AXES = MESH_AXES
BATCH_AXES = dict(logical_to_mesh_rules())["batch"]

# Environment variables that mean "several processes were launched together".
_MULTI_HOST_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")
_WORLD_SIZE_ENV = (
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "WORLD_SIZE",
    "JAX_NUM_PROCESSES",
)

_initialized = False


def multi_host_env() -> bool:
    """Whether the environment says several processes were launched together (SLURM,
    Open MPI, PMI, torchrun-style ``WORLD_SIZE``, a JAX coordinator variable)."""
    if any(os.environ.get(k) for k in _MULTI_HOST_ENV):
        return True
    for k in _WORLD_SIZE_ENV:
        try:
            if int(os.environ.get(k, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def maybe_initialize_distributed(mesh_cfg) -> bool:
    """Call ``jax.distributed.initialize`` when configured or a multi-host launch is
    detected (see module doc). Returns True when the runtime is (now) multi-process."""
    global _initialized
    mode = mesh_cfg.distributed
    explicit = mesh_cfg.coordinator_address is not None
    if mode == "off" or _initialized:
        return _initialized
    if mode == "auto" and not (explicit or multi_host_env()):
        return False
    kwargs: dict = dict(
        initialization_timeout=mesh_cfg.init_timeout_s,
        heartbeat_timeout_seconds=mesh_cfg.heartbeat_timeout_s,
    )
    if explicit:
        kwargs.update(
            coordinator_address=mesh_cfg.coordinator_address,
            num_processes=mesh_cfg.num_processes,
            process_id=mesh_cfg.process_id,
        )
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as e:
        if "already" not in str(e).lower():
            raise RuntimeError(
                f"jax.distributed.initialize() failed ({e}). Launch the same command on every "
                "host (srun/mpirun do this), or pass mesh.coordinator_address=HOST:PORT "
                "mesh.num_processes=N mesh.process_id=I; mesh.distributed=off runs single-host."
            ) from e
    _initialized = True
    log.info(
        "jax.distributed: process %d of %d, %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.device_count(),
    )
    return True


def check_every_process_writes(out: os.PathLike | str) -> Path:
    """``out`` as the run folder of a multi-process job, once every process has checked it
    (:func:`~microscale.files.check_output_dir`), created it when missing and written and
    removed a probe file in it. All of them learn who failed (one all-gather of a flag);
    when any did, every process raises ``OSError``, the failing ones with their own cause,
    the others naming them. Without it a process that cannot write leaves the job and the
    others wait for it until the heartbeat runs out."""
    from jax.experimental import multihost_utils

    problem, made = None, not os.path.exists(os.path.expanduser(out))
    try:
        path = check_output_dir(out, what="out=")
        path.mkdir(exist_ok=True)
        probe = path / f".write-probe-{jax.process_index()}-{os.getpid()}"
        probe.write_bytes(b"microscale")
        probe.unlink()
    except (OSError, ValueError) as e:
        problem = str(e) if isinstance(e, ValueError) or not e.strerror else _os_error(e)
    flags = multihost_utils.process_allgather(np.array(problem is not None, np.int32))
    failed = [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]
    if not failed:
        return path
    if made and problem is None:  # created for the probe: leave no empty run folder behind
        with contextlib.suppress(OSError):
            path.rmdir()
    who, n = ", ".join(map(str, failed)), jax.process_count()
    if problem is not None:
        raise OSError(
            f"process {jax.process_index()} of {n} cannot write the run folder: {problem}. "
            f"Every process must reach out={out} on a file system all of them share "
            f"(failed: process {who})"
        )
    raise OSError(
        f"process {who} of {n} cannot write the run folder out={out} (its log says why), so "
        "every process stops: out= must be on a file system all of them share"
    )


def _os_error(e: OSError) -> str:
    return f"{e.strerror}: {e.filename}" if e.filename else str(e.strerror)


def resolve_mesh_shape(mesh_cfg, n_devices: int) -> tuple[int, int, int]:
    """``(data, fsdp, tensor)`` with one ``-1`` filled in; raises if it does not fit."""
    sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
    free = [i for i, s in enumerate(sizes) if s == -1]  # at most one (MeshConfig checks)
    fixed = math.prod(s for s in sizes if s != -1)
    if free:
        if n_devices % fixed:
            raise ValueError(
                f"mesh {tuple(sizes)}: {n_devices} devices are not divisible by "
                f"the fixed axes' product {fixed}"
            )
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes) > n_devices:
        raise ValueError(
            f"mesh data*fsdp*tensor = {sizes[0]}*{sizes[1]}*{sizes[2]} = "
            f"{math.prod(sizes)} but only {n_devices} devices are available; set "
            f"the sizes to multiply to {n_devices} (or one of them to -1)"
        )
    return tuple(sizes)


def build_mesh(mesh_cfg, devices: Sequence | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over ``devices`` (default: all global devices, or
    those of ``mesh.device_ids``).

    Axis types are ``Auto``: the SPMD partitioner propagates shardings from the annotated
    inputs/outputs, as in MaxText.
    """
    devices = list(jax.devices() if devices is None else devices)
    ids = tuple(getattr(mesh_cfg, "device_ids", ()) or ())
    if ids:
        by_id = {d.id: d for d in devices}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise ValueError(
                f"mesh.device_ids {list(ids)}: no device with id(s) {missing}; "
                f"available ids: {sorted(by_id)}"
            )
        devices = [by_id[i] for i in ids]
    shape = resolve_mesh_shape(mesh_cfg, len(devices))
    n = math.prod(shape)
    if n < len(devices):
        log.warning("mesh %s uses %d of %d devices; the others stay idle", shape, n, len(devices))
        devices = devices[:n]
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def shard_batch(mesh: Mesh, local: np.ndarray, spec: PartitionSpec) -> jax.Array:
    """This process's rows of a global batch -> a global ``jax.Array`` sharded by ``spec``.

    The batch axis is the first axis ``spec`` shards. With one process ``local`` is the
    whole batch; with several, each holds its contiguous block of rows (the data
    package's ``Batcher``/``val_batches`` split them that way), and
    ``jax.make_array_from_process_local_data`` assembles the global array without any
    exchange of data.
    """
    sharding = NamedSharding(mesh, spec)
    if jax.process_count() == 1:
        return jax.device_put(local, sharding)
    axis = next(i for i, s in enumerate(spec) if s is not None)
    global_shape = list(local.shape)
    global_shape[axis] *= jax.process_count()
    return jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))
