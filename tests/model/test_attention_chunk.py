"""Attention in query chunks (``model.attention_chunk``): the same values and gradients as
all queries at once, and memory that grows linearly in the sequence length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.model import ModelConfig, Transformer, causal_attention

# inspected, never run: compiled as `plan` compiles (the HLO and memory do not depend on it)
from microscale.plan.compile import COMPILER_OPTIONS as INSPECT


def _qkv(t, s=None, b=1, h=4, kv=2, hd=16, dtype=jnp.bfloat16, seed=0):
    s = t if s is None else s
    kq, kk, kvv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (b, t, h, hd)).astype(dtype)
    k = jax.random.normal(kk, (b, s, kv, hd)).astype(dtype)
    v = jax.random.normal(kvv, (b, s, kv, hd)).astype(dtype)
    return q, k, v


def _fwd_bwd(chunk):
    def f(q, k, v, w):
        out = causal_attention(q, k, v, chunk=chunk)
        return jnp.sum(out.astype(jnp.float32) * w)

    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "t,s,chunk",
    [(4096, 4096, 512), (1000, 1000, 256), (37, 37, 8), (16, 48, 5)],
    ids=["T4096", "T1000-partial", "T37", "decode-S48"],
)
def test_chunked_attention_equals_all_queries_at_once(t, s, chunk):
    """Forward and gradients (q, k, v) at bf16 tolerance: each query row is the same
    computation up to the order of its float32 sums; the gradients of k and v also sum
    over chunks in another order."""
    q, k, v = _qkv(t, s)
    w = jax.random.normal(jax.random.key(9), q.shape)
    (l0, g0), (l1, g1) = _fwd_bwd(0)(q, k, v, w), _fwd_bwd(chunk)(q, k, v, w)
    o0 = causal_attention(q, k, v)
    o1 = jax.jit(lambda q, k, v: causal_attention(q, k, v, chunk=chunk))(q, k, v)
    o0, o1 = np.asarray(o0, np.float32), np.asarray(o1, np.float32)
    # the float32 sums of the value product run in a kernel-chosen order: at most one
    # bfloat16 ulp apart, in a few elements
    assert (np.abs(o0 - o1) <= 2.0**-7 * np.abs(o0) + 1e-3 * np.abs(o0).max()).all()
    assert (o0 != o1).mean() < 1e-3
    assert abs(float(l0) - float(l1)) <= 1e-5 * abs(float(l0)) + 1e-3
    for a, b in zip(g0, g1, strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 1e-2 * np.abs(a).max()  # a few bf16 ulps


def _temp_bytes(t, chunk):
    q, k, v = _qkv(t, h=2, kv=1)
    w = jnp.ones(q.shape, jnp.float32)

    def f(q, k, v):
        return jnp.sum(causal_attention(q, k, v, chunk=chunk).astype(jnp.float32) * w)

    c = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, k, v).compile(compiler_options=INSPECT)
    return c.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_attention_memory_grows_linearly():
    """Compiled fwd+bwd temporary bytes from T = 1024 to 4096 (4x): with 256-query chunks
    at most ~4x (linear); all queries at once 10.6x measured (the [T, T] float32 scores
    dominate; 16x in the limit)."""
    chunked = _temp_bytes(4096, 256) / _temp_bytes(1024, 256)
    whole = _temp_bytes(4096, 0) / _temp_bytes(1024, 0)
    assert chunked <= 5.0, chunked
    assert whole >= 8.0, whole  # measured 10.6: the [T, T] terms dominate
    assert _temp_bytes(4096, 256) < _temp_bytes(4096, 0) / 4


@pytest.mark.slow
def test_model_with_attention_chunks_matches():
    cfg = ModelConfig(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 64)
    a = Transformer(cfg, rngs=nnx.Rngs(0))
    b = Transformer(cfg.replace(attention_chunk=16), rngs=nnx.Rngs(0))
    la, lb = (nnx.jit(lambda m: m(tokens))(m) for m in (a, b))
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("chunk", [16, 7, 0])
def test_set_attention_chunk_equals_building_with_it(chunk):
    """``Transformer.set_attention_chunk`` on a built model (what PTQ's engine does to its
    copy) gives the model built with that chunk: the same logits, bit for bit, in every
    block, and the config follows; a bad chunk is refused naming it."""
    cfg = ModelConfig(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    tokens = jax.random.randint(jax.random.key(1), (2, 40), 0, 64)
    built = Transformer(cfg.replace(attention_chunk=chunk), rngs=nnx.Rngs(0))
    changed = Transformer(cfg.replace(attention_chunk=32), rngs=nnx.Rngs(0))
    changed.set_attention_chunk(chunk)
    assert changed.config.attention_chunk == chunk
    assert [blk.attn.attention_chunk for blk in changed.layers] == [chunk, chunk]
    la, lb = (nnx.jit(lambda m: m(tokens))(m) for m in (built, changed))
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    with pytest.raises(ValueError, match="attention_chunk=-3"):
        changed.set_attention_chunk(-3)
