"""The native NVFP4 path at scale: the same sharded train step, compiled on 8 simulated
devices (fsdp=2 x tensor=4) with the emulated GEMMs and with the native ones
(``jax.nn.scaled_matmul`` inside ``ops.backend.block_scaled_matmul``, whose partitioning
rule decides how the SPMD partitioner splits the cuDNN call).

On CPU the native path needs two stand-ins, both outside microscale's code (the
``native_on_cpu`` fixture): the capability probe reports Blackwell (10, 0), and the
``scaled_matmul`` primitive gets a CPU lowering by its documented reference formula.

History: with JAX's own rule for ``scaled_matmul`` the native step gathered every
row-parallel weight in full onto each device (o/down: both of the weight's dims share mesh
axes with the activation's, and the rule then drops the weight's sharding altogether);
microscale's rule keeps the contraction split and sums it. Each device now quantizes the
shard it holds and gathers only the quantized fsdp shards (ZeRO-3), so the native step
moved as many elements as the emulated one did under the partitioner (XLA:CPU widens the
float4/float8 payloads to float16, so bytes are compared as elements). The emulated step
now runs its projections under ``shard_map`` with Megatron's collectives
(``model.tensor_parallel``) and moves 2.1x fewer elements; the native GEMMs are not run
that way yet (they derive their own tensor scales, which would need the ``pmax`` over the
slices), so their excess over it is pinned as an upper bound.
"""

from __future__ import annotations

import json
import textwrap

import pytest

# the module fixture compiles in a child process once per worker: one worker runs them all
pytestmark = pytest.mark.xdist_group("plan_native_sharding")

SCRIPT = textwrap.dedent("""
    import json
    from microscale.config import apply_overrides
    from microscale.data import DataConfig
    from microscale.model import ModelConfig
    from microscale.plan import compile_step
    from microscale.plan.hlo import HloModule
    from microscale.train import PrecisionConfig, TrainConfig

    model = ModelConfig(vocab_size=256, d_model=192, n_layers=1, n_heads=4, n_kv_heads=4,
                        d_ff=320, max_seq_len=32)
    cfg = TrainConfig(model=model, data=DataConfig(seq_len=32, batch_size=8),
                      recipe="nvfp4", precision=PrecisionConfig(bf16_last=0))
    cfg = apply_overrides(cfg, ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"])
    res = {}
    for name, cc in (("emulated", None), ("native", (10, 0))):
        backend.device_capability = lambda cc=cc: cc
        path = "hlo-" + name + ".txt"
        r = compile_step(cfg, hlo_path=path, verbose=False)
        hlo = HloModule(open(path).read(), 8)
        res[name] = {"gathers": [list(s) for s in hlo.gathered_shapes()],
                     "elements": {k: v["elements"] for k, v in hlo.collectives().items()},
                     "flops": hlo.dot_flops()}
    print("RESULT" + json.dumps(res))
""")

# The model's linear kernels [K, N]; tensor=4 splits N (q/k/v/gate/up) or K (o/down).
# Dims differ from every activation's (256 global / 128 local tokens), so a gathered
# [192, 320] can only be a whole weight.
WEIGHTS = [(192, 192), (192, 320), (320, 192)]


def _full_weights(gathers):
    return [
        g
        for g in gathers
        if tuple(sorted(g[-2:])) in {tuple(sorted(w)) for w in WEIGHTS} and len(g) >= 2
    ]


@pytest.fixture(scope="module")
def compiled(fake_devices, native_on_cpu, tmp_path_factory):
    cwd = tmp_path_factory.mktemp("hlo")
    script = f"import os; os.chdir({str(cwd)!r})\n" + native_on_cpu + SCRIPT
    out = fake_devices(script)
    return json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[6:])


@pytest.mark.slow
@pytest.mark.parametrize("path", ["emulated", "native"])
def test_weights_stay_sharded(compiled, path):
    g = compiled[path]["gathers"]
    assert g, "FSDP must all-gather the weights' fsdp shards"
    assert _full_weights(g) == []


@pytest.mark.slow
def test_native_excess_over_emulated_is_bounded(compiled):
    em, na = compiled["emulated"], compiled["native"]
    total = {k: sum(v["elements"].values()) for k, v in compiled.items()}
    assert total["native"] <= 2.2 * total["emulated"], (em["elements"], na["elements"])
    assert na["flops"] == em["flops"]
