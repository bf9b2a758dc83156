"""The exact identities hold on every XLA:CPU variant, with the same bits.

XLA:CPU picks its dot kernels by machine and flags: YNNPACK fusions by default, Eigen
when they are off, narrower vector code on a CPU without AVX-512 or AVX2. A float32 dot's
summation order is the kernel's choice, so anything computed *through a dot* and then
rounded (to bfloat16, FP8 or FP4) can change bits at a rounding tie from one machine to
the next. That is how ``test_rht_invisible_without_quantization`` once failed on a CPU
with AMX: the random Hadamard transform was a dot. It is now a fixed sequence of
elementwise operations (``formats/hadamard.py``).

This test runs one probe under each variant in a child process (``XLA_FLAGS`` must be
set before jax is imported). The probe computes every claimed exact result: the NVFP4
quantizer in both scale orders against the independent numpy reference of
``test_scale_order.py`` on near-tie data, the other formats, stochastic rounding, the
Hadamard transform against a numpy float32 butterfly, and every operand the NVFP4
training recipe feeds its three GEMMs (rotation, stochastic rounding, 16x16 tiles). Each
identity must hold in every variant, and the bytes of every result must be the same in
all of them. Not covered, by design: a GEMM's float32 output, whose summation order is
the kernel's on every machine (the emulated backend is exact up to that order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Each variant changes which kernels XLA:CPU compiles a dot to (checked below: a float32
# dot's sum differs between them).
# The two CPU kinds CI runs on: Intel with AMX, and AMD EPYC with AVX-512 BF16 and no AMX.
# ``avx512_bf16`` is the AMD kind's widest ISA: on an AMX machine it is the no-AMX variant
# (on the AMD kind, the default); ``avx512`` drops the BF16 dot instructions too.
VARIANTS = {
    "default": "",
    "ynnpack_off": "--xla_cpu_experimental_ynn_fusion_type=",
    "avx512_bf16": "--xla_cpu_max_isa=AVX512_BF16",
    "avx512": "--xla_cpu_max_isa=AVX512",
    "avx": "--xla_cpu_max_isa=AVX",  # (SSE4_2 does not compile: XLA fails to link a convert)
    "ynnpack_off_avx2": "--xla_cpu_experimental_ynn_fusion_type= --xla_cpu_max_isa=AVX2",
}

PROBE = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np, jax, jax.numpy as jnp, ml_dtypes
    sys.path.insert(0, sys.argv[1])
    from test_scale_order import nvfp4_reference, random_bf16_tensors, random_f32_tensors
    import microscale as ms
    from microscale.formats import random_hadamard
    from microscale.formats.hadamard import random_signs
    from microscale.ops import SLOTS, get_recipe, quantize_operand, operand_key

    F32 = np.float32
    res = {}

    def put(name, holds, *arrays):
        h = hashlib.sha256()
        for a in arrays:
            a = np.ascontiguousarray(np.asarray(a))
            h.update(str((a.dtype, a.shape)).encode())
            h.update(a.tobytes())
        res[name] = {"holds": bool(holds), "digest": h.hexdigest()[:16]}

    # A float32 dot: its sum is what the variants change (the power check).
    a = jax.random.normal(jax.random.key(1), (64, 256))
    b = jax.random.normal(jax.random.key(2), (256, 64))
    res["dot_sum"] = float(np.asarray(jax.jit(jnp.matmul)(a, b), np.float64).sum())

    def nvfp4(order):
        def one(x):
            q = ms.quantize(x, "nvfp4", scale_order=order)
            return q.codes(), q.scales.view(jnp.uint8), q.global_scale
        return jax.jit(jax.vmap(one))

    data = {"f32": random_f32_tensors(8, 32, 512, seed=3),
            "bf16": random_bf16_tensors(8, 32, 512, seed=4)}
    for order in ("te", "jax"):
        f = nvfp4(order)
        for dname, x in data.items():
            codes, scales, s_dec = (np.asarray(t) for t in f(jnp.asarray(x)))
            r_codes, r_scales, _ = nvfp4_reference(x.astype(F32), order)
            live = np.repeat(scales != 0, 16, axis=-1) | (x.astype(F32) != 0)
            put(f"nvfp4_{order}_{dname}", (scales == r_scales).all()
                and (codes == r_codes)[live].all(), codes, scales, s_dec)

    x = jnp.asarray(data["f32"][:2])
    for fmt in ("mxfp4", "mxfp8", "fp8_e4m3", "fp8_e5m2", "q8_0"):
        q = ms.quantize(x, fmt)
        put(f"quantize_{fmt}", True, q.data, q.scales if q.scales is not None else 0,
            q.global_scale if q.global_scale is not None else 0)
    q = ms.quantize(x, "nvfp4", rounding="stochastic", key=jax.random.key(5))
    put("nvfp4_stochastic", True, q.data, q.scales, q.global_scale)

    def butterfly(v, signs, size, inverse):  # numpy float32, the documented order
        v = v.astype(F32).reshape(-1, size)
        sc = F32(1.0 / np.sqrt(size))
        v = v if inverse else v * signs
        m = size
        while m >= 2:
            z = v.reshape(v.shape[0], -1, 2, m // 2)
            v = np.stack([z[:, :, 0] + z[:, :, 1], z[:, :, 0] - z[:, :, 1]], axis=2)
            m //= 2
        v = v.reshape(-1, size)
        return v * (signs * sc).astype(F32) if inverse else v * sc

    t = np.asarray(data["f32"][0] * F32(1e3), F32)  # [32, 512], 9 decades of magnitude
    for size in (16, 32):
        signs = np.asarray(random_signs(7, size))
        for axis in (0, 1):
            for inverse in (False, True):
                got = np.asarray(random_hadamard(jnp.asarray(t), axis, size=size,
                                                 seed_or_key=7, inverse=inverse))
                tm = np.moveaxis(t, axis, -1)
                want = np.moveaxis(butterfly(tm, signs, size, inverse).reshape(tm.shape),
                                   -1, axis)
                put(f"hadamard_{size}_axis{axis}_{'inv' if inverse else 'fwd'}",
                    np.array_equal(got.view(np.uint32), want.view(np.uint32)), got)

    recipe = get_recipe("nvfp4")
    xb = jnp.asarray(data["bf16"][0]).astype(jnp.bfloat16)  # [32, 512]
    key = jax.random.key(9)
    for slot in SLOTS:
        spec = getattr(recipe, slot)
        for axis in (-1, -2):
            v, s = jax.jit(lambda t, k: quantize_operand(
                t, spec, axis=axis, key=operand_key(k, slot),
                hadamard_seed=recipe.hadamard_seed, slot=slot))(xb, key)
            put(f"operand_{slot}_axis{axis}", True, v, s)
    print("RESULT" + json.dumps(res))
""")


def _probe(flags: str, timeout: int) -> dict:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, str(Path(__file__).parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT") :])


@pytest.mark.slow
def test_exact_identities_are_the_same_bits_on_every_cpu_variant(hang_guard_s):
    runs = {name: _probe(flags, hang_guard_s) for name, flags in VARIANTS.items()}
    base = runs["default"]
    names = [k for k in base if k != "dot_sum"]
    assert len(names) >= 30
    for variant, res in runs.items():
        assert set(res) == set(base), variant
        failed = [k for k in names if not res[k]["holds"]]
        assert not failed, f"{variant}: identities that do not hold: {failed}"
        moved = [k for k in names if res[k]["digest"] != base[k]["digest"]]
        assert not moved, f"{variant}: results whose bits differ from the default: {moved}"
    # Power: the variants really compile dots differently (a float32 dot's sum moves).
    assert len({res["dot_sum"] for res in runs.values()}) >= 2, {
        v: r["dot_sum"] for v, r in runs.items()
    }
