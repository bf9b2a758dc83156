"""Building blocks: the quantized linear layer and the high-precision pieces around it.

Where each operation runs (the NVIDIA NVFP4 recipe; docs/design.md#what-stays-in-high-precision):

==========================  ===================================================
operation                   precision
==========================  ===================================================
q/k/v/o, gate/up/down       `QLinear`: the layer's recipe for all three GEMMs
                            (fprop, dgrad, wgrad), via ``microscale.ops``
token embedding             float32 table, gathered then used in float32
RMSNorm                     float32 statistics, output in ``compute_dtype``
RoPE                        float32 rotation, output in ``compute_dtype``
attention QK^T and PV       ``compute_dtype`` operands, float32 accumulation,
                            float32 softmax
LM head (tied or not)       ``compute_dtype`` operands, float32 logits and
                            float32-accumulated weight gradient
master weights              ``param_dtype`` (float32)
==========================  ===================================================

`QLinear` owns a float32 kernel of shape ``[in, out]`` and a recipe (a name or an
``ops.Recipe``; static, so changing it retraces). Its matmul is
``make_dot_general(recipe, key=fold_in(key, layer_id))`` where ``key`` is the per-step key
the caller passes and ``layer_id`` is a stable id of the layer's path, so every layer
and every step draws different stochastic-rounding bits. The layer never quantizes by
itself; the recipe decides which operand of which GEMM gets which format.

Parameters carry logical axis names (`nnx.with_partitioning`), e.g. a q_proj kernel is
``('embed', 'heads')``; see `microscale.model.sharding` for the names and their default
mapping onto the (data, fsdp, tensor) mesh. When a mesh context is active at
construction, flax shards each parameter eagerly by those names (use
``nnx.logical_axis_rules``); with no mesh the annotation is only metadata.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import meta

from microscale.model.rope import rope_tables
from microscale.ops import (
    RecipeLike,
    TensorSplit,
    get_recipe,
    make_dot_general,
    quantized_dot_general,
    recipe_name,
)

__all__ = [
    "Embed",
    "LMHead",
    "QLinear",
    "RMSNorm",
    "add_bias",
    "apply_rope",
    "partitioned",
    "rms_norm",
    "rope_tables",
]

Initializer = Callable[..., jax.Array]


def partitioned(init: Initializer, axes: Sequence[str | None]) -> Initializer:
    """``init`` annotated with logical axis names. Sharded eagerly only when flax's eager
    sharding is on *and* a mesh is active (so plain CPU construction needs no mesh)."""
    eager = nnx.using_eager_sharding() and meta.get_global_mesh() is not None
    return nnx.with_partitioning(init, tuple(axes), eager_sharding=eager)


class QLinear(nnx.Module):
    """``y = x @ kernel`` through microscale's quantized ``dot_general``.

    kernel: ``[in_features, out_features]`` in ``param_dtype``; operands are cast to
    ``compute_dtype`` and the result is returned in ``compute_dtype`` (the GEMM itself
    accumulates in float32). The kernel's cast happens inside the quantized dot's custom
    VJP (``operand_dtype``), so its gradient is the float32-accumulated wgrad, not one
    rounded to ``compute_dtype`` (Transformer Engine's FP32 main grads). ``bias=True``
    (Qwen2's q/k/v): a float32 ``bias [out_features]`` (zeros at init, never quantized)
    that the block adds (`microscale.model.block`, `add_bias`); the call is the GEMM
    alone, which is what PTQ's taps see (``Y_q - Y = X (W_q - W)`` either way).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rngs: nnx.Rngs,
        recipe: RecipeLike = "bf16",
        layer_id: int = 0,
        axes: Sequence[str | None] = (None, None),
        init_std: float = 0.02,
        param_dtype: jnp.dtype | str = jnp.float32,
        compute_dtype: jnp.dtype | str = jnp.bfloat16,
        bias: bool = False,
    ):
        get_recipe(recipe)  # fail early on an unknown name
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.layer_id = int(layer_id)
        self.compute_dtype = jnp.dtype(compute_dtype)
        init = partitioned(nnx.initializers.normal(init_std), axes)
        self.kernel = nnx.Param(
            init(rngs.params(), (in_features, out_features), jnp.dtype(param_dtype))
        )
        if bias:
            zeros = partitioned(nnx.initializers.zeros, (tuple(axes)[1],))
            self.bias = nnx.Param(zeros(rngs.params(), (out_features,), jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        return self.matmul(x, self.kernel[...], key=key)

    def matmul(
        self,
        x: jax.Array,
        kernel: jax.Array,
        *,
        key: jax.Array | None = None,
        split: TensorSplit | None = None,
        out_dtype: jnp.dtype | None = None,
    ) -> jax.Array:
        """``x @ kernel`` as this layer computes it, with ``kernel`` in place of its own:
        under ``shard_map``, this device's slice of it, split as ``split`` says
        (`microscale.model.tensor_parallel`). ``out_dtype``: default ``compute_dtype``.
        Under a split, ``x`` keeps its dtype (cast inside the GEMM's VJP), so that its
        gradient, a partial sum over the devices, reaches their reduction unrounded."""
        layer_key = None if key is None else jax.random.fold_in(key, self.layer_id)
        cdt = self.compute_dtype
        dot_general = make_dot_general(self.recipe, key=layer_key, operand_dtype=cdt, split=split)
        x = x.astype(cdt) if split is None else x
        return dot_general(
            x,
            kernel,
            (((x.ndim - 1,), (0,)), ((), ())),
            preferred_element_type=cdt if out_dtype is None else out_dtype,
        )

    def __repr__(self) -> str:  # short: graphs print these a lot
        return (
            f"QLinear({self.in_features}->{self.out_features}, recipe={recipe_name(self.recipe)!r})"
        )


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * (offset + scale)`` with float32 statistics; ``scale``
    starts at ``1 - offset`` (the identity): ``offset=1`` is Gemma's ``1 + w``."""

    def __init__(
        self,
        dim: int,
        *,
        eps: float = 1e-5,
        offset: float = 0.0,
        param_dtype: jnp.dtype | str = jnp.float32,
        compute_dtype: jnp.dtype | str = jnp.bfloat16,
    ):
        self.eps = float(eps)
        self.offset = float(offset)
        self.compute_dtype = jnp.dtype(compute_dtype)
        init = partitioned(nnx.initializers.constant(1.0 - self.offset), ("norm",))
        self.scale = nnx.Param(init(jax.random.key(0), (dim,), jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.compute_dtype, self.offset)


def add_bias(y: jax.Array, bias: jax.Array) -> jax.Array:
    """``y + bias`` in float32, rounded back to ``y``'s dtype once."""
    return (y.astype(jnp.float32) + bias.astype(jnp.float32)).astype(y.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype, offset: float = 0.0) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps) * (offset + scale)`` over the last axis, in float32;
    ``dtype`` out. The one RMSNorm of every block, model and inference alike (``offset``:
    the family's `norm_offset`, 1 for Gemma's ``1 + w``)."""
    x32 = x.astype(jnp.float32)
    ms = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    w = scale.astype(jnp.float32)
    w = w + offset if offset else w
    return (x32 * jax.lax.rsqrt(ms + eps) * w).astype(dtype)


class Embed(nnx.Module):
    """Token embedding table ``[vocab, d_model]`` (high precision, never quantized)."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        rngs: nnx.Rngs,
        init_std: float = 0.02,
        param_dtype: jnp.dtype | str = jnp.float32,
        compute_dtype: jnp.dtype | str = jnp.bfloat16,
    ):
        self.compute_dtype = jnp.dtype(compute_dtype)
        init = partitioned(nnx.initializers.normal(init_std), ("vocab", "embed"))
        self.embedding = nnx.Param(init(rngs.params(), (vocab_size, dim), jnp.dtype(param_dtype)))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int tokens ``[...]`` -> float32 ``[..., d_model]`` (the residual stream)."""
        return jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.float32)

    def attend(self, x: jax.Array, table: jax.Array | None = None) -> jax.Array:
        """Tied LM head: ``x @ embedding^T`` -> float32 logits ``[..., vocab]``; the table's
        gradient is float32-accumulated (see :func:`_head_matmul`). ``table``: the
        embedding as already read (e.g. gathered once for many calls)."""
        table = self.embedding[...] if table is None else table
        return _head_matmul(x, table, self.compute_dtype, contract=1)


class LMHead(nnx.Module):
    """Untied output projection ``[d_model, vocab]``; high precision, float32 logits."""

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        *,
        rngs: nnx.Rngs,
        init_std: float = 0.02,
        param_dtype: jnp.dtype | str = jnp.float32,
        compute_dtype: jnp.dtype | str = jnp.bfloat16,
    ):
        self.compute_dtype = jnp.dtype(compute_dtype)
        init = partitioned(nnx.initializers.normal(init_std), ("embed", "vocab"))
        self.kernel = nnx.Param(init(rngs.params(), (dim, vocab_size), jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array, kernel: jax.Array | None = None) -> jax.Array:
        """``kernel``: the weight as already read (e.g. gathered once for many calls)."""
        kernel = self.kernel[...] if kernel is None else kernel
        return _head_matmul(x, kernel, self.compute_dtype, contract=0)


def _head_matmul(x: jax.Array, w: jax.Array, cdt: jnp.dtype, *, contract: int) -> jax.Array:
    """float32 logits of ``x [..., d]`` against the float32 head ``w`` (contracted on its
    axis ``contract``), operands in ``cdt``. The cast to ``cdt`` happens inside the bf16
    recipe's custom VJP (``operand_dtype``), as in `QLinear`, so the head's gradient is the
    float32-accumulated GEMM, not one rounded to ``cdt`` by an outside cast."""
    return quantized_dot_general(
        x,
        w,
        (((x.ndim - 1,), (contract,)), ((), ())),
        "bf16",
        preferred_element_type=jnp.float32,
        operand_dtype=cdt,
    )


# ---------------------------------------------------------------------- RoPE


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [B, T, H, head_dim]`` by position ("rotate half", HF Llama layout: the
    pair (i, i + head_dim/2) is rotated by angle pos * freq_i). float32 math, x's dtype out.

    ``cos``/``sin``: ``[T, head_dim/2]`` or ``[B, T, head_dim/2]``. The dot product of a
    rotated query at position m and a rotated key at position n depends only on m - n.
    """
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    c = cos[..., None, :]  # broadcast over heads
    s = sin[..., None, :]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
