"""``quantized_dot_general(split=...)``: one device's slices of a tensor-parallel layer
under ``shard_map`` compute the slices of the unsplit layer (``ops.dot`` module doc).

On 8 simulated devices (data 2 x fsdp 2 x tensor 2; tokens split over data x fsdp, the
weight's other side over fsdp and gathered, as ZeRO-3 does), on the emulated and the native
backend, for NVFP4 (per-tensor amax,
stochastic rounding of dY, Hadamard rotation along the tokens) and MXFP8: the results
that no device sums partially are bit-identical to the unsplit call -- the column-parallel
output, the row-parallel input gradient -- and the partial sums (the other input gradient,
the output of the row-parallel layer, both weight gradients) agree to float32 rounding. A
wrong tensor amax, or stochastic-rounding uniforms drawn for the slice instead of the
whole operand, moves them by the quantization error.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from microscale.ops import TensorSplit

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import AxisType, PartitionSpec as P
    from microscale.ops import TensorSplit, quantized_dot_general
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)
    tok = ("data", "fsdp")
    kx, kw, kd, ks = jax.random.split(jax.random.key(0), 4)
    dims = (((2,), (0,)), ((), ()))
    out = {}
    for recipe in ("nvfp4", "mxfp8"):
        for kind in ("column", "row"):
            x = jax.random.normal(kx, (8, 32, 128), jnp.float32)
            w = jax.random.normal(kw, (128, 64), jnp.float32) * 0.05
            dy = jax.random.normal(kd, (8, 32, 64), jnp.float32)
            def f(x, w, split=None):
                return quantized_dot_general(x, w, dims, recipe, key=ks, split=split,
                                             preferred_element_type=jnp.float32,
                                             backend=sys.argv[1])
            y1, vjp1 = jax.vjp(f, x, w)
            dx1, dw1 = vjp1(dy)
            split = TensorSplit("tensor", 2, kind, tok, 4,
                                ((0 if kind == "column" else 1, "fsdp", 2),))
            xs = P(tok, None, None) if kind == "column" else P(tok, None, "tensor")
            ws = P("fsdp", "tensor") if kind == "column" else P("tensor", "fsdp")
            ys = P(tok, None, "tensor") if kind == "column" else P(tok, None, None)
            def local(x, w, dy):
                y, vjp = jax.vjp(lambda x, w: f(x, w, split), x, w)
                dx, dw = vjp(dy)
                dw = jax.lax.psum(dw, "data")  # the op reduce-scatters over fsdp only
                if kind == "row":  # partial sums over the K slices
                    y = jax.lax.psum(y, "tensor")
                else:  # partial sums over the N slices
                    dx = jax.lax.psum(dx, "tensor")
                return y, dx, dw
            y8, dx8, dw8 = jax.jit(jax.shard_map(
                local, mesh=mesh, in_specs=(xs, ws, ys), out_specs=(ys, xs, ws),
                check_vma=False))(x, w, dy)
            rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
            same = lambda a, b: bool(jnp.all(a == b))
            out[f"{recipe}-{kind}"] = {
                "y": [same(y8, y1), rel(y8, y1)], "dx": [same(dx8, dx1), rel(dx8, dx1)],
                "dw": [same(dw8, dw1), rel(dw8, dw1)]}
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["emulated", "native"])
def test_split_slices_equal_the_unsplit_layer(fake_devices, native_on_cpu, backend):
    """On the native backend (the block-scaled GEMM stood in on CPU by its documented
    formula) each device quantizes its slices and runs the kernel on them. A kernel may sum
    a dot product in an order that depends on the GEMM's shape (the stand-in's float32 dot
    does: MXFP8's column-parallel output differs from the unsplit one by 5e-8), so there
    the results without partial sums are held to float32 rounding, as the others are."""
    out = fake_devices((native_on_cpu if backend == "native" else "") + SCRIPT, backend)
    res = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[6:])
    for recipe in ("nvfp4", "mxfp8"):
        col, row = res[f"{recipe}-column"], res[f"{recipe}-row"]
        # no partial sum: bit-identical (emulated: bf16 products, one float32 dot)
        assert backend == "native" or (col["y"][0] and row["dx"][0]), (recipe, res)
        assert col["y"][1] < 1e-6 and row["dx"][1] < 1e-6, (recipe, res)
        # partial sums over devices: float32 rounding (a wrong scale or wrong uniforms
        # would differ by the quantization error, ~1e-2)
        for r in (col["dx"], col["dw"], row["y"], row["dw"]):
            assert r[1] < 1e-5, (recipe, res)


def test_split_is_checked():
    with pytest.raises(ValueError, match="kind 'diagonal'"):
        TensorSplit("tensor", 2, "diagonal")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parts=1"):
        TensorSplit("tensor", 1, "column")
    with pytest.raises(ValueError, match="cannot split the tokens"):
        TensorSplit("tensor", 2, "row", ("tensor",), 2)


@pytest.mark.parametrize(
    "fmt,kw",
    [
        ("nvfp4", dict(axis=-1)),
        ("nvfp4", dict(axis=-2)),
        ("nvfp4", dict(axis=-1, block_shape=(16, 16))),
        ("mxfp4", dict(axis=-1)),
        ("fp8_e5m2", dict(axis=-1)),
    ],
)
@pytest.mark.parametrize("via", ["quantize_dequantize", "quantize"])
def test_slices_round_as_the_whole(fmt, kw, via):
    """``quantize_dequantize(slice_of=...)`` and ``quantize(slice_of=...)`` (the native
    backend's) with the whole tensor's amax: stochastic rounding of the slices (along either
    or both axes) is exactly the whole's, sliced."""
    import jax
    import jax.numpy as jnp

    from microscale.formats import dequantize, quantize, quantize_dequantize, tensor_amax

    def quantize_dequantize_via(x, fmt, **kw):
        if via == "quantize_dequantize":
            return quantize_dequantize(x, fmt, **kw)
        return (dequantize(quantize(x, fmt, **kw), jnp.bfloat16, with_global_scale=False),)

    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
    key, amax = jax.random.key(3), tensor_amax(x)
    whole = quantize_dequantize(x, fmt, rounding="stochastic", key=key, **kw)[0]
    for pr, pc in ((4, 1), (1, 4), (2, 4)):
        rows = []
        for i, r in enumerate(jnp.split(x, pr, axis=0)):
            parts = [
                quantize_dequantize_via(
                    p, fmt, rounding="stochastic", key=key, amax=amax,
                    slice_of=((0, pr), (1, pc)), slice_index=(i, j), **kw,
                )[0]
                for j, p in enumerate(jnp.split(r, pc, axis=1))
            ]  # fmt: skip
            rows.append(jnp.concatenate(parts, axis=1))
        assert bool((jnp.concatenate(rows, axis=0) == whole).all()), (pr, pc)


def test_slices_are_checked():
    import jax
    import jax.numpy as jnp

    from microscale.formats import quantize_dequantize

    x = jnp.ones((48, 32), jnp.float32)
    with pytest.raises(ValueError, match="whole blocks of 16"):
        quantize_dequantize(
            x[:12], "nvfp4", axis=-2, rounding="stochastic", key=jax.random.key(0),
            slice_of=((0, 4),), slice_index=(0,),
        )  # fmt: skip
    with pytest.raises(ValueError, match="slice_of="):
        quantize_dequantize(x, "nvfp4", slice_of=((5, 2),), slice_index=(0,))
