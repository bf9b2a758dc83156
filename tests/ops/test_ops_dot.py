"""The quantized dot_general: values, gradients, structure, randomness."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from microscale.formats import fake_quantize, quantize, random_hadamard
from microscale.formats.quantize import block_scales_f32
from microscale.ops import (
    SLOTS,
    OperandSpec,
    Recipe,
    get_recipe,
    list_recipes,
    make_dot_general,
    operand_key,
    qdot,
    quantized_dot_general,
)

HI = jax.lax.Precision.HIGHEST
KEY = jax.random.key(42)


def _data(m=40, k=48, n=40, seed=0, dtype=jnp.float32):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (m, k)) * jnp.exp(jax.random.normal(kd, (m, k)))  # outliers
    w = jax.random.normal(kw, (k, n)) / np.sqrt(k)
    dy = jax.random.normal(kd, (m, n))
    return x.astype(dtype), w.astype(dtype), dy.astype(dtype)


def _fq(t, spec: OperandSpec, axis: int, key, slot: str, seed: int):
    """Plain reference: (rotate) and fake-quantize an operand, blocks along ``axis``."""
    t = t.astype(jnp.float32)
    if spec.hadamard:
        pad = -t.shape[axis] % spec.hadamard
        widths = [(0, 0)] * t.ndim
        widths[axis] = (0, pad)
        t = random_hadamard(jnp.pad(t, widths), axis, size=spec.hadamard, seed_or_key=seed)
    bs = spec.block_shape
    if bs is not None and axis in (-1, t.ndim - 1):
        bs = bs[::-1]  # (along, other) -> array order
    return fake_quantize(
        t,
        spec.format,
        axis=axis,
        rounding=spec.rounding,
        key=operand_key(key, slot) if spec.stochastic else None,
        block_shape=bs,
        scale_rounding=spec.scale_rounding,
    )


def reference(recipe: Recipe, x, w, dy, key, seed=0):
    """Explicit formulas for the three GEMMs (no autodiff), float32 everywhere."""
    r = recipe
    y = jnp.matmul(
        _fq(x, r.fprop_x, -1, key, "fprop_x", seed),
        _fq(w, r.fprop_w, 0, key, "fprop_w", seed),
        precision=HI,
    )
    dx = jnp.matmul(
        _fq(dy, r.dgrad_dy, -1, key, "dgrad_dy", seed),
        _fq(w, r.dgrad_w, -1, key, "dgrad_w", seed).T,
        precision=HI,
    )
    dw = jnp.matmul(
        _fq(x.T, r.wgrad_x, -1, key, "wgrad_x", seed),
        _fq(dy, r.wgrad_dy, 0, key, "wgrad_dy", seed),
        precision=HI,
    )
    return y, dx, dw


@functools.partial(jax.jit, static_argnums=0)
def _vjp_jit(recipe, x, w, dy, key, hist):
    y, pb = jax.vjp(lambda x, w: qdot(x, w, recipe, key=key, amax_history=hist), x, w)
    return (y,) + pb(dy)


def current_amax_history(recipe, x, w, dy):
    """A delayed-scaling history whose window max is each operand's own amax (the other
    entries smaller), so delayed scaling must reproduce current scaling exactly."""
    operand = {
        "fprop_x": x,
        "fprop_w": w,
        "dgrad_dy": dy,
        "dgrad_w": w,
        "wgrad_x": x,
        "wgrad_dy": dy,
    }
    now = jnp.stack([jnp.max(jnp.abs(operand[s].astype(jnp.float32))) for s in SLOTS])
    older = jax.random.uniform(jax.random.key(7), (len(SLOTS), recipe.amax_history_len), maxval=0.9)
    return (older * now[:, None]).at[:, 3].set(now)


def _vjp(recipe, x, w, dy, key):
    """(y, dx, dw) of the jitted layer; one compile per (recipe, shapes), keys traced.
    Delayed-scaling recipes get :func:`current_amax_history`."""
    recipe = get_recipe(recipe)
    hist = current_amax_history(recipe, x, w, dy) if recipe.delayed else None
    return _vjp_jit(recipe, x, w, dy, key, hist)


def _close(a, b, rtol=2e-6):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    err = np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)
    assert err <= rtol, f"max error {err:.3g} relative to max |ref| exceeds {rtol}"


# ---- values and gradients --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_matches_fake_quant_reference(name):
    recipe = get_recipe(name)
    x, w, dy = _data()  # M=40 tokens: RHT and 1x16 blocks along M need padding
    got = _vjp(recipe, x, w, dy, KEY)
    want = reference(recipe, x, w, dy, KEY)
    for g, r, what in zip(got, want, ("y", "dx", "dw"), strict=True):
        assert g.dtype == jnp.float32, what
        _close(g, r)


def test_bf16_recipe_equals_jnp_dot():
    x, w, dy = _data(dtype=jnp.bfloat16)
    y = qdot(x, w, "bf16")
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(y, np.float32),
        np.asarray(
            jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32
        ),
    )
    _close(y.astype(jnp.float32), jnp.dot(x, w).astype(jnp.float32), rtol=1e-2)
    # Gradients: the same bf16 GEMMs with float32 accumulation.
    _, pb = jax.vjp(lambda x, w: qdot(x, w, "bf16"), x, w)
    dx, dw = pb(dy)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(dx, np.float32),
        np.asarray(
            jnp.dot(dy, w.T, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32
        ),
    )
    np.testing.assert_array_equal(
        np.asarray(dw, np.float32),
        np.asarray(
            jnp.dot(x.T, dy, preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float32
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "nvfp4"])
def test_general_dimension_numbers(name):
    """Batch dims and several contracting dims equal the canonical [B,M,K] x [B,K,N] form."""
    kx, kw, kd = jax.random.split(jax.random.key(3), 3)
    # lhs (K1, B, M, K2), rhs (B, N, K2, K1): contract (K1, K2), batch B.
    lhs = jax.random.normal(kx, (4, 2, 24, 8))
    rhs = jax.random.normal(kw, (2, 20, 8, 4))
    dims = (((0, 3), (3, 2)), ((1,), (0,)))
    ct = jax.random.normal(kd, (2, 24, 20))
    f = lambda a, b: quantized_dot_general(a, b, dims, name, key=KEY)
    y, pb = jax.vjp(f, lhs, rhs)
    dl, dr = pb(ct)

    def canonical(a, b):
        x = jnp.transpose(a, (1, 2, 0, 3)).reshape(2, 24, 32)
        w = jnp.transpose(b, (0, 3, 2, 1)).reshape(2, 32, 20)
        return quantized_dot_general(x, w, (((2,), (1,)), ((0,), (0,))), name, key=KEY)

    y2, pb2 = jax.vjp(canonical, lhs, rhs)
    dl2, dr2 = pb2(ct)
    for a, b in ((y, y2), (dl, dl2), (dr, dr2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if name == "bf16":
        _close(y, jax.lax.dot_general(lhs, rhs, dims, precision=HI), rtol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("n", [256, 257])
def test_jit_grad_with_rhs_contracted_on_its_last_axis(name, n):
    """``x [..., K] . w [N, K]^T`` (a tied embedding as LM head) with bf16 operands and a
    float32 result, under jit and grad. XLA:CPU used to fold the transpose of dW into the
    wgrad dot and fail ("DotThunk: BF16 x BF16 = F32"); the gradients must also equal those
    of the same product written with the weight already transposed."""
    x = jax.random.normal(jax.random.key(1), (2, 32, 64), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(2), (n, 64), jnp.float32)
    ct = jax.random.normal(jax.random.key(3), (2, 32, n), jnp.float32)

    def f(x, w, dims):
        y = quantized_dot_general(
            x,
            w,
            dims,
            name,
            key=KEY,
            operand_dtype=jnp.bfloat16,
            preferred_element_type=jnp.float32,
        )
        return jnp.sum(y * ct)

    g = jax.jit(jax.grad(f, argnums=(0, 1)), static_argnums=2)
    dx, dw = g(x, w, (((2,), (1,)), ((), ())))
    dx2, dwt = g(x, w.T, (((2,), (0,)), ((), ())))
    assert dw.dtype == jnp.float32 and dx.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx2, np.float32))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dwt).T)


def test_flax_nnx_linear_and_dtypes():
    dg = make_dot_general("nvfp4", key=jax.random.key(1))
    lin = nnx.Linear(64, 32, dot_general=dg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 16, 64), jnp.bfloat16)

    @nnx.jit
    def step(m, x):
        return nnx.value_and_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2))(m)

    loss, grads = step(lin, x)
    assert np.isfinite(float(loss))
    assert grads["kernel"][...].dtype == jnp.float32  # master-weight dtype preserved
    assert grads["kernel"][...].shape == (64, 32)
    # preferred_element_type picks the output dtype.
    y = dg(
        x,
        lin.kernel[...].astype(jnp.bfloat16),
        (((2,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    assert y.dtype == jnp.float32 and y.shape == (2, 16, 32)


# ---- randomness ------------------------------------------------------------------------


def test_key_contract():
    x, w, dy = _data()
    # Forward of nvfp4 is all round-to-nearest: no key needed (inference).
    qdot(x, w, "nvfp4")
    with pytest.raises(ValueError, match="stochastic rounding: pass key"):
        jax.vjp(lambda w: qdot(x, w, "nvfp4"), w)[1](dy)
    a = _vjp("nvfp4", x, w, dy, jax.random.key(1))
    b = _vjp("nvfp4", x, w, dy, jax.random.key(1))
    c = _vjp("nvfp4", x, w, dy, jax.random.key(2))
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(c[0]))  # fprop: RNE
    assert not np.array_equal(np.asarray(a[1]), np.asarray(c[1]))  # dgrad: SR
    assert not np.array_equal(np.asarray(a[2]), np.asarray(c[2]))  # wgrad: SR
    # Without stochastic rounding the key does not matter.
    d = _vjp("nvfp4_no_sr", x, w, dy, jax.random.key(1))
    e = _vjp("nvfp4_no_sr", x, w, dy, jax.random.key(2))
    for u, v in zip(d, e, strict=True):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.slow
def test_sr_dgrad_is_unbiased():
    """Mean of dX = Q_sr(dY) Wq^T over many keys -> E[Q_sr(dY)] Wq^T.

    E[Q_sr(v)] is v itself except where an element saturates: the E4M3 block scale is
    rounded to nearest, so a block's largest element can map slightly above 6 and is
    clipped (the recipe does this too). The exact expectation is therefore
    clip(v * enc, -6, 6) / enc * (sb * s_dec), computed from formats' block scales.
    Bound: per sample var(Q_sr(v)) <= gap^2 / 4 with gap <= 2 * sb * s_dec (the widest
    E2M1 step), so var(dX_mk) <= sum_n gap_mn^2 W_kn^2 / 4; with n samples we require
    every |mean - E| <= 5 sigma / sqrt(n) (CLT; 1024 entries, false alarm < 1e-3).
    """
    m, k, n, samples = 16, 64, 64, 2000
    x, w, dy = _data(m, k, n, seed=5)
    recipe = get_recipe("nvfp4")
    keys = jax.random.split(jax.random.key(9), samples)

    def dgrad(key):
        return jax.vjp(lambda x: qdot(x, w, recipe, key=key), x)[1](dy)[0]

    dxs = jax.jit(jax.vmap(dgrad))(keys)
    mean = np.asarray(jnp.mean(dxs, axis=0), np.float64)

    q = quantize(dy, "nvfp4", axis=-1)
    sb = np.repeat(np.asarray(block_scales_f32(q)), 16, axis=-1)[:, :n]
    s_dec = float(q.global_scale)
    unit = sb * s_dec
    enc = np.where(unit > 0, 1.0 / np.where(unit > 0, unit, 1), 0.0)
    expect_dy = np.clip(np.asarray(dy, np.float64) * enc, -6, 6) * unit
    wq = np.asarray(_fq(w, recipe.dgrad_w, -1, None, "dgrad_w", 0), np.float64)
    expect = expect_dy @ wq.T
    sigma = np.sqrt((2 * unit) ** 2 / 4 @ (wq.T**2))
    z = np.abs(mean - expect) / (sigma / np.sqrt(samples) + 1e-12)
    assert z.max() < 5, f"max z-score {z.max():.2f}"
    # Power check: round-to-nearest is biased under the same yardstick.
    rne = np.asarray(_vjp("nvfp4_no_sr", x, w, dy, KEY)[1], np.float64)
    z_rne = np.abs(rne - expect) / (sigma / np.sqrt(samples) + 1e-12)
    assert z_rne.max() > 20


def _sr_probe(m=64):
    """dY built so that stochastic rounding of every non-diagonal element is a fair coin
    in both SR slots: in each 16x16 tile the diagonal holds the tensor amax ``A`` (each
    1x16 and 16x1 block then has block amax ``A``, so its scale maps ``A`` to 6) and the
    other elements are ``+-1.25 A / 6``: midway between E2M1 1 and 1.5."""
    rng = np.random.default_rng(0)
    a = 3.0
    tile = np.eye(16, dtype=bool)
    diag = np.tile(tile, (m // 16, m // 16))
    dy = np.where(diag, a, 1.25 * a / 6) * rng.choice([-1.0, 1.0], (m, m))
    return jnp.asarray(dy, jnp.float32), ~diag, a


def test_sr_slots_fair_and_independent_at_ops_level():
    """Through the layer's VJP (X = I and W = I expose the quantized dY of each GEMM):
    dgrad's and wgrad's stochastic rounding round a 50/50 element up half the time (a
    1.5% bias in P(up) is ~15 standard errors here), and the two slots draw independent
    noise (one key shared by the slots would make their decisions identical)."""
    m, samples = 64, 64
    dy, live, a = _sr_probe(m)
    eye = jnp.eye(m)
    recipe = get_recipe("nvfp4_no_rht")
    keys = jax.random.split(jax.random.key(11), samples)
    out = jax.jit(jax.vmap(lambda k: _vjp_jit(recipe, eye, eye, dy, k, None)))(keys)
    step_ = a / 6 * 0.5  # the E2M1 step between 1 and 1.5, in dY units
    up = {}
    for name, q in (("dgrad", out[1]), ("wgrad", out[2])):
        q = np.abs(np.asarray(q, np.float64))[:, live]
        lo = 1.0 * a / 6
        assert np.all(np.isclose(q, lo) | np.isclose(q, lo + step_)), name
        up[name] = q > lo + step_ / 2
        n = up[name].size
        frac = up[name].mean()
        assert abs(frac - 0.5) < 5 * 0.5 / np.sqrt(n), (name, frac)
    corr = np.corrcoef(up["dgrad"].ravel(), up["wgrad"].ravel())[0, 1]
    assert abs(corr) < 5 / np.sqrt(up["dgrad"].size), corr


# ---- structure -------------------------------------------------------------------------


@pytest.mark.slow
def test_2d_weights_same_w_in_fprop_and_dgrad():
    """X = I and dY = I expose the W each GEMM sees: Y = W_fprop, dX = W_dgrad^T."""
    k = 48
    w = jax.random.normal(jax.random.key(4), (k, k))
    eye = jnp.eye(k)  # quantizes exactly (one nonzero per block)
    for name, same in (("nvfp4", True), ("nvfp4_no_sr", True), ("nvfp4_1d", False)):
        y, dx, _ = _vjp(name, eye, w, eye, KEY)
        assert np.array_equal(np.asarray(y), np.asarray(dx).T) == same, name
        want = np.asarray(_fq(w, get_recipe(name).fprop_w, 0, None, "fprop_w", 0))
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-6)


def test_rht_invisible_without_quantization():
    """With every operand in bf16, rotating both wgrad operands leaves dW unchanged
    (up to the bf16 rounding of the rotated operands), and the rotation really runs: dW
    equals the explicitly rotated reference to float32 accuracy, where the unrotated
    bf16 product is off by its (different) bf16 rounding."""
    x, w, dy = _data(m=64)
    rht = Recipe(
        name="rht_only", wgrad_x=OperandSpec(hadamard=16), wgrad_dy=OperandSpec(hadamard=16)
    )
    plain = _vjp("bf16", x, w, dy, KEY)
    rotated = _vjp(rht, x, w, dy, KEY)
    exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    np.testing.assert_array_equal(np.asarray(plain[0]), np.asarray(rotated[0]))
    np.testing.assert_array_equal(np.asarray(plain[1]), np.asarray(rotated[1]))
    _close(rotated[2], exact, rtol=1e-2)
    _close(plain[2], exact, rtol=1e-2)
    want = reference(rht, x, w, dy, KEY)[2]  # bf16(X^T R) . bf16(R^T dY), explicitly
    _close(rotated[2], want, rtol=2e-6)
    err_plain = np.max(np.abs(np.asarray(plain[2]) - np.asarray(want)))
    assert err_plain > 100 * np.max(np.abs(np.asarray(rotated[2]) - np.asarray(want)))
    # A recipe whose two sides used different rotations would not cancel:
    xr = random_hadamard(x.T, -1, seed_or_key=0)
    dyr = random_hadamard(dy.T, -1, seed_or_key=1)
    assert np.max(np.abs(np.asarray(xr @ dyr.T) - exact)) > 0.1 * np.max(np.abs(exact))


def _lineages(jaxpr, env):
    """Walk a jaxpr (recursively through sub-jaxprs); return the lineage (set of op
    tags upstream) of both operands of every bf16 x bf16 dot_general whose operands
    both derive from the layer's inputs (tagged "input"): the GEMMs. A ``jit`` equation
    is tagged with its function's name (``jit:NAME``)."""
    from jax.extend import core as jcore

    def lin(v):
        return frozenset() if isinstance(v, jcore.Literal) else env.get(v, frozenset())

    dots = []
    for eqn in jaxpr.eqns:
        ins = [lin(v) for v in eqn.invars]
        subs = [p for p in eqn.params.values() if isinstance(p, jcore.Jaxpr | jcore.ClosedJaxpr)]
        if eqn.primitive.name == "dot_general" and all(
            getattr(v.aval, "dtype", None) == jnp.bfloat16 and "input" in lin(v) for v in eqn.invars
        ):
            dots.append(tuple(ins))
        tag = eqn.primitive.name
        if tag == "jit":  # a named function: the Hadamard transform is one
            tag += f":{eqn.params['name']}"
        if tag == "convert_element_type":
            tag += f"->{eqn.params['new_dtype']}"
        out = frozenset().union(*ins) | {tag}
        for sub in subs:
            sj = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
            if len(sj.invars) == len(eqn.invars):
                sub_env = dict(zip(sj.invars, ins, strict=True))
                sub_dots, sub_env = _lineages(sj, sub_env)
                dots += sub_dots
                for o, so in zip(eqn.outvars, sj.outvars, strict=False):
                    so_lin = (
                        frozenset()
                        if isinstance(so, jcore.Literal)
                        else sub_env.get(so, frozenset())
                    )
                    env[o] = so_lin | out
        for o in eqn.outvars:
            env.setdefault(o, out)
    return dots, env


def _gemm_operand_lineages(name):
    x, w, dy = _data(dtype=jnp.bfloat16)

    def f(x, w, dy):
        y, pb = jax.vjp(lambda x, w: qdot(x, w, name, key=KEY), x, w)
        return (y,) + pb(dy)

    closed = jax.make_jaxpr(f)(x, w, dy)
    dots, _ = _lineages(closed.jaxpr, {v: frozenset({"input"}) for v in closed.jaxpr.invars})
    return dots


def test_jaxpr_all_three_gemms_quantized_for_nvfp4():
    dots = _gemm_operand_lineages("nvfp4")
    assert len(dots) == 3, "fprop, dgrad, wgrad"
    for lhs, rhs in dots:
        for side in (lhs, rhs):
            assert "reduce_max" in side  # block/tensor amax: the operand was quantized
            # rounding to the E2M1 grid (RNE: round; SR: floor + uniform) and to E4M3 scales
            assert "round" in side or "floor" in side
    # The Hadamard transform feeds only the wgrad operands.
    rht = "jit:_hadamard_butterfly"
    assert [(rht in lhs, rht in rhs) for lhs, rhs in dots] == [(False, False)] * 2 + [(True, True)]
    no_rht = _gemm_operand_lineages("nvfp4_no_rht")
    assert len(no_rht) == 3 and not any(rht in a or rht in b for a, b in no_rht)
    fwd_only = _gemm_operand_lineages("nvfp4_fwd_only")
    assert len(fwd_only) == 3
    assert sum("reduce_max" in a and "reduce_max" in b for a, b in fwd_only) == 1


def test_jaxpr_no_gemm_quantized_for_bf16():
    dots = _gemm_operand_lineages("bf16")
    assert len(dots) == 3
    for lhs, rhs in dots:
        for side in (lhs, rhs):
            assert "reduce_max" not in side and "max" not in side
            assert not any("float8" in t for t in side)


@pytest.mark.slow
def test_raw_prng_key_remat_and_vector_lhs():
    x, w, _ = _data(m=16, k=32, n=16)
    loss = lambda x, w, k: jnp.sum(qdot(x, w, "nvfp4", key=k) ** 2)
    g_raw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w, jax.random.PRNGKey(0))
    g_remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(x, w, jax.random.PRNGKey(0))
    for a, b in zip(g_raw, g_remat, strict=True):  # remat may reassociate f32 scaling
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert qdot(x[0], w, "nvfp4").shape == (16,)
