"""The decoder block, defined once: training, PTQ scoring, evaluation and KV-cache
generation all run `block_forward`.

Per block (pre-norm, residual stream in float32; the family's switches from
`microscale.model.family` in brackets)::

    n    = rms_norm(x, attn_norm)                              [every norm: offset + w]
    q, k, v = n Wq [+ bq], n Wk [+ bk], n Wv [+ bv]          one column-parallel group
    q, k = [rms_norm per head (q_norm, k_norm)] q, k
    q, k = rope(q), rope(k)                                    [the layer's own base]
    a    = attention(q, k, v) Wo                  [sliding window; the scores' scale]
    h    = x + [rms_norm(a, attn_post_norm)] a
    m    = rms_norm(h, mlp_norm)
    y    = (act(m Wgate) * (m Wup)) Wdown                    [act: silu or tanh-GELU]
    out  = h + [rms_norm(y, mlp_post_norm)] y

Outside the blocks, `embed_residual` scales the embedding [by sqrt(d_model)] and
`layer_rope_tables` gives each layer its RoPE tables (local and global layers differ).

The block owns the arithmetic; the caller owns the parameters and the attention's
memory, through a `BlockOps`: ``column``/``row`` run projections by their path inside the
block (training: `QLinear`\\ s under a recipe, tensor-parallel under a mesh; inference:
packed weights decoded beside their GEMM), ``param`` reads a norm scale or a bias, and
``attend`` runs attention over the new q/k/v (training: the sequence itself, causal, in
query chunks; inference: the KV cache, written first). Both reach the same `attention`,
whose mask is one expression of the query and key positions.

Precision: norm statistics, RoPE, softmax, biases and the gated product in float32;
projections' operands and outputs in ``compute_dtype`` (their GEMMs accumulate in float32).
A bias is added to the projection's ``compute_dtype`` output in float32 and rounded back
once. Activations carry logical sharding axes (``constrain``: a no-op outside
`activation_sharding`) and remat names (``proj``, ``attn_out``, ``mlp_hidden``: no-ops
outside ``jax.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from microscale.model.config import ModelConfig
from microscale.model.layers import add_bias, apply_rope, rms_norm, rope_tables
from microscale.model.sharding import constrain

__all__ = [
    "ACTIVATIONS",
    "RESIDUAL",
    "BlockOps",
    "attention",
    "block_forward",
    "causal_attention",
    "embed_residual",
    "layer_rope_tables",
]

# Logical axes of the activations (microscale.model.sharding maps them to the mesh).
RESIDUAL = ("act_batch", "act_residual_length", "act_embed")
_HEADS = ("act_batch", "act_length", "act_heads", None)
_KV = ("act_batch", "act_length", "act_kv_heads", None)
_HIDDEN = ("act_batch", "act_length", "act_mlp")

# The MLP gate's activation by `Family.mlp_act` (tanh-GELU: transformers'
# "gelu_pytorch_tanh", Gemma's GeGLU).
ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
}

_QKV = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
_GATE_UP = ("mlp.gate_proj", "mlp.up_proj")


class BlockOps(Protocol):
    """What `block_forward` asks of its caller, by paths inside the block
    (``attn.q_proj``, ``attn_norm.scale``, ``attn.q_proj.bias``, ...)."""

    def column(self, names: Sequence[str], x: jax.Array) -> list[jax.Array]:
        """Projections ``names`` of one input ``x`` (one column-parallel group)."""
        ...

    def row(self, name: str, x: jax.Array) -> jax.Array:
        """Projection ``name`` of ``x`` (row-parallel: o_proj, down_proj)."""
        ...

    def param(self, name: str) -> jax.Array:
        """A norm scale or a bias."""
        ...

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """Attention of the rotated q ``[B, T, H, hd]`` over k/v ``[B, T, KV, hd]`` (and
        whatever the caller keeps of earlier positions); ``[B, T, H, hd]`` out."""
        ...


def block_forward(cfg: ModelConfig, ops: BlockOps, x: jax.Array, cos, sin) -> jax.Array:
    """One decoder block of ``cfg``'s family on the residual stream ``x [B, T, D]``
    (float32); ``cos``/``sin``: RoPE tables of the positions (`rope_tables`)."""
    fam, cdt = cfg.arch, jnp.dtype(cfg.compute_dtype)
    b, t, _ = x.shape
    h_, kv_, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    x = constrain(x, RESIDUAL)

    def norm(y: jax.Array, name: str, dtype: Any) -> jax.Array:
        return rms_norm(y, ops.param(f"{name}.scale"), cfg.norm_eps, dtype, fam.norm_offset)

    n = norm(x, "attn_norm", cdt)
    q, k, v = ops.column(_QKV, n)
    if fam.qkv_bias:
        q, k, v = (
            add_bias(y, ops.param(f"{p}.bias")) for y, p in zip((q, k, v), _QKV, strict=True)
        )
    q = constrain(q.reshape(b, t, h_, hd), _HEADS)
    k = constrain(k.reshape(b, t, kv_, hd), _KV)
    v = constrain(v.reshape(b, t, kv_, hd), _KV)
    if fam.qk_norm:
        q, k = norm(q, "attn.q_norm", q.dtype), norm(k, "attn.k_norm", k.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = constrain(ops.attend(q, k, v), _HEADS)
    o = checkpoint_name(o.reshape(b, t, h_ * hd), "attn_out")
    a = constrain(ops.row("attn.o_proj", o), RESIDUAL)
    if fam.post_norms:
        a = norm(a, "attn_post_norm", a.dtype)
    h = x + a.astype(x.dtype)
    m = norm(h, "mlp_norm", cdt)
    g, u = (constrain(y, _HIDDEN) for y in ops.column(_GATE_UP, m))
    act = ACTIVATIONS[fam.mlp_act]
    hidden = (act(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(g.dtype)
    down = constrain(ops.row("mlp.down_proj", checkpoint_name(hidden, "mlp_hidden")), RESIDUAL)
    if fam.post_norms:
        down = norm(down, "mlp_post_norm", down.dtype)
    return constrain(h + down.astype(h.dtype), RESIDUAL)


def embed_residual(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The residual stream entering block 0 from the gathered embedding rows ``x``
    (float32): times ``sqrt(d_model)`` (rounded to float32) where the family scales it."""
    return x * np.float32(cfg.d_model**0.5) if cfg.arch.embed_scale else x


def layer_rope_tables(cfg: ModelConfig, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
    """Per layer, the ``(cos, sin)`` RoPE tables of ``positions`` (`rope_tables`) for its
    base and scaling (`ModelConfig.layer_rope`); each distinct table is computed once."""
    tables: dict[Any, tuple[jax.Array, jax.Array]] = {}
    out = []
    for i in range(cfg.n_layers):
        theta, scaling = cfg.layer_rope(i)
        if (theta, scaling) not in tables:
            tables[theta, scaling] = rope_tables(positions, cfg.head_dim, theta, scaling)
        out.append(tables[theta, scaling])
    return out


# ---------------------------------------------------------------------- attention


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int | None = None,
    first: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Grouped-query attention: q ``[B, T, H, hd]`` at positions ``q_pos [T]`` over k/v
    ``[B, S, KV, hd]`` at ``k_pos [S]``; query head ``h`` reads kv head ``h // (H/KV)``
    (HF's ``repeat_kv``). Key ``j`` is visible to query ``i`` iff ``k_pos[j] <= q_pos[i]``,
    ``q_pos[i] - k_pos[j] < window`` (a sliding window) and ``k_pos[j] >= first[b]`` (the
    first real slot of row ``b`` of a left-padded batch). Scores ``QK^T * scale`` (default
    ``hd ** -0.5``; `ModelConfig.attn_scale`) and
    the value product with ``q``'s dtype operands and float32 accumulation; float32
    softmax; ``[B, T, H, hd]`` in q's dtype."""
    b, t, h, hd = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5 if scale is None else scale)
    gap = q_pos[:, None] - k_pos[None, :]  # [T, S]
    mask = gap >= 0
    if window is not None:
        mask = mask & (gap < window)
    if first is not None:
        mask = (mask[None] & (k_pos[None, None, :] >= first[:, None, None]))[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    chunk: int = 0,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Causal `attention` of a sequence on itself. q ``[B, T, H, hd]``, k/v ``[B, S, KV,
    hd]`` with the last T of S positions being the queries (S == T in training).

    ``chunk > 0`` (and ``< T``): the queries in chunks of that many positions, one at a time
    (``lax.map``), each chunk's scores recomputed in the backward pass
    (``jax.checkpoint``): ``[B, H, chunk, S]`` float32 scores live instead of
    ``[B, H, T, S]``, memory linear in T. Every query row is the same computation either
    way (its softmax runs over all its keys); a last partial chunk is zero-padded and cut.
    """
    t, s = q.shape[1], k.shape[1]
    k_pos = jnp.arange(s)
    if not chunk or chunk >= t:
        return attention(q, k, v, jnp.arange(t) + (s - t), k_pos, window=window, scale=scale)
    b, _, h, hd = q.shape
    n = -(-t // chunk)
    qs = jnp.pad(q, ((0, 0), (0, n * chunk - t), (0, 0), (0, 0)))
    qs = qs.reshape(b, n, chunk, h, hd).swapaxes(0, 1)
    starts = jnp.arange(n) * chunk + (s - t)

    def one(qc: Any, start: Any) -> jax.Array:
        out = attention(
            constrain(qc, _HEADS),
            k,
            v,
            jnp.arange(chunk) + start,
            k_pos,
            window=window,
            scale=scale,
        )
        return constrain(out, _HEADS)

    out = jax.lax.map(lambda a: jax.checkpoint(one)(*a), (qs, starts))  # [n, B, chunk, H, hd]
    return out.swapaxes(0, 1).reshape(b, n * chunk, h, hd)[:, :t]
