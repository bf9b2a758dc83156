"""Transformer: shapes, causality, GQA, RoPE, tied embeddings, gradients per recipe."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from microscale.model import (
    LOGICAL_AXES,
    ModelConfig,
    PrecisionRules,
    QLinear,
    Transformer,
    apply_rope,
    causal_attention,
    logical_to_mesh_rules,
    logical_to_mesh_spec,
    param_logical_axes,
    partition_specs,
    rope_tables,
)
from microscale.model.layers import Embed, LMHead
from microscale.ops import get_recipe, list_recipes, make_dot_general


def _cfg(**kw) -> ModelConfig:
    base = dict(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64
    )
    return ModelConfig(**{**base, **kw})


def _tokens(cfg, b=2, t=16, seed=0):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size, jnp.int32)


_forward = nnx.jit(lambda m, tokens: m(tokens))


def test_shapes_dtypes_and_param_paths():
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    logits = _forward(model, _tokens(cfg))
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    axes = param_logical_axes(model)
    hd = cfg.head_dim
    expected = {
        "embed.embedding": ((64, 64), ("vocab", "embed")),
        "final_norm.scale": ((64,), ("norm",)),
        "layers.1.attn_norm.scale": ((64,), ("norm",)),
        "layers.1.mlp_norm.scale": ((64,), ("norm",)),
        "layers.1.attn.q_proj.kernel": ((64, 4 * hd), ("embed", "heads")),
        "layers.1.attn.k_proj.kernel": ((64, 2 * hd), ("embed", "kv_heads")),
        "layers.1.attn.v_proj.kernel": ((64, 2 * hd), ("embed", "kv_heads")),
        "layers.1.attn.o_proj.kernel": ((4 * hd, 64), ("heads", "embed")),
        "layers.1.mlp.gate_proj.kernel": ((64, 128), ("embed", "mlp")),
        "layers.1.mlp.up_proj.kernel": ((64, 128), ("embed", "mlp")),
        "layers.1.mlp.down_proj.kernel": ((128, 64), ("mlp", "embed")),
    }
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert len(params) == 2 + 9 * cfg.n_layers  # embed, final norm, 9 per block (tied)
    for path, (shape, ax) in expected.items():
        assert params[path][...].shape == shape, path
        assert params[path][...].dtype == jnp.float32, path
        assert axes[path] == ax, path
    assert set(a for ax in axes.values() for a in ax) <= set(LOGICAL_AXES)


def test_causal_masking():
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(cfg, t=16)
    changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % cfg.vocab_size)
    a, b = _forward(model, tokens), _forward(model, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert float(jnp.abs(a[:, 10:] - b[:, 10:]).max()) > 1e-3


@pytest.mark.slow
def test_gqa_equals_mha_with_repeated_kv():
    # Attention kernel level: KV heads shared by groups == explicitly repeated KV heads.
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (2, 8, 6, 16))
    k = jax.random.normal(kk, (2, 8, 2, 16))
    v = jax.random.normal(kv, (2, 8, 2, 16))
    gqa = causal_attention(q, k, v)
    mha = causal_attention(q, jnp.repeat(k, 3, axis=2), jnp.repeat(v, 3, axis=2))
    np.testing.assert_allclose(gqa, mha, rtol=1e-6, atol=1e-6)

    # Model level: n_kv_heads=2 vs an MHA model whose k/v kernels repeat each kv head.
    cfg = _cfg(n_heads=4, n_kv_heads=2)
    gqa_model = Transformer(cfg, rngs=nnx.Rngs(0))
    mha_model = Transformer(cfg.replace(n_kv_heads=4), rngs=nnx.Rngs(1))
    d, hd = cfg.d_model, cfg.head_dim

    def rep(kernel):  # [d, KV*hd] -> [d, H*hd], kv head j serves query heads 2j, 2j+1
        return jnp.repeat(kernel.reshape(d, 2, hd), 2, axis=1).reshape(d, 4 * hd)

    params = nnx.to_pure_dict(nnx.state(gqa_model, nnx.Param))
    for i in range(cfg.n_layers):
        for name in ("k_proj", "v_proj"):
            kernel = params["layers"][i]["attn"][name]["kernel"]
            params["layers"][i]["attn"][name]["kernel"] = rep(kernel)
    dst = nnx.state(mha_model, nnx.Param)
    nnx.replace_by_pure_dict(dst, params)
    nnx.update(mha_model, dst)
    assert mha_model.layers[0].attn.k_proj.kernel[...].shape == (d, 4 * hd)
    tokens = _tokens(cfg)
    np.testing.assert_allclose(
        _forward(gqa_model, tokens), _forward(mha_model, tokens), rtol=1e-6, atol=1e-6
    )


def test_rope_relative_position():
    hd = 32
    kq, kk = jax.random.split(jax.random.key(0))
    q = jax.random.normal(kq, (1, 1, 1, hd))
    k = jax.random.normal(kk, (1, 1, 1, hd))

    def score(m, n):
        cm, sm = rope_tables(jnp.array([m]), hd, 10000.0)
        cn, sn = rope_tables(jnp.array([n]), hd, 10000.0)
        return jnp.sum(apply_rope(q, cm, sm) * apply_rope(k, cn, sn))

    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-5)
    np.testing.assert_allclose(score(40, 40), score(0, 0), rtol=1e-5)
    assert abs(float(score(5, 2)) - float(score(5, 3))) > 1e-4
    c0, s0 = rope_tables(jnp.array([0]), hd, 10000.0)
    np.testing.assert_allclose(apply_rope(q, c0, s0), q)  # position 0 is the identity
    # Norm-preserving rotation.
    c, s = rope_tables(jnp.array([17]), hd, 10000.0)
    np.testing.assert_allclose(jnp.linalg.norm(apply_rope(q, c, s)), jnp.linalg.norm(q), rtol=1e-5)


def test_tied_and_untied_embeddings():
    cfg = _cfg()
    tied = Transformer(cfg, rngs=nnx.Rngs(0))
    assert not hasattr(tied, "lm_head")
    tokens = _tokens(cfg)
    # Tied head: scaling the embedding table changes the logits through the head as well.
    logits = _forward(tied, tokens)
    untied = Transformer(cfg.replace(tie_embeddings=False), rngs=nnx.Rngs(0))
    assert untied.lm_head.kernel[...].shape == (cfg.d_model, cfg.vocab_size)
    n_tied = sum(x.size for x in jax.tree.leaves(nnx.state(tied, nnx.Param)))
    n_untied = sum(x.size for x in jax.tree.leaves(nnx.state(untied, nnx.Param)))
    assert (n_tied, n_untied) == (cfg.num_params(), cfg.replace(tie_embeddings=False).num_params())
    # With the untied head set to E^T, both models compute the same logits.
    untied_state = nnx.state(untied, nnx.Param)
    tied_state = nnx.state(tied, nnx.Param)
    for name in ("embed", "layers", "final_norm"):
        untied_state[name] = tied_state[name]
    untied_state["lm_head"]["kernel"][...] = tied_state["embed"]["embedding"][...].T
    nnx.update(untied, untied_state)
    np.testing.assert_allclose(_forward(untied, tokens), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_tiny_forward_grad_under_jit(recipe):
    cfg = ModelConfig.tiny()
    rules = PrecisionRules.for_recipe(recipe, cfg.n_layers)
    model = Transformer(cfg, rngs=nnx.Rngs(0), rules=rules)
    tokens = _tokens(cfg, b=2, t=33)

    @nnx.jit
    def loss_and_grads(m, tokens, key):
        def loss_fn(m):
            logits = m(tokens[:, :-1], key=key)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        return nnx.value_and_grad(loss_fn)(m)

    loss, grads = loss_and_grads(model, tokens, jax.random.key(1))
    assert np.isfinite(float(loss))
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.5  # near-uniform at init
    leaves = jax.tree.leaves(grads)
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(bool(jnp.isfinite(g).all()) for g in leaves)
    q_grad = grads["layers"][0]["attn"]["q_proj"]["kernel"][...]
    assert q_grad.dtype == jnp.float32 and float(jnp.abs(q_grad).sum()) > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "save_dots", "minimal", True])
def test_remat_policies_match_no_remat(policy):
    """Every remat policy computes the same gradients as none (recomputation, not other
    math; up to float rounding: the recomputed forward may be fused differently)."""
    cfg = _cfg(n_layers=2)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    remat = Transformer(cfg.replace(remat=policy), rngs=nnx.Rngs(0))
    assert remat.config.remat == ("full" if policy is True else policy)
    tokens = _tokens(cfg)

    def loss(m):
        return jnp.mean(m(tokens) ** 2)

    grad = nnx.jit(nnx.grad(loss))
    g1, g2 = grad(model), grad(remat)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_remat_policy_names_are_one_list():
    from microscale.model import config, transformer

    assert tuple(transformer.REMAT_POLICIES) == config.REMAT_POLICIES


def test_remat_policy_is_validated():
    with pytest.raises(ValueError, match="remat='sometimes'.*save_dots"):
        _cfg(remat="sometimes")
    assert _cfg(remat="false").remat == "none" and _cfg(remat=False).remat == "none"


def test_positions_and_errors():
    cfg = _cfg(n_layers=1)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = _tokens(cfg)
    explicit = nnx.jit(lambda m, t: m(t, positions=jnp.arange(t.shape[1])))(model, tokens)
    np.testing.assert_array_equal(explicit, _forward(model, tokens))
    with pytest.raises(ValueError, match="sequence length 65 exceeds max_seq_len=64"):
        model(jnp.zeros((1, 65), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens shape \(16,\): expected \[batch, seq\]"):
        model(jnp.zeros((16,), jnp.int32))
    with pytest.raises(TypeError, match="expected a ModelConfig"):
        Transformer({"d_model": 64}, rngs=nnx.Rngs(0))  # type: ignore[arg-type]


def test_sharding_annotations():
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    specs = partition_specs(model)
    P = jax.sharding.PartitionSpec
    assert specs["layers"][0]["mlp"]["gate_proj"]["kernel"].get_value() == P("fsdp", "tensor")
    assert specs["layers"][0]["attn"]["o_proj"]["kernel"].get_value() == P("tensor", "fsdp")
    assert specs["embed"]["embedding"].get_value() == P("tensor", "fsdp")
    assert specs["final_norm"]["scale"].get_value() == P(None)
    assert logical_to_mesh_spec(("batch", "length", "embed")) == P(("data", "fsdp"), None, None)
    rules = dict(logical_to_mesh_rules())
    assert set(rules) >= {"embed", "heads", "kv_heads", "mlp", "vocab", "norm", "batch"}
    # An unknown name is replicated (as the trainer always did) and reported.
    recs = []
    assert logical_to_mesh_spec(("expert",), replicated=recs) == P(None)
    assert "no mesh rule for logical axis 'expert'" in recs[0].reason


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [r for r in list_recipes() if not get_recipe(r).delayed])
def test_qlinear_kernel_gradient_is_the_float32_wgrad(recipe):
    """The f32 master kernel receives the float32-accumulated wgrad: float32, not
    bf16-representable in general, and exactly the value that the old cast-outside-the-VJP
    path rounded to bf16 (same forward, same GEMMs)."""
    layer = QLinear(64, 48, rngs=nnx.Rngs(0), recipe=recipe)
    x = jax.random.normal(jax.random.key(1), (4, 64, 64), jnp.bfloat16)
    key = jax.random.key(2)
    w = layer.kernel[...]

    def loss(y):
        return jnp.sum(jnp.square(y.astype(jnp.float32)) * jnp.arange(48, dtype=jnp.float32))

    g = nnx.grad(lambda m: loss(m(x, key=key)))(layer)["kernel"][...]
    assert g.dtype == jnp.float32 and w.dtype == jnp.float32
    g = np.asarray(g)
    # (MXFP4 operands carry so few bits that a third of the sums still fit in bf16)
    assert np.mean(g != g.astype(jnp.bfloat16).astype(np.float32)) > 0.25
    # Casting outside the VJP (the old QLinear) gives the same gradient rounded to bf16.
    lkey = jax.random.fold_in(key, layer.layer_id)
    dg = make_dot_general(recipe, key=lkey)
    dims = (((2,), (0,)), ((), ()))
    outside = jax.grad(
        lambda w: loss(dg(x, w.astype(jnp.bfloat16), dims, preferred_element_type=jnp.bfloat16))
    )(w)
    np.testing.assert_array_equal(np.asarray(outside), g.astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_gradient_is_float32_accumulated(tied):
    """The LM head (untied kernel or tied embedding table) gets the float32-accumulated
    gradient of bf16 operands: float32, mostly not bf16-representable, and equal to a
    plain numpy float32 reference X^T dY computed from the same bf16-rounded operands."""
    rngs = nnx.Rngs(0)
    head = Embed(40, 32, rngs=rngs) if tied else LMHead(32, 40, rngs=rngs)
    x = jax.random.normal(jax.random.key(1), (3, 16, 32), jnp.bfloat16)
    weights = jnp.linspace(0.5, 2.0, 40, dtype=jnp.float32)

    def loss(m):
        logits = m.attend(x) if tied else m(x)
        assert logits.dtype == jnp.float32
        return jnp.sum(jnp.square(logits) * weights)

    grads = nnx.grad(loss)(head)
    g = np.asarray(grads["embedding" if tied else "kernel"][...])
    assert g.dtype == np.float32
    assert np.mean(g != g.astype(jnp.bfloat16).astype(np.float32)) > 0.5
    # Reference: dL/dlogits = 2 logits w, rounded to bf16 as the GEMM operand; X^T dY in f64.
    w32 = np.asarray((head.embedding if tied else head.kernel)[...])
    wb = w32.astype(jnp.bfloat16).astype(np.float64)
    xb = np.asarray(x).astype(np.float64).reshape(-1, 32)
    logits = xb @ (wb.T if tied else wb)
    dy = (2 * logits.astype(np.float32) * np.asarray(weights)).astype(jnp.bfloat16)
    ref = xb.T @ dy.astype(np.float64)  # [32, 40]
    ref = ref.T if tied else ref
    np.testing.assert_allclose(g, ref, rtol=2e-3, atol=1e-3 * np.abs(ref).max())
