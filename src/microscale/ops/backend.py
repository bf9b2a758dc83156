"""Backends of the quantized GEMM and the capability probe that picks one.

* ``"emulated"`` — quantize, decode exactly to bfloat16, bf16 x bf16 GEMM with float32
  accumulation, tensor scales applied to the float32 result. Runs everywhere.
* ``"native"`` — the hardware's low-precision GEMM: FP8 dots on NVIDIA compute capability
  >= 8.9, cuDNN block-scaled GEMMs (``jax.nn.scaled_matmul``) for NVFP4/MXFP8 on >= 10.0.
* ``"auto"`` — native where :func:`native_supported` says so, else emulated.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from microscale.formats import e2m1_decode, quantize

BACKENDS = ("auto", "emulated", "native")


@functools.cache
def device_capability() -> tuple[int, int] | None:
    """CUDA compute capability of the first device, or None (CPU/TPU/unknown)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:  # pragma: no cover - no backend at all
        return None
    if dev.platform != "gpu":
        return None
    cc = getattr(dev, "compute_capability", None)
    try:
        major, minor = (int(p) for p in str(cc).split(".")[:2])
    except (TypeError, ValueError):
        return None
    return major, minor


def native_supported(recipe) -> bool:
    """True when every quantized GEMM of ``recipe`` has a native kernel on this device.

    Block-scaled formats (cuDNN) need compute capability >= 10.0, per-tensor FP8 >= 8.9.
    GEMMs whose operands are both bf16 always run natively (a bf16 dot).
    """
    gemms = [(a, b) for a, b in recipe.gemms().values() if a.quantized or b.quantized]
    return bool(gemms) and all(gemm_supported(a, b) for a, b in gemms)


def resolve_backend(backend: str, recipe) -> str:
    """ "auto" -> "native" or "emulated"; validates the name and native availability.

    With "native", each GEMM whose operand pair has a kernel (:func:`gemm_supported`)
    runs natively and the others are emulated; "auto" is "native" when at least one
    GEMM has a kernel. "native" raises when none has.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {list(BACKENDS)}")
    any_native = any(gemm_supported(a, b) for a, b in recipe.gemms().values())
    if backend == "auto":
        return "native" if any_native else "emulated"
    if backend == "native" and not any_native:
        raise ValueError(
            f"backend='native' is not available for recipe {recipe.name!r} on "
            f"{jax.devices()[0].platform} (compute capability "
            f"{device_capability()}); use backend='emulated' or 'auto'"
        )
    return backend


# ---- native GEMMs -----------------------------------------------------------------------
#
# Operands arrive "contraction last": a [(B,) P, C], b [(B,) Q, C]. Each is quantized with
# formats.quantize in that layout (blocks along C), its codes decoded to the element dtype
# the hardware reads (float4_e2m1fn / float8_*), its block scales expanded to one per
# (row, block) (a 16x16 tile scale is the same scale for 16 rows), and the product
# computed by the block-scaled GEMM; the float32 tensor scales multiply the result, as in
# the emulated backend.


def gemm_supported(sa, sb) -> bool:
    """True when the GEMM of operand specs ``sa`` x ``sb`` has a native kernel here."""
    cc = device_capability()
    if cc is None:
        return False
    fa, fb = sa.spec, sb.spec
    if not (fa.quantized and fb.quantized):
        return False
    if fa.block_size is None and fb.block_size is None:  # per-tensor FP8 (cuBLASLt)
        return cc >= (8, 9) and fa.elem_bits == fb.elem_bits == 8
    square = all(s.block_shape is None or s.block_shape[0] == s.block_shape[1] for s in (sa, sb))
    return (
        cc >= (10, 0)
        and square
        and fa.block_size == fb.block_size
        and fa.scale_kind == fb.scale_kind
        and fa.elem_bits == fb.elem_bits
    )


def native_operand(t, spec, *, axis: int = -1, key=None, whole: dict | None = None):
    """(elements in the hardware dtype, per-(row, block) scales or None, tensor scale or
    None), contraction along the last axis, of an operand quantized along ``axis``.

    ``axis=-2`` quantizes ``t`` in its own layout (so stochastic-rounding noise matches
    the emulated backend) and hands the kernel its transpose. ``whole``: the
    ``formats.quantize`` keywords (``amax``, ``slice_of``, ``slice_index``) that quantize
    ``t``, one device's slice of a tensor-parallel operand, as the whole operand is.
    """
    q = quantize(t, spec.spec, **spec.quantize_kwargs(axis, key), **(whole or {}))
    fmt = q.spec
    if q.block_shape is None:  # per-tensor scale
        elems = q.data if axis == -1 else jnp.swapaxes(q.data, -1, -2)
        return elems, None, q.scales
    codes = q.codes()
    elems = e2m1_decode(codes).astype(fmt.elem_dtype) if fmt.packed else codes
    scales = q.scales
    assert scales is not None  # a block-scaled QArray has scales
    other = -2 if axis == -1 else -1
    if q.block_shape[other] > 1:  # a tile scale serves each of its rows
        scales = jnp.repeat(scales, q.block_shape[other], axis=other)
    rows = t.shape[other]
    if axis == -2:
        elems, scales = jnp.swapaxes(elems, -1, -2), jnp.swapaxes(scales, -1, -2)
    return elems[..., :rows, :], scales[..., :rows, :], q.global_scale


def native_gemm(
    a,
    sa,
    b,
    sb,
    *,
    axis_a: int = -1,
    axis_b: int = -1,
    key_a=None,
    key_b=None,
    whole_a: dict | None = None,
    whole_b: dict | None = None,
) -> jax.Array:
    """a ``[(B,) P, C]`` x b ``[(B,) Q, C]`` -> float32 ``[(B,) P, Q]`` on the hardware's
    GEMM. ``axis_a``/``axis_b`` = -2 pass an operand as ``[(B,) C, P]`` instead;
    ``whole_a``/``whole_b``: see :func:`native_operand`."""
    ea, ca, ta = native_operand(a, sa, axis=axis_a, key=key_a, whole=whole_a)
    eb, cb, tb = native_operand(b, sb, axis=axis_b, key=key_b, whole=whole_b)
    nb = a.ndim - 2
    if ca is None:  # per-tensor FP8: XLA rewrites this dot to a cuBLASLt FP8 GEMM
        batch = tuple(range(nb))
        dims = (((nb + 1,), (nb + 1,)), (batch, batch))
        y = jax.lax.dot_general(ea, eb, dims, preferred_element_type=jnp.float32)
    else:
        lead = ea.shape[:-2]
        flat = lambda v: v.reshape((-1,) + v.shape[-2:])
        y = block_scaled_matmul(flat(ea), flat(eb), flat(ca), flat(cb))
        y = y.reshape(lead + y.shape[-2:]) if nb else y[0]
    for s in (ta, tb):
        if s is not None:
            y = y * s
    return y


# ---- the block-scaled GEMM on sharded operands --------------------------------------------
#
# ``jax.nn.scaled_matmul`` carries JAX's own partitioning rule, which drops the contraction
# sharding whenever the output is sharded along another axis, and drops a weight's sharding
# altogether when both its dims share mesh axes with the activation's: a row-parallel layer
# (o/down under tensor parallelism, weight [N (fsdp), K (tensor)]) then gathers its whole
# weight onto every device. The rule below is the one a sharded dot follows:
#
# * the contraction dim stays split when both operands split it over the same mesh axes;
#   the local products are then summed over those axes (``psum``), or summed and scattered
#   (``psum_scatter``) along an output dim that the partitioner wants split over them
#   (wgrad: dW's fsdp shard, ZeRO-3's gradient reduce-scatter);
# * every other output dim takes its mesh axes from the output sharding the partitioner
#   asks for, and the operand that owns that dim is split the same way (a weight's fsdp
#   shards are gathered before the GEMM, ZeRO-3's parameter all-gather).
#
# Quantization happens outside, on whatever shard each device holds: block scales are local
# (a block never straddles devices: refused below) and the tensor amax is a max over the
# shards. The GEMM itself then runs on local operands.


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _spec3(sharding) -> tuple:
    spec = tuple(getattr(sharding, "spec", ()))
    return spec + (None,) * (3 - len(spec))


def block_scaled_plan(lhs, rhs, out):
    """Operand and output specs, and the reduction, of a block-scaled GEMM
    ``[B, P, C] x [B, Q, C] -> [B, P, Q]`` whose operands arrive split as ``lhs`` / ``rhs``
    and whose output the partitioner wants split as ``out`` (3-tuples of mesh-axis entries).

    Returns ``(lhs_spec, rhs_spec, out_spec, psum_axes, scatter)``: ``scatter`` is None or
    ``(output dim, mesh axes)`` to reduce-scatter over."""
    k = _axes(lhs[2]) if _axes(lhs[2]) == _axes(rhs[2]) else ()
    batch = tuple(a for a in _axes(out[0]) if a not in k)
    dims, scatter = [], None
    for d in (1, 2):
        want = tuple(a for a in _axes(out[d]) if a not in batch)
        red = tuple(a for a in want if a in k)
        if red and scatter is None and red == want:
            scatter = (d, red)
            dims.append(())
        else:
            dims.append(tuple(a for a in want if a not in k))
    if set(dims[0]) & set(dims[1]):  # one mesh axis cannot split both output dims
        dims[1] = tuple(a for a in dims[1] if a not in dims[0])
    psum = tuple(a for a in k if scatter is None or a not in scatter[1])
    b, k_e = _entry(batch), _entry(k)
    out_dims = [_entry(dims[0]), _entry(dims[1])]
    if scatter is not None:
        out_dims[scatter[0] - 1] = _entry(scatter[1])
    return ((b, _entry(dims[0]), k_e), (b, _entry(dims[1]), k_e), (b, *out_dims), psum, scatter)


def _infer(mesh, arg_shapes, result_shape):
    lhs, rhs = (_spec3(s.sharding) for s in arg_shapes[:2])
    out = (lhs[0], lhs[1], rhs[1] if not set(_axes(rhs[1])) & set(_axes(lhs[1])) else None)
    return NamedSharding(mesh, PartitionSpec(*block_scaled_plan(lhs, rhs, out)[2]))


def _partition(mesh, arg_shapes, result_shape):
    lhs, rhs = (_spec3(s.sharding) for s in arg_shapes[:2])
    lspec, rspec, ospec, psum, scatter = block_scaled_plan(lhs, rhs, _spec3(result_shape.sharding))
    k = _axes(lspec[2])
    if k:
        parts = math.prod(mesh.shape[a] for a in k)
        c, nblk = arg_shapes[0].shape[2], arg_shapes[2].shape[2]
        if c % parts or nblk % parts:
            raise ValueError(
                f"block-scaled GEMM: the contraction length {c} ({nblk} blocks of "
                f"{c // nblk}) is split over mesh axes {k} ({parts} devices), which leaves a "
                f"block straddling two devices; use a mesh whose {k} size divides {nblk}"
            )

    def local(a, b, sa, sb):
        y = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
        if scatter is not None:
            y = jax.lax.psum_scatter(y, scatter[1], scatter_dimension=scatter[0], tiled=True)
        if psum:
            y = jax.lax.psum(y, psum)
        return y

    lsh, rsh = (NamedSharding(mesh, PartitionSpec(*s)) for s in (lspec, rspec))
    return mesh, local, NamedSharding(mesh, PartitionSpec(*ospec)), (lsh, rsh, lsh, rsh)


@custom_partitioning
def block_scaled_matmul(a, b, sa, sb):
    """``jax.nn.scaled_matmul`` (float32 out) on operands as each device holds them: see
    :func:`block_scaled_plan`."""
    return jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)


block_scaled_matmul.def_partition(
    infer_sharding_from_operands=_infer,
    partition=_partition,
    sharding_rule="b p c, b q c, b p s, b q s -> b p q",
)
