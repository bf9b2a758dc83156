"""Quantized ``dot_general`` with a custom VJP over the three GEMMs of a linear layer.

For ``Y = X W`` with X ``[M, K]`` (M tokens) and W ``[K, N]``, the chain rule gives

    Y_mn  = sum_k X_mk W_kn              fprop   contracts K
    dX_mk = sum_n dY_mn W_kn  = dY W^T    dgrad   contracts N
    dW_kn = sum_m X_mk dY_mn  = X^T dY    wgrad   contracts M (tokens)

``jax.grad`` of a quantized forward would differentiate the rounding (zero almost
everywhere) or, with a straight-through estimator, run the backward GEMMs in high
precision. Low-precision *training* instead quantizes the operands of all three GEMMs,
each along that GEMM's contraction axis (a block-scaled tensor core reads one scale per
block of a dot product), so every operand is quantized on its own terms:

* X in fprop (blocks along K) and again in wgrad (blocks along M): activations,
  round-to-nearest; in wgrad optionally rotated by a random Hadamard transform along M.
* W in fprop (along K) and dgrad (along N): weights, round-to-nearest. NVFP4 uses 16x16
  tiles, so one quantized W serves both GEMMs and the backward pass differentiates
  exactly the function the forward computed.
* dY in dgrad (along N) and wgrad (along M): gradients, stochastic rounding so the
  error is zero-mean: ``E[Q(dY)] = dY`` makes ``E[dX] = dY W_q^T`` unbiased.

The recipe (:mod:`microscale.ops.recipe`) says which format each of the six operands
gets; this module never looks at format names, only at :class:`FormatSpec` fields.

Emulated backend (any device): quantize, decode to bfloat16 *without* the float32
tensor scale (``E2M1 x E4M3`` and ``E4M3``/``E5M2`` x ``E8M0`` products are exact in
bfloat16), multiply in bfloat16 with float32 accumulation, and apply the two tensor
scales to the float32 result. This is what an FP4/FP8 tensor core computes, up to the
order of summation. Native backends (:mod:`microscale.ops.backend`) feed the codes to
block-scaled hardware GEMMs where a capability probe says the device has them.

Randomness is explicit: the caller's key is split per operand with ``fold_in`` (slot
index in :data:`~microscale.ops.recipe.SLOTS`); the same key gives the same result.
The Hadamard sign vector comes from ``recipe.hadamard_seed`` (fixed, not per step).
A key is required only when an operand with stochastic rounding is actually computed
(for NVFP4: in the backward pass), so ``key=None`` is fine for inference.

Tensor parallelism (``split``, a :class:`TensorSplit`): the call runs under ``shard_map``
on one device's slices of a Megatron layer split ``P`` ways over a mesh axis, with every
position of its sequences local (the caller gathers the sequence-parallel activation
first) and its sequences split over the data axes, and computes exactly the slices of the
unsplit layer's three GEMMs:

* column-parallel (q/k/v, gate/up): W ``[K, N/P]``, X ``[M, K]`` (this device's tokens).
  Y's columns are local GEMMs; dX is a partial sum over the N slices (the caller
  reduce-scatters it, the transpose of its gather).
* row-parallel (o, down): X ``[M, K/P]``, W ``[K/P, N]``, dY ``[M, N]``. dX's columns
  are local; Y is a partial sum over the K slices (the caller reduce-scatters it along the
  sequence, in float32).

dW is a partial sum over the token slices either way. A weight whose other side is split
too (``weight_gather``, ZeRO-3 over fsdp) is all-gathered before the forward GEMM and
again for dgrad, and dW is reduce-scattered back in float32; ``shard_map`` sums it over
the data axis. Quantization stays the unsplit layer's, so no quantized operand is
gathered: a split operand (W; dY when column-parallel; X when row-parallel; every
activation and gradient along M) is cut along N, K or M, which its blocks either run
along (a slice holds whole blocks: required) or across, so every block is local, and the
Hadamard rotation along M runs in whole chunks (likewise required). What is not local is
the per-tensor amax behind NVFP4's and FP8's tensor scale, ``max|t| = max_p max|t_p|``:
one float32 ``pmax`` per split operand; and the stochastic-rounding uniforms, which are
indexed by position in the whole operand, so a slice draws the whole operand's uniforms,
sliced (``formats.quantize_dequantize(slice_of=...)``). The result equals the unsplit
call's up to the order of the partial sums (``tests/ops/test_tensor_split.py``). The native
backend quantizes the same slices the same way to codes and block scales
(``formats.quantize(slice_of=...)``) and runs its kernel on them: local operands, no
collective of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.shard_alike import shard_alike

from microscale.formats import (
    quantize_dequantize,
    random_hadamard,
    tensor_amax,
)
from microscale.formats.quantize import check_prng_key
from microscale.ops.backend import gemm_supported, native_gemm, resolve_backend
from microscale.ops.recipe import SLOT_PAIRS, SLOTS, OperandSpec, Recipe, get_recipe

COMPUTE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """A tensor-parallel call's split (module doc): ``kind`` "column" or "row", over mesh
    axis ``axis`` of size ``parts``; the tokens (M) split over the mesh axes ``tokens``
    (major first, ``token_parts`` in all), under ``shard_map`` with all of them manual."""

    axis: str
    parts: int
    kind: Literal["column", "row"]
    tokens: tuple[str, ...] = ()
    token_parts: int = 1
    # (dim of W [K, N], mesh axes, their size): W arrives split along them too and is
    # all-gathered before its GEMMs, in the forward and again in the backward, and dW
    # reduce-scattered back (ZeRO-3 over fsdp). Needs a 2-D rhs contracted on its dim 0.
    weight_gather: tuple[tuple[int, str | tuple[str, ...], int], ...] = ()

    def __post_init__(self):
        if self.kind not in _SPLIT_DIMS:
            raise ValueError(f"TensorSplit kind {self.kind!r}: expected 'column' or 'row'")
        if int(self.parts) < 2 or int(self.token_parts) < 1:
            raise ValueError(
                f"TensorSplit parts={self.parts!r}, token_parts={self.token_parts!r}: "
                "expected parts >= 2 and token_parts >= 1"
            )
        if self.axis in self.tokens:
            raise ValueError(f"TensorSplit: mesh axis {self.axis!r} cannot split the tokens too")


# The split dimension of each operand slot as it is quantized (module doc; canonical
# layouts below): column-parallel cuts N, row-parallel K. Unlisted slots are whole.
_SPLIT_DIMS: dict[str, dict[str, int]] = {
    "column": {"fprop_w": -1, "dgrad_dy": -1, "dgrad_w": -1, "wgrad_dy": -1},
    "row": {"fprop_x": -1, "fprop_w": -2, "dgrad_w": -2, "wgrad_x": -2},
}
# The token (M) dimension of each activation and gradient slot as it is quantized.
_TOKEN_DIMS = {"fprop_x": -2, "dgrad_dy": -2, "wgrad_x": -1, "wgrad_dy": -2}


def _gather_w(w, split: TensorSplit | None):
    """W gathered along ``split.weight_gather`` (ZeRO-3)."""
    for dim, axes, _ in () if split is None else split.weight_gather:
        w = jax.lax.all_gather(w, axes, axis=dim % w.ndim, tiled=True)
    return w


def _scatter_dw(dw, split: TensorSplit | None):
    """dW summed over the devices of ``split.weight_gather`` and split back as W came."""
    for dim, axes, _ in () if split is None else split.weight_gather[::-1]:
        dw = jax.lax.psum_scatter(dw, axes, scatter_dimension=dim % dw.ndim, tiled=True)
    return dw


def _slices(split: TensorSplit | None, slot: str) -> list[tuple[int, int, tuple[str, ...]]]:
    """``(dim, parts, mesh axes)`` of each split dimension of ``slot``'s operand."""
    if split is None:
        return []
    out: list[tuple[int, int, tuple[str, ...]]] = []
    if slot in _SPLIT_DIMS[split.kind]:
        out.append((_SPLIT_DIMS[split.kind][slot], split.parts, (split.axis,)))
    if slot in _TOKEN_DIMS and split.tokens:
        out.append((_TOKEN_DIMS[slot], split.token_parts, split.tokens))
    return out


def operand_key(key, slot: str):
    """The PRNG key of one operand slot: ``fold_in(key, SLOTS.index(slot))`` (None -> None)."""
    if slot not in SLOTS:
        raise ValueError(f"unknown operand slot {slot!r}; expected one of {list(SLOTS)}")
    return None if key is None else jax.random.fold_in(key, SLOTS.index(slot))


def _rotate(t: jax.Array, spec: OperandSpec, axis: int, seed: int) -> jax.Array:
    """The random Hadamard transform of ``spec`` along ``axis`` (-1 or -2), zero-padded to
    a multiple of its size: each chunk ``v`` becomes ``v R`` with ``R = diag(s) H``,
    exactly :func:`microscale.formats.random_hadamard` (the same bits on every machine).
    Float32 result."""
    if spec.hadamard is None:
        return t
    h = spec.hadamard
    pad = -t.shape[axis] % h
    if pad:  # zero rows/cols along the contraction axis add nothing to the product
        widths = [(0, 0)] * t.ndim
        widths[axis] = (0, pad)
        t = jnp.pad(t, widths)
    return random_hadamard(t, axis, size=h, seed_or_key=seed, dtype=jnp.float32)


def _check_key(spec: OperandSpec, key, slot: str) -> None:
    if spec.stochastic and key is None:
        raise ValueError(
            f"operand {slot!r} uses stochastic rounding: pass key=jax.random.key(...) "
            "(derive one per step and layer with jax.random.fold_in)"
        )


def quantize_operand(
    t: jax.Array,
    spec: OperandSpec,
    *,
    axis: int = -1,
    key=None,
    hadamard_seed: int = 0,
    slot: str = "operand",
    amax=None,
):
    """One GEMM operand -> (bf16 values, f32 tensor scale).

    ``axis`` (-1 or -2) is the contraction axis: blocks, the Hadamard transform and
    stochastic-rounding noise run along it (noise is drawn in ``t``'s layout); a 2-D
    block shape ``(along, other)`` covers the last two axes. The values are exactly
    ``dequantize(quantize(t', ...), bfloat16, with_global_scale=False)`` of the (rotated)
    operand ``t'``; the second output is the omitted float32 tensor scale (1 if none).
    ``amax`` replaces the (rotated) operand's own amax in its tensor scale (delayed
    scaling); values beyond it saturate.
    """
    if axis not in (-1, -2):
        raise ValueError(f"quantize_operand: axis must be -1 or -2 (a GEMM dim), got {axis}")
    return _quantize_rotated(_rotate(t, spec, axis, hadamard_seed), spec, axis, key, slot, amax)


def _quantize_rotated(t, spec: OperandSpec, axis: int, key, slot: str, amax, split=None):
    """:func:`quantize_operand` of an operand already rotated by :func:`_rotate`; with a
    :class:`TensorSplit`, ``t`` is this device's slice of ``slot``'s operand (module doc)."""
    _check_key(spec, key, slot)
    return quantize_dequantize(
        t, spec.spec, **spec.quantize_kwargs(axis, key), dtype=COMPUTE,
        **_as_whole(t, spec, slot, amax, split),
    )  # fmt: skip


def _as_whole(t, spec: OperandSpec, slot: str, amax, split: TensorSplit | None) -> dict:
    """The ``formats.quantize`` keywords that quantize ``t``, this device's slice of
    ``slot``'s operand under ``split``, exactly as the whole operand is (module doc):
    ``amax`` (the given one, or ``max|t|`` ``pmax``-ed over the slices when the format has
    a tensor scale) and, for stochastic rounding, ``slice_of``/``slice_index``."""
    cuts = _slices(split, slot) if spec.quantized else []
    if cuts and spec.spec.has_tensor_scale and amax is None:
        # max|t| = the max over the slices of theirs: the unsplit operand's tensor scale
        amax = jax.lax.pmax(tensor_amax(t), tuple(a for _, _, names in cuts for a in names))
    if not (cuts and spec.stochastic):
        return {"amax": amax}
    return dict(
        amax=amax,
        slice_of=tuple((d, n) for d, n, _ in cuts),
        slice_index=tuple(jax.lax.axis_index(names) for _, _, names in cuts),
    )


def _scaled(y: jax.Array, *scales) -> jax.Array:
    s = None
    for t in scales:
        if t is not None:
            s = t if s is None else s * t
    return y if s is None else y * s


def _gemm(a, b, cb: int = -1) -> jax.Array:
    """``a [(B,) P, C]`` contracted with ``b``'s axis ``cb`` (-1: ``[Q, C]``, -2: ``[C, Q]``)
    -> ``[(B,) P, Q]`` with float32 accumulation and output.

    The optimization barrier pins the operands in the layout they were quantized in:
    without it XLA folds a transpose feeding an elementwise quantizer (per-tensor FP8,
    bf16) into the dot's dimension numbers, and XLA:CPU then runs the slow "TN" form or,
    for some shapes, fails ("Unsupported element type for DotThunk: BF16 x BF16 = F32").
    """
    a, b = jax.lax.optimization_barrier((a, b))
    batch = tuple(range(a.ndim - 2))
    dims = (((a.ndim - 1,), (b.ndim + cb,)), (batch, batch))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _keep_sharding(q: jax.Array, t: jax.Array) -> jax.Array:
    """``q`` (a wgrad operand rotated along the tokens and quantized from ``t``) sharded as
    ``t`` is. Without the hint the partitioner loses the token sharding through the
    Hadamard transform and all-gathers the operand over all tokens, instead of summing the
    local partial products: a full ``[tokens, N]`` per device, every layer (measured on
    fsdp=8; ``tests/plan/test_plan_collectives.py``). ``shard_alike`` binds both ways, so
    it is used only where the source's sharding is the one wanted. Padded operands (a
    length that is not a multiple of the block) are left to the partitioner."""
    if q.shape != t.shape:
        return q
    return shard_alike(q, t)[0]


def _t(a):
    return jnp.swapaxes(a, -1, -2)


# ---- the custom VJP on canonical operands: x [(B,) M, K], w [(B,) K, N] ------------------
#
# Operand layouts (the layout in which each is quantized and its SR noise drawn):
#   fprop  Y  = Xq   [M,K] . Wq  [K,N]   X blocks along its last axis, W along its first
#   dgrad  dX = dYq  [M,N] . Wq^T        dY and W (when requantized) along their last axis
#   wgrad  dW = XqT  [K,M] . dYq [M,N]   X^T and dY both blocked (and rotated) along M
# No GEMM contracts the first axis of both operands: XLA:CPU runs that form ("TN") at
# ~3.5x the cost. X^T is materialized for wgrad; dY is blocked along its rows in place.


def _native_gemm(
    recipe: Recipe, gemm: str, a, b, key, axis_a: int = -1, axis_b: int = -1, split=None
):
    """A GEMM on the hardware kernel, operands as the emulated path lays them out; under
    a ``split``, each operand slice quantized as the whole operand is (:func:`_as_whole`)."""
    sa, sb = recipe.gemms()[gemm]
    slot_a, slot_b = SLOT_PAIRS[gemm]
    ka, kb = operand_key(key, slot_a), operand_key(key, slot_b)
    _check_key(sa, ka, slot_a)
    _check_key(sb, kb, slot_b)
    seed = recipe.hadamard_seed
    ra, rb = _rotate(a, sa, axis_a, seed), _rotate(b, sb, axis_b, seed)
    if gemm == "wgrad" and (sa.hadamard or sb.hadamard) and split is None:  # as emulated
        ra, rb = _keep_sharding(ra, a), _keep_sharding(rb, b)
    return native_gemm(
        ra, sa, rb, sb, axis_a=axis_a, axis_b=axis_b, key_a=ka, key_b=kb,
        whole_a=_as_whole(ra, sa, slot_a, None, split),
        whole_b=_as_whole(rb, sb, slot_b, None, split),
    )  # fmt: skip


def _use_native(recipe: Recipe, backend: str, gemm: str) -> bool:
    # Delayed scaling runs emulated: the native operand path derives its own scales.
    return backend == "native" and not recipe.delayed and gemm_supported(*recipe.gemms()[gemm])


def _operand(recipe: Recipe, slot: str, t, key, history, updates: dict, axis: int = -1, split=None):
    """Quantize the operand of ``slot`` (:func:`quantize_operand`; ``split``: see
    :func:`_quantize_rotated`). With an amax history (delayed scaling) its tensor scale
    comes from the history, and the history row with this step's amax pushed in front
    goes to ``updates[slot]``."""
    spec = getattr(recipe, slot)
    t = _rotate(t, spec, axis, recipe.hadamard_seed)
    amax = None
    if history is not None and spec.quantized:
        row = history[SLOTS.index(slot)]
        amax = tensor_amax(row) if recipe.amax_compute == "max" else row[0]
        updates[slot] = jnp.concatenate([tensor_amax(t)[None], row[:-1]])
    return _quantize_rotated(t, spec, axis, operand_key(key, slot), slot, amax, split)


def _new_history(history, updates: dict):
    """The amax history with the rows in ``updates`` replaced (None stays None)."""
    if history is None:
        return None
    return jnp.stack([updates.get(slot, history[i]) for i, slot in enumerate(SLOTS)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _qmatmul(recipe: Recipe, backend: str, out_dtype, operand_dtype, split, x, w, key, history):
    y, _ = _qmatmul_fwd(recipe, backend, out_dtype, operand_dtype, split, x, w, key, history)
    return y


def _qmatmul_fwd(recipe: Recipe, backend: str, out_dtype, operand_dtype, split, x, w, key, history):
    # Cotangent dtypes must match the primals: carry them as zero-size arrays. The cast to
    # ``operand_dtype`` happens here, inside the VJP, so the float32-accumulated gradients
    # reach float32 primals (master weights) without a round trip through bf16.
    tags = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    w_res = w  # a split weight is kept as it came and gathered again in the backward
    w = _gather_w(w, split)
    if operand_dtype is not None:
        x, w = x.astype(operand_dtype), w.astype(operand_dtype)
        w_res = w if split is None or not split.weight_gather else w_res
    updates: dict = {}
    if _use_native(recipe, backend, "fprop"):
        y = _native_gemm(recipe, "fprop", x, w, key, axis_b=-2, split=split)
    else:
        xq, sx = _operand(recipe, "fprop_x", x, key, history, updates, split=split)
        wq, sw = _operand(recipe, "fprop_w", w, key, history, updates, axis=-2, split=split)
        y = _scaled(_gemm(xq, wq, -2), sx, sw)
        # dgrad reuses fprop's quantized W when quantizing along N gives the same values
        # (16x16 tiles, per-tensor scale, bf16): DESIGN's "same quantized W".
        gathered = split is not None and split.weight_gather
        if recipe.reuses_fprop_w and not _use_native(recipe, backend, "dgrad") and not gathered:
            w_res = (wq, sw)
    return y.astype(out_dtype), (x, w_res, key, tags, history, updates)


def _qmatmul_bwd(recipe: Recipe, backend: str, out_dtype, operand_dtype, split, res, dy):
    x, w_res, key, (x_tag, w_tag), history, updates = res
    updates = dict(updates)
    if split is not None and split.weight_gather:
        # Gathered again, as ZeRO-3 does. XLA may merge this gather with the forward's
        # (CSE; XLA:CPU does, through optimization barriers too), holding the gathered
        # weight from the forward to here unless remat recomputes the forward.
        w_res = _gather_w(w_res, split)
        w_res = w_res if operand_dtype is None else w_res.astype(operand_dtype)
    # dgrad: dX = dY W^T, contracting N.
    if _use_native(recipe, backend, "dgrad"):
        dx = _native_gemm(recipe, "dgrad", dy, w_res, key, split=split)
    else:
        dyq, sdy = _operand(recipe, "dgrad_dy", dy, key, history, updates, split=split)
        if isinstance(w_res, tuple):
            wq, sw = w_res
            if "fprop_w" in updates:  # the same W (quantized with fprop's scale): same amax
                row = history[SLOTS.index("dgrad_w")]
                updates["dgrad_w"] = jnp.concatenate([updates["fprop_w"][:1], row[:-1]])
        else:
            wq, sw = _operand(recipe, "dgrad_w", w_res, key, history, updates, split=split)
        dx = _scaled(_gemm(dyq, wq), sdy, sw)
    # wgrad: dW = X^T dY, contracting M (tokens).
    if _use_native(recipe, backend, "wgrad"):
        dw = _native_gemm(recipe, "wgrad", _t(x), dy, key, axis_b=-2, split=split)
    else:
        xqt, sx = _operand(recipe, "wgrad_x", _t(x), key, history, updates, split=split)
        dyq2, sdy2 = _operand(recipe, "wgrad_dy", dy, key, history, updates, axis=-2, split=split)
        # (shard_alike cannot reach across shard_map's manual boundary: not under a split)
        if (recipe.wgrad_x.hadamard or recipe.wgrad_dy.hadamard) and split is None:
            xqt, dyq2 = _keep_sharding(xqt, _t(x)), _keep_sharding(dyq2, dy)
        dw = _scaled(_gemm(xqt, dyq2, -2), sx, sdy2)
    dw = _scatter_dw(dw, split)
    dkey = None if key is None else np.zeros(jnp.shape(key), jax.dtypes.float0)
    # The history's "gradient" is its next value (overwrite-with-gradient; see
    # microscale.ops.delayed): the only way state leaves a custom VJP's backward pass.
    return dx.astype(x_tag.dtype), dw.astype(w_tag.dtype), dkey, _new_history(history, updates)


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


# ---- general dimension numbers -> canonical 2-D / batched GEMM ---------------------------


def _canonical_dims(dimension_numbers, lhs_ndim: int, rhs_ndim: int):
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = (
        tuple(int(a) % n for a in axes)
        for axes, n in ((lc, lhs_ndim), (rc, rhs_ndim), (lb, lhs_ndim), (rb, rhs_ndim))
    )
    if len(lc) != len(rc) or len(lb) != len(rb):
        raise ValueError(
            f"dimension_numbers {dimension_numbers!r}: contracting and batch "
            "dims must pair up between lhs and rhs"
        )
    lf = tuple(a for a in range(lhs_ndim) if a not in lc + lb)
    rf = tuple(a for a in range(rhs_ndim) if a not in rc + rb)
    return lc, rc, lb, rb, lf, rf


def init_amax_history(recipe: Recipe | str) -> jax.Array:
    """A zero amax history for a delayed-scaling recipe: float32 ``[6, amax_history_len]``,
    one row per operand slot (:data:`~microscale.ops.recipe.SLOTS`), newest amax first.
    An all-zero history means scale 1 (as Transformer Engine starts)."""
    recipe = get_recipe(recipe)
    return jnp.zeros((len(SLOTS), int(recipe.amax_history_len)), jnp.float32)


def _check_history(recipe: Recipe, amax_history):
    if not recipe.delayed:
        if amax_history is not None:
            raise ValueError(
                f"recipe {recipe.name!r} uses current scaling; amax_history "
                "applies only to delayed-scaling recipes (e.g. 'fp8_delayed')"
            )
        return None
    if amax_history is None:
        raise ValueError(
            f"recipe {recipe.name!r} uses delayed scaling: pass amax_history="
            "(init_amax_history(recipe), or the DelayedScaling module in "
            "microscale.ops.delayed, which carries it)"
        )
    want = (len(SLOTS), int(recipe.amax_history_len))
    if tuple(jnp.shape(amax_history)) != want:
        raise ValueError(
            f"amax_history has shape {tuple(jnp.shape(amax_history))}; recipe "
            f"{recipe.name!r} expects {want} (operand slots x amax_history_len)"
        )
    return jnp.asarray(amax_history, jnp.float32)


def quantized_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    recipe: Recipe | str = "nvfp4",
    *,
    key=None,
    preferred_element_type=None,
    backend: str = "auto",
    amax_history=None,
    operand_dtype=None,
    split: TensorSplit | None = None,
) -> jax.Array:
    """``jax.lax.dot_general`` whose three GEMMs (forward and both gradients) follow
    ``recipe``. lhs plays X (activations), rhs plays W (weights). Any dimension numbers:
    operands are transposed/reshaped to ``[B, M, K] x [B, K, N]`` and back.

    ``amax_history`` (delayed-scaling recipes only): the ``[6, L]`` history the tensor
    scales come from. Its cotangent under ``jax.grad`` is the *next* history, with this
    call's amaxes pushed in (overwrite it, do not apply it as a gradient).

    ``operand_dtype`` (e.g. bfloat16): both operands are cast to it *inside* the custom
    VJP, before quantization. The gradients keep the operands' own dtypes, so a float32
    master weight passed as ``rhs`` receives the float32-accumulated wgrad (Transformer
    Engine's FP32 main grads) instead of one rounded to bf16 by an outside cast.

    ``split``: one device's slices of a tensor-parallel layer under ``shard_map`` (module
    doc); current scaling only, on either backend."""
    recipe = get_recipe(recipe)
    backend = resolve_backend(backend, recipe)
    amax_history = _check_history(recipe, amax_history)
    if split is not None and recipe.delayed:
        raise ValueError(
            f"split={split!r} needs current scaling; recipe {recipe.name!r} uses delayed "
            "scaling (its amax history is per device)"
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
    lc, rc, lb, rb, lf, rf = _canonical_dims(dimension_numbers, lhs.ndim, rhs.ndim)
    rshape = _gathered_shape(rhs, rc, split)
    for a, b in zip(lc + lb, rc + rb, strict=True):
        if lhs.shape[a] != rshape[b]:
            raise ValueError(
                f"dot_general: lhs dim {a} (size {lhs.shape[a]}) does not match "
                f"rhs dim {b} (size {rshape[b]})"
            )
    bsz, m, k = (math.prod(lhs.shape[a] for a in axes) for axes in (lb, lf, lc))
    k_w, n_w = (math.prod(rhs.shape[a] for a in axes) for axes in (rc, rf))
    lead = (bsz,) if lb else ()
    x = jnp.transpose(lhs, lb + lf + lc) if lb + lf + lc != tuple(range(lhs.ndim)) else lhs
    if rb + rc + rf != tuple(range(rhs.ndim)):
        # The barrier (whose transpose is a barrier on the cotangent) keeps XLA from folding
        # the transpose of dW back into the wgrad dot, which XLA:CPU cannot run for bf16
        # operands with a float32 result (e.g. a tied embedding's gradient); see _gemm.
        w = jax.lax.optimization_barrier(jnp.transpose(rhs, rb + rc + rf))
    else:
        w = rhs
    x = x.reshape(lead + (m, k))
    w = w.reshape(lead + (k_w, n_w))
    operand_dtype = None if operand_dtype is None else jnp.dtype(operand_dtype)
    y = _qmatmul(
        recipe, backend, jnp.dtype(out_dtype), operand_dtype, split, x, w, key, amax_history
    )
    out_shape = (
        tuple(lhs.shape[a] for a in lb)
        + tuple(lhs.shape[a] for a in lf)
        + tuple(rshape[a] for a in rf)
    )
    return y.reshape(out_shape)


def _gathered_shape(rhs, rc: tuple[int, ...], split: TensorSplit | None) -> tuple[int, ...]:
    """The shape of ``rhs`` once ``split.weight_gather`` has gathered it."""
    shape = list(rhs.shape)
    if split is None or not split.weight_gather:
        return tuple(shape)
    if rhs.ndim != 2 or rc != (0,):
        raise ValueError(
            f"split.weight_gather needs a 2-D rhs [K, N] contracted on dim 0; got rhs shape "
            f"{tuple(rhs.shape)} contracted on {rc}"
        )
    for dim, _, parts in split.weight_gather:
        shape[dim] *= parts
    return tuple(shape)


def make_dot_general(
    recipe: Recipe | str = "nvfp4",
    *,
    key=None,
    backend: str = "auto",
    amax_history=None,
    operand_dtype=None,
    split: TensorSplit | None = None,
):
    """A drop-in for ``jax.lax.dot_general`` (``flax.nnx.Linear(dot_general=...)``).

    ``precision`` is ignored (the recipe decides); ``preferred_element_type`` sets the
    output dtype. ``key`` feeds stochastic rounding (required when the recipe uses it
    and a gradient is taken); ``backend`` is "auto", "emulated" or "native";
    ``amax_history`` feeds delayed scaling, ``operand_dtype`` casts the operands
    inside the VJP and ``split`` marks a tensor-parallel slice (see
    :func:`quantized_dot_general`). A flax ``nnx.Linear`` with
    ``dtype=bfloat16`` casts its kernel itself, before this is called, so its kernel
    gradient is bf16-rounded; microscale's ``QLinear`` passes the float32 kernel and
    ``operand_dtype`` instead.
    """
    check_prng_key(key)
    recipe = get_recipe(recipe)
    backend = resolve_backend(backend, recipe)  # fail early on a bad name
    _check_history(recipe, amax_history)

    def dot_general(
        lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_ignored
    ):
        del precision
        return quantized_dot_general(
            lhs,
            rhs,
            dimension_numbers,
            recipe,
            key=key,
            preferred_element_type=preferred_element_type,
            backend=backend,
            amax_history=amax_history,
            operand_dtype=operand_dtype,
            split=split,
        )

    dot_general.recipe = recipe  # type: ignore[attr-defined]
    return dot_general


def qdot(
    x,
    w,
    recipe: Recipe | str = "nvfp4",
    *,
    key=None,
    backend: str = "auto",
    amax_history=None,
    operand_dtype=None,
):
    """``Y = X @ W`` for X ``[..., K]`` and W ``[K, N]`` with the recipe's three GEMMs."""
    x = jnp.asarray(x)
    return make_dot_general(
        recipe, key=key, backend=backend, amax_history=amax_history, operand_dtype=operand_dtype
    )(x, w, (((x.ndim - 1,), (0,)), ((), ())))
