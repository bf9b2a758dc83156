"""One tiny configuration per model family, each exercising its switches, and a random
model whose family parameters matter; shared by the tests that run every family
(tests/model/test_families.py, tests/ptq/test_sequential.py).

Qwen2's q/k/v biases, Qwen3's per-head q/k norms with an explicit head_dim unlike
d_model / n_heads, Mistral's sliding window shorter than the sequence, Gemma 3's
everything (offset norms, post-norms, GeGLU, scaled embedding, local and global layers
with their own RoPE bases, the global one scaled, a scores' scale of its own).
"""

from __future__ import annotations

import jax
from flax import nnx

from microscale.model import ModelConfig, RopeScaling, Transformer

BASE = dict(vocab_size=257, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
            max_seq_len=64)  # fmt: skip
CONFIGS = {
    "llama": ModelConfig(**BASE),
    "mistral": ModelConfig(**BASE, family="mistral", sliding_window=5),
    "qwen2": ModelConfig(**BASE, family="qwen2"),
    "qwen3": ModelConfig(**BASE, family="qwen3", attn_head_dim=32),
    # local, global, local: a window, two RoPE bases (the global one scaled), a scores'
    # scale unlike head_dim's
    "gemma3": ModelConfig(
        **{**BASE, "n_layers": 3},
        family="gemma3",
        attn_head_dim=32,
        sliding_window=5,
        sliding_window_pattern=2,
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=24.0,
        rope_scaling=RopeScaling(kind="linear", factor=4.0),
    ),
}


def moved_model(cfg: ModelConfig) -> Transformer:
    """A random model whose family parameters matter: biases and norm scales moved off
    their init (zeros, ones) by 0.3 sd, so a bias or norm left out would show."""
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    moved = [
        leaf + 0.3 * jax.random.normal(k, leaf.shape) if ("bias" in p or "norm" in p) else leaf
        for leaf, k, p in zip(leaves, keys, paths, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(tree, moved))
    return model
