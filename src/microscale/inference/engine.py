"""The inference forward pass over packed weights, with a KV cache.

Weights. Each linear layer is a :class:`Linear`: either a dense ``[N, K]`` array in the
compute dtype, or a ``QArray`` of shape ``(N, K)`` (blocks along ``K``) that *stays packed
in memory* — NVFP4 holds ``uint8 [N, K/2]`` codes, ``float8_e4m3fn [N, K/16]`` block
scales and one float32: ``4 + 8/16 = 4.5`` bits per weight instead of BF16's 16. Inside
the jitted forward each layer is decoded just before its GEMM (W4A16)::

    Wv = dequantize(q, bf16, with_global_scale=False)   # e2m1 * e4m3: exact in bf16
    y  = (x @ Wv^T  in float32) * s_dec                   # tensor scale on the output

(on CPU ``Wv`` is decoded to float32 instead -- equally exact -- because XLA:CPU runs a
bf16 GEMM by converting to float32 anyway). Each weight passes an
``optimization_barrier`` together with its layer's input, so XLA can neither hoist the
decode out of the generation loop (which would keep every decoded layer resident for the
whole call) nor decode a layer before the previous one has finished: only one layer's
decoded weights are live at a time. With ``act`` set (W4A4 emulation) the
input is quantized too, ``xv, xs = quantize_dequantize(x, act, amax=static amax or None)``
(NVFP4 1x16 blocks along ``K``; a calibrated static scale when the checkpoint has one,
else the amax of the current tensor), and ``y = (xv @ Wv^T) * xs * s_dec``.

Everything else is the model's own block, `microscale.model.block.block_forward` (this
module keeps no norm, attention or MLP of its own): float32 residual stream and RMSNorm
statistics, RoPE in float32 (HF "rotate half" layout), grouped-query attention with
float32 scores and softmax (the family's sliding window over the cache's slots), SwiGLU,
the family's biases and q/k norms, float32 logits; so a bf16 model gives the same logits
here as there.

KV cache and batching. Prompts of different lengths are *left*-padded to a common length
``P`` (rounded up to a multiple of 16 to limit recompilation); row ``b`` starts at slot
``start[b]``. The cache holds ``k, v [B, S, KV, hd]`` per layer for ``S = P +
max_new_tokens`` slots. A step writes its keys/values at slot ``index`` and its queries
attend to slots ``j`` with ``start[b] <= j <= own slot``; RoPE positions are
``slot - start[b]``, so every row sees positions ``0, 1, ...`` as in training. Prefill
runs the whole padded prompt in one call; decode then runs one token per step inside
one ``lax.while_loop`` (stopping early once every row has emitted a stop token).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from microscale.export.hf import LINEAR_KINDS, hf_module
from microscale.export.layouts import (
    LayerQuant,
    amax_from_decode_scale,
    row_blocks,
    to_hf_orientation,
)
from microscale.formats import FormatSpec, QArray, dequantize, quantize_dequantize
from microscale.model import ModelConfig, block_param_shapes
from microscale.model.block import attention, block_forward, embed_residual, layer_rope_tables
from microscale.model.layers import rms_norm

__all__ = ["Linear", "build_weights", "forward", "init_cache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear:
    """One linear layer of the inference model (a pytree; ``act`` is static)."""

    # Dense [N, K] array (compute dtype) or a packed QArray of shape (N, K), blocks along K.
    weight: Any
    # Static input decode scale (float32 scalar) for W4A4 emulation; None = dynamic.
    input_scale: Any = None
    # Input activation format for W4A4 emulation; None = inputs stay in the compute dtype.
    act: FormatSpec | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def packed(self) -> bool:
        return isinstance(self.weight, QArray)


def _tensor_scale(q: QArray):
    """The float32 scale ``dequantize(..., with_global_scale=False)`` leaves out."""
    if q.global_scale is not None:
        return q.global_scale
    if q.block_shape is None and q.scales is not None:
        return q.scales
    return None


def _apply_linear(lin: Linear, x: jax.Array, cdt) -> jax.Array:
    # Tie the weight to this layer's input: XLA can then neither hoist its decode (or a
    # converted copy) out of the decode loop -- loop-invariant code motion would keep every
    # layer's decoded weights resident for the whole generation -- nor decode it before
    # the previous layer has finished. Only one layer's decoded weights are live at a time.
    w, x = jax.lax.optimization_barrier((lin.weight, x.astype(cdt)))
    if not lin.packed:
        return jnp.einsum("...k,nk->...n", x, w.astype(cdt), preferred_element_type=cdt)
    q = w
    # Decoded values (E2M1 x E4M3, E4M3, x 2^k) are exact in bf16 and in f32; XLA:CPU
    # multiplies bf16 by converting to f32 anyway, so decode straight to f32 there.
    mdt = jnp.float32 if jax.default_backend() == "cpu" else cdt
    wv = dequantize(q, mdt, with_global_scale=False)
    scale = _tensor_scale(q)
    if lin.act is not None:
        amax = None if lin.input_scale is None else amax_from_decode_scale(lin.act, lin.input_scale)
        x, xs = quantize_dequantize(x, lin.act, axis=-1, amax=amax, dtype=cdt)
        scale = xs if scale is None else scale * xs
    y = jnp.einsum("...k,nk->...n", x.astype(mdt), wv, preferred_element_type=jnp.float32)
    if scale is not None:
        y = y * scale
    return y.astype(cdt)


def init_cache(cfg: ModelConfig, batch: int, slots: int, dtype) -> list[dict[str, jax.Array]]:
    """Zeroed KV cache: per layer ``{"k", "v"}`` of shape ``[batch, slots, KV, head_dim]``."""
    shp = (batch, slots, cfg.n_kv_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shp, dtype), "v": jnp.zeros(shp, dtype)} for _ in range(cfg.n_layers)]


@dataclasses.dataclass
class _CacheOps:
    """`BlockOps` of one layer's inference weights: packed or dense `Linear`\\ s, the
    layer's norm scales and biases, and attention over the KV cache (written first) or,
    without one, over the call's own tokens."""

    weights: Mapping[str, Any]  # {path inside the block: Linear or array}
    cdt: Any
    window: int | None
    scale: float  # the attention scores' factor (ModelConfig.attn_scale)
    q_slot: jax.Array  # [T] slots of the call's tokens
    start: jax.Array  # [B] first real slot per row
    index: Any
    cache: dict[str, jax.Array] | None  # this layer's {"k", "v"}; None: no cache
    new_cache: dict[str, jax.Array] | None = None

    def _linear(self, name: str, x: jax.Array) -> jax.Array:
        return _apply_linear(self.weights[name], x, self.cdt)

    def column(self, names, x):
        return [self._linear(n, x) for n in names]

    def row(self, name, x):
        return self._linear(name, x)

    def param(self, name):
        return self.weights[name]

    def attend(self, q, k, v):
        if self.cache is None:
            k_all, v_all, k_slot = k, v, self.q_slot
        else:
            c, at = self.cache, (0, self.index, 0, 0)
            k_all = jax.lax.dynamic_update_slice(c["k"], k.astype(c["k"].dtype), at)
            v_all = jax.lax.dynamic_update_slice(c["v"], v.astype(c["v"].dtype), at)
            self.new_cache = {"k": k_all, "v": v_all}
            k_slot = jnp.arange(k_all.shape[1], dtype=jnp.int32)
        k_all, v_all = k_all.astype(q.dtype), v_all.astype(v.dtype)
        return attention(
            q,
            k_all,
            v_all,
            self.q_slot,
            k_slot,
            window=self.window,
            first=self.start,
            scale=self.scale,
        )


def forward(
    weights: Mapping[str, Any],
    tokens: jax.Array,
    *,
    cfg: ModelConfig,
    cdt,
    cache: list | None = None,
    index: Any = 0,
    start: jax.Array | None = None,
):
    """Logits ``[B, T, V]`` (float32) of ``tokens [B, T]`` at slots ``index ... index+T-1``.

    Each layer is `microscale.model.block.block_forward`, the model's own block. With
    ``cache`` the new keys/values are written at those slots and attention reads the
    whole cache (returns ``(logits, cache)``); without, attention is over ``tokens`` only
    (returns ``(logits, None)``). ``start [B]``: first non-padding slot of each row.
    """
    b, t = tokens.shape
    cdt = jnp.dtype(cdt)
    cfg = dataclasses.replace(cfg, compute_dtype=cdt.name) if cfg.compute_dtype != cdt else cfg
    if start is None:
        start = jnp.zeros((b,), jnp.int32)
    q_slot = index + jnp.arange(t, dtype=jnp.int32)
    positions = jnp.maximum(q_slot[None, :] - start[:, None], 0)
    tables = layer_rope_tables(cfg, positions)
    x = embed_residual(cfg, jnp.take(weights["embed"], tokens, axis=0).astype(jnp.float32))
    new_cache: list[dict[str, Any]] = []
    for i, lw in enumerate(weights["layers"]):
        ops = _CacheOps(
            lw,
            cdt,
            cfg.layer_window(i),
            cfg.attn_scale,
            q_slot,
            start,
            index,
            None if cache is None else cache[i],
        )
        x = block_forward(cfg, ops, x, *tables[i])
        if ops.new_cache is not None:
            new_cache.append(ops.new_cache)
    x = rms_norm(x, weights["final_norm"], cfg.norm_eps, cdt, cfg.arch.norm_offset)
    head = weights["embed"] if weights["lm_head"] is None else weights["lm_head"]  # [V, D]
    head, x = jax.lax.optimization_barrier((head, x))  # no hoisted copy (see _apply_linear)
    logits = jnp.einsum("...d,vd->...v", x, head.astype(cdt), preferred_element_type=jnp.float32)
    return logits, (new_cache if cache is not None else None)


# ---------------------------------------------------------------------- building


def build_weights(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    layers: Mapping[str, LayerQuant],
    *,
    compute_dtype,
    input_scales: Mapping[str, Any] | None = None,
    activations: bool = False,
) -> dict[str, Any]:
    """The forward pass's weight pytree from flat params (kernels float ``[K, N]`` or
    QArrays in either orientation). Dense kernels become ``[N, K]`` arrays in
    ``compute_dtype``; QArrays stay packed (moved to the device as they are)."""
    cdt = jnp.dtype(compute_dtype)
    input_scales = input_scales or {}
    out_layers = []
    for i in range(cfg.n_layers):
        prefix = f"layers.{i}."
        lw: dict[str, Any] = {
            k.removeprefix(prefix): jnp.asarray(params[k])
            for k in (prefix + p for p in block_param_shapes(cfg))
            if not k.endswith(".kernel")
        }
        for kind in LINEAR_KINDS:
            path = f"layers.{i}.{kind}"
            w = params[f"{path}.kernel"]
            lq = layers.get(path, LayerQuant())
            if isinstance(w, QArray):
                q = row_blocks(to_hf_orientation(w))
                q = jax.tree.map(jnp.asarray, q)
                act = (lq.input_spec or q.spec) if activations else None
                s = input_scales.get(path) if act is not None else None
                lw[kind] = Linear(q, None if s is None else jnp.float32(s), act)
            else:
                if lq.quantized:
                    raise ValueError(
                        f"{hf_module(path)}: layer is {lq} but its kernel is not "
                        "quantized; quantize it first (quantize_linear_weights)"
                    )
                lw[kind] = Linear(jnp.asarray(jnp.asarray(w).T, cdt))
        out_layers.append(lw)
    head = params.get("lm_head.kernel")
    return {
        "embed": jnp.asarray(params["embed.embedding"]),
        "final_norm": jnp.asarray(params["final_norm.scale"]),
        "lm_head": None if head is None else jnp.asarray(head).T,
        "layers": out_layers,
    }
