"""Every family through the one block definition: the training `Transformer` and the
inference engine (full forward and KV-cache decode) give the same logits, per family.

The table (tests/family_configs.py) holds one tiny configuration per family, each
exercising its switches (Qwen2's biases non-zero here). Bounds:

* dense engine vs `Transformer` (bf16 recipe, bfloat16 compute): atol one bfloat16 eps
  (2^-7) of the largest logit. Both run `microscale.model.block.block_forward`; only the
  projections differ (the engine's einsum of ``x`` with ``W^T`` against the recipe's
  ``dot_general`` of ``x`` with ``W``), the same bfloat16 operands with float32
  accumulation. Where both take one kernel the outputs are equal (0.0 for every family
  on an AMD EPYC Zen 3, and for all but Gemma 3 on an Intel Xeon with AMX); where the two
  contractions take different kernels (AMX), their float32 sums differ in order, one
  output's bfloat16 rounding can flip by an ulp, and Gemma 3's post-norms carry it on:
  measured 1.6e-3 at a largest logit of 0.69 (bound 5.4e-3). A norm, bias or scale left
  out moves logits by O(0.1-1) (the parameters are moved by 0.3 sd), far above it.
* KV-cache decode vs full forward, float32: atol 2e-5 (the bound of
  ``tests/inference/test_inference_engine.py``: the cache's attention runs over all
  slots with masked ones at exp(-inf) = 0, so its softmax sums in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from family_configs import CONFIGS, moved_model
from microscale.export import flat_params
from microscale.inference import InferenceModel, forward, init_cache
from microscale.model import FAMILIES, Transformer, param_shapes

T = 20  # > the sliding window


def test_every_family_is_in_the_table():
    assert set(CONFIGS) == set(FAMILIES)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request):
    cfg = CONFIGS[request.param]
    return request.param, cfg, moved_model(cfg)


def _tokens(b=2, t=T, seed=3):
    return np.asarray(jax.random.randint(jax.random.key(seed), (b, t), 0, 257))


def test_param_shapes_and_count(family):
    name, cfg, model = family
    params = flat_params(model)
    assert {k: tuple(v.shape) for k, v in params.items()} == param_shapes(cfg)
    assert sum(int(np.prod(s)) for s in param_shapes(cfg).values()) == cfg.num_params()
    has = {k.split(".", 2)[2] for k in params if k.startswith("layers.0.")}
    assert ("attn.q_proj.bias" in has) == (name == "qwen2")
    assert ("attn.q_norm.scale" in has) == (name in ("qwen3", "gemma3"))
    assert ("mlp_post_norm.scale" in has) == (name == "gemma3")


def test_engine_equals_the_transformer(family):
    _, cfg, model = family
    tokens = _tokens()
    ref = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    got = np.asarray(InferenceModel.from_params(model, cfg).logits(tokens))
    np.testing.assert_allclose(got, ref, atol=2.0**-7 * np.abs(ref).max(), rtol=0)


def test_kv_cache_decode_equals_the_full_forward(family):
    """Prefill 7 tokens, then decode the rest one at a time through the cache: each
    step's logits are the full forward's at that position (past the sliding window)."""
    _, cfg, model = family
    cfg = cfg.replace(compute_dtype="float32")
    engine = InferenceModel.from_params(flat_params(model), cfg)
    tokens = jnp.asarray(_tokens())
    full, _ = forward(engine.weights, tokens, cfg=cfg, cdt="float32")
    cache = init_cache(cfg, tokens.shape[0], T, jnp.float32)
    step = jax.jit(lambda w, t, c, i: forward(w, t, cfg=cfg, cdt="float32", cache=c, index=i))
    logits, cache = step(engine.weights, tokens[:, :7], cache, 0)
    got = [logits]
    for i in range(7, T):
        logits, cache = step(engine.weights, tokens[:, i : i + 1], cache, i)
        got.append(logits)
    np.testing.assert_allclose(np.concatenate(got, axis=1), full, atol=2e-5, rtol=0)


def test_sliding_window_changes_what_is_seen():
    """Mistral's window is live: the same weights without it give other logits past the
    window, and the same logits inside it."""
    cfg = CONFIGS["mistral"]
    model = moved_model(cfg)
    tokens = _tokens()
    windowed = np.asarray(InferenceModel.from_params(model, cfg).logits(tokens))
    full = np.asarray(
        InferenceModel.from_params(flat_params(model), cfg.replace(sliding_window=None)).logits(
            tokens
        )
    )
    w = cfg.sliding_window
    np.testing.assert_allclose(windowed[:, :w], full[:, :w], atol=1e-6, rtol=0)
    assert np.abs(windowed[:, w:] - full[:, w:]).max() > 1e-3


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(family="phi3"), "family='phi3'"),
        (dict(sliding_window_pattern=6), "sliding_window_pattern=6: family 'llama' has no"),
        (dict(family="qwen3", rope_local_theta=1e4), "rope_local_theta=10000.0: family 'qwen3'"),
        (dict(family="gemma3", sliding_window_pattern=-1), "sliding_window_pattern=-1"),
        (dict(family="gemma3", query_pre_attn_scalar=0), "query_pre_attn_scalar=0"),
        (dict(sliding_window=8), "sliding_window=8: family 'llama'"),
        (dict(family="mistral", sliding_window=0), "sliding_window=0"),
        (dict(attn_head_dim=33), "head_dim = 33 is odd"),
        (dict(attn_head_dim=20), "n_kv_heads \\* head_dim=40 is not a multiple"),
    ],
)
def test_bad_family_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        CONFIGS["llama"].replace(**changes)


def test_gemma3_local_and_global_layers():
    """Layer kinds follow the pattern (every second layer global here), scanned layers run
    in runs of one kind and give the unrolled model's logits, and each switch is live:
    the model without the local RoPE base, or with every layer global, differs."""
    cfg = CONFIGS["gemma3"]
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    assert cfg.layer_rope(0) == (1e4, None) and cfg.layer_rope(1) == (1e6, cfg.rope_scaling)
    model = moved_model(cfg)
    params = flat_params(model)
    tokens = _tokens()
    ref = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))
    scanned = Transformer(cfg.replace(scan_layers=True), rngs=nnx.Rngs(0))
    nnx.update(scanned, nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, t: m(t))(scanned, tokens)), ref)
    for changes in (dict(rope_local_theta=None), dict(sliding_window_pattern=1)):
        other = InferenceModel.from_params(params, cfg.replace(**changes)).logits(tokens)
        assert np.abs(np.asarray(other) - ref).max() > 1e-3, changes
