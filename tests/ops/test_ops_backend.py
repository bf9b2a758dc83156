"""Backends: the capability probe, and the native path's data plumbing.

Real native kernels need an NVIDIA GPU (FP8: compute capability >= 8.9, block-scaled
NVFP4/MXFP8: >= 10.0); ``test_native_matches_emulated_on_device`` runs there and skips
elsewhere. On CPU the plumbing (element dtypes, scale expansion of 16x16 tiles, layouts,
tensor scales) is checked by standing in ``jax.nn.scaled_matmul``'s documented reference
formula for the cuDNN kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from microscale.ops import backend, get_recipe, native_supported, qdot

NATIVE_RECIPES = ["nvfp4", "nvfp4_1d", "mxfp8", "mxfp4_rht_sr", "fp8"]


def _fwd_bwd(name, backend_name):
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 40, 64)) * 3
    w = jax.random.normal(kw, (64, 48)) / 8
    dy = jax.random.normal(kd, (2, 40, 48))
    key = jax.random.key(5)

    @jax.jit
    def f(x, w, dy):
        y, pb = jax.vjp(lambda x, w: qdot(x, w, name, key=key, backend=backend_name), x, w)
        return (y,) + pb(dy)

    return f(x, w, dy)


def _reference_scaled_matmul(lhs, rhs, lhs_scales, rhs_scales, preferred_element_type):
    """jax.nn.scaled_matmul's documented semantics, in float32."""
    a = lhs.astype(jnp.float32) * jnp.repeat(
        lhs_scales.astype(jnp.float32), lhs.shape[-1] // lhs_scales.shape[-1], axis=-1
    )
    b = rhs.astype(jnp.float32) * jnp.repeat(
        rhs_scales.astype(jnp.float32), rhs.shape[-1] // rhs_scales.shape[-1], axis=-1
    )
    return jnp.einsum("bmk,bnk->bmn", a, b, precision=jax.lax.Precision.HIGHEST).astype(
        preferred_element_type
    )


def test_probe_on_this_machine():
    cc = backend.device_capability()
    if jax.devices()[0].platform != "gpu":
        assert cc is None and not native_supported(get_recipe("nvfp4"))
    assert backend.resolve_backend("emulated", get_recipe("nvfp4")) == "emulated"
    assert backend.resolve_backend("auto", get_recipe("bf16")) == "emulated"
    if cc is None:
        assert backend.resolve_backend("auto", get_recipe("nvfp4")) == "emulated"
        with pytest.raises(ValueError, match="backend='native' is not available"):
            backend.resolve_backend("native", get_recipe("nvfp4"))


def test_probe_thresholds(monkeypatch):
    r = get_recipe
    monkeypatch.setattr(backend, "device_capability", lambda: (9, 0))  # Hopper
    assert native_supported(r("fp8")) and not native_supported(r("nvfp4"))
    assert not native_supported(r("mxfp8"))
    monkeypatch.setattr(backend, "device_capability", lambda: (10, 0))  # Blackwell
    assert all(native_supported(r(n)) for n in NATIVE_RECIPES)
    assert native_supported(r("nvfp4_fwd_only"))  # bf16 backward GEMMs are native bf16 dots
    monkeypatch.setattr(backend, "device_capability", lambda: (8, 0))  # Ampere
    assert not native_supported(r("fp8"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NATIVE_RECIPES)
def test_native_plumbing_matches_emulated(monkeypatch, name):
    from microscale.ops import dot

    calls = []

    def counting(*args, **kwargs):
        calls.append(args[1].format)
        return backend.native_gemm(*args, **kwargs)

    monkeypatch.setattr(backend, "device_capability", lambda: (10, 0))
    monkeypatch.setattr(jax.nn, "scaled_matmul", _reference_scaled_matmul)
    monkeypatch.setattr(dot, "native_gemm", counting)
    native = _fwd_bwd(name, "native")
    assert len(calls) == 3  # fprop, dgrad, wgrad all took the native path
    emulated = _fwd_bwd(name, "emulated")
    for a, b in zip(native, emulated, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 2e-6 * np.max(np.abs(b))


@pytest.mark.skipif(
    not native_supported(get_recipe("fp8")),
    reason="needs an NVIDIA GPU with compute capability >= 8.9",
)
@pytest.mark.parametrize("name", NATIVE_RECIPES)
def test_native_matches_emulated_on_device(name):  # pragma: no cover - hardware only
    if not native_supported(get_recipe(name)):
        pytest.skip(f"{name}: no native kernel on this device")
    native = _fwd_bwd(name, "native")
    emulated = _fwd_bwd(name, "emulated")
    for a, b in zip(native, emulated, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(b))
