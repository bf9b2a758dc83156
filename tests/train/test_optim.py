"""The optimizer's own part (``train/optim.py``): Adam's scaling against optax's rule, and
one update alone and under ``jax.vmap`` (a seed batch) within what the arithmetic allows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from microscale.train import OptimConfig
from microscale.train.optim import make_optimizer, scale_by_adam

# Leaves of the shapes a small model has: odd sizes (the pairwise sum's zero padding), a
# vector, a matrix, a 3-D stack.
SHAPES = [(257, 64), (64,), (64, 128), (3, 5, 7), (1,)]


def _tree(seed: int, scale: float = 1e-2) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        f"w{i}": jnp.asarray(rng.normal(size=s).astype(np.float32) * scale)
        for i, s in enumerate(SHAPES)
    }


def _stack(trees):
    return jax.tree.map(lambda *x: jnp.stack(x), *trees)


def test_adam_is_optax_rule_with_its_state():
    """Three steps from the same state: optax's ``scale_by_adam`` and ours agree to a few
    float32 ulps (ours multiplies by the bias corrections' reciprocals where optax divides:
    two roundings instead of one, <= 2 * 2^-24 each for the two moments), and the states
    have one structure (checkpoints made by either restore into the other)."""
    ours, ref = scale_by_adam(0.9, 0.95, 1e-8), optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8)
    p = _tree(1)
    so, sr = ours.init(p), ref.init(p)
    assert jax.tree.structure(so) == jax.tree.structure(sr)
    for step in range(3):
        g = _tree(10 + step)
        uo, so = ours.update(g, so)
        ur, sr = ref.update(g, sr)
        for a, b in zip(jax.tree.leaves(uo), jax.tree.leaves(ur), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=8 * 2.0**-24, atol=0)
        for a, b in zip(jax.tree.leaves(so), jax.tree.leaves(sr), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_update_alone_and_in_a_seed_batch_within_one_rounding_per_op():
    """The trainer's optimizer (clip, Adam, decay) on a multi-leaf tree, for three seeds
    alone and vmapped (``experiments/seeds.py``), from states that are inputs (not the
    constant zeros of an init the compiler folds), with the clip active.

    The clip's global norm is a float32 reduction over ``N`` elements in the backend's
    order, so alone and batched it differs by at most ``2 (N - 1) u`` relative (``u =
    2^-24``, two summation orders each within ``(N - 1) u`` of the exact sum, Higham
    4.2), and so does every clipped gradient (plus one rounding of the product). The
    elementwise rest may differ too: XLA:CPU lets LLVM contract ``a * b + c`` into one
    fused multiply-add, and whether it does depends on how the loop over a leaf is
    emitted. So each moment is within two roundings of its two-term sum plus what the
    clip moved, ``|dm| <= 2u (b1 |m0| + (1 - b1) |g|) + (1 - b1) |dg|`` (likewise ``v``
    with ``g^2``, ``|d g^2| <= 2 |g dg|``), and the update within what those move it plus
    four roundings: ``|du| <= r1 |dm| / (sqrt(v r2) + eps) + |u| (|dv| / 2v + 4u)``."""
    b1, b2, eps, u = 0.9, 0.95, 1e-8, 2.0**-24
    tx = make_optimizer(OptimConfig(grad_clip=1.0, weight_decay=0.0, betas=(b1, b2), eps=eps))
    params = [_tree(s) for s in range(3)]
    grads = [_tree(100 + s, scale=1.0) for s in range(3)]  # norm > 1: the clip applies
    n_total = sum(x.size for x in jax.tree.leaves(grads[0]))
    clip_rel = 2 * (n_total - 1) * u + u
    states = [jax.jit(tx.init)(p) for p in params]
    for _ in range(3):
        step = lambda g, s, p: tx.update(g, s, p)
        alone = [jax.jit(step)(g, s, p) for g, s, p in zip(grads, states, params, strict=True)]
        batch = _unstack(jax.jit(jax.vmap(step))(_stack(grads), _stack(states), _stack(params)), 3)
        for (ua, sa), (ub, sb), s0, g_raw in zip(alone, batch, states, grads, strict=True):
            adam0, adam_a, adam_b = s0[1], sa[1], sb[1]
            assert int(adam_a.count) == int(adam_b.count)
            n = int(adam_a.count)
            r1, r2 = 1 / (1 - b1**n), 1 / (1 - b2**n)
            scale = min(1.0, 1.0 / float(optax.tree.norm(g_raw)))
            for k in g_raw:
                g_ = np.asarray(g_raw[k], np.float64) * scale
                m0, v0 = (np.asarray(x[k], np.float64) for x in (adam0.mu, adam0.nu))
                dg = clip_rel * np.abs(g_)
                dm_max = 2 * u * (b1 * np.abs(m0) + (1 - b1) * np.abs(g_)) + (1 - b1) * dg
                dv_max = 2 * u * (b2 * v0 + (1 - b2) * g_**2) + (1 - b2) * 2 * np.abs(g_) * dg
                ma, mb = np.asarray(adam_a.mu[k], np.float64), np.asarray(adam_b.mu[k], np.float64)
                va, vb = np.asarray(adam_a.nu[k], np.float64), np.asarray(adam_b.nu[k], np.float64)
                assert np.all(np.abs(ma - mb) <= dm_max), k
                assert np.all(np.abs(va - vb) <= dv_max), k
                a, b = np.asarray(ua[k], np.float64), np.asarray(ub[k], np.float64)
                du_max = r1 * dm_max / (np.sqrt(va * r2) + eps) + np.abs(a) * (
                    dv_max / (2 * va) + 4 * u
                )
                assert np.all(np.abs(a - b) <= du_max), k
        states = [s for _, s in alone]


def _unstack(tree, n: int) -> list:
    return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]
