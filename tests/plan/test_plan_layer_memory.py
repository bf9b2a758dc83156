"""Memory per layer of the tensor-parallel step, from the compiled program.

A scanned model's compiled temporaries grow by a fixed amount per block: the block's
stacked parameter shards and gradients (and the block input that remat keeps). The NVFP4
step may add its own per-block residuals to that, within a stated factor of bf16's growth.
Compiled on 8 simulated devices (fsdp 2 x tensor 4) with 1 and 3 blocks, for bf16 and
nvfp4.

History: each device once drew the stochastic-rounding uniforms of the whole (unsplit)
operand and sliced out its own; XLA:CPU hoisted those draws out of the layer loop and the
NVFP4 step's temporaries grew 2.4x as fast per block as bf16's (llama-70b at fsdp 8 x
tensor 8: 113.5 GB per device instead of 79.8).
"""

from __future__ import annotations

import json
import textwrap

import pytest

pytestmark = pytest.mark.xdist_group("plan_layer_memory")

SCRIPT = textwrap.dedent("""
    import json
    from microscale.config import apply_overrides
    from microscale.data import DataConfig
    from microscale.model import ModelConfig
    from microscale.plan import compile_step
    from microscale.train import PrecisionConfig, TrainConfig

    res = {}
    for recipe in ("bf16", "nvfp4"):
        for n in (1, 3):
            model = ModelConfig(vocab_size=256, d_model=256, n_layers=n, n_heads=4,
                                n_kv_heads=4, d_ff=512, max_seq_len=64, remat="full",
                                scan_layers=True)
            cfg = TrainConfig(model=model, data=DataConfig(seq_len=64, batch_size=8),
                              recipe=recipe, precision=PrecisionConfig(bf16_last=0))
            cfg = apply_overrides(cfg, ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=4"])
            r = compile_step(cfg, verbose=False)
            res[f"{recipe}-{n}"] = r["memory"]["temp"]
    print("RESULT" + json.dumps(res))
""")


@pytest.mark.slow
def test_quantized_step_adds_no_memory_per_layer(fake_devices):
    out = fake_devices(SCRIPT)
    temp = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT"))[6:])
    per_block = {r: (temp[f"{r}-3"] - temp[f"{r}-1"]) / 2 for r in ("bf16", "nvfp4")}
    # measured: bf16 1.11 MB, nvfp4 1.56 MB per block (1.41x; 2.68 MB, 2.42x, while the
    # uniforms were drawn whole). The excess, 1.4x a block's f32 parameter shard, is not
    # explained yet; the bound keeps the whole-operand draw out.
    assert per_block["nvfp4"] <= 1.6 * per_block["bf16"], (per_block, temp)
