"""Logical axis names of the model's parameters and their default mesh mapping.

Every parameter is annotated with one logical name per dimension (MaxText style), and a
table of rules maps logical names to axes of a ``jax.sharding.Mesh`` with axes
``("data", "fsdp", "tensor")``. Sharding then uses JAX's own machinery: the train loop
turns the annotations into ``PartitionSpec``\\ s (`partition_specs`) and places the
state with ``jax.device_put`` / ``jit(out_shardings=...)``; XLA's SPMD partitioner
inserts the collectives.

Default mapping (`logical_to_mesh_rules`):

* ``embed`` (d_model) -> ``fsdp``: parameters and optimizer state are split across the
  fully-sharded data-parallel axis and gathered per layer for compute (ZeRO-3).
* ``heads``, ``kv_heads``, ``mlp``, ``vocab`` -> ``tensor``: Megatron-style tensor
  parallelism (column-parallel q/k/v/gate/up, row-parallel o/down).
* ``batch`` -> ``("data", "fsdp")``: the batch is split over both data axes.
* ``norm``, ``length``, ``head_dim`` -> replicated.
* Activations, MaxText-style, by their own names in the same table: ``act_batch`` ->
  ``("data", "fsdp")``, ``act_residual_length`` (the residual stream's sequence axis) ->
  ``tensor`` (Megatron's sequence parallelism: norms, residual adds and remat's saved
  block inputs are split along the sequence over the tensor ranks, and each activation
  all-reduce becomes a reduce-scatter plus an all-gather), ``act_length`` (inside
  attention and the MLP) and ``act_embed`` -> replicated, ``act_heads``, ``act_kv_heads``,
  ``act_mlp``, ``act_vocab`` -> ``tensor``. `constrain` pins an activation under
  `activation_sharding` (the train and eval steps enter it with their mesh), at block
  boundaries and inside attention and the MLP. Without them the partitioner kept
  fsdp-sharded weights in place, contracted over the sharded ``d_model`` and all-reduced
  whole activations (42 TB per device per step at llama-8b on fsdp 8); with them each
  weight is gathered before its GEMM and its gradient reduced, as ZeRO-3 does
  (``microscale.plan.comm`` has the analytic volumes; ``docs/plan/collectives.md``).

Meshes with ``AxisType.Auto`` axes (GSPMD propagation) are supported: inputs sharded on
``batch`` and parameters on their specs are enough, and the result equals the unsharded
one. ``AxisType.Explicit`` meshes are not (the embedding gather would need explicit
``out_sharding`` hints). Construction under ``jax.set_mesh(mesh)`` and
``nnx.logical_axis_rules(logical_to_mesh_rules())`` shards each parameter as it is
created; without a mesh, construct then ``jax.device_put`` the state with
`partition_specs`.

One function, `logical_to_mesh_spec`, turns logical names into a ``PartitionSpec``; the
trainer, ``microscale plan`` and `partition_specs` all call it. A mesh axis of size 1
costs nothing, so one mapping serves one CPU, 8 fake devices and a cluster. A dimension
whose length the mesh axes do not divide (e.g. 8 kv heads of 128 on ``tensor=3``), or
whose logical name has no rule, is replicated rather than refused, so every preset runs on
every mesh; each such dimension is logged and returned as a `Replicated` record, and
``microscale plan`` lists them (a replicated weight costs memory on every device).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from microscale.model.rules import path_str

__all__ = [
    "LOGICAL_AXES",
    "MESH_AXES",
    "Replicated",
    "activation_mesh",
    "activation_sharding",
    "batch_axes",
    "constrain",
    "logical_to_mesh_rules",
    "logical_to_mesh_spec",
    "param_logical_axes",
    "partition_specs",
    "var_logical_axes",
]

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXES: dict[str, str] = {
    "batch": "examples of a batch (activations; inputs are [batch, length])",
    "length": "sequence positions (activations)",
    "vocab": "vocabulary: embed.embedding [vocab, embed], lm_head.kernel [embed, vocab]",
    "embed": "the residual stream width d_model: every kernel's d_model side",
    "heads": "n_heads * head_dim: q_proj [embed, heads], o_proj [heads, embed]",
    "kv_heads": "n_kv_heads * head_dim: k_proj/v_proj [embed, kv_heads]",
    "mlp": "the MLP hidden width d_ff: gate/up_proj [embed, mlp], down_proj [mlp, embed]",
    "norm": "RMSNorm scales [norm] (replicated)",
}

LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def logical_to_mesh_rules() -> LogicalRules:
    """Default (logical name -> mesh axis / axes / None) rules for a (data, fsdp, tensor)
    mesh; usable with ``nnx.logical_axis_rules`` and `partition_specs`. Parameters use the
    plain names, activations the ``act_*`` names (see the module doc)."""
    return (
        ("batch", ("data", "fsdp")),
        ("length", None),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("norm", None),
        ("act_batch", ("data", "fsdp")),
        ("act_length", None),
        ("act_residual_length", "tensor"),
        ("act_embed", None),
        ("act_heads", "tensor"),
        ("act_kv_heads", "tensor"),
        ("act_mlp", "tensor"),
        ("act_vocab", "tensor"),
    )


_ACTIVATION_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar(
    "microscale_activation_mesh", default=None
)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None) -> Iterator[None]:
    """``with activation_sharding(mesh):`` trace a model whose activations
    :func:`constrain` pins to ``mesh`` (entered inside the jitted step, around the model
    call; ``None`` or a one-device mesh: no constraints)."""
    token = _ACTIVATION_MESH.set(mesh if mesh is not None and mesh.size > 1 else None)
    try:
        yield
    finally:
        _ACTIVATION_MESH.reset(token)


def activation_mesh() -> Mesh | None:
    """The mesh of the surrounding :func:`activation_sharding` (None outside one)."""
    return _ACTIVATION_MESH.get()


def batch_axes() -> tuple[Mesh | None, tuple[str, ...]]:
    """``(mesh, axes)``: the mesh of the surrounding `activation_sharding` and the mesh
    axes (of size > 1) that ``act_batch`` shards over; ``(None, ())`` outside one."""
    mesh = _ACTIVATION_MESH.get()
    if mesh is None:
        return None, ()
    axes = _rule_axes(dict(logical_to_mesh_rules())["act_batch"])
    return mesh, tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``x`` with its sharding pinned by logical axis names (``act_*``) under
    :func:`activation_sharding`; unchanged outside one (one device, inference, export).
    A dimension the mesh does not divide stays replicated, as for parameters."""
    mesh = _ACTIVATION_MESH.get()
    if mesh is None:
        return x
    spec = logical_to_mesh_spec(axes, x.shape, mesh, where="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class Replicated:
    """A dimension that its logical name asked to shard, left replicated instead."""

    where: str  # the array's label (a parameter path) as passed to logical_to_mesh_spec
    dim: int  # index of the dimension
    name: str  # its logical axis name
    size: int | None  # its length (None when the shape was not given)
    axes: tuple[str, ...]  # the mesh axes its rule asked for
    reason: str  # why it is replicated, in words

    def __str__(self) -> str:
        size = "" if self.size is None else f" ({self.size})"
        return f"{self.where or '<array>'} dim {self.dim} {self.name!r}{size}: {self.reason}"


def _rule_axes(rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def _dim_mesh_axes(
    name: str, table: Mapping, used: set[str], sizes: Mapping[str, int] | None, length: int | None
) -> tuple[list[str], tuple[str, ...], str | None]:
    """The mesh axes that shard one dimension named ``name``, the axes its rule asked for,
    and why the dimension is left replicated (None when it is not, or nothing was asked)."""
    if name not in table:
        return [], (), f"no mesh rule for logical axis {name!r} (rules for {sorted(table)})"
    asked = _rule_axes(table[name])
    again = [a for a in asked if a in used]
    keep = [a for a in asked if a not in used]
    missing = [] if sizes is None else [a for a in keep if a not in sizes]
    if sizes is not None:
        keep = [a for a in keep if a in sizes and sizes[a] > 1]
    if not keep and (again or missing):
        why = (
            f"mesh axis {again} already shards an earlier dimension"
            if again
            else f"the mesh has no axis {missing}"
        )
        return [], asked, why
    if keep and sizes is not None and length is not None:
        n = math.prod(sizes[a] for a in keep)
        if length % n:
            return (
                [],
                asked,
                f"length {length} is not divisible by mesh axes {tuple(keep)} (size {n})",
            )
    return keep, asked, None


def logical_to_mesh_spec(
    axes: Sequence[str | None] | None,
    shape: Sequence[int] | None = None,
    mesh: Mesh | Mapping[str, int] | None = None,
    rules: LogicalRules | Mapping | None = None,
    *,
    where: str = "",
    replicated: list[Replicated] | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of one array from its logical axis names (the one mapping
    used by the trainer, ``microscale plan`` and `partition_specs`).

    ``rules`` (default `logical_to_mesh_rules`) maps a logical name to a mesh axis, a
    tuple of mesh axes, or None (replicated on purpose). A dimension is left replicated,
    and recorded in ``replicated`` (and logged), when it was asked to shard but

    * its name has no rule (an unknown name),
    * none of its mesh axes is left: each mesh axis is used at most once per array, and
      with ``mesh`` given, axes the mesh does not have are dropped,
    * with ``mesh`` and ``shape`` given: the product of its mesh axes' sizes does not
      divide its length.

    Mesh axes of size 1 shard nothing and are dropped without a record. ``mesh`` is a
    ``Mesh`` / ``AbstractMesh`` or a plain ``{axis: size}``; without it every rule's
    axes are kept (no divisibility check).
    """
    table = dict(logical_to_mesh_rules() if rules is None else rules)
    if not axes:
        return PartitionSpec()
    if shape is not None and len(axes) != len(shape):
        raise ValueError(
            f"{where or 'array'}: logical axes {tuple(axes)} do not match shape {tuple(shape)}"
        )
    sizes = None if mesh is None else dict(mesh.shape if hasattr(mesh, "shape") else mesh)
    used: set[str] = set()
    out: list[Any] = []

    def skip(i: int, name: str, asked: tuple[str, ...], reason: str) -> None:
        rec = Replicated(
            where=where,
            dim=i,
            name=name,
            size=None if shape is None else int(shape[i]),
            axes=asked,
            reason=reason,
        )
        log.info("replicated: %s", rec)
        if replicated is not None:
            replicated.append(rec)

    for i, name in enumerate(axes):
        if name is None:
            out.append(None)
            continue
        length = None if shape is None else int(shape[i])
        keep, asked, reason = _dim_mesh_axes(name, table, used, sizes, length)
        if reason is not None:
            skip(i, name, asked, reason)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else tuple(keep))
    return PartitionSpec(*out)


def var_logical_axes(var: nnx.Variable) -> tuple[str | None, ...] | None:
    """The logical axis names a variable was annotated with (None: unannotated)."""
    meta = var.get_metadata()
    axes = meta.get("out_sharding", meta.get("sharding"))
    return None if axes is None else tuple(axes)


def param_logical_axes(model: Any) -> dict[str, tuple[str | None, ...] | None]:
    """{dotted param path: logical axes} for every ``nnx.Param`` of ``model``."""
    out = {}
    for parts, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            out[path_str(parts)] = var_logical_axes(node)
    return out


def partition_specs(
    tree: Any,
    rules: LogicalRules | None = None,
    *,
    mesh: Mesh | Mapping[str, int] | None = None,
    replicated: list[Replicated] | None = None,
) -> Any:
    """Mesh ``PartitionSpec``\\ s for a model or an ``nnx.State`` (same tree structure as
    ``nnx.state(model)``; unannotated leaves are replicated), by `logical_to_mesh_spec`.
    With ``mesh`` (a ``Mesh`` or ``{axis: size}``) each variable's shape is checked
    against it, as the trainer does; dimensions left replicated are appended to
    ``replicated``. Feed the result to ``jax.sharding.NamedSharding(mesh, spec)`` per
    leaf."""
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)

    def spec(path, x):
        if isinstance(x, nnx.Variable):
            shape = None if mesh is None else x.get_value().shape
            return x.replace(
                logical_to_mesh_spec(
                    var_logical_axes(x),
                    shape,
                    mesh,
                    rules,
                    where=path_str(path),
                    replicated=replicated,
                )
            )
        return PartitionSpec()

    return nnx.from_flat_state([(p, spec(p, v)) for p, v in nnx.to_flat_state(state)])
