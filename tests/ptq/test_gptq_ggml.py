"""GPTQ on ggml's block grids (ptq.gptq.gptq_ggml): a plain float64 reference per type and
weighting, identity Hessian = the encoder's scales with nearest codes, output error below
ggml's own encoder's, and the engine's quantize_group path."""

from __future__ import annotations

import numpy as np
import pytest

from microscale.formats import dequantize
from microscale.formats.ggml import (
    dequantize_ggml,
    ggml_codes,
    ggml_grid,
    quantize_ggml,
    row_sigma2,
)
from microscale.formats.spec import GGML_FORMATS
from microscale.ptq import WeightPTQ
from microscale.ptq.gptq import gptq_ggml
from microscale.ptq.weights import quantize_group

from .test_gptq import paper_setup

TYPES = [f for f, s in GGML_FORMATS.items() if s.ggml_codec != "q8"]  # Q8_0: JAX's GPTQ


def reference_gptq_ggml(w_t, hessian, fmt, importance=None, damp=0.01):
    """GPTQ as the paper states it (Algorithm 1, no lazy batches), float64, one column at a
    time with the error moved onto every later column at once. When a column starts one of
    ggml's blocks, ggml's encoder fixes the block's scales from the updated weights (the
    legacy types' imatrix fit with the given row's mean square); each column takes
    the decoded level nearest it, found by brute force over every code."""
    w, u = paper_setup(w_t, hessian, damp)
    k = w.shape[1]
    spec = GGML_FORMATS[fmt]
    bs = spec.super_block or spec.block_size
    legacy = spec.ggml_codec in ("sym", "asym") and importance is not None
    sig = row_sigma2(w_t) if legacy else None  # the given row's, as ggml computes it
    for j in range(k):
        g0 = (j // bs) * bs
        if j == g0:
            imp = None if importance is None else importance[g0 : g0 + bs]
            fixed = quantize_ggml(w[:, g0 : g0 + bs].astype(np.float32), fmt, imp, sigma2=sig)
            grid = ggml_grid(fixed, fmt, bs)
            every = np.stack(
                [grid.values(np.full((w.shape[0], bs), c)) for c in range(len(grid.levels))], -1
            ).astype(np.float64)
        cand = every[:, j - g0]  # [out, levels]
        q = cand[np.arange(w.shape[0]), np.abs(cand - w[:, j : j + 1]).argmin(1)]
        err = (w[:, j] - q) / u[j, j]
        w[:, j:] -= np.outer(err, u[j, j:])
        w[:, j] = q
    return w


def _layer(seed, out=8, k=512, n=1024):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((out, k)) * np.exp(rng.standard_normal((out, 1)))).astype(np.float32)
    x = rng.standard_normal((n, k)) @ (np.eye(k) + 0.2 * rng.standard_normal((k, k)))
    x[:, rng.choice(k, 8, replace=False)] *= 10.0  # a few heavy input channels
    h = 2.0 * x.T @ x / n
    h[7, :] = h[:, 7] = 0.0  # an input never active in calibration
    imp = (np.diag(h) / 2.0).astype(np.float32)  # llama.cpp's imatrix: mean x^2 per input
    return w, h, imp


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("fmt", TYPES)
def test_matches_the_plain_reference(fmt, weighted):
    w, h, imp = _layer(GGML_FORMATS[fmt].ggml_type)
    imp = imp if weighted else None
    got = dequantize_ggml(gptq_ggml(w, h, fmt, importance=imp), fmt, 512)
    want = reference_gptq_ggml(w, h, fmt, imp)
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("fmt", TYPES)
def test_identity_hessian_keeps_the_encoders_scales_and_rounds_to_nearest(fmt):
    """Nothing propagates: the bytes outside the codes are the encoder's, every code is the
    nearest level of that grid, so no element's error exceeds the encoder's own."""
    w, _, imp = _layer(3)
    got = gptq_ggml(w, np.eye(512), fmt, importance=imp)
    enc = quantize_ggml(w, fmt, imp)
    grid = ggml_grid(enc, fmt, 512)
    assert np.array_equal(ggml_grid(got, fmt, 512).scale, grid.scale)
    assert np.array_equal(ggml_codes(got, fmt, 512), grid.nearest(w))
    e_got = np.abs(dequantize_ggml(got, fmt, 512) - w)
    e_enc = np.abs(dequantize_ggml(enc, fmt, 512) - w)
    assert np.all(e_got <= e_enc)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_k", "q3_k", "iq4_xs", "q6_k"])
def test_output_error_below_ggmls_encoder(fmt):
    """``tr((Q - W) H (Q - W)^T)``, the calibration output error GPTQ minimises greedily,
    below ggml's own encoder's with the same importance weights (a wide margin here: the
    inputs are correlated, and 64 rows give every type many blocks)."""
    w, h, imp = _layer(11, out=64)

    def out_err(q):
        d = (q - w).astype(np.float64)
        return float(np.einsum("ij,jk,ik->", d, h, d))

    gptq = out_err(dequantize_ggml(gptq_ggml(w, h, fmt, importance=imp), fmt, 512))
    rtn = out_err(dequantize_ggml(quantize_ggml(w, fmt, imp), fmt, 512))
    assert gptq < 0.8 * rtn, (gptq, rtn)


def test_quantize_group_runs_gptq_on_a_ggml_grid():
    w, h, imp = _layer(5)
    kernel = w.T  # [in, out]
    (q,) = quantize_group([kernel], "q4_k", WeightPTQ(method="gptq"), [h], [imp])
    assert q.format == "q4_k" and q.qarray.scales is None
    assert np.array_equal(np.asarray(q.qarray.data), gptq_ggml(w, h, "q4_k", importance=imp))
    vals = np.asarray(dequantize(q.qarray))
    assert np.array_equal(vals, dequantize_ggml(np.asarray(q.qarray.data), "q4_k", 512))
    n = float(np.sum(w.astype(np.float64) ** 2))
    assert q.rel_mse == pytest.approx(float(np.sum((vals - w) ** 2)) / n, rel=1e-5)
    rtn = dequantize_ggml(quantize_ggml(w, "q4_k"), "q4_k", 512)
    assert q.rel_mse_rtn == pytest.approx(float(np.sum((rtn - w) ** 2)) / n, rel=1e-5)


def test_refusals():
    w, h, imp = _layer(1)
    with pytest.raises(ValueError, match=r"hessian has shape \(4, 4\); .* needs \[512, 512\]"):
        gptq_ggml(w, np.eye(4), "q4_0")
    with pytest.raises(ValueError, match=r"importance of shape \(3,\); expected \(512,\)"):
        gptq_ggml(w, h, "q4_0", importance=np.ones(3))
    with pytest.raises(ValueError, match=r"q4_k: a row of 96 is not a multiple of 256"):
        gptq_ggml(w[:, :96], h[:96, :96], "q4_k")
    with pytest.raises(ValueError, match=r"expected a 2-D \[out, in\] weight"):
        gptq_ggml(w[0], h, "q4_0")
