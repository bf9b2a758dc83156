"""The native block-scaled GEMM on sharded operands (``ops.backend.block_scaled_matmul``).

Its partitioning rule (``block_scaled_plan``) is checked as a table of the layouts a
Megatron + ZeRO-3 step produces, and the partitioned GEMM against the unsharded one on 8
simulated devices, for each layout: the same numbers, and the collectives the rule promises
(no whole weight gathered, the contraction reduced where it is split). A mesh that would put
a scale block across two devices is refused.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from microscale.ops.backend import block_scaled_plan

# the module fixture compiles in a child process once per worker: one worker runs them all
pytestmark = pytest.mark.xdist_group("native_sharded")

F, T, D = "fsdp", "tensor", "data"

# (case, lhs spec, rhs spec, output spec the partitioner asks for) ->
# (lhs, rhs, out specs the GEMM runs with, psum axes, reduce-scatter)
PLAN = [
    (
        "replicated",
        (None, None, None),
        (None, None, None),
        (None, None, None),
        ((None, None, None), (None, None, None), (None, None, None), (), None),
    ),
    (
        "column-parallel fprop: W^T [N (tensor), K (fsdp)] gathers its fsdp shards",
        (None, F, None),
        (None, T, F),
        (None, F, T),
        ((None, F, None), (None, T, None), (None, F, T), (), None),
    ),
    (
        "row-parallel fprop: K split over tensor on both sides, summed",
        (None, F, T),
        (None, F, T),
        (None, F, None),
        ((None, F, T), (None, None, T), (None, F, None), (T,), None),
    ),
    (
        "dgrad of a column-parallel layer: contraction N over tensor",
        (None, (D, F), T),
        (None, F, T),
        (None, (D, F), None),
        ((None, (D, F), T), (None, None, T), (None, (D, F), None), (T,), None),
    ),
    (
        "wgrad: tokens over data x fsdp, dW reduce-scattered to its fsdp shard",
        (None, None, (D, F)),
        (None, T, (D, F)),
        (None, F, T),
        ((None, None, (D, F)), (None, T, (D, F)), (None, F, T), (D,), (1, (F,))),
    ),
    (
        "contraction split on one side only: gathered",
        (None, F, T),
        (None, None, None),
        (None, F, None),
        ((None, F, None), (None, None, None), (None, F, None), (), None),
    ),
    (
        "both output dims asked on one axis: the second gives way",
        (None, F, None),
        (None, F, None),
        (None, F, F),
        ((None, F, None), (None, None, None), (None, F, None), (), None),
    ),
]


@pytest.mark.parametrize("case,lhs,rhs,out,expected", PLAN, ids=[p[0] for p in PLAN])
def test_plan_table(case, lhs, rhs, out, expected):
    assert block_scaled_plan(lhs, rhs, out) == expected


SCRIPT = """
import json, sys
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from microscale.plan.hlo import HloModule

mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("data", "fsdp", "tensor"))
cases = json.loads(sys.argv[1])
out = {}
rng = np.random.default_rng(0)
for name, (lhs, rhs, o, shape, scales) in cases.items():
    b, p, q, c = shape
    a = jnp.asarray(rng.standard_normal((b, p, c)), jnp.float8_e4m3fn)
    w = jnp.asarray(rng.standard_normal((b, q, c)), jnp.float8_e4m3fn)
    sa = jnp.asarray(2.0 ** rng.integers(-3, 3, (b, p, c // 32)), jnp.float8_e8m0fnu)
    sw = jnp.asarray(2.0 ** rng.integers(-3, 3, (b, q, c // 32)), jnp.float8_e8m0fnu)
    ref = np.asarray(reference(a, w, sa, sw, preferred_element_type=jnp.float32)[0])
    spec = lambda s: NamedSharding(mesh, P(*[tuple(x) if isinstance(x, list) else x
                                             for x in s]))
    ls, rs = (lhs, rhs) if scales is None else (scales, scales)
    f = jax.jit(backend.block_scaled_matmul,
                in_shardings=(spec(lhs), spec(rhs), spec(ls), spec(rs)), out_shardings=spec(o))
    try:
        compiled = f.lower(a, w, sa, sw).compile()
    except Exception as e:
        out[name] = {"error": str(e)[-600:]}
        continue
    y = np.asarray(compiled(a, w, sa, sw))
    hlo = HloModule(compiled.as_text(), 8)
    out[name] = {"max_err": float(np.max(np.abs(y - ref)) / np.max(np.abs(ref))),
                 "gathers": [list(g) for g in hlo.gathered_shapes()],
                 "collectives": {k: v["count"] for k, v in hlo.collectives().items()}}
print("RESULT" + json.dumps(out))
"""

# name: (lhs spec, rhs spec, out spec, (B, P, Q, C), scales' spec (None: the elements'))
RUN = {
    "column": ([None, F, None], [None, T, F], [None, F, T], (1, 64, 96, 256), None),
    "row": ([None, F, T], [None, F, T], [None, F, None], (1, 64, 96, 256), None),
    "dgrad": ([None, [D, F], T], [None, F, T], [None, [D, F], None], (1, 64, 96, 256), None),
    "wgrad": ([None, None, [D, F]], [None, T, [D, F]], [None, F, T], (1, 64, 96, 256), None),
    # 96 columns over tensor=2: 48 each, one and a half 32-blocks per device (the 3 scale
    # columns cannot be split in two: they arrive whole)
    "straddle": ([None, F, T], [None, F, T], [None, F, None], (1, 64, 96, 96), [None, None, None]),
}


@pytest.fixture(scope="module")
def sharded(fake_devices, native_on_cpu):
    text = native_on_cpu + textwrap.dedent(SCRIPT)
    out = fake_devices(text, json.dumps(RUN))
    return json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[6:])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["column", "row", "dgrad", "wgrad"])
def test_sharded_equals_unsharded(sharded, name):
    r = sharded[name]
    assert "error" not in r, r
    assert r["max_err"] <= 1e-6
    _, q, c = RUN[name][3][1:]
    # no device ends up holding a whole [Q, C] operand (a weight, or dY^T in wgrad)
    assert not [g for g in r["gathers"] if g[-2:] == [q, c]], r["gathers"]


@pytest.mark.slow
def test_split_contractions_are_reduced(sharded):
    assert sharded["row"]["collectives"]["all-reduce"] >= 1
    assert sharded["column"]["collectives"]["all-reduce"] == 0
    assert sharded["wgrad"]["collectives"]["reduce-scatter"] >= 1


@pytest.mark.slow
def test_block_across_devices_refused(sharded):
    err = sharded["straddle"].get("error", "")
    assert "block straddling two devices" in err and "3 blocks of 32" in err, sharded["straddle"]
