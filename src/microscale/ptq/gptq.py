"""GPTQ error compensation (Frantar et al., 2022) for block-scaled formats.

Round-to-nearest quantizes each weight on its own. GPTQ quantizes a linear layer
``Y = X W^T`` (``W^T [out, in]``, the export layout) one input column at a time and moves
each column's rounding error onto the columns not yet quantized, weighted by the inverse
Hessian of the layer's output error, ``H = 2 X^T X / n`` over calibration inputs ``X``:

    for column j in order:
        q_j = Q(w_j)                               # rounded with the format's scales
        e   = (w_j - q_j) / U[j, j]                # U: upper Cholesky factor of H^-1
        w_k -= e * U[j, k]  for k > j              # error onto the remaining columns

which minimises ``||X W^T - X Q^T||^2`` greedily (the OBS update). Details, as the
reference implementation and llm-compressor / torchao do them:

* damping ``H += damp * mean(diag H) * I``; input features never active in calibration
  (``H[i, i] == 0``) get ``H[i, i] = 1`` and weight 0;
* **block scales**: when column ``j`` starts a block (16 columns for NVFP4, 32 for MX),
  that block's scales are fixed from the *current* (error-updated) weights of its columns
  with the format's own scale rule (``microscale.formats.quantize``; four over six
  included), and each of its columns is then rounded with them
  (``microscale.formats.requantize``). The tensor scale (NVFP4's FP32 global scale, a
  per-tensor FP8 scale) is fixed once up front from ``amax`` (default the original
  weight's, or the MSE-searched one);
* lazy batch updates: columns are processed in blocks of ``block`` (128); inside a block
  the error updates only the block, the rest of the matrix once per block (one GEMM); the
  same again one level down: inside a format block (16 / 32 columns) a column's error
  updates only that format block, the rest of the lazy block once per format block.

The Cholesky factorisation runs in float64 numpy (at most three ``[in, in]`` float64
arrays at once, :func:`inverse_hessian_factor`), the column loop in float32 under
``jit`` (``lax.fori_loop``). The result is an ordinary :class:`~microscale.formats.QArray`
of the format: any reader decodes it, only the values differ from round-to-nearest. With
an identity Hessian nothing propagates and the result equals round-to-nearest exactly.

**ggml's block types** (Q4_K, IQ4_XS, ...: :func:`gptq_ggml`) run the same loop on the host,
in float64 numpy, one format block (32 columns, or a 256-column super-block) at a time:
when its first column is reached, ggml's own encoder (:func:`~microscale.formats.ggml.
quantize_ggml`, with the layer's importance weights) fixes the block's scales and minimums
from the current weights of its columns, exactly as it would encode them; each column is
then rounded to the nearest value of that grid (:class:`~microscale.formats.ggml.GgmlGrid`:
``scale * levels[code] + offset``), its error moved onto the block's later columns, and
the block's errors onto the rest of the matrix in one GEMM. The bytes are the encoder's
with the codes GPTQ chose (:func:`~microscale.formats.ggml.ggml_with_codes`). Q4_0 .. Q5_1
weight their imatrix fit by the mean square of the whole row: the given row's, as ggml
computes it, so that with an identity Hessian every type keeps exactly the encoder's scales.

The Hessians come from the full-precision model (:meth:`~microscale.ptq.engine.Engine.
input_hessians`, one forward per calibration batch), not sequentially from the already
quantized earlier layers as the original paper does: every layer and format is then
independent, so one calibration pass serves every candidate format of the search.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from microscale.formats import (
    FormatSpec,
    QArray,
    get_format,
    quantize,
    requantize,
    requantize_values,
    tensor_amax,
)
from microscale.formats.ggml import (
    ggml_grid,
    ggml_with_codes,
    quantize_ggml,
    row_bytes,
    row_sigma2,
)
from microscale.formats.spec import get_ggml_format

__all__ = ["gptq_ggml", "gptq_quantize", "inverse_hessian_factor", "padded_factor"]


def inverse_hessian_factor(hessian, damp: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
    """``(U, dead)``: the upper Cholesky factor of ``(H + damp * mean(diag H) I)^-1``
    (float64, Fortran order) after the dead-input fix (``H[i, i] == 0 -> 1``), and the
    dead-input mask.

    At most three float64 ``[in, in]`` arrays are alive at once (the damped copy, numpy's
    working copy and the Cholesky factor, inside ``np.linalg.cholesky``), two during the
    triangular solve, which overwrites its identity right-hand side. The LAPACK calls are
    those of the plain formula (``np.linalg.cholesky`` of the reversed matrix, then
    ``solve_triangular`` with an identity), on the same data, so ``U`` is the same to the
    bit; scipy's in-place ``potrf`` / ``trtri`` would save one more array but change
    ``U`` in its last float64 bits and, rarely, in float32 (tests/ptq/test_gptq.py)."""
    h = np.array(hessian, np.float64)
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"gptq: hessian has shape {h.shape}; expected a square [in, in]")
    if not np.all(np.isfinite(h)):
        raise ValueError("gptq: hessian has NaN or infinite entries")
    if not (np.isfinite(damp) and damp >= 0):
        raise ValueError(f"gptq: damp={damp!r}: expected a finite fraction >= 0 (e.g. 0.01)")
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    h[np.diag_indices_from(h)] += damp * float(np.mean(np.diag(h)))
    # H = R R^T with R upper (the Cholesky factor of H with rows and columns reversed), so
    # H^-1 = R^-T R^-1 and U = R^-1: one factorisation and one triangular solve R U = I.
    try:
        low = np.linalg.cholesky(h[::-1, ::-1])
    except np.linalg.LinAlgError:
        raise ValueError(
            f"gptq: the damped Hessian is not positive definite (damp={damp}); raise damp"
        ) from None
    del h
    r = np.asfortranarray(low[::-1, ::-1])  # the copy solve_triangular would make
    del low
    upper = scipy.linalg.solve_triangular(
        r, np.eye(len(r), order="F"), lower=False, overwrite_b=True, check_finite=False
    )
    return upper, dead


def padded_factor(upper: np.ndarray, block: int) -> np.ndarray:
    """``U`` in float32, padded to a multiple of ``block`` with an identity: ``[Kp, Kp]``,
    the ``u`` of the column loop. Written straight into float32 (no padded float64 copy);
    the entries are ``U``'s rounded to nearest, as ``jnp.asarray(U, jnp.float32)``."""
    n = upper.shape[0]
    kp = n + (-n % block)
    u = np.zeros((kp, kp), np.float32)
    u[:n, :n] = upper
    u[np.arange(n, kp), np.arange(n, kp)] = 1.0
    return u


def gptq_quantize(
    w_t,
    hessian,
    fmt: str | FormatSpec,
    *,
    amax=None,
    four_over_six: bool = False,
    damp: float = 0.01,
    block: int = 128,
) -> QArray:
    """GPTQ-quantize ``w_t [out, in]`` along ``in`` (axis -1) given the layer's input
    Hessian ``[in, in]`` (module doc). ``amax``: tensor amax for formats with a tensor
    scale (default ``max|w_t|``); ``four_over_six``: per-block 4/6 scale choice (E4M3
    block scales); ``damp``: fraction of ``mean(diag H)`` added to the diagonal;
    ``block``: lazy-update block, a multiple of the format's block size. Returns a QArray
    in ``fmt`` (the export layout, as :func:`~microscale.ptq.weights.quantize_weight`)."""
    spec = get_format(fmt)
    w = jnp.asarray(w_t, jnp.float32)
    if w.ndim != 2:
        raise ValueError(f"gptq: expected a 2-D [out, in] weight, got shape {w.shape}")
    n_in = w.shape[1]
    if tuple(np.shape(hessian)) != (n_in, n_in):
        raise ValueError(
            f"gptq: hessian has shape {tuple(np.shape(hessian))}; the weight "
            f"[out, in] = {tuple(w.shape)} needs [{n_in}, {n_in}]"
        )
    group = spec.block_size or 16  # per-tensor scales: any group (columns unrolled per group)
    if isinstance(block, bool) or not isinstance(block, int) or block < 1 or block % group:
        raise ValueError(
            f"gptq: block={block!r}: expected a positive multiple of the format's "
            f"block size {group}"
        )
    if not spec.quantized:
        return quantize(w, spec, axis=-1)
    upper, dead = inverse_hessian_factor(hessian, damp)
    u = padded_factor(upper, block)
    del upper
    w = jnp.where(jnp.asarray(dead)[None, :], 0.0, w)
    a = tensor_amax(w_t) if amax is None else jnp.float32(amax)
    pad = -n_in % block
    u_dev = jnp.asarray(u)
    del u
    vals, scales = _gptq_loop(
        jnp.pad(w, ((0, 0), (0, pad))),
        u_dev,
        a if spec.has_tensor_scale else None,
        spec=spec,
        four6=bool(four_over_six),
        block=block,
        group=group,
    )
    template = quantize(
        w,
        spec,
        axis=-1,
        amax=a if spec.has_tensor_scale else None,
        four_over_six=bool(four_over_six),
    )
    if spec.block_size is not None:
        assert template.scales is not None  # a block-scaled QArray
        n_blocks = template.scales.shape[-1]
        stored = jax.lax.bitcast_convert_type(scales[:, :n_blocks], template.scales.dtype)
        template = QArray(
            template.data,
            stored,
            template.global_scale,
            template.spec,
            template.axis,
            template.shape,
            template.block_shape,
        )
    return requantize(vals[:, :n_in], template)


def gptq_ggml(
    w_t, hessian, fmt: str | FormatSpec, *, importance=None, damp: float = 0.01
) -> np.ndarray:
    """GPTQ-quantize ``w_t [out, in]`` along ``in`` on one of ggml's block grids (module
    doc): ggml's bytes ``[out, row_bytes]`` (uint8), as :func:`~microscale.formats.ggml.
    quantize_ggml` lays them out. ``importance``: the ``[in]`` importance weights the
    encoder fixes each block's scales with (llama.cpp's imatrix; None: its plain encoder);
    ``damp``: fraction of ``mean(diag H)`` added to the diagonal. With an identity Hessian
    nothing propagates: the encoder's scales, each value rounded to its nearest level."""
    spec = get_ggml_format(fmt)
    w = np.array(w_t, np.float64)
    if w.ndim != 2:
        raise ValueError(f"gptq_ggml: expected a 2-D [out, in] weight, got shape {w.shape}")
    n_out, n_in = w.shape
    if tuple(np.shape(hessian)) != (n_in, n_in):
        raise ValueError(
            f"gptq_ggml: hessian has shape {tuple(np.shape(hessian))}; the weight "
            f"[out, in] = {(n_out, n_in)} needs [{n_in}, {n_in}]"
        )
    row_bytes(spec, n_in)  # rows of whole blocks, else the type's own message
    imp = None if importance is None else np.asarray(importance, np.float32).reshape(-1)
    if imp is not None and imp.shape != (n_in,):
        raise ValueError(
            f"gptq_ggml: importance of shape {np.shape(importance)}; expected ({n_in},)"
        )
    # the legacy types' imatrix fit reads the row's mean square (quantize_ggml's sigma2)
    sig = row_sigma2(w) if imp is not None and spec.ggml_codec in ("sym", "asym") else None
    upper, dead = inverse_hessian_factor(hessian, damp)
    w[:, dead] = 0.0
    P = spec.super_block or spec.block_size
    assert P is not None and spec.block_bytes is not None
    out = np.empty((n_out, n_in // P, spec.block_bytes), np.uint8)
    for b0 in range(0, n_in, P):
        b1 = b0 + P
        g = w[:, b0:b1]  # a view: the block's columns become their quantized values
        fixed = quantize_ggml(
            g.astype(np.float32), spec, None if imp is None else imp[b0:b1], sigma2=sig
        )
        grid = ggml_grid(fixed, spec, P)
        u = upper[b0:b1, b0:b1]
        err = np.empty((n_out, P))
        codes = np.empty((n_out, P), np.int32)
        for j in range(P):
            col = slice(j, j + 1)
            c = grid.nearest(g[:, col], col)
            q = grid.values(c, col).astype(np.float64)[:, 0]
            e = (g[:, j] - q) / u[j, j]
            g[:, j + 1 :] -= np.outer(e, u[j, j + 1 :])
            g[:, j], codes[:, j], err[:, j] = q, c[:, 0], e
        w[:, b1:] -= err @ upper[b0:b1, b1:]  # the block's errors onto every later column
        out[:, b0 // P] = ggml_with_codes(fixed, spec, codes)
    return out.reshape(n_out, -1)


def _uint_of(dtype) -> jnp.dtype:
    return jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")


@functools.partial(jax.jit, static_argnames=("spec", "four6", "block", "group"))
def _gptq_loop(w, u, amax, *, spec: FormatSpec, four6: bool, block: int, group: int):
    """The column loop on padded ``w [out, Kp]`` and ``u [Kp, Kp]``: (quantized values
    ``[out, Kp]``, block scales as raw uints ``[out, Kp / group]``).

    Two levels of lazy updates: inside a format block the columns update only that block,
    then one GEMM carries the block's errors to the rest of its lazy block, and one more
    per lazy block to the rest of the matrix. All three levels are ``fori_loop``s: the
    column steps unrolled made a program 2.5-4x costlier to compile and no quicker to run
    (``[32, 128]`` nvfp4: 2.9 -> 1.1 s; ``[2048, 2048]`` mxfp4 warm: 1.30 -> 0.91 s; the
    values bit-identical)."""
    rows, kp = w.shape
    blocked = spec.block_size is not None
    sdt = _uint_of(spec.scale_dtype) if blocked else jnp.uint8
    scales0 = jnp.zeros((rows, kp // group if blocked else 1), sdt)

    def lazy(bi, carry):
        w, q, scales = carry
        i1 = bi * block
        w1 = jax.lax.dynamic_slice(w, (0, i1), (rows, block))
        u1 = jax.lax.dynamic_slice(u, (i1, i1), (block, block))

        def one_group(gi, c):
            w1, q1, e1, scales = c
            g0 = gi * group
            g = jax.lax.dynamic_slice(w1, (0, g0), (rows, group))
            ug = jax.lax.dynamic_slice(u1, (g0, 0), (group, block))
            ugg = jax.lax.dynamic_slice(ug, (0, g0), (group, group))
            fixed = quantize(g, spec, axis=-1, amax=amax, four_over_six=four6)
            if blocked:
                raw = jax.lax.bitcast_convert_type(fixed.scales, sdt)
                scales = jax.lax.dynamic_update_slice(scales, raw, (0, (i1 + g0) // group))
            cols = jnp.zeros_like(g)

            def one_column(ci, c):
                g, qg, eg = c
                qj = jax.lax.dynamic_slice_in_dim(requantize_values(g, fixed), ci, 1, axis=1)
                gj = jax.lax.dynamic_slice_in_dim(g, ci, 1, axis=1)
                err = (gj - qj) / jax.lax.dynamic_slice(ugg, (ci, ci), (1, 1))
                # U upper triangular: the earlier columns of the group are kept
                g = g - err * jax.lax.dynamic_slice_in_dim(ugg, ci, 1, axis=0)
                qg = jax.lax.dynamic_update_slice(qg, qj, (0, ci))
                eg = jax.lax.dynamic_update_slice(eg, err, (0, ci))
                return g, qg, eg

            _, qg, eg = jax.lax.fori_loop(0, group, one_column, (g, cols, cols))
            w1 = w1 - eg @ ug  # the group's errors onto the rest of the lazy block
            q1 = jax.lax.dynamic_update_slice(q1, qg, (0, g0))
            e1 = jax.lax.dynamic_update_slice(e1, eg, (0, g0))
            return w1, q1, e1, scales

        zeros = jnp.zeros_like(w1)
        _, q1, e1, scales = jax.lax.fori_loop(
            0, block // group, one_group, (w1, zeros, zeros, scales)
        )
        q = jax.lax.dynamic_update_slice(q, q1, (0, i1))
        # the block's errors onto every later column (earlier ones: U is zero there)
        w = w - e1 @ jax.lax.dynamic_slice(u, (i1, 0), (block, kp))
        return w, q, scales

    _, q, scales = jax.lax.fori_loop(0, kp // block, lazy, (w, jnp.zeros_like(w), scales0))
    return q, scales
