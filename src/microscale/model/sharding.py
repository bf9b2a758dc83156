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

Meshes with ``AxisType.Auto`` axes (GSPMD propagation) are supported: inputs sharded on
``batch`` and parameters on their specs are enough, and the result equals the unsharded
one. ``AxisType.Explicit`` meshes are not (the embedding gather would need explicit
``out_sharding`` hints). Construction under ``jax.set_mesh(mesh)`` and
``nnx.logical_axis_rules(logical_to_mesh_rules())`` shards each parameter as it is
created; without a mesh, construct then ``jax.device_put`` the state with
`partition_specs`.

A mesh axis of size 1 costs nothing, so one mapping serves one CPU, 8 fake devices and a
cluster. A dimension that a mesh axis does not divide must not be sharded on it; pick the
mesh accordingly (e.g. ``tensor`` must divide ``n_kv_heads * head_dim``).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from microscale.model.rules import path_str

__all__ = ["LOGICAL_AXES", "MESH_AXES", "logical_to_mesh_rules", "logical_to_mesh_spec",
           "param_logical_axes", "partition_specs", "var_logical_axes"]

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
    mesh; usable with ``nnx.logical_axis_rules`` and `partition_specs`."""
    return (
        ("batch", ("data", "fsdp")),
        ("length", None),
        ("vocab", "tensor"),
        ("embed", "fsdp"),
        ("heads", "tensor"),
        ("kv_heads", "tensor"),
        ("mlp", "tensor"),
        ("norm", None),
    )


def logical_to_mesh_spec(axes: tuple[str | None, ...] | None,
                         rules: LogicalRules | None = None) -> PartitionSpec:
    """Translate one tuple of logical names to a mesh ``PartitionSpec``. Unknown names
    raise with the known ones; a mesh axis is used at most once per spec (later repeats
    are replicated)."""
    table = dict(logical_to_mesh_rules() if rules is None else rules)
    if axes is None:
        return PartitionSpec()
    used: set[str] = set()
    out: list[Any] = []
    for name in axes:
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no mesh rule; expected one of "
                           f"{sorted(table)}")
        mesh = table[name]
        mesh_t = () if mesh is None else (mesh,) if isinstance(mesh, str) else tuple(mesh)
        mesh_t = tuple(a for a in mesh_t if a not in used)
        used.update(mesh_t)
        out.append(None if not mesh_t else mesh_t[0] if len(mesh_t) == 1 else mesh_t)
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


def partition_specs(tree: Any, rules: LogicalRules | None = None) -> Any:
    """Mesh ``PartitionSpec``\\ s for a model or an ``nnx.State`` (same tree structure as
    ``nnx.state(model)``; unannotated leaves are replicated). Feed the result to
    ``jax.sharding.NamedSharding(mesh, spec)`` per leaf."""
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)

    def spec(x):
        if isinstance(x, nnx.Variable):
            return x.replace(logical_to_mesh_spec(var_logical_axes(x), rules))
        return PartitionSpec()

    return jax.tree.map(spec, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
