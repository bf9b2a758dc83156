"""Megatron tensor parallelism with sequence parallelism for the block's projections, run
under ``shard_map`` so that the collectives are exactly Megatron's.

Left to XLA's SPMD partitioner, a quantized projection moved far more than Megatron does:
``ops.quantized_dot_general`` flattens ``[batch, seq, K]`` to ``[M, K]``, which loses the
sequence sharding of the residual stream, and the partitioner then quantized a split
operand and all-gathered the quantized result, once per projection (NVFP4 at tensor=8:
1.80x the analytic collective bytes; ``tests/plan/test_plan_collectives.py``). Here each
group of projections runs on every device's slices, with the collectives written out.
With ``P`` devices on the tensor axis, tokens ``T`` split along the sequence (``T/P``
each) and weights split as the parameter rules say:

* column-parallel group (q/k/v from one norm output, gate/up from another): the input
  ``n [B, T/P, D]`` is all-gathered along the sequence once for the group, ``g [B, T,
  D]``, and each projection computes its output columns ``y_i = g W_i[:, slice]``
  locally. Backward: the transpose of the gather reduce-scatters ``dn = sum_i dy_i
  W_i[:, slice]^T`` once for the group; ``dW_i = g^T dy_i`` is local.
* row-parallel (o from the attention heads, down from the MLP hidden, both split along
  their input features ``K``): each device computes the partial sum ``h[:, :, slice]
  W[slice, :]`` in float32 and a reduce-scatter along the sequence sums it and splits the
  tokens again. Backward: the transpose gathers ``dy`` along the sequence; ``dh`` and
  ``dW`` are local.

Per block that is 2 all-gathers and 2 reduce-scatters in the forward and the same in the
backward (``plan.comm``'s Megatron rows). Quantization runs on each device's slices and
equals the unsplit layer's (``ops.dot`` module doc, tensor parallelism): no quantized
operand is gathered.

Every mesh axis is manual: the batch stays split over the data axes as the residual
stream is, and a kernel's ``d_model`` side split over ``fsdp`` is gathered inside the op
(ZeRO-3; ``TensorSplit.weight_gather``). With the data axes left to the partitioner
(``axis_names={tensor}``), XLA replicated the batch around every collective of the body
(data 2 x fsdp 2 x tensor 2: 3.5x the analytic bytes).

Applies under `activation_sharding` when the rules put the residual stream's sequence
(``act_residual_length``) on a mesh axis of size > 1, its batch on every other mesh axis
of size > 1, and each kernel's output (column) or input (row) features on the sequence's
axis alone; the recipe uses current scaling; and every slice (of the features, and of the
tokens) holds whole quantization blocks and Hadamard chunks. Either backend: a native
block-scaled GEMM runs on the local slices too, each quantized as the whole operand is.
Otherwise (one device, inference, fsdp or data meshes, delayed scaling, shapes that do not
divide) each layer runs on its own under the partitioner, as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from microscale.model.layers import QLinear
from microscale.model.sharding import activation_mesh, logical_to_mesh_spec, var_logical_axes
from microscale.ops import TensorSplit, get_recipe

__all__ = ["column_parallel", "row_parallel"]


def _unit(layer: QLinear) -> int:
    """The least slice length that holds whole blocks and Hadamard chunks of every
    operand of ``layer``."""
    unit = 1
    for spec in get_recipe(layer.recipe).operands().values():
        unit = math.lcm(unit, spec.spec.block_size or 1, *(spec.block_shape or ()))
        unit = math.lcm(unit, spec.hadamard or 1)
    return unit


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _plan(layers: Sequence[QLinear], x_axes, x_shape, kind: Literal["column", "row"]):
    """``(splits, spec of the residual-stream side, kernel specs)`` of ``layers`` (all
    ``kind``; ``x_shape``: the global residual-stream shape) under the active mesh, or
    None when the partitioner runs them (module doc)."""
    mesh = activation_mesh()
    if mesh is None:
        return None
    x_spec = logical_to_mesh_spec(x_axes, x_shape, mesh)
    seq, batch = x_spec[1], _axes(x_spec[0])
    if not isinstance(seq, str) or x_spec[2] is not None:
        return None
    big = {a for a, n in mesh.shape.items() if n > 1}
    if big - {seq} - set(batch):  # a mesh axis that would hold copies of the activations
        return None
    token_parts = math.prod(mesh.shape[a] for a in batch)
    tokens = x_shape[0] // token_parts * x_shape[1]  # M on each device, inside the op
    dim = 1 if kind == "column" else 0
    splits, specs = [], []
    for layer in layers:
        recipe = get_recipe(layer.recipe)
        if recipe.delayed:
            return None
        shape = layer.kernel.get_value().shape
        spec = tuple(logical_to_mesh_spec(var_logical_axes(layer.kernel), shape, mesh))
        spec += (None,) * (2 - len(spec))
        if spec[dim] != seq or seq in _axes(spec[1 - dim]):
            return None
        if (shape[dim] // mesh.shape[seq]) % _unit(layer) or tokens % _unit(layer):
            return None
        other = _axes(spec[1 - dim])
        gather = ((1 - dim, other, math.prod(mesh.shape[a] for a in other)),) if other else ()
        splits.append(TensorSplit(seq, mesh.shape[seq], kind, batch, token_parts, gather))
        specs.append(PartitionSpec(*spec))
    return splits, x_spec, specs


def _args(key):
    return () if key is None else (key,)


def column_parallel(
    layers: Sequence[QLinear], x: jax.Array, x_axes, *, key: jax.Array | None = None
) -> list[jax.Array]:
    """``[layer(x, key=key) for layer in layers]`` for column-parallel ``layers`` sharing
    the input ``x`` (logical axes ``x_axes``: batch, sequence, features): one sequence
    gather for the group, local GEMMs (module doc)."""
    plan = _plan(layers, x_axes, x.shape, "column")
    if plan is None:
        return [layer(x, key=key) for layer in layers]
    splits, x_spec, specs = plan
    ax = splits[0].axis
    x = x.astype(layers[0].compute_dtype)

    def local(x, kernels, *key):
        # Gathered in float32 so that its transpose reduces the input gradient in float32,
        # as the partitioner does (XLA:CPU also cannot promote a bfloat16 reduce-scatter).
        g = jax.lax.all_gather(x.astype(jnp.float32), ax, axis=1, tiled=True)
        k = key[0] if key else None
        return [
            layer.matmul(g, w, key=k, split=split)
            for layer, w, split in zip(layers, kernels, splits, strict=True)
        ]

    return jax.shard_map(
        local,
        mesh=activation_mesh(),
        in_specs=(x_spec, specs) + (PartitionSpec(),) * len(_args(key)),
        out_specs=[PartitionSpec(x_spec[0], None, ax)] * len(layers),
        check_vma=False,
    )(x, [layer.kernel[...] for layer in layers], *_args(key))


def row_parallel(
    layer: QLinear, x: jax.Array, x_axes, *, key: jax.Array | None = None
) -> jax.Array:
    """``layer(x, key=key)`` for a row-parallel ``layer`` whose output has the logical axes
    ``x_axes`` (batch, sequence, features): local partial sums reduce-scattered along the
    sequence in float32 (module doc)."""
    plan = _plan([layer], x_axes, x.shape[:-1] + (layer.out_features,), "row")
    if plan is None:
        return layer(x, key=key)
    (split,), y_spec, (spec,) = plan
    ax = split.axis

    def local(x, w, *key):
        k = key[0] if key else None
        y = layer.matmul(x, w, key=k, split=split, out_dtype=jnp.float32)
        return jax.lax.psum_scatter(y, ax, scatter_dimension=1, tiled=True)

    y = jax.shard_map(
        local,
        mesh=activation_mesh(),
        in_specs=(PartitionSpec(y_spec[0], None, ax), spec) + (PartitionSpec(),) * len(_args(key)),
        out_specs=y_spec,
        check_vma=False,
    )(x, layer.kernel[...], *_args(key))
    return y.astype(layer.compute_dtype)
