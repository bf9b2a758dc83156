"""Data + FSDP + tensor parallel on 8 fake CPU devices give the losses of 1 device.

Runs in a subprocess: ``--xla_force_host_platform_device_count=8`` must be set before
jax is imported. Tolerance: the sharded run sums in a different order (partial sums per
device, then all-reduce), so losses agree to float32 rounding, not bit-exactly. Stated
tolerance, at every step of a 5-step run and for the final val loss:
|loss_8 - loss_1| <= 1e-4 * loss_1 for bf16 and 1e-3 for nvfp4 (quantization can amplify
a last-bit difference when a value sits on a rounding boundary). Observed on CPU: <= 2e-5
for both. Stochastic rounding draws the same bits on any mesh (threefry keys are
partitionable), and NVFP4's tensor amax is global (XLA all-reduces the max).
"""

from __future__ import annotations

import json
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    from jax.sharding import PartitionSpec as P
    from microscale.config import apply_overrides
    from microscale.data import DataConfig
    from microscale.model import ModelConfig
    from microscale.train import OptimConfig, TrainConfig, build_state, train
    assert jax.device_count() == 8, jax.devices()
    corpus, out = sys.argv[1:3]
    model = ModelConfig(vocab_size=257, d_model=64, n_layers=2, n_heads=2, n_kv_heads=2,
                        d_ff=128, max_seq_len=32)
    base = TrainConfig(model=model, data=DataConfig(corpus=corpus, heldout="none", seq_len=32,
                       batch_size=8, eval_batches=1, val_fraction=0.2, prefetch=0),
                       optim=OptimConfig(lr=3e-3, warmup_steps=2), steps=5,
                       eval_every=0, log_every=1, tensorboard=False)
    res = {}
    for recipe in ("bf16", "nvfp4"):
        for name, mesh in (("one", ["mesh.data=1"]),
                           ("many", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"])):
            cfg = apply_overrides(base, mesh + [f"recipe={recipe}", f"out={out}/{recipe}-{name}"])
            s = train(cfg, progress=False)
            lines = [json.loads(l) for l in open(f"{out}/{recipe}-{name}/metrics.jsonl")]
            res[f"{recipe}-{name}"] = {"loss": [r["loss"] for r in lines if r["kind"] == "train"],
                                      "val": s["final_val_loss"], "mesh": s["mesh"]}
    st = build_state(apply_overrides(base, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]))
    q = st.params["layers"][0]["attn"]["q_proj"]["kernel"]
    mu = st.opt_state[1].mu["layers"][0]["attn"]["q_proj"]["kernel"]
    res["q_spec"] = [str(q.sharding.spec), str(mu.sharding.spec), len(q.addressable_shards)]
    from microscale.train import MeshConfig, build_mesh
    m = build_mesh(MeshConfig(data=-1, fsdp=2, device_ids=(4, 5, 6, 7)))
    res["device_ids"] = [dict(m.shape), [d.id for d in m.devices.flat]]
    print("RESULT" + json.dumps(res))
""")


@pytest.mark.slow
def test_eight_devices_match_one(corpus_dir, tmp_path, fake_devices):
    stdout = fake_devices(
        SCRIPT, corpus_dir, str(tmp_path), env={"MICROSCALE_CACHE": str(tmp_path / "cache")}
    )
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT"))
    res = json.loads(line[len("RESULT") :])
    # q_proj [embed, heads] -> (fsdp, tensor); its Adam moment is sharded the same way.
    assert res["q_spec"][0] == res["q_spec"][1] == "P('fsdp', 'tensor')"
    assert res["q_spec"][2] == 8
    assert res["device_ids"] == [{"data": 2, "fsdp": 2, "tensor": 1}, [4, 5, 6, 7]]
    for recipe, tol in (("bf16", 1e-4), ("nvfp4", 1e-3)):
        one, many = res[f"{recipe}-one"], res[f"{recipe}-many"]
        assert one["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
        assert many["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
        assert len(one["loss"]) == len(many["loss"]) == 5
        for a, b in zip(one["loss"], many["loss"], strict=True):
            assert abs(a - b) <= tol * a, (recipe, one["loss"], many["loss"])
        assert abs(one["val"] - many["val"]) <= tol * one["val"], recipe
