"""Sharded == unsharded on 8 fake CPU devices (in a subprocess: XLA_FLAGS must be set
before jax is imported, and the parent process has already imported it)."""

import textwrap

import pytest

CHILD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from microscale.ops import qdot

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (64, 96)).at[3, 5].set(40.0)  # outlier in one shard only
    w = jax.random.normal(kw, (96, 64)) / 10
    dy = jax.random.normal(kd, (64, 64)).at[60, 1].set(-30.0)
    key = jax.random.key(7)

    def step(recipe):
        def f(x, w, dy, key):
            y, pb = jax.vjp(lambda x, w: qdot(x, w, recipe, key=key), x, w)
            return (y,) + pb(dy)
        return f

    layouts = {  # (x, w, dy) partition specs
        "tokens x out": (P("data", None), P(None, "model"), P("data", "model")),
        "contraction": (P(None, "model"), P("model", None), P("data", None)),
    }
    cases = [("nvfp4", "tokens x out"), ("nvfp4", "contraction"), ("mxfp4_rht_sr", "tokens x out"),
             ("fp8", "contraction"), ("bf16", "tokens x out")]
    refs = {}
    for recipe, label in cases:
        if recipe not in refs:
            refs[recipe] = jax.jit(step(recipe))(x, w, dy, key)
        sh = [NamedSharding(mesh, s) for s in layouts[label]]
        args = [jax.device_put(a, s) for a, s in zip((x, w, dy), sh)]
        out = jax.jit(step(recipe))(*args, key)
        assert len(out[0].sharding.device_set) > 1, "not actually sharded"
        for name, a, b in zip(("y", "dx", "dw"), out, refs[recipe]):
            a, b = np.asarray(a), np.asarray(b)
            # Quantized operands are identical; only GEMM summation order may differ.
            err = np.max(np.abs(a - b)) / np.max(np.abs(b))
            assert err < 1e-5, (recipe, label, name, err)
    print("SHARDED_OK")
""")


@pytest.mark.slow
def test_sharded_equals_unsharded_on_8_devices(fake_devices):
    assert "SHARDED_OK" in fake_devices(CHILD)
