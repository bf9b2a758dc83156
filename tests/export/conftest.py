"""A tiny Llama for the export tests (d_model 64, 2 layers, vocab 257; every linear dim a
multiple of 32 so the MX formats apply too)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from microscale.model import ModelConfig, Transformer

TINY = ModelConfig(
    vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
)


def make_model(cfg: ModelConfig = TINY, seed: int = 0) -> Transformer:
    """Random weights with a few outliers, so block and global scales differ per layer."""
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    for i, (_, var) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        w = var[...]
        if w.ndim == 2:
            w = w * (1.0 + 3.0 * (jax.random.uniform(jax.random.key(i), w.shape) > 0.995))
            var[...] = w.astype(jnp.float32)
        else:
            var[...] = 1.0 + 0.1 * jax.random.normal(jax.random.key(i), w.shape)
    return model


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return make_model()


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return TINY


@pytest.fixture
def mixed() -> dict[str, str]:
    """A mixed allocation: NVFP4 q/k/v, FP8 o/down, NVFP4 MLP in block 0, BF16 in block 1."""
    return {
        f"layers.{i}.{k}": f
        for i in range(2)
        for k, f in (
            ("attn.q_proj", "nvfp4"),
            ("attn.k_proj", "nvfp4"),
            ("attn.v_proj", "nvfp4"),
            ("attn.o_proj", "fp8_e4m3"),
            ("mlp.gate_proj", "nvfp4" if i == 0 else "bf16"),
            ("mlp.up_proj", "nvfp4" if i == 0 else "bf16"),
            ("mlp.down_proj", "fp8_e4m3"),
        )
    }
